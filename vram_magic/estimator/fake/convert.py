"""The user's model and inputs as fake tensors: shapes and dtypes only, no memory, never the real weights.

A real ``nn.Module`` is deep-copied with every parameter and buffer swapped for a fake CPU tensor first
(so tied weights stay tied, the copy never holds real memory, and an already fake or meta model works
too); a zero-argument builder is called under the fake mode with the default dtype set. Fake tensors are
always on the CPU: autograd on fake CUDA tensors aborts a CPU-only process, so CUDA is modelled instead.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..torch_private import FakeCopyMode, FakeTensorMode


@dataclass(frozen=True)
class TensorSpec:
    """What an input tensor is, without its data."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False
    channels_last: bool = False
    # a real copy of a small integer/boolean input (a mask, token ids): see known_values.py
    values: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorSpec:
        from .known_values import keep

        cl = t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)
        return cls(tuple(int(s) for s in t.shape), t.dtype, bool(t.requires_grad), cl, keep(t))

    def make(self, dtype: torch.dtype | None, device: str | None = None) -> torch.Tensor:
        """A fake tensor (call under the fake mode), or a meta one (``device="meta"``); floating inputs take
        ``dtype`` when one is set."""
        dt = dtype if dtype is not None and self.dtype.is_floating_point else self.dtype
        t = torch.empty(self.shape, dtype=dt, device=device)
        if self.channels_last:
            t = t.contiguous(memory_format=torch.channels_last)
        if self.requires_grad and dt.is_floating_point:
            t.requires_grad_(True)
        if self.values is not None and dt == self.values.dtype and device is None:
            from .known_values import attach, real_copy

            attach(t, real_copy(self.values))
        return t

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def to_specs(value: Any) -> Any:
    """Replace every tensor in a tensor/tuple/list/dict structure by its :class:`TensorSpec`."""
    if isinstance(value, torch.Tensor):
        return TensorSpec.of(value)
    if isinstance(value, (tuple, list)):
        items = [to_specs(v) for v in value]
        return _rebuild(value, items) if type(value) in (tuple, list) or is_named_tuple(value) else tuple(items)
    if isinstance(value, Mapping):
        return {k: to_specs(v) for k, v in value.items()}
    return value


def from_specs(value: Any, dtype: torch.dtype | None) -> Any:
    return map_specs(value, lambda s: s.make(dtype))


def map_specs(value: Any, fn: Callable[[TensorSpec], Any]) -> Any:
    """The structure with ``fn(spec)`` in place of every :class:`TensorSpec`."""
    if isinstance(value, TensorSpec):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return _rebuild(value, [map_specs(v, fn) for v in value])
    if isinstance(value, dict):
        return {k: map_specs(v, fn) for k, v in value.items()}
    return value


def is_named_tuple(value: Any) -> bool:
    return isinstance(value, tuple) and isinstance(getattr(type(value), "_fields", None), tuple)


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model`` called on ``inputs`` as a training loop calls it: a tensor as the argument, a dict as keyword
    arguments, a tuple or list as positional arguments (a named tuple whole when the forward takes one)."""
    if isinstance(inputs, torch.Tensor):
        return model(inputs)
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if is_named_tuple(inputs) and takes_one(model, inputs):
        return model(inputs)  # one structured argument, read by its fields
    return model(*inputs)


def takes_one(model: nn.Module, inputs: tuple) -> bool:
    """Whether ``model.forward`` takes a named tuple whole: it accepts one argument (else its fields are the
    arguments, as a plain tuple's are)."""
    try:
        inspect.signature(model.forward).bind(inputs)
    except TypeError:
        return False
    except ValueError:  # no signature to read
        return True
    return True


def _rebuild(value: tuple | list, items: list[Any]) -> Any:
    """A tuple or list like ``value`` holding ``items``: a named tuple keeps its type (a model reads its fields)."""
    if is_named_tuple(value):
        return type(value)(*items)
    return type(value)(items)


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in a tensor/tuple/list/dict structure, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in tensors_in(v)]
    return []


def specs_in(value: Any) -> list[TensorSpec]:
    if isinstance(value, TensorSpec):
        return [value]
    if isinstance(value, (tuple, list)):
        return [s for v in value for s in specs_in(v)]
    if isinstance(value, dict):
        return [s for v in value.values() for s in specs_in(v)]
    return []


def resize(value: Any, dim: int, old: int, new: int) -> Any:
    """Change dimension ``dim`` from ``old`` to ``new`` in every spec whose dimension ``dim`` is ``old``."""
    if isinstance(value, TensorSpec):
        if len(value.shape) > dim and value.shape[dim] == old:
            from .known_values import resized

            shape = list(value.shape)
            shape[dim] = new
            return TensorSpec(tuple(shape), value.dtype, value.requires_grad, value.channels_last,
                              resized(value.values, dim, new))
        return value
    if isinstance(value, (tuple, list)):
        return _rebuild(value, [resize(v, dim, old, new) for v in value])
    if isinstance(value, dict):
        return {k: resize(v, dim, old, new) for k, v in value.items()}
    return value


