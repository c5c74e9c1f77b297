"""PyTorch's private names that the engine relies on, all in one place: a PyTorch release that moves one breaks
this file, and tests/test_torch_private.py names what broke.

Each name says which PyTorch releases it was checked on. "2.5.1, 2.13, 2.15": read in those releases' sources
(2.5.1 is the floor pyproject.toml admits, 2.15 the newest release at the time), and tests/test_torch_private.py
passes on each (2.13 the CPU build, 2.5.1 and 2.15 the registry's CUDA builds on a CPU); a name present in fewer
says so, with what the code does without it. Names read on every op (the autograd node, ``OpOverload``) are bound once
here as module attributes, so using them costs no call. What lives in a module that is slow to import
(``torch._dynamo``) is imported by its accessor, when first needed, never here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _python_dispatch as _pd

# --- the dispatch-mode stack (torch/utils/_python_dispatch.py) ------------------------------------------------

#: The base class of dispatch modes. Checked on torch 2.5.1, 2.13, 2.15.
TorchDispatchMode = _pd.TorchDispatchMode
#: The modes on the stack, innermost last. Checked on torch 2.5.1, 2.13, 2.15.
current_mode_stack = _pd._get_current_dispatch_mode_stack
#: Take the innermost mode off the stack / put a mode on it. Checked on torch 2.5.1, 2.13, 2.15.
pop_mode = _pd._pop_mode
push_mode = _pd._push_mode
#: Context manager: every mode off the stack for its body, put back after. Checked on torch 2.5.1, 2.13, 2.15.
disable_current_modes = _pd._disable_current_modes

# The flags PyTorch keeps of "a mode is active": (the deque a mode keeps the flag's old values in, the module's
# flag, how a mode sets the flag on entering). The first two: torch 2.5.1, 2.13, 2.15; the third (and its setter
# ``set_is_in_mode_without_ignore_compile_internals``): torch 2.13, 2.15, absent from 2.5.1 (skipped there).
_MODE_FLAGS = (
    ("old_dispatch_mode_flags", "_is_in_torch_dispatch_mode", lambda m, v: True),
    ("old_non_infra_dispatch_mode_flags", "_is_in_non_infra_torch_dispatch_mode",
     lambda m, v: v or not getattr(m, "is_infra_mode", lambda: False)()),
    ("old_without_ignore_compile_internals_dispatch_mode_flags", "_is_in_any_mode_without_ignore_compile_internals",
     lambda m, v: v or not getattr(m, "ignore_compile_internals", lambda: False)()),
)


def leave_mode_stack(mode: Any) -> None:
    """Take ``mode`` off the dispatch-mode stack wherever it is, leaving the modes above it (the user's own,
    entered inside the measured block and left on) in place and in order, with PyTorch's "a mode is active"
    flags as if ``mode`` had never been there."""
    stack = current_mode_stack()
    if stack and stack[-1] is mode:
        TorchDispatchMode.__exit__(mode, None, None, None)
        return
    above: list[Any] = []
    found = False
    for m in stack:
        if found:
            above.append(m)
        elif m is mode:
            found = True
    if found:
        for _ in above:
            pop_mode()
        pop_mode()
        for m in above:
            push_mode(m)
    # the flags our __enter__ saved are the state before us; the modes above saved states that included us
    for saved, flag, combine in _MODE_FLAGS:
        ours = getattr(mode, saved, None)
        if ours is None or not hasattr(_pd, flag):
            continue  # a PyTorch without this flag
        value = ours.pop() if ours else False
        for m in above:
            theirs = getattr(m, saved, None)
            if theirs:
                theirs[-1] = value
            value = combine(m, value)
        setattr(_pd, flag, value)
        if flag == "_is_in_any_mode_without_ignore_compile_internals":
            setter = getattr(_pd, "set_is_in_mode_without_ignore_compile_internals", None)
            if setter is not None:
                setter(value)


def modes_ignore_compile_internals() -> bool:
    """Whether dispatch modes can ask to be left out of compilation (``TorchDispatchMode.ignore_compile_internals``:
    torch 2.13, 2.15; absent from 2.5.1, where this is False)."""
    return hasattr(TorchDispatchMode, "ignore_compile_internals")


# --- TorchDynamo's marks on code objects (torch._C._dynamo.eval_frame) ----------------------------------------

def never_compiled(*functions: object) -> None:
    """TorchDynamo never tries to compile these functions' frames, nor the frames they call (a dispatch mode's
    ``__torch_dispatch__``).

    A mode that opts out of PyTorch's per-op dynamo wrapper (``_should_skip_dynamo``) is otherwise seen by
    TorchDynamo as user code whenever it runs while a compiled function evaluates frames: it compiles it, again
    for each new argument pattern, and past its recompile limit marks the code run-only, with a warning naming
    the tracker. Marking the code skipped up front costs nothing per op (TorchDynamo reads the mark only where it
    evaluates frames). Uses ``set_code_exec_strategy``, ``_FrameAction``, ``_FrameExecStrategy`` (torch 2.13,
    2.15; absent from 2.5.1, which is left as it is)."""
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    except ImportError:
        return
    for f in functions:
        code = getattr(f, "__code__", None)
        if code is not None:
            set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))


# --- ops and autograd (read on every op: plain aliases) -------------------------------------------------------

#: The autograd node being run (None outside backward). Checked on torch 2.5.1, 2.13, 2.15.
current_autograd_node = torch._C._current_autograd_node
#: The id of the graph task (one ``backward()`` or ``autograd.grad()`` call) running on this thread, unique per task;
#: -1 outside backward. Checked on torch 2.13, 2.15 (2.5.1's torch/utils/checkpoint.py calls it too).
current_graph_task_id = torch._C._current_graph_task_id
#: The class of one overload of an op (``torch.ops.aten.mm.default``). Checked on torch 2.5.1, 2.13, 2.15.
OpOverload = torch._ops.OpOverload
#: ``(op name, dispatch key name) -> bool``: the op has a kernel of its own for that key. Checked on torch 2.5.1,
#: 2.13, 2.15.
has_kernel_for_dispatch_key = torch._C._dispatch_has_kernel_for_dispatch_key

# --- module names (strings: reading them imports nothing) -----------------------------------------------------

#: TorchDynamo's package; nothing is compiled unless it is in ``sys.modules``. Checked on torch 2.5.1, 2.13, 2.15.
DYNAMO_MODULE = "torch._dynamo"
#: The package of PyTorch's tracing tensors (fake and functional tensors). Checked on torch 2.5.1, 2.13, 2.15.
TRACING_TENSORS_PACKAGE = "torch._subclasses"
TRACING_TENSORS_PREFIX = TRACING_TENSORS_PACKAGE + "."


def optimized_module_class() -> type:
    """``torch._dynamo.eval_frame.OptimizedModule``, the class of ``torch.compile(module)`` (imports TorchDynamo:
    call it only once it is loaded). Checked on torch 2.5.1, 2.13, 2.15."""
    from torch._dynamo.eval_frame import OptimizedModule

    return OptimizedModule


# --- methods patched while a block is measured ----------------------------------------------------------------

def storage_resize() -> Any:
    """``torch.UntypedStorage.resize_`` as it is now (a method of the storage, not an op: dispatch never sees
    it). Checked on torch 2.5.1, 2.13, 2.15."""
    return torch.UntypedStorage.resize_


def patch_storage_resize(method: Any) -> None:
    """Put ``method`` in place of ``UntypedStorage.resize_``."""
    torch.UntypedStorage.resize_ = method  # type: ignore[method-assign]


def unpatch_storage_resize(method: Any) -> None:
    """Put PyTorch's ``UntypedStorage.resize_`` back, if ``method`` is still the one in place."""
    if torch.UntypedStorage.__dict__.get("resize_") is method:
        del torch.UntypedStorage.resize_


