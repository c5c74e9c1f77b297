"""Taking a dispatch mode off PyTorch's mode stack wherever it is, with the modes above it left in place."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


def leave_mode_stack(mode: TorchDispatchMode) -> None:
    """Take ``mode`` off the dispatch-mode stack wherever it is, leaving the modes above it (the user's own,
    entered inside the measured block and left on) in place and in order, with PyTorch's "a mode is active"
    flags as if ``mode`` had never been there."""
    from torch.utils import _python_dispatch as pd

    stack = pd._get_current_dispatch_mode_stack()
    if stack and stack[-1] is mode:
        TorchDispatchMode.__exit__(mode, None, None, None)
        return
    above: list[TorchDispatchMode] = []
    found = False
    for m in stack:
        if found:
            above.append(m)
        elif m is mode:
            found = True
    if found:
        for _ in above:
            pd._pop_mode()
        pd._pop_mode()
        for m in above:
            pd._push_mode(m)
    # the flags our __enter__ saved are the state before us; the modes above saved states that included us
    for saved, flag, combine in _MODE_FLAGS:
        ours = getattr(mode, saved, None)
        if ours is None or not hasattr(pd, flag):
            continue  # a PyTorch without this flag
        value = ours.pop() if ours else False
        for m in above:
            theirs = getattr(m, saved, None)
            if theirs:
                theirs[-1] = value
            value = combine(m, value)
        setattr(pd, flag, value)
        if flag == "_is_in_any_mode_without_ignore_compile_internals":
            setter = getattr(pd, "set_is_in_mode_without_ignore_compile_internals", None)
            if setter is not None:
                setter(value)


# (the deque a mode keeps the flag's old values in, the module's flag, how a mode sets the flag on entering)
_MODE_FLAGS = (
    ("old_dispatch_mode_flags", "_is_in_torch_dispatch_mode", lambda m, v: True),
    ("old_non_infra_dispatch_mode_flags", "_is_in_non_infra_torch_dispatch_mode",
     lambda m, v: v or not getattr(m, "is_infra_mode", lambda: False)()),
    ("old_without_ignore_compile_internals_dispatch_mode_flags", "_is_in_any_mode_without_ignore_compile_internals",
     lambda m, v: v or not getattr(m, "ignore_compile_internals", lambda: False)()),
)


__all__ = ["leave_mode_stack"]


def never_compiled(*functions: object) -> None:
    """TorchDynamo never tries to compile these functions' frames, nor the frames they call (a dispatch mode's
    ``__torch_dispatch__``).

    A mode that opts out of PyTorch's per-op dynamo wrapper (``_should_skip_dynamo``) is otherwise seen by
    TorchDynamo as user code whenever it runs while a compiled function evaluates frames: it compiles it, again
    for each new argument pattern, and past its recompile limit marks the code run-only, with a warning naming
    the tracker. Marking the code skipped up front costs nothing per op (TorchDynamo reads the mark only where it
    evaluates frames). Uses ``torch._C._dynamo.eval_frame.set_code_exec_strategy`` (torch 2.13); a
    PyTorch without it is left as it is."""
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    except ImportError:
        return
    for f in functions:
        code = getattr(f, "__code__", None)
        if code is not None:
            set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
