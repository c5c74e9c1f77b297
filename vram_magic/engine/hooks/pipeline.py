"""Pipeline parallelism (``torch.distributed.pipelining``), as the tracker and the namespace scan see it.

A ``PipelineStage`` runs its module once per micro-batch (``forward_one_chunk``, ``backward_one_chunk``). While a
tracker is active those methods are wrapped — once, whatever the number of trackers, and put back when the last
one leaves; the pipelining package is never imported for it (a tracker that begins before it is imported wraps
it once it is) — so that what a micro-batch's forward makes counts as that stage's activations, named with the
stage, and what its backward makes as the stage's activation gradients (parameter gradients stay gradients: the
optimizer step and the scan name them).

At the end of a block the scan reads the stages it finds (the namespace's, or a schedule's): their receive buffers
(the activations a stage receives from the stage before, the gradients from the stage after: made once for every
micro-batch in the first step and kept, up to PyTorch 2.13; made just before each receive and let go of once used,
in 2.15), the gradients of its inputs it sends back, the micro-batches still in flight and the last stage's outputs
kept for the merged output. Sends need no memory of their own: a stage sends its output tensor as it is.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from typing import Any

from ..after_import import after_import, forget

_STAGE_MODULE = "torch.distributed.pipelining.stage"
_SCHEDULES_MODULE = "torch.distributed.pipelining.schedules"
_WRAPPED = "__vram_magic_wrapped__"

_watchers: list[Any] = []  # the active trackers
_patched: list[tuple[type, str, Any, Any]] = []  # (class, name, original, wrapper)


def forward_role(stage: int) -> tuple[str, str]:
    return ("activations", f"pipeline stage {stage}: micro-batch activations")


def backward_role(stage: int) -> tuple[str, str]:
    return ("activations", f"pipeline stage {stage}: activation gradients (backward)")


def received_role(stage: int, what: str) -> tuple[str, str]:
    """``what``: "activations" or "gradients"."""
    return ("other", f"pipeline stage {stage}: receive buffers ({what})")


def input_grads_role(stage: int) -> tuple[str, str]:
    return ("other", f"pipeline stage {stage}: gradients of its inputs (sent back)")


def outputs_role(stage: int) -> tuple[str, str]:
    return ("other", f"pipeline stage {stage}: outputs kept for the merged output")


def inference_role(stage: int) -> tuple[str, str]:
    return ("other", f"pipeline stage {stage}: shape inference (first step)")


MERGED = ("other", "pipeline: merged output of the last stage")


def _received(stage: Any, what: str) -> list[tuple[Any, tuple[str, str]]]:
    infos = stage.__dict__.get("args_recv_info" if what == "activations" else "grad_recv_info") or {}
    index = getattr(stage, "stage_index", 0)
    return [(info.buffer, received_role(index, what)) for chunk in list(infos.values()) for info in chunk
            if getattr(info, "buffer", None) is not None and not getattr(info, "is_root_arg", False)]


def _last_outputs(stage: Any) -> list[tuple[Any, tuple[str, str]]]:
    chunks = stage.__dict__.get("output_chunks") or []
    if not getattr(stage, "is_last", False) or not chunks:
        return []
    return [(t, outputs_role(getattr(stage, "stage_index", 0))) for t in _tensors(chunks[-1])]


# the stage's methods wrapped: (name, the role of what it makes, what it leaves named otherwise)
_STAGE_METHODS = (
    ("forward_one_chunk", forward_role, _last_outputs),
    ("backward_one_chunk", backward_role, None),
    ("backward_weight_one_chunk", backward_role, None),
    # where a stage allocates a micro-batch's receive buffer just before its receive (2.15; before, they are made
    # once for all micro-batches in the first step, below)
    ("get_fwd_recv_ops", lambda stage: received_role(stage, "activations"), None),
    ("get_bwd_recv_ops", lambda stage: received_role(stage, "gradients"), None),
    # the first step: one micro-batch's forward and backward on the shapes, then the receive buffers
    ("_prepare_forward_infra", inference_role, lambda stage: _received(stage, "activations")),
    ("_prepare_backward_infra", inference_role, lambda stage: _received(stage, "gradients")),
)


# --- the tracker's side -------------------------------------------------------------------------------------------
def watch(tracker: Any) -> None:
    """Let ``tracker`` hear of every stage's micro-batches (wraps the stage class if loaded, or once it is)."""
    if tracker not in _watchers:
        _watchers.append(tracker)
    if not _wrap_loaded():
        after_import(_STAGE_MODULE, _stage_module_loaded)


def unwatch(tracker: Any) -> None:
    """Stop telling ``tracker``; the last tracker to leave puts the stage's methods back."""
    if tracker in _watchers:
        _watchers.remove(tracker)
    if _watchers:
        return
    forget(_STAGE_MODULE)
    while _patched:
        cls, name, original, wrapper = _patched.pop()
        if cls.__dict__.get(name) is wrapper:  # someone else's patch on top stays, and so does ours under it
            setattr(cls, name, original)


def is_wrapped(name: str = "forward_one_chunk") -> bool:
    """A stage method is one of the wrappers (for tests: none is left once no tracker is active)."""
    cls = _defining(_public("PipelineStage"), "forward_one_chunk")
    return cls is not None and bool(getattr(cls.__dict__.get(name), _WRAPPED, False))


def _public(name: str, module: str = _STAGE_MODULE) -> type | None:
    found = getattr(sys.modules.get(module), name, None)
    return found if isinstance(found, type) else None


