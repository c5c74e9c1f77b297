"""What the tracker does with each op, decided once per process and shared by every tracker.

A measured block used to decide again for every op it met, at its own cost. Each decision is kept in a dict keyed
by ``id(op)`` (hashing an ``OpOverload`` runs Python); the ops themselves are kept in :data:`DECIDED` so that an id
is never reused by another op (one defined with ``torch.library`` and later destroyed).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ..hooks.collectives import tp_collective
from ..torch_private import DYNAMO_MODULE, TRACING_TENSORS_PACKAGE, has_kernel_for_dispatch_key
from ..torch_private import pop_mode as _pop_mode
from ..torch_private import push_mode as _push_mode
from .scratch_ops import uses_scratch

is_compiling = getattr(torch.compiler, "is_compiling", lambda: False)


class _CompilingFlag:
    """For a torch without ``torch.compiler._is_compiling_flag``: the same attribute, read through the function."""

    @property
    def _is_compiling_flag(self) -> bool:
        return bool(is_compiling())


# Read as an attribute on every op: torch.compiler.is_compiling() is a Python call (~1 µs in between kernels)
# that returns this flag, which dynamo holds True while it traces. No tracing without dynamo imported: check
# ``DYNAMO in LOADED`` first.
COMPILER: Any = torch.compiler if hasattr(torch.compiler, "_is_compiling_flag") else _CompilingFlag()
DYNAMO = DYNAMO_MODULE
LOADED = sys.modules

# `torch.tensor(...)` builds its data outside dispatch and hands it over through lift_fresh, which returns an
# alias: its storage is new memory, made now.
FRESH = frozenset(op for op in (getattr(torch.ops.aten, "lift_fresh", None),) if op is not None) | frozenset(
    op.default for op in (getattr(torch.ops.aten, "lift_fresh", None),) if op is not None)
FRESH_IDS = frozenset(map(id, FRESH))  # looked up by id: hashing an OpOverload runs Python (they live forever)

# PyTorch's named scopes (``torch.profiler.record_function``) pass through dispatch as these two ops; FSDP2 wraps
# its collectives in scopes named ``FSDP::…``, which is how its buffers are told from the model's memory.
SCOPE_ENTER = getattr(getattr(torch.ops.profiler, "_record_function_enter_new", None), "default", None)
SCOPE_EXIT = getattr(getattr(torch.ops.profiler, "_record_function_exit", None), "_RecordFunction", None)

# What skips() says of an op besides True and False: a named scope opens or closes, the op's only kernel is its
# decomposition, its kernel allocates inside itself (scratch_ops.py), it is a GEMM whose operand copies a rule gives,
# it is a collective of tensor parallelism whose output is named after it (engine/hooks/collectives.py), some output
# may be an
# input's memory or memory made outside dispatch (every output looked up as it comes).
SCOPE_IN, SCOPE_OUT = object(), object()
DECOMPOSE = object()
SCRATCH_OP = object()
GEMM = object()
COLLECTIVE = object()
SEEN = object()
MM, ADDMM = torch.ops.aten.mm.default, torch.ops.aten.addmm.default

# id(op) -> the decision
ALIASING: dict[int, bool] = {}
SKIPPING: dict[int, Any] = {}
RESIZING: dict[int, bool] = {}
DECIDED: dict[int, Any] = {}


def decided(func: Any) -> int:
    """``id(func)``, with ``func`` kept alive for as long as a decision about it is."""
    key = id(func)
    DECIDED[key] = func
    return key


def is_composite(func: Any, kernels: tuple[str, ...] = ("CPU", "CUDA")) -> bool:
    """An op with no kernel of its own, only its decomposition (``linear``, ``cross_entropy_loss``): none for any
    of the dispatch keys ``kernels``."""
    has = has_kernel_for_dispatch_key
    try:
        name = func.name()
        return bool(has(name, "CompositeImplicitAutograd") and not any(has(name, k) for k in kernels)
                    and not has(name, "CompositeExplicitAutograd"))
    except (AttributeError, RuntimeError, TypeError):
        return False


def resizes(func: Any) -> bool:
    """The op can grow a storage it returns (``out=``, ``resize_``, ``set_``)."""
    hit = RESIZING.get(id(func))
    if hit is None:
        name = getattr(func, "_overloadname", "")
        base = str(getattr(func, "__name__", "")).split(".")[0]
        hit = "out" in name or base in ("resize_", "resize_as_", "set_")
        RESIZING[decided(func)] = hit
    return hit


def aliases(func: Any) -> bool:
    """Some output of the op is a view of an input (what it returns is memory that existed before)."""
    hit = ALIASING.get(id(func))
    if hit is None:
        try:
            hit = any(r.alias_info is not None for r in func._schema.returns) and func not in FRESH
        except AttributeError:
            hit = False
        ALIASING[decided(func)] = hit
    return hit


def skips(func: Any) -> Any:
    """Ops whose every output aliases an input and cannot grow its storage (in-place ops, views): ``True``; the
    scope ops are skipped too, with :data:`SCOPE_IN` or :data:`SCOPE_OUT` in place of ``True``; :data:`DECOMPOSE`
    for an op whose only kernel is its decomposition (it reaches a mode whole only under inference_mode);
    :data:`GEMM` for ``mm``/``addmm``, :data:`SCRATCH_OP` for another op whose CPU kernel allocates inside itself;
    :data:`COLLECTIVE` for a functional collective's op (not skipped: what it returns is counted, then named);
    :data:`SEEN` for one that may return an input's memory (some outputs alias, ``out=``, ``resize_``, ``set_``) or
    memory made outside dispatch (``lift_fresh``); ``False`` for the rest, whose outputs are new memory unless
    already known."""
    if func is SCOPE_ENTER or func is SCOPE_EXIT:
        hit: Any = SCOPE_IN if func is SCOPE_ENTER else SCOPE_OUT
        SKIPPING[decided(func)] = hit
        return hit
    try:
        returns = func._schema.returns
        hit = bool(returns) and all(r.alias_info is not None for r in returns) and not resizes(func) \
            and func not in FRESH
    except AttributeError:
        hit = False
    if not hit and tp_collective(func) is not None:
        hit = COLLECTIVE
    elif not hit and is_composite(func):
        hit = DECOMPOSE
    elif not hit and (func is MM or func is ADDMM):
        hit = GEMM
    elif not hit and uses_scratch(func):
        hit = SCRATCH_OP
    elif not hit and (aliases(func) or resizes(func) or func in FRESH):
        hit = SEEN
    SKIPPING[decided(func)] = hit
    return hit


def defers(types: Any, cache: dict[Any, bool]) -> bool:
    """Ops on these subclasses are left to the subclasses themselves: traceable wrappers, except PyTorch's own
    tracing tensors (fake and functional tensors belong to compilation, which runs unmeasured). Kept in ``cache``
    (one per tracker) except while torch.compile traces."""
    hit = bool(types) and all(getattr(t, "__tensor_flatten__", None) is not None
                              and not str(getattr(t, "__module__", "")).startswith(TRACING_TENSORS_PACKAGE)
                              for t in types)
    if DYNAMO in LOADED and is_compiling():
        return False  # not cached: the same types outside compilation are deferred
    cache[types] = hit
    return hit


_DROPOUT = torch.ops.aten.dropout.default


def _dropping(args: Any, kwargs: Any) -> bool:
    """Whether ``aten.dropout(input, p, train)`` drops anything."""
    named = kwargs or {}
    p = args[1] if len(args) > 1 else named.get("p", 0.5)
    train = args[2] if len(args) > 2 else named.get("train")
    return bool(train) and p != 0


def run_decomposed(mode: Any, func: Any, args: Any, kwargs: Any) -> Any:
    """Run a composite op's decomposition with ``mode`` seeing each of its parts (under inference_mode composite ops
    reach a dispatch mode whole, and their parts, such as the log-softmax inside a loss, would allocate out of
    sight); ``NotImplemented`` where it has none."""
    if func is _DROPOUT and not _dropping(args, kwargs):
        # eager's kernel returns the input itself (ATen's _dropout_impl: p == 0 or not training); PyTorch's Python
        # decomposition, which decompose() runs, returns a clone: an eval-mode Dropout would read as a copy
        return args[0] if args else kwargs["input"]
    _push_mode(mode)
    try:
        return func.decompose(*args, **(kwargs or {}))
    finally:
        _pop_mode()


__all__ = ["ADDMM", "ALIASING", "COLLECTIVE", "COMPILER", "DECIDED", "DECOMPOSE", "DYNAMO", "FRESH", "FRESH_IDS",
           "GEMM", "LOADED", "MM", "RESIZING", "SCOPE_ENTER", "SCOPE_EXIT", "SCOPE_IN", "SCOPE_OUT", "SCRATCH_OP",
           "SEEN", "SKIPPING",
           "aliases", "decided", "defers", "is_compiling", "is_composite", "resizes", "run_decomposed", "skips"]
