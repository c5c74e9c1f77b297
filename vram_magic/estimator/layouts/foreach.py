"""The optimizer's ``_foreach_*`` update on ``DTensor`` shards, run as ``DTensor`` runs it but without its sharding
propagation, which grows with the square of the lists' length (an 80-layer model's AdamW step took most of a
tensor-parallel trace): every list's shard at position i redistributed to the first list's placements there (a
norm's gradient, a partial sum over the sequence shards, all-reduced under the tracer, so the collective is
counted), then the op on the local shards, its results wrapped back as ``DTensor`` placed as the first list's."""

from __future__ import annotations

from typing import Any

import torch

from ..torch_private import dtensor_from_local, pop_mode, push_mode

#: foreach ops that reduce (their shards' results are partial), left to ``DTensor``
_REDUCING_FOREACH = frozenset({"_foreach_norm", "_foreach_max"})


class _Mixed(Exception):
    """A foreach op's arguments that only ``DTensor`` itself can run."""


def is_pointwise_foreach(func: Any) -> bool:
    """Whether ``func`` is an ATen ``_foreach_*`` op that works element by element (every one but the reductions)."""
    name = str(getattr(func, "__name__", "")).split(".")[0]
    return getattr(func, "namespace", None) == "aten" and name.startswith("_foreach_") and \
        name.rstrip("_") not in _REDUCING_FOREACH


def foreach_locally(tracer: Any, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """A pointwise ``_foreach_*`` op run on the local shards under ``tracer`` (a ``TensorParallelTracer``);
    ``NotImplemented`` where ``DTensor`` must decide (the first list partial, other meshes)."""
    from torch.distributed.tensor import DTensor, Partial

    reference: list[Any] | None = None

    def unwrap(value: Any) -> Any:
        nonlocal reference
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, DTensor) for v in value):
            if reference is None:
                if any(isinstance(p, Partial) for v in value for p in v.placements):
                    raise _Mixed
                reference = list(value)
                return [v._local_tensor for v in value]
            if len(value) != len(reference) or any(v.device_mesh != r.device_mesh
                                                   for v, r in zip(value, reference, strict=True)):
                raise _Mixed
            return [_placed(tracer, v, r.placements)._local_tensor for v, r in zip(value, reference, strict=True)]
        if isinstance(value, DTensor):
            if not all(p.is_replicate() for p in value.placements):
                raise _Mixed
            return value._local_tensor
        if isinstance(value, (list, tuple)) and any(isinstance(v, DTensor) for v in value):
            raise _Mixed
        return value

    try:
        local_args = tuple(unwrap(a) for a in args)
        local_kwargs = {k: unwrap(v) for k, v in kwargs.items()}
    except _Mixed:
        return NotImplemented
    if reference is None:
        return NotImplemented
    out = tracer.__torch_dispatch__(func, (torch.Tensor,), local_args, local_kwargs)
    if not isinstance(out, (list, tuple)) or not out:
        return out
    return [_as_dtensor(o, r) for o, r in zip(out, reference, strict=True)]


def _placed(tracer: Any, t: Any, placements: Any) -> Any:
    """``t`` redistributed to ``placements`` under ``tracer`` (its collective counted), as ``DTensor`` does before a
    pointwise op whose operands are placed differently."""
    if t.placements == placements:
        return t
    push_mode(tracer)
    try:
        return t.redistribute(t.device_mesh, placements)
    finally:
        pop_mode()


def _as_dtensor(local_out: Any, like: Any) -> Any:
    """``local_out`` (a pointwise op's result on ``like``'s shard) as a ``DTensor`` placed as ``like``."""
    if not isinstance(local_out, torch.Tensor):
        return local_out
    return dtensor_from_local(local_out, like.device_mesh, like.placements, like.shape, like.stride())


__all__ = ["foreach_locally", "is_pointwise_foreach"]
