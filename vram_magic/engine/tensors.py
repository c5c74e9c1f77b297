"""The storages behind a tensor, whatever kind of tensor it is.

A plain tensor has one storage. A wrapper subclass (``DTensor``, torchao's quantized tensors, float8 and
NF4 tensors) has none of its own: its memory is in the inner tensors ``__tensor_flatten__`` names (a DTensor's
local shard, a quantized tensor's data, scales and zero points). Sparse tensors keep indices and values.
Every read is guarded: a tensor subclass may raise on attribute access, and a scan must never fail the cell.
"""

from __future__ import annotations

from typing import Any

import torch

from .hooks.quantized import parameter_parts, subclass_format
from .torch_private import TRACING_TENSORS_PREFIX

_MAX_DEPTH = 4


def storage_parts(t: Any, depth: int = 0) -> list[tuple[Any, str]] | None:
    """``[(untyped storage, kind), ...]``: the storages holding ``t``'s memory; ``kind`` names a subclass's
    part (``"DTensor"``, ``"AffineQuantizedTensor"``) and is "" for a plain tensor. ``None``: the tensor could
    not be read (a subclass that raises on access)."""
    try:
        cls = type(t)
        if cls is not torch.Tensor and cls is not torch.nn.Parameter and depth < _MAX_DEPTH \
                and getattr(cls, "__tensor_flatten__", None) is not None and is_wrapper(t):
            names, _ = t.__tensor_flatten__()
            out: list[tuple[Any, str]] = []
            own = wrapper_kind(t, cls)
            for name in names:
                inner = getattr(t, name, None)
                if isinstance(inner, torch.Tensor):
                    out.extend((s, kind or own) for s, kind in storage_parts(inner, depth + 1) or ())
            return out
        layout = t.layout
        if layout == torch.strided:
            if cls is not torch.Tensor and cls is not torch.nn.Parameter:
                quant = parameter_parts(t)  # bitsandbytes' quantized parameters: data and quantization constants
                if quant is not None:
                    return quant
            return [(t.untyped_storage(), "")]
        if layout == torch.sparse_coo:
            parts = (t._indices(), t._values())
        elif layout in (torch.sparse_csr, torch.sparse_bsr):
            parts = (t.crow_indices(), t.col_indices(), t.values())
        elif layout in (torch.sparse_csc, torch.sparse_bsc):
            parts = (t.ccol_indices(), t.row_indices(), t.values())
        else:
            return []  # nested and other storage-less layouts
        return [p for part in parts for p in storage_parts(part, depth + 1) or ()]
    except Exception:  # a subclass that raises on access
        return None


def wrapper_kind(t: Any, cls: type) -> str:
    """What a wrapper subclass's parts are called in a report: a ``DTensor`` sharded across ranks (FSDP2's
    parameters, tensor parallelism's ``ColwiseParallel`` and ``RowwiseParallel`` weights, their gradients and
    optimizer state) holds only its rank's shard, and says so; a replicated one (a ``RowwiseParallel`` bias)
    holds the whole tensor on every rank; a partial one (a sum waiting for its all-reduce) holds this rank's
    part of the sum. Others go by their class name."""
    if cls.__name__ == "DTensor":
        try:
            placements = t.placements
            if any(p.is_shard() for p in placements):
                return "sharded"
            if all(p.is_replicate() for p in placements):
                return "replicated"
            if any(p.is_partial() for p in placements):
                return "partial"
        except Exception:
            pass
    return subclass_format(cls) or cls.__name__


def is_wrapper(t: Any) -> bool:
    """A wrapper subclass (``_make_wrapper_subclass``) has a storage object without memory behind it; so have
    PyTorch's own tracing tensors (fake and functional tensors: a DTensor's sharding propagation makes fake ones
    while a rank is measured)."""
    if str(getattr(type(t), "__module__", "")).startswith(TRACING_TENSORS_PREFIX):
        return True
    try:
        t.untyped_storage().data_ptr()
        return False
    except Exception:
        return True


def returned_tensors(out: Any) -> tuple[Any, ...] | list[Any]:
    """The tensors an op returned: ``out`` itself, or those of a tuple or list it returned."""
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, (tuple, list)):
        return [o for o in out if isinstance(o, torch.Tensor)]
    return ()


def grad_fn(t: Any) -> Any:
    try:
        return t.grad_fn
    except Exception:
        return None


def grad(t: Any) -> Any:
    try:
        g = t.grad
    except Exception:
        return None
    return g if isinstance(g, torch.Tensor) else None
