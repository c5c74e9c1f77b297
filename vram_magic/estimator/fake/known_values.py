"""Real values beside small fake tensors, so a model takes the code path a real run takes.

Fake tensors have shapes, no data. Most models never read their data, but some steer on it: Hugging Face
models drop an all-ones attention mask (and then run a different attention graph) only after reading it,
and a model that reads a value on a fake tensor cannot go on. So the small integer and boolean tensors of
the inputs (attention masks, token ids, positions) keep a real copy of their values, and every op whose
tensor arguments all have values computes the real result beside the fake one, when that result is small
too. A value read (``.item()``, ``bool(mask.all())``, ``torch.equal``) or an op whose output shape depends
on values (``nonzero``) is then answered from the real copy, as the real run would answer it.

A value is a plain CPU tensor kept as an attribute of the fake tensor: it lives exactly as long as the
fake tensor does, and the real work happens only on tensors of at most :data:`LIMIT` elements.
"""

from __future__ import annotations

from typing import Any

import torch

from ..torch_private import TorchDispatchMode
from ..torch_private import disable_current_modes as _disable_current_modes

ATTR = "_vram_magic_value"
LIMIT = 1 << 20  # elements: masks and ids of a batch, never activations
#: the mark of values that come from an MoE router's assumed choices (tracing/routing.py), and what they may grow to:
#: the eager experts' one-hot routing mask is tokens × k × (experts + 1) elements
ROUTED = "_vram_magic_routed"
ROUTED_LIMIT = 1 << 24
#: the outputs of ops on routed values that were too large to compute for real, counted (tracing/routing.py reads it)
ROUTED_DROPPED = [0]
_RANDOM = torch.Tag.nondeterministic_seeded
#: factories whose memory is uninitialized: their values are whatever the allocator handed out (a real run's are
#: as arbitrary), so they get none; a kept value would steer the fake run by garbage (``mask.all()``)
_UNINITIALIZED = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided",
                            "empty_permuted"})
#: uniform draws that get a stated value when they are this small (see _stated_draw), and the mark they carry
_UNIFORM = frozenset({"rand", "rand_like", "uniform_"})
DRAW_LIMIT = 16
DRAWN = "_vram_magic_drawn"
_IS_RANDOM: dict[Any, bool] = {}  # op -> tagged nondeterministic_seeded
#: in-place ops that overwrite all of their target: an uninitialized one gains values from them
_OVERWRITE = frozenset({"fill_", "zero_", "copy_"})


def value_of(t: Any) -> torch.Tensor | None:
    """The real values of ``t``: its kept copy if it is fake, itself if it is a plain real tensor."""
    if not isinstance(t, torch.Tensor):
        return None
    v = getattr(t, ATTR, None)
    if v is None and type(t) is torch.Tensor and t.device.type == "cpu":
        return t
    return v


def attach(fake: torch.Tensor, value: torch.Tensor | None) -> None:
    if value is not None:
        setattr(fake, ATTR, value)


def keep(t: torch.Tensor) -> torch.Tensor | None:
    """The values worth keeping of an input tensor: a copy of small integer and boolean tensors."""
    known = getattr(t, ATTR, None)
    if known is not None:
        return known
    if t.is_floating_point() or t.is_complex() or t.numel() > LIMIT or t.layout != torch.strided:
        return None
    if t.device.type == "meta" or _is_fake(t):
        return None
    with _disable_current_modes(), torch.no_grad():
        return t.detach().to("cpu", copy=True)


def real_copy(value: torch.Tensor) -> torch.Tensor:
    """A copy made outside every mode (under a fake mode ``clone`` would make a fake tensor)."""
    with _disable_current_modes(), torch.no_grad():
        return value.clone()


def _is_fake(t: torch.Tensor) -> bool:
    from ..torch_private import FakeTensor

    return isinstance(t, FakeTensor)


def _small(out: Any, limit: int | None = None) -> bool:
    if isinstance(out, torch.Tensor):
        return out.numel() <= (LIMIT if limit is None else limit) and out.layout == torch.strided
    if isinstance(out, (tuple, list)):
        return all(_small(o, limit) for o in out if isinstance(o, torch.Tensor))
    return True