#: ``nn.Module._apply``, the one method ``.to()``, ``.cuda()``, ``.half()`` … move parameters through, as PyTorch
#: defines it. Checked on torch 2.5.1, 2.13, 2.15.
MODULE_APPLY = torch.nn.Module._apply


def set_module_apply(method: Any) -> None:
    """Put ``method`` in place of ``nn.Module._apply`` (``MODULE_APPLY`` puts PyTorch's back)."""
    torch.nn.Module._apply = method  # type: ignore[method-assign]


# --- the profiler (torch._C._autograd, torch._C._profiler) ----------------------------------------------------

def profiler_enabled() -> bool:
    """A profiler is recording in this process. ``torch._C._autograd._profiler_enabled``: torch 2.5.1, 2.13,
    2.15."""
    return bool(torch._C._autograd._profiler_enabled())


def start_memory_profiler(scopes: bool) -> None:
    """Start PyTorch's (Kineto) profiler recording CPU memory events, and the scopes ``USER_SCOPE`` and
    ``BACKWARD_FUNCTION`` when ``scopes`` (else one eager code never opens: an empty set would record every op).
    ``_prepare_profiler``, ``_enable_profiler``, ``ProfilerConfig``, ``ProfilerState``, ``ProfilerActivity``,
    ``RecordScope``, ``_ExperimentalConfig``: torch 2.5.1, 2.13, 2.15."""
    from torch._C._autograd import _enable_profiler, _prepare_profiler
    from torch._C._profiler import (
        ProfilerActivity,
        ProfilerConfig,
        ProfilerState,
        RecordScope,
        _ExperimentalConfig,
    )

    config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig())
    activities = {ProfilerActivity.CPU}
    _prepare_profiler(config, activities)
    _enable_profiler(config, activities, {RecordScope.USER_SCOPE, RecordScope.BACKWARD_FUNCTION}
                     if scopes else {RecordScope.STATIC_RUNTIME_MODEL})


