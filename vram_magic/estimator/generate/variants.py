"""Caches whose memory the fake run cannot get from transformers' own code on this machine, modelled.

**Quantized** (``cache_implementation="quantized"``: transformers' ``QuantizedCache(backend="quanto")``, KIVI
style). transformers' own ``QuantizedLayer.update`` runs — the residual of ``residual_length`` (128) tokens
kept in full precision, the whole layer dequantized and concatenated at every step, requantized when the
residual is full — over :class:`ModelledQuantoLayer`, whose quantize/dequantize allocate what
optimum-quanto's ``quantize_weight`` and ``dequantize`` do: packed ``nbits`` data, a scale and a shift per
group of ``q_group_size`` (64) values in the cache's dtype, a full-size temporary of the rounded values and
an unpacked ``uint8`` copy while quantizing; the ``uint8`` unpacked values and the full-precision result while
dequantizing. (optimum-quanto need not be installed: its layout is modelled, not measured.)

**Offloaded** (``"offloaded"``: ``DynamicCache(offloading=True)``). On CUDA each layer moves to the host after
its update and the next one is prefetched back before it is used, so the GPU holds the layer in use and the
one prefetched. The fake run does the same with host stand-ins (meta tensors the tracker never counts) for
the layers on the host. On the CPU there is nowhere to offload to (and transformers' offloading needs CUDA).
transformers makes its prefetch stream when the cache is built (``torch.Stream()``): the estimate runs with
:func:`no_streams`, so no GPU is touched (a CUDA build without a driver refuses the stream; one with a GPU would
start a CUDA context, hundreds of MiB, for an estimate).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch

from ..torch_private import disable_current_modes as _disable_current_modes


class StandInStream:
    """What an offloading cache's prefetch stream is during an estimate: never used (its prefetch and offload are
    modelled, :func:`model_offloading`), it only has to exist."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> StandInStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def wait_stream(self, other: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


@contextlib.contextmanager
def no_streams() -> Iterator[None]:
    """``torch.Stream`` and ``torch.cuda.Stream`` are :class:`StandInStream` inside (put back after)."""
    saved = torch.Stream, torch.cuda.Stream
    torch.Stream = torch.cuda.Stream = StandInStream  # type: ignore[misc, assignment]
    try:
        yield
    finally:
        torch.Stream, torch.cuda.Stream = saved  # type: ignore[misc]


def quanto_available() -> bool:
    try:
        from transformers.utils import is_optimum_quanto_available
    except ImportError:
        return False
    return bool(is_optimum_quanto_available())