def _defining(cls: type | None, method: str) -> type | None:
    """The class in ``cls``'s MRO that defines ``method`` (a stage's micro-batch methods are its base's)."""
    for c in cls.__mro__ if cls is not None else ():
        if method in c.__dict__:
            return c
    return None


def _wrap_loaded() -> bool:
    """Wrap the stage's (and the schedules' merge) methods if the pipelining package is loaded; whether it is."""
    stage = _public("PipelineStage")
    if stage is None:
        return False
    for name, role, named in _STAGE_METHODS:
        cls = _defining(stage, name)
        if cls is not None:
            _wrap(cls, name, role, named)
    schedule = _defining(_public("ScheduleGPipe", _SCHEDULES_MODULE), "_merge_outputs")
    if schedule is not None:
        _wrap(schedule, "_merge_outputs", None, None)
    return True


def _wrap(cls: type, name: str, role: Any, named: Any) -> None:
    fn = cls.__dict__.get(name)
    if fn is None or not callable(fn) or getattr(fn, _WRAPPED, False):
        return
    wrapper = _wrapper(fn, role, named)
    setattr(wrapper, _WRAPPED, True)
    setattr(cls, name, wrapper)
    _patched.append((cls, name, fn, wrapper))


def _wrapper(fn: Any, role: Any, named: Any) -> Any:
    """``role(stage index)``: what the call makes (``None``: a schedule's merged output)."""
    @functools.wraps(fn)
    def wrapped(owner: Any, *args: Any, **kwargs: Any) -> Any:
        watchers = list(_watchers)
        if not watchers:
            return fn(owner, *args, **kwargs)
        made = role(getattr(owner, "stage_index", 0)) if role is not None else MERGED
        began = [t.stage_work_began() for t in watchers]
        try:
            return fn(owner, *args, **kwargs)
        finally:
            try:
                others = named(owner) if named is not None else ()
            except Exception:  # a stage of another shape: what it made keeps the call's role
                others = ()
            for t, first in zip(watchers, began):
                t.stage_work_done(first, made, others)

    return wrapped


def _stage_module_loaded(module: Any) -> None:
    """The pipelining package was imported after the measurement began: wrap its stage class now."""
    if _watchers:
        _wrap_loaded()  # a stage class of another shape raises: its micro-batches go unnamed


# --- the scan's side -----------------------------------------------------------------------------------------------
def loaded() -> bool:
    return _STAGE_MODULE in sys.modules


_kinds: list[Any] = [None, ()]  # [id of the stage module, (stage base, schedule bases)], looked up once


def _stage_kinds() -> tuple[Any, ...]:
    """(the stages' base class, the schedules' base classes), or () before the pipelining package is loaded."""
    module = sys.modules.get(_STAGE_MODULE)
    if _kinds[0] != id(module):
        base = _defining(_public("PipelineStage"), "forward_one_chunk")
        schedules = sys.modules.get(_SCHEDULES_MODULE)
        roots = tuple(c for c in (getattr(schedules, "PipelineScheduleSingle", None),
                                  getattr(schedules, "PipelineScheduleMulti", None)) if isinstance(c, type))
        _kinds[:] = [id(module), (base, roots) if base is not None else ()]
    return _kinds[1]


def stages_of(obj: Any) -> list[Any]:
    """The pipeline stages ``obj`` is or holds (a stage; a schedule's one stage or several), else ``[]``."""
    kinds = _stage_kinds()
    if not kinds:
        return []
    base, roots = kinds
    if isinstance(obj, base):
        return [obj]
    if not roots or not isinstance(obj, roots):
        return []
    d = getattr(obj, "__dict__", {})
    found = [d.get("_stage")] + list(d.get("_stages") or ())
    return [s for s in found if isinstance(s, base)]


def held_tensors(stage: Any) -> Iterator[tuple[Any, tuple[str, str]]]:
    """``(tensor, (category, label))`` for what a stage holds beside its module: receive buffers, the gradients of
    its inputs, micro-batches in flight, the last stage's outputs. Every read guarded by the caller."""
    import torch

    index = getattr(stage, "stage_index", 0)
    d = stage.__dict__
    for infos in list((d.get("args_recv_info") or {}).values()):
        for info in infos:
            buffer = getattr(info, "buffer", None)
            if isinstance(buffer, torch.Tensor) and not getattr(info, "is_root_arg", False):
                yield buffer, received_role(index, "activations")
                if isinstance(buffer.grad, torch.Tensor):  # cleared at the next step's start
                    yield buffer.grad, input_grads_role(index)
    for infos in list((d.get("grad_recv_info") or {}).values()):
        for info in infos:
            buffer = getattr(info, "buffer", None)
            if isinstance(buffer, torch.Tensor):
                yield buffer, received_role(index, "gradients")
    for t in _tensors(list((d.get("bwd_cache") or {}).values())):
        yield t, input_grads_role(index)
    for t in _tensors(list((d.get("fwd_cache") or {}).values())):  # in flight: forward done, backward not yet
        yield t, forward_role(index)
    for state in list((d.get("_forward_chunk_states") or {}).values()):  # the same, 2.15
        for t in _tensors([getattr(state, "live_outputs", None), getattr(state, "input_values", None)]):
            yield t, forward_role(index)
    for t in _tensors(list(d.get("output_chunks") or ())):
        yield t, outputs_role(index)


def _tensors(obj: Any, depth: int = 4) -> Iterator[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 0 and isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v, depth - 1)
    elif depth > 0 and isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v, depth - 1)


__all__ = ["MERGED", "backward_role", "forward_role", "held_tensors", "inference_role", "input_grads_role",
           "is_wrapped", "loaded", "outputs_role", "received_role", "stages_of", "unwatch", "watch"]