def stop_profiler() -> Any:
    """Stop the profiler: its result (``experimental_event_tree()`` reads it). ``_disable_profiler``: torch 2.5.1,
    2.13, 2.15."""
    from torch._C._autograd import _disable_profiler

    return _disable_profiler()


def python_profiler_enabled() -> bool:
    """``torch.autograd.profiler._is_profiler_enabled``: the user's ``torch.profiler`` is on (torch 2.5.1, 2.13,
    2.15; False where absent)."""
    import torch.autograd.profiler as autograd_profiler

    return bool(getattr(autograd_profiler, "_is_profiler_enabled", False))


def profiler_event_type() -> Any:
    """``torch._C._profiler._EventType`` (``Allocation``, ``TorchOp``, …). Checked on torch 2.5.1, 2.13, 2.15."""
    from torch._C._profiler import _EventType

    return _EventType


def profiler_record_scope() -> Any:
    """``torch._C._profiler.RecordScope`` (``BACKWARD_FUNCTION``, …). Checked on torch 2.5.1, 2.13, 2.15."""
    from torch._C._profiler import RecordScope

    return RecordScope


# --- CUDA and the caching allocator ---------------------------------------------------------------------------

def cuda_has_primary_context() -> Any:
    """``torch._C._cuda_hasPrimaryContext(index)`` (CUDA builds; torch 2.13, 2.15 stubs, not in 2.5.1's stubs),
    or None where this build has none."""
    return getattr(torch._C, "_cuda_hasPrimaryContext", None)


def default_device_context() -> Any:
    """The context ``torch.set_default_device`` installed (``torch._GLOBAL_DEVICE_CONTEXT``, its ``.device_context``
    has ``.device``), or None. Checked on torch 2.5.1, 2.13, 2.15."""
    return getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)


def cuda_history_enabled() -> bool:
    """The caching allocator records its history now (``torch._C._cuda_isHistoryEnabled``: CUDA builds, in the
    stubs of torch 2.5.1, 2.13, 2.15). Raises where this build has no CUDA."""
    return bool(torch._C._cuda_isHistoryEnabled())


def record_memory_history() -> Any:
    """``torch.cuda.memory._record_memory_history`` as it is now. Checked on torch 2.5.1, 2.13, 2.15."""
    return torch.cuda.memory._record_memory_history


def set_record_memory_history(function: Any) -> None:
    """Put ``function`` in place of ``torch.cuda.memory._record_memory_history`` (to see the user switch it)."""
    torch.cuda.memory._record_memory_history = function


def memory_snapshot() -> Any:
    """``torch.cuda.memory._snapshot()``: the allocator's segments and recorded history. Checked on torch 2.5.1,
    2.13, 2.15."""
    return torch.cuda.memory._snapshot()


def lazy_call(function: Any) -> None:
    """``torch.cuda._lazy_call``: ``function()`` now if CUDA is initialised, else queued to run right after PyTorch
    initialises it (inside its initialisation lock: ``function`` must not call back into ``torch.cuda``'s lazy
    machinery, and must not raise, which would fail the user's initialisation). Checked on torch 2.5.1, 2.13, 2.15."""
    torch.cuda._lazy_call(function)


def attach_oom_observer() -> Any:
    """``torch._C._cuda_attach_out_of_memory_observer`` (CUDA builds: torch 2.5.1, 2.13, 2.15), or None on a build
    without CUDA. The observer is called as ``f(device, block size asked, device total or the allowed maximum,
    device free)`` after the allocator gave up, with its lock released; attaching it initialises CUDA, and an
    observer cannot be detached."""
    return getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)


# --- torch.distributed --------------------------------------------------------------------------------------

def group_store_entry(group: Any) -> Any:
    """The entry ``(backend, store)`` c10d keeps for ``group`` (the default group for None), or None.
    ``distributed_c10d._get_default_group``, ``_world.pg_map``: torch 2.5.1, 2.13, 2.15."""
    from torch.distributed import distributed_c10d as c10d

    pg = group if group is not None else c10d._get_default_group()
    return c10d._world.pg_map.get(pg)


__all__ = [
    "DYNAMO_MODULE", "MODULE_APPLY", "OpOverload", "TRACING_TENSORS_PACKAGE", "TRACING_TENSORS_PREFIX",
    "TorchDispatchMode", "attach_oom_observer", "cuda_has_primary_context", "cuda_history_enabled",
    "current_autograd_node", "current_graph_task_id", "current_mode_stack", "default_device_context",
    "disable_current_modes", "group_store_entry", "has_kernel_for_dispatch_key", "lazy_call", "leave_mode_stack",
    "memory_snapshot", "modes_ignore_compile_internals", "never_compiled", "optimized_module_class",
    "patch_storage_resize", "pop_mode", "profiler_enabled", "profiler_event_type", "profiler_record_scope",
    "push_mode", "python_profiler_enabled", "record_memory_history", "set_module_apply",
    "set_record_memory_history", "start_memory_profiler", "stop_profiler", "storage_resize",
    "unpatch_storage_resize",
]