def _layer_class() -> type:
    from transformers.cache_utils import QuantizedLayer

    class ModelledQuantoLayer(QuantizedLayer):  # type: ignore[misc, valid-type]
        """transformers' ``QuantizedLayer`` with optimum-quanto's allocations (see the module's text)."""

        def _quantize(self, tensor: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            n = tensor.numel()
            groups = -(-n // self.q_group_size)
            rounded = torch.empty_like(tensor)  # round((x - shift) / scale), clamped
            unpacked = torch.empty(n, dtype=torch.uint8)
            packed = torch.empty(-(-n * self.nbits // 8), dtype=torch.uint8)
            del rounded, unpacked
            scale = torch.empty(groups, dtype=tensor.dtype)
            shift = torch.empty(groups, dtype=tensor.dtype)
            return packed, scale, shift, tuple(tensor.shape), tensor.dtype  # type: ignore[return-value]

        def _dequantize(self, qtensor: Any) -> torch.Tensor:
            packed, _scale, _shift, shape, dtype = qtensor
            n = 1
            for d in shape:
                n *= d
            unpacked = torch.empty(n, dtype=torch.uint8)
            out = torch.empty(shape, dtype=dtype)
            del unpacked
            return out

    # one of transformers' cache layers with modelled kernels: cache walkers (vram_magic.engine.hooks.kv_cache,
    # transformers' own) look for their module
    ModelledQuantoLayer.__module__ = QuantizedLayer.__module__
    return ModelledQuantoLayer


_CLASS: list[type] = []


def modelled_layer_class() -> type:
    if not _CLASS:
        _CLASS.append(_layer_class())
    return _CLASS[0]


def quantized_cache(config: Any, nbits: int = 4) -> Any:
    """A ``Cache`` of :class:`ModelledQuantoLayer` as ``QuantizedCache(backend="quanto", config=config)`` builds
    it (full-attention models only, as transformers requires)."""
    from transformers.cache_utils import Cache

    text = config.get_text_config(decoder=True)
    types_ = set(getattr(text, "layer_types", None) or ["full_attention"])
    if types_ - {"full_attention"} or getattr(text, "sliding_window", None) and getattr(
            text, "use_sliding_window", True) and "layer_types" not in vars(text):
        raise ValueError(f"the quantized cache supports models with full-attention layers only (transformers' "
                         f"QuantizedCache); this one has {', '.join(sorted(types_))}")
    if nbits not in (2, 4):
        raise ValueError(f"the quantized cache (quanto) takes 2 or 4 bits, not {nbits}")
    cls = modelled_layer_class()
    return Cache(layers=[cls(nbits=nbits) for _ in range(text.num_hidden_layers)])


def is_modelled_quantized(layer: Any) -> bool:
    return bool(_CLASS) and isinstance(layer, _CLASS[0])


def _packed(shape: tuple[int, ...], dtype: torch.dtype, nbits: int, group: int) -> tuple[Any, ...]:
    """What ``_quantize`` keeps for a tensor of ``shape`` (made directly: no temporaries)."""
    n = 1
    for d in shape:
        n *= d
    groups = -(-n // group)
    return (torch.empty(-(-n * nbits // 8), dtype=torch.uint8), torch.empty(groups, dtype=dtype),
            torch.empty(groups, dtype=dtype), tuple(shape), dtype)


def grow_quantized(layer: Any, tokens: int) -> None:
    """A quantized layer ``tokens`` decoding steps later: after ``j`` steps its residual holds ``j %
    residual_length`` tokens in full precision (flushed into the quantized part whenever it fills) and the rest
    of the prompt + ``j`` tokens are quantized; old tensors freed first."""
    if not layer.is_initialized or layer._quantized_keys is None:
        return
    prompt = getattr(layer, "_vram_magic_prompt", None)
    if prompt is None:
        return
    residual = layer.keys.shape[-2] if layer.keys.dim() == 4 else 0
    j = layer._quantized_keys[3][-2] + residual - prompt + tokens
    r = j % layer.residual_length
    q = prompt + j - r
    for qname, name in (("_quantized_keys", "keys"), ("_quantized_values", "values")):
        shape, dtype = list(getattr(layer, qname)[3]), getattr(layer, qname)[4]
        setattr(layer, qname, None)
        setattr(layer, name, None)
        shape[-2] = q
        setattr(layer, qname, _packed(tuple(shape), dtype, layer.nbits, layer.q_group_size))
        shape[-2] = r
        setattr(layer, name, torch.empty(tuple(shape), dtype=dtype) if r else torch.tensor([], dtype=dtype))
    layer.cumulative_length += tokens


def remember_prompt(cache: Any) -> None:
    """After the prefill: each quantized layer's prompt length (its residual counts decoding steps from it)."""
    for layer in getattr(cache, "layers", []) or []:
        if is_modelled_quantized(layer) and layer._quantized_keys is not None:
            layer._vram_magic_prompt = layer._quantized_keys[3][-2]


# --- offloading -----------------------------------------------------------------------------------------------
def is_host(t: Any) -> bool:
    """A host stand-in: a real meta tensor (fake tensors report the CPU)."""
    return isinstance(t, torch.Tensor) and t.device.type == "meta"


def host_like(shape: Any, dtype: torch.dtype) -> torch.Tensor:
    with _disable_current_modes():
        return torch.empty(tuple(shape), dtype=dtype, device="meta")


def _to_host(layer: Any) -> None:
    if not layer.is_initialized:
        return
    for name in ("keys", "values"):
        t = getattr(layer, name)
        if isinstance(t, torch.Tensor) and not is_host(t):
            setattr(layer, name, host_like(t.shape, t.dtype))


def _to_device(layer: Any) -> None:
    if not layer.is_initialized:
        return
    for name in ("keys", "values"):
        t = getattr(layer, name)
        if is_host(t):
            setattr(layer, name, torch.empty(tuple(t.shape), dtype=t.dtype))


def model_offloading(cache: Any) -> None:
    """Make an offloading cache behave as on CUDA (layers on the host but the one in use and the one prefetched),
    without CUDA streams."""
    inner = getattr(cache, "self_attention_cache", cache)

    def prefetch(self: Any, layer_idx: int, only_non_sliding: bool = True) -> None:
        flags = [not (lin or (sl and only_non_sliding) or dummy)
                 for lin, sl, dummy in zip(self.is_linear, self.is_sliding, self.is_dummy)]
        if True not in flags:
            return
        rest = flags[layer_idx:]
        idx = layer_idx + rest.index(True) if True in rest else flags.index(True)
        _to_device(self.layers[idx])

    def offload(self: Any, layer_idx: int, only_non_sliding: bool = True) -> None:
        if not (only_non_sliding and self.is_sliding[layer_idx]):
            _to_host(self.layers[layer_idx])

    def update(self: Any, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> Any:
        if self.layer_class_to_replicate is not None:
            while len(self.layers) <= layer_idx:
                self.layers.append(self.layer_class_to_replicate())
        self.prefetch(layer_idx + 1, self.only_non_sliding)
        _to_device(self.layers[layer_idx])  # already there (prefetched), unless this is the first update
        keys, values = self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)
        self.offload(layer_idx, self.only_non_sliding)
        return keys, values

    inner.prefetch = types.MethodType(prefetch, inner)
    inner.offload = types.MethodType(offload, inner)
    inner.update = types.MethodType(update, inner)


__all__ = ["StandInStream", "grow_quantized", "host_like", "is_host", "is_modelled_quantized", "model_offloading",
           "modelled_layer_class", "no_streams", "quanto_available", "quantized_cache", "remember_prompt"]