def size_of(value: Any, dim: int) -> int | None:
    """Dimension ``dim`` of the first input tensor that has one (the batch for 0, the sequence for 1)."""
    for s in specs_in(value):
        if len(s.shape) > dim:
            return s.shape[dim]
    return None


def check_inputs(inputs: Any) -> None:
    if callable(inputs) and not isinstance(inputs, torch.Tensor):
        return
    specs = specs_in(to_specs(inputs)) if _is_structure(inputs) else []
    if not specs:
        raise TypeError("inputs must be a tensor, a tuple/list or dict of tensors, or a zero-argument callable "
                        f"returning them; got {type(inputs).__name__}")


def _is_structure(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, tuple, list, Mapping))


class ModelSource:
    """Where the model comes from: a weak reference to a real module, or a builder (held strongly)."""

    def __init__(self, model: Any) -> None:
        if isinstance(model, nn.Module):
            self._ref: Callable[[], Any] | None = weakref.ref(model)
            self.builder: Callable[[], Any] | None = None
            self.name = type(model).__name__
        elif callable(model):
            try:
                sig = inspect.signature(model)
                required = [p for p in sig.parameters.values()
                            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            except (TypeError, ValueError):
                required = []
            if required:
                raise TypeError(f"model builder {getattr(model, '__name__', model)!r} must take no arguments "
                                f"(it needs {', '.join(p.name for p in required)}); wrap it, e.g. "
                                "lambda: build(config)")
            self._ref = None
            self.builder = model
            self.name = getattr(model, "__name__", type(model).__name__)
        else:
            raise TypeError(f"model must be an nn.Module or a zero-argument callable that builds one, not "
                            f"{type(model).__name__}")

    def module(self) -> nn.Module | None:
        return self._ref() if self._ref is not None else None

    def fake(self, mode: FakeTensorMode, dtype: torch.dtype | None) -> tuple[nn.Module, dict[str, str]]:
        """A fake copy (or fake build) of the model, with floating weights in ``dtype`` when given, without its
        ``torch.compile`` wrappers; and which parts were compiled (see ``tracing/compiled/backend.py``)."""
        from ..tracing.compiled.backend import compiled_parts, copy_plain, strip
        from .scripted import has_scripted, replicate_scripted

        if self.builder is not None:
            from .known_values import ValueMode

            old = torch.get_default_dtype()
            with mode, ValueMode(), init_skipped():
                if dtype is not None:
                    torch.set_default_dtype(dtype)
                try:
                    built = self.builder()
                except RuntimeError as err:
                    if "Uninitialized" not in str(err):
                        raise
                    raise ValueError("the model builder makes lazy modules (nn.LazyLinear, ...), whose parameters "
                                     "cannot be made on fake tensors; pass the built module instead (before its "
                                     "first forward it holds no memory for them)") from None
                finally:
                    torch.set_default_dtype(old)
            if not isinstance(built, nn.Module):
                raise TypeError(f"the model builder returned {type(built).__name__}, not an nn.Module")
            parts = compiled_parts(built)
            built = strip(built) if parts else built
            if not self.name.isidentifier():  # a lambda: name the estimate after what it built
                self.name = type(built).__name__
            _normalise(built, mode, dtype)
            return built, parts
        model = self.module()
        if model is None:
            raise ValueError("the model this estimate was made for no longer exists; estimate again")
        parts = compiled_parts(model)
        from .quantize import stand_ins

        memo: dict[int, Any] = dict(stand_ins(model, mode))  # quantized layers: fake stand-ins, copied as they are
        tensors = list(model.parameters()) + list(model.buffers())
        for t in tensors:  # a lazy module's: still to be made (see materialize_lazy)
            if _is_lazy(t) and id(t) not in memo:
                memo[id(t)] = _lazy_twin(t, dtype)
        with mode:
            for t in tensors:
                if id(t) not in memo:
                    memo[id(t)] = _fake_like(t, dtype)
        if has_scripted(model):  # TorchScript modules: replicas on the fake weights, never a C++ deep copy
            def twin(t: torch.Tensor) -> torch.Tensor:
                with mode:
                    return _fake_like(t, dtype)

            replicate_scripted(model, memo, twin)
        with FakeCopyMode(mode):
            fake = copy_plain(model, memo) if parts else copy.deepcopy(model, memo)
        _normalise(fake, mode, dtype)
        return fake, parts


#: ``torch.nn.init``'s initialisers (the names transformers' ``initialization`` module wraps too)
_INITS = ("uniform_", "normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_",
          "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_", "orthogonal_", "sparse_")


#: how many ``init_skipped`` blocks are open now: the skipping initialisers skip only while one is
_SKIPPING = [0]


def _skipping(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` (an initialiser), returning its tensor untouched while :func:`init_skipped` is open and running
    as itself outside it."""
    def init(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        if _SKIPPING[0]:
            return tensor
        return original(tensor, *args, **kwargs)

    init.__wrapped__ = original  # type: ignore[attr-defined]
    init.__name__ = getattr(original, "__name__", "init")
    init.__doc__ = getattr(original, "__doc__", None)
    init._vram_magic_skipping = True  # type: ignore[attr-defined]
    return init


@contextlib.contextmanager
def init_skipped() -> Any:
    """While a builder builds on fake tensors: weight initialisers return their tensor untouched. Initial values
    are no memory, and ``trunc_normal_`` reads its random draws (``if not mask.any()`` in its rejection loop), which
    fake tensors do not have (ViT, DeiT, ModernBERT). Patched where models call them: ``torch.nn.init``, the
    ``torch.nn.modules`` that import them by name, and transformers' wrappers (``transformers.initialization``, as
    its own ``no_init_weights`` does; its ``init_weights`` still runs, so tied weights are tied).

    What a module takes from ``torch.nn.init`` while the block is open keeps the stand-in after it: transformers'
    ``initialization`` (imported by the builder's first transformers model) records ``torch.nn.init``'s functions
    at its import in ``TORCH_INIT_FUNCTIONS`` and calls those ever after, and ``from torch.nn.init import
    trunc_normal_`` does the same. So the stand-ins skip only while a block is open and are the original
    initialisers otherwise: a model built for real later is initialised as it would be without the estimator."""
    import sys

    names = ["torch.nn.init", "transformers.initialization"]
    names += [n for n in list(sys.modules) if n.startswith("torch.nn.modules.")]
    saved: list[tuple[Any, str, Any]] = []
    _SKIPPING[0] += 1
    try:
        for name in names:
            module = sys.modules.get(name)
            for fn in _INITS:
                current = getattr(module, fn, None) if module is not None else None
                if callable(current) and not getattr(current, "_vram_magic_skipping", False):
                    saved.append((module, fn, current))
                    setattr(module, fn, _skipping(current))
        yield
    finally:
        _SKIPPING[0] -= 1
        for module, fn, original in reversed(saved):
            setattr(module, fn, original)


def _fake_like(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    dt = dtype if dtype is not None and t.is_floating_point() else t.dtype
    new = torch.empty(tuple(t.shape), dtype=dt)
    if isinstance(t, nn.Parameter):
        return nn.Parameter(new, requires_grad=t.requires_grad)
    return new


def _is_lazy(t: Any) -> bool:
    return isinstance(t, nn.parameter.UninitializedTensorMixin)


def _lazy_twin(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A lazy module's parameter (or buffer) not made yet: a new one, on the meta device, in ``dtype``."""
    dt = dtype if dtype is not None and t.is_floating_point() else t.dtype
    kind = nn.UninitializedParameter if isinstance(t, nn.Parameter) else nn.UninitializedBuffer
    return kind(requires_grad=t.requires_grad, device="meta", dtype=dt)


def has_lazy(model: nn.Module) -> bool:
    """Lazy modules (``nn.LazyLinear``, ``nn.LazyConv2d``, ...) whose parameters are still to be made."""
    return any(_is_lazy(t) for t in list(model.parameters()) + list(model.buffers()))


def materialize_lazy(model: nn.Module, specs: Any, mode: FakeTensorMode, dtype: torch.dtype | None,
                     call: Callable[[nn.Module, Any], Any]) -> None:
    """Our own fake copy only: its lazy modules make their parameters on a first forward, which runs here on
    meta tensors (the copy's tensors swapped for meta twins, the inputs made on meta, ``call(model, inputs)``
    without gradients); then every tensor of the copy is a fake one again, the new parameters included."""
    twins: dict[int, torch.Tensor] = {}
    for m in model.modules():
        for table in (m._parameters, m._buffers):
            for name, t in list(table.items()):
                if t is None or _is_lazy(t):
                    continue
                if id(t) not in twins:
                    meta = torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")
                    twins[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(
                        t, nn.Parameter) else meta
                table[name] = twins[id(t)]
    inputs = map_specs(specs, lambda s: s.make(dtype, device="meta"))
    with torch.no_grad(), torch.device("meta"):
        call(model, inputs)
    _normalise(model, mode, dtype)


def _normalise(model: nn.Module, mode: FakeTensorMode, dtype: torch.dtype | None) -> None:
    """Our own fake model only: every parameter and buffer a fake CPU tensor in the asked dtype."""
    memo: dict[int, Any] = {}
    with mode:
        for m in model.modules():
            if getattr(m, "keeps_dtypes", False):  # a quantized stand-in: its tensors are already ours
                continue
            for table in (m._parameters, m._buffers):
                for name, t in list(table.items()):
                    if t is None or _is_lazy(t):
                        continue
                    wrong_dtype = dtype is not None and t.is_floating_point() and t.dtype != dtype
                    if t.device.type == "cpu" and not wrong_dtype and _is_fake(t, mode):
                        continue
                    if id(t) not in memo:
                        memo[id(t)] = _fake_like(t, dtype)
                    table[name] = memo[id(t)]


def _is_fake(t: torch.Tensor, mode: FakeTensorMode) -> bool:
    from ..torch_private import FakeTensor

    return isinstance(t, FakeTensor) and t.fake_mode is mode
