"""Quantized weights, as the namespace scan must read them: every byte is a parameter, named by its format.

Three kinds of quantized weight hold their memory where a plain scan does not look:

* ``torch.ao`` quantized modules (``quantize_dynamic``, static quantization) keep their weights *packed* in a
  TorchScript object (``LinearPackedParamsBase``, ``Conv2dPackedParamsBase``) that owns a buffer of its own,
  allocated outside PyTorch's tensors. Its size is worked out from the layout of fbgemm, the x86 backend: one
  byte per int8 weight (two per fp16 weight), a 32-bit column offset per output channel, and one fp32 scale
  and one int32 zero point per tensor or per output channel. The object stands for that memory in the live
  registry (a weak reference to it tells when it is freed); the bias it keeps is a real tensor.
* bitsandbytes' ``Params4bit`` and ``Int8Params`` are parameters whose data is the packed weight; the
  quantization constants (``quant_state``: absmax per block, the code book, and with double quantization the
  absmax of the absmax; ``SCB``: an fp32 scale per row) hang off the parameter as plain attributes.
* torchao's quantized tensors are wrapper subclasses flattened by ``storage_parts`` (tensors.py); this module
  only names their format.

Every read is guarded and cached per class (the scan runs before and after every measured cell).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

#: what a scan found of one packed object: (a weak reference to it, its bytes, its format, its bias or None);
#: keyed by id(object), dropped when the object dies
_packed: dict[int, tuple[Any, int, str, Bias | None]] = {}
_module_kinds: dict[type, bool] = {}
_param_kinds: dict[type, str] = {}

_BNB_PARAMS = {"Params4bit": "4bit", "Int8Params": "int8"}


def is_ao_quantized(cls: type) -> bool:
    """A module class of torch.ao's quantized modules (``torch.ao.nn.quantized``, its dynamic and intrinsic
    variants); decided once per class."""
    hit = _module_kinds.get(cls)
    if hit is None:
        mod = str(getattr(cls, "__module__", ""))
        hit = _module_kinds[cls] = mod.startswith(("torch.ao.nn.quantized", "torch.nn.quantized",
                                                   "torch.ao.nn.intrinsic.quantized"))
    return hit


def packed_objects(module: Any) -> list[tuple[Any, str]]:
    """``[(packed object, attribute)]``: the TorchScript objects a ``torch.ao`` quantized module holds its
    weights in (none for every other module; decided once per class)."""
    if not is_ao_quantized(type(module)):
        return []
    out = []
    for attr in ("_packed_params", "_packed_weight"):
        obj = module.__dict__.get(attr)
        if isinstance(obj, torch.ScriptObject):
            out.append((obj, attr))
    return out


class Bias:
    """The bias a packed object keeps: its storage (weakly: a storage's Python object lives as long as its memory,
    while unpacking may hand out a new tensor each time), shape and dtype."""

    def __init__(self, t: torch.Tensor) -> None:
        self._storage = weakref.ref(t.untyped_storage())
        self.shape, self.dtype = tuple(t.shape), t.dtype

    @property
    def storage(self) -> Any:
        return self._storage()


def packed_info(obj: Any) -> tuple[int, str, Bias | None]:
    """``(bytes, format, bias or None)`` of one packed object, worked out from fbgemm's layout (cached: unpacking
    copies the weight). ``(0, "", None)`` for an object of a kind this module does not know."""
    hit = _packed.get(id(obj))
    if hit is not None and hit[0]() is obj:
        return hit[1], hit[2], hit[3]
    size, fmt, tensor = _measure(obj)
    bias = Bias(tensor) if isinstance(tensor, torch.Tensor) else None
    try:
        ref = weakref.ref(obj, lambda _r, key=id(obj): _packed.pop(key, None))
    except TypeError:
        return size, fmt, bias
    _packed[id(obj)] = (ref, size, fmt, bias)
    return size, fmt, bias


def packed_bytes(weight: torch.Tensor, fp16: bool = False) -> int:
    """Bytes fbgemm packs a quantized weight of this shape into (output channels first): the weights, a 32-bit
    column offset per output channel, and a scale and zero point per tensor or per channel. Padding to the CPU's
    block sizes (none for sizes that are multiples of 64) is not counted."""
    n = weight.numel()
    if fp16:
        return 2 * n
    channels = int(weight.shape[0])
    per_channel = weight.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric,
                                       torch.per_channel_affine_float_qparams)
    return n + 4 * channels + (8 * channels if per_channel else 8)


def _measure(obj: Any) -> tuple[int, str, Any]:
    name = _script_type(obj)
    ops = torch.ops.quantized
    try:
        if "LinearPackedParams" in name:
            weight, bias = ops.linear_unpack(obj)
            fp16 = not weight.is_quantized  # dynamic quantization with dtype=torch.float16 unpacks to floats
            size = packed_bytes(weight, fp16)
            fmt = "fp16 packed, torch.ao" if fp16 else f"int8 packed {_scheme(weight)}, torch.ao"
            return size, fmt, bias
        if "Conv" in name and "PackedParams" in name:
            unpack = ops.conv3d_unpack if "Conv3d" in name else ops.conv2d_unpack  # 1-d convolutions pack as 2-d
            weight, bias = unpack(obj)
            return packed_bytes(weight), f"int8 packed {_scheme(weight)}, torch.ao", bias
    except Exception:
        return 0, "", None
    return 0, "", None


def _script_type(obj: Any) -> str:
    try:
        return str(obj._type().qualified_name())
    except Exception:
        return ""


def _scheme(weight: torch.Tensor) -> str:
    try:
        return "per channel" if "per_channel" in str(weight.qscheme()) else "per tensor"
    except Exception:
        return "per tensor"


def parameter_parts(t: Any) -> list[tuple[Any, str]] | None:
    """The storages of a bitsandbytes quantized parameter: its packed data (``"nf4, bitsandbytes"``) and its
    quantization constants (``"nf4 constants, bitsandbytes"``); ``None`` for any other class (decided once per
    class)."""
    cls = type(t)
    kind = _param_kinds.get(cls)
    if kind is None:
        mod = str(getattr(cls, "__module__", ""))
        kind = _param_kinds[cls] = next((k for n, k in _BNB_PARAMS.items() if mod.startswith("bitsandbytes")
                                         and any(c.__name__ == n for c in cls.__mro__)), "")
    if not kind:
        return None
    out: list[tuple[Any, str]] = []
    if kind == "4bit":
        state = getattr(t, "quant_state", None)
        fmt = str(getattr(state, "quant_type", "") or "4-bit") if state is not None else "4-bit"
        out.append((t.untyped_storage(), f"{fmt}, bitsandbytes"))
        constants: list[Any] = []
        if state is not None:
            constants += [getattr(state, a, None) for a in ("absmax", "code", "offset")]
            nested = getattr(state, "state2", None) if getattr(state, "nested", False) else None
            if nested is not None:
                constants += [getattr(nested, "absmax", None), getattr(nested, "code", None)]
        out += [(c.untyped_storage(), f"{fmt} constants, bitsandbytes") for c in constants
                if isinstance(c, torch.Tensor)]
    else:
        out.append((t.untyped_storage(), "int8, bitsandbytes"))
        for attr in ("SCB", "CB"):  # CB is the data itself once quantized (the scan counts a storage once)
            c = getattr(t, attr, None)
            if isinstance(c, torch.Tensor):
                out.append((c.untyped_storage(), "int8 constants, bitsandbytes" if attr == "SCB" else
                            "int8, bitsandbytes"))
    return out


_TORCHAO_FORMATS = {
    "Int8Tensor": "int8", "Int4Tensor": "int4", "IntxUnpackedToInt8Tensor": "intx in int8",
    "NF4Tensor": "nf4", "AffineQuantizedTensor": "affine quantized", "LinearActivationQuantizedTensor": "quantized",
    "Float8Tensor": "float8", "Int4PreshuffledTensor": "int4", "Int4TilePackedTo4dTensor": "int4",
}


def subclass_format(cls: type) -> str:
    """A torchao quantized tensor's format as reports name it (``"int8, torchao Int8Tensor"``); "" for other
    wrapper subclasses."""
    if not str(getattr(cls, "__module__", "")).startswith("torchao"):
        return ""
    fmt = _TORCHAO_FORMATS.get(cls.__name__, "quantized")
    return f"{fmt}, torchao {cls.__name__}"


__all__ = ["is_ao_quantized", "packed_bytes", "packed_info", "packed_objects", "parameter_parts", "subclass_format"]
