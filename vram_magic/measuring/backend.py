"""Which backend measures a block (see ``measurement.py``): the one asked for, else the tracker unless the block
runs compiled code or a dispatch mode of the user's is active when it starts; with the reason the report gives."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..engine.hooks.compiled import compiled_reason
from ..engine.profiler.recorder import profiler_busy
from ..engine.torch_private import current_mode_stack
from ..engine.tracker.mode import Tracker

BACKENDS = ("auto", "tracker", "allocator")


def check_backend(backend: Any) -> str:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    return backend


def dispatch_modes_active() -> bool:
    """A dispatch mode of the user's (not a measuring block's own tracker) is on the stack."""
    try:
        return any(not isinstance(m, Tracker) for m in current_mode_stack())
    except Exception:
        return False


def choose_backend(want: str, *, namespace: Mapping[str, Any] | None, source: str, budget: int | None,
                   device: str) -> tuple[str, str]:
    """``(backend, reason)`` for a block that asked for ``want``; the reason is empty when there is nothing to
    say."""
    busy = profiler_busy()
    if want == "tracker":
        return "tracker", "asked for"
    if want == "allocator":
        if busy:
            return "tracker", ("the allocator backend was asked for, but a profiler is already recording in this "
                               "process (PyTorch runs one at a time): measured by the tracker")
        return "allocator", "asked for"
    compiled = compiled_reason(namespace, source)
    if dispatch_modes_active():
        if busy:
            return "tracker", ""
        return "allocator", "a dispatch mode of yours was active when the block started"
    if not compiled:
        return "tracker", ""
    if budget is not None and device == "cpu":
        return "tracker", (f"{compiled}, but a --budget on the CPU is enforced by the tracker, under which "
                           "compiled code runs eagerly: the figures are the eager step's")
    if busy:
        return "tracker", (f"{compiled}, but a profiler is already recording in this process: compiled code "
                           "runs eagerly under the tracker, and the figures are the eager step's")
    if "profile" in source:
        return "tracker", (f"{compiled}, but the cell may start PyTorch's profiler, which would end the "
                           "allocator recording: measured by the tracker, under which compiled code runs "
                           "eagerly (use --backend allocator to measure it compiled)")
    return "allocator", compiled


__all__ = ["BACKENDS", "check_backend", "choose_backend", "dispatch_modes_active"]