def _real_args(value: Any) -> tuple[bool, Any]:
    """``(all tensors have values, the structure with each tensor replaced by its value)``."""
    if isinstance(value, torch.Tensor):
        v = value_of(value)
        return (v is not None), v
    if isinstance(value, (tuple, list)):
        out = []
        for item in value:
            ok, r = _real_args(item)
            if not ok:
                return False, None
            out.append(r)
        return True, type(value)(out) if type(value) in (tuple, list) else tuple(out)
    if isinstance(value, dict):
        out_d = {}
        for k, item in value.items():
            ok, r = _real_args(item)
            if not ok:
                return False, None
            out_d[k] = r
        return True, out_d
    return True, value


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, list)):
        return any(_has_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(_has_tensor(v) for v in value.values())
    return False


def _run_real(func: Any, args: Any, kwargs: Any) -> Any:
    with _disable_current_modes(), torch.no_grad():
        return func(*args, **kwargs)


def propagate(func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
    """After ``func`` ran on fake tensors: give its outputs values when every tensor argument has one (or when
    it is a deterministic factory such as ``arange``) and the outputs are small."""
    if args and func.overloadpacket.__name__ in _OVERWRITE:
        _overwritten(args)
    # random ops never run for real: they would draw from (and advance) the user's random generator
    random = _IS_RANDOM.get(func)
    if random is None:
        random = _IS_RANDOM[func] = _RANDOM in getattr(func, "tags", ())
    if random:
        _forget_written(func, args)
        _stated_draw(func, args, kwargs, out)
        return
    for a in args:  # the fast way out: an argument without a value (most ops of a model)
        if isinstance(a, torch.Tensor) and getattr(a, ATTR, None) is None and type(a) is not torch.Tensor:
            _forget_written(func, args)
            return
    small = _small(out) or routed(args) and (_small(out, ROUTED_LIMIT) or _dropped())
    if not small or func.overloadpacket.__name__ in _UNINITIALIZED:
        _forget_written(func, args)
        return
    tensors_in = _has_tensor(args) or _has_tensor(kwargs)
    if not tensors_in:
        if not isinstance(out, torch.Tensor):
            return
        if "device" in kwargs:
            kwargs = {**kwargs, "device": "cpu"}
    ok, rargs = _real_args(args)
    ok2, rkwargs = _real_args(kwargs) if ok else (False, None)
    if not (ok and ok2):
        _forget_written(func, args)
        return
    try:
        real = _run_real(func, rargs, rkwargs)
    except Exception:  # the real kernel disagrees (an op fake tensors accept): no value, as before
        _forget_written(func, args)
        return
    _pair(out, real)
    if any(getattr(a, DRAWN, False) for a in args if isinstance(a, torch.Tensor)):
        _mark(out, DRAWN)
    if routed(args):
        _mark(out, ROUTED)


def _stated_draw(func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
    """A few uniform draws (``torch.rand([])``, ``torch.empty(n).uniform_()``: LayerDrop's per-layer coin) get a
    stated value, the top of their range, marked as drawn: a ``draw < p`` test is then False and ``draw > p``
    True, so a layer dropped with probability ``p`` runs (the step's largest memory), and the read is answered
    instead of ending the estimate. Larger draws (dropout masks) keep no value."""
    name = func.overloadpacket.__name__
    if name not in _UNIFORM or not isinstance(out, torch.Tensor) or out.numel() > DRAW_LIMIT \
            or not out.is_floating_point() or out.layout != torch.strided:
        return
    high = 1.0
    if name == "uniform_":
        high = float(kwargs.get("to", args[2] if len(args) > 2 else 1.0))
    with _disable_current_modes():
        top = torch.nextafter(torch.tensor(high, dtype=out.dtype), torch.tensor(float("-inf"), dtype=out.dtype))
        setattr(out, ATTR, torch.full(tuple(out.shape), top.item(), dtype=out.dtype))
    setattr(out, DRAWN, True)


def _mark(out: Any, mark: str) -> None:
    for o in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(o, torch.Tensor) and getattr(o, ATTR, None) is not None:
            setattr(o, mark, True)


def _dropped() -> bool:
    ROUTED_DROPPED[0] += 1
    return False


def routed(args: Any) -> bool:
    """Whether an op's arguments hold values of an MoE router's assumed choices (tracing/routing.py)."""
    return any(getattr(a, ROUTED, False) for a in args if isinstance(a, torch.Tensor))


def drawn(args: Any) -> bool:
    """Whether a value read's arguments hold a stated draw (see :func:`_stated_draw`)."""
    return any(getattr(a, DRAWN, False) for a in args if isinstance(a, torch.Tensor))


def _pair(fake: Any, real: Any) -> None:
    if isinstance(fake, torch.Tensor) and isinstance(real, torch.Tensor):
        if tuple(fake.shape) == tuple(real.shape) and fake.dtype == real.dtype:
            setattr(fake, ATTR, real)
    elif isinstance(fake, (tuple, list)) and isinstance(real, (tuple, list)):
        for f, r in zip(fake, real):
            _pair(f, r)


def _overwritten(args: Any) -> None:
    """``empty(...).fill_(1)``: the target of an op that overwrites it all starts from zeros, so the op's real
    run gives it its values (when the source has them)."""
    target = args[0]
    if not isinstance(target, torch.Tensor) or getattr(target, ATTR, None) is not None or not _small(target):
        return
    if target.layout != torch.strided or not _is_fake(target):
        return
    source = args[1] if len(args) > 1 else None
    if isinstance(source, torch.Tensor) and value_of(source) is None:
        return
    with _disable_current_modes():
        setattr(target, ATTR, torch.zeros(tuple(target.shape), dtype=target.dtype))


def _forget_written(func: Any, args: Any) -> None:
    """An in-place op whose result is not known leaves its target's value stale: drop it."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return
    for a, arg in zip(schema.arguments, args):
        if a.alias_info is not None and a.alias_info.is_write and isinstance(arg, torch.Tensor):
            if hasattr(arg, ATTR):
                delattr(arg, ATTR)


def answer(func: Any, args: Any, kwargs: dict[str, Any]) -> tuple[bool, Any]:
    """An op fake tensors cannot run (a value read, an output shape that depends on values): ``(True,
    result)`` from the real values when every tensor argument has them, else ``(False, None)``. Tensor
    results come back as fake tensors of the real result's shape (made under the fake mode below the
    caller), carrying the real result as their value."""
    if _RANDOM in getattr(func, "tags", ()):
        return False, None
    masked = _masked_index(func, args)
    if masked is not None:
        return True, masked
    ok, rargs = _real_args(args)
    ok2, rkwargs = _real_args(kwargs) if ok else (False, None)
    if not (ok and ok2) or not (_has_tensor(args) or _has_tensor(kwargs)):
        return False, None
    try:
        real = _run_real(func, rargs, rkwargs)
    except Exception:
        return False, None
    out = _fake_of(real)
    if routed(args):
        _mark(out, ROUTED)
    return True, out


def _masked_index(func: Any, args: Any) -> Any:
    """``x[mask]`` where the mask's values are known and ``x``'s are not (activations selected by a loss mask, a chunked
    loss's valid tokens): the mask's positions found on its values, then ``x`` indexed by them on fake tensors (the
    shape the real op gives; the positions are the kernel's own, no memory of the step). None for any other op."""
    if func is not _INDEX or len(args) < 2 or not isinstance(args[1], (list, tuple)):
        return None
    indices: list[Any] = []
    masks = 0
    for ix in args[1]:
        if isinstance(ix, torch.Tensor) and ix.dtype in (torch.bool, torch.uint8):
            v = value_of(ix)
            if v is None:
                return None
            with _disable_current_modes():
                positions = v.nonzero(as_tuple=True)
            indices.extend(_fake_of(p) for p in positions)
            masks += 1
        else:
            indices.append(ix)
    return func(args[0], indices) if masks else None


_INDEX = torch.ops.aten.index.Tensor


def _fake_of(real: Any) -> Any:
    if isinstance(real, torch.Tensor):
        fake = torch.empty_strided(tuple(real.shape), tuple(real.stride()), dtype=real.dtype)
        setattr(fake, ATTR, real)
        return fake
    if isinstance(real, (tuple, list)):
        return type(real)(_fake_of(r) for r in real)
    return real


def resized(value: torch.Tensor | None, dim: int, new: int) -> torch.Tensor | None:
    """The values of an input whose dimension ``dim`` changes to ``new`` (a what-if's batch or sequence
    length): cut, or repeated cyclically (an all-ones mask stays all ones)."""
    if value is None or value.dim() <= dim:
        return value
    old = value.shape[dim]
    with _disable_current_modes(), torch.no_grad():
        if new <= old:
            return value.narrow(dim, 0, new).clone()
        if old == 0:
            return None
        out = torch.cat([value] * -(-new // old), dim).narrow(dim, 0, new).clone()
    return out if out.numel() <= LIMIT else None


class ValueMode(TorchDispatchMode):
    """Above a fake mode while the inputs are made, or a builder builds the model: factories (``torch.ones``,
    ``arange``, ``linspace``) and ops on known values give their small outputs values, so a mask made by an
    ``--input`` expression is known too, and a value read on them (a constructor's
    ``torch.linspace(0, rate, depth).tolist()`` for its drop-path rates) is answered from them."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from ..torch_private import DataDependentOutputException, DynamicOutputShapeException

        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            known, out = answer(func, args, kwargs)
            if not known:
                raise
            return out
        propagate(func, args, kwargs, out)
        return out
