"""The allocator-level backend: PyTorch's profiler records every allocation and free the device's allocator
makes (CPU allocator or CUDA caching allocator), off the dispatch path.

It sees what the live-storage tracker cannot: compiled (inductor) kernels' buffers and kernel scratch, and it
leaves ``torch.compile`` alone — no dispatch mode on the stack, no global module or optimizer hooks, so a
compiled model runs the same graphs as unmeasured and a first call inside the cell compiles normally. It
does not see which line or module made an allocation; the phase comes from the profiler's own scopes
(autograd's backward functions, ``Optimizer.step#…``, ``Optimizer.zero_grad#…``) and from what freed it.

The profiler is started with only the user-scope and backward-function record scopes, so ordinary ops record
nothing; the cost is the memory events themselves, mostly paid when the recording is read at the end.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .stderr_filter import StderrFilter
from .torch_private import (
    profiler_enabled,
    profiler_event_type,
    profiler_record_scope,
    python_profiler_enabled,
    start_memory_profiler,
    stop_profiler,
)
from .tracker import BACKWARD, CELL, FORWARD, OPTIMIZER

# Phases only this backend tells apart: memory freed by ``zero_grad`` was a gradient.
ZERO_GRAD = -1


def profiler_busy() -> bool:
    """A profiler is recording in this process (the user's own, or an outer measured block)."""
    try:
        return profiler_enabled()
    except Exception:
        return True


@contextmanager
def quiet_stderr() -> Any:
    """The profiler's C++ side prints a line to file descriptor 2 on every start and stop (which a notebook
    shows under the cell); silence it for the length of the call only."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, 2)
        finally:
            os.close(null)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class MemoryEvent(NamedTuple):
    """One allocation (``size > 0``) or free (``size < 0``) of the measured device."""

    time: int
    addr: int
    size: int
    phase: int


@dataclass
class Recording:
    """What the allocator did during the block, in order; ``complete`` is False when something (the user's
    own profiler) stopped the recording before the end."""

    events: list[MemoryEvent] = field(default_factory=list)
    complete: bool = True
    oom_requests: list[int] = field(default_factory=list)
    scopes: set[str] = field(default_factory=set)


class AllocatorRecorder:
    """Start and stop the profiler's memory recording around a block."""

    def __init__(self, device: str, *, scopes: bool = True) -> None:
        self.device = device
        self.scopes = scopes  # False: the memory events only (no scopes, so no phases)
        self._on = False
        self._filter: StderrFilter | None = None

    def start(self) -> AllocatorRecorder:
        with quiet_stderr():
            start_memory_profiler(self.scopes)
        self._on = True
        # from here on, c10 logs a line to stderr when the cell frees a block made before the recording
        self._filter = StderrFilter().start()
        return self

    def stop(self) -> Recording:
        """End the recording and read it. If the user's own profiler took over during the block (PyTorch runs
        one at a time: starting theirs ended ours), theirs is left running and the recording is incomplete."""
        roots = self.finish()
        if roots is None:
            return Recording(complete=False)
        return read_events(roots, self.device)

    def finish(self) -> Any:
        """End the recording: the profiler's event tree (its roots), or ``None`` where it is incomplete."""
        if not self._on:
            return None
        self._on = False
        if self._filter is not None:
            self._filter.stop()
            self._filter = None
        if not profiler_busy() or python_profiler_enabled():
            return None
        with quiet_stderr():
            result = stop_profiler()
        return result.experimental_event_tree()


_SKIP_SCOPES = ("ProfilerStep#",)


def _phase_of(name: str, scope: Any, backward_scope: Any) -> int | None:
    if scope == backward_scope:
        return BACKWARD
    if name.startswith("Optimizer.step#"):
        return OPTIMIZER
    if name.startswith("Optimizer.zero_grad#"):
        return ZERO_GRAD
    return None


def read_events(roots: Iterable[Any], device: str) -> Recording:
    """The memory events of ``device`` in a profiler event tree, each with the phase of its innermost known
    scope (``FORWARD`` outside any: forward or plain cell code, which this backend does not tell apart)."""
    event_type = profiler_event_type()
    allocation, torch_op = event_type.Allocation, event_type.TorchOp
    backward_scope = profiler_record_scope().BACKWARD_FUNCTION
    want = torch.device(device)
    want_type = want.type
    want_index = (want.index if want.index is not None else 0) if want_type == "cuda" else None
    rec = Recording()
    events = rec.events
    append = events.append
    scopes = rec.scopes
    # (node, phase) pairs; most nodes are allocations directly under the root or a scope, read as cheaply as
    # pybind allows (one attribute read is ~0.2 µs)
    stack: list[tuple[Any, int]] = [(node, FORWARD) for node in roots]
    pop = stack.pop
    while stack:
        node, phase = pop()
        tag = node.tag
        if tag == allocation:
            fields = node.extra_fields
            dev = fields.device
            if dev.type != want_type or (want_index is not None and (dev.index or 0) != want_index):
                continue
            append(MemoryEvent(node.start_time_ns, fields.ptr, fields.alloc_size, phase))
        elif tag == torch_op:
            name = node.name
            scopes.add(name)
            inner = _phase_of(name, node.extra_fields.scope, backward_scope)
            if inner is not None and not (phase == BACKWARD and inner != BACKWARD):
                phase = inner
            stack.extend([(child, phase) for child in node.children])
        else:
            stack.extend([(child, phase) for child in node.children])
    events.sort()
    return rec


@dataclass
class Replayed:
    """A recording turned into the live-storage tracker's terms, so the rest of the engine reads both
    backends alike: ``allocs`` (serial → (size, phase, site, module)), ``events`` (+serial / −serial),
    ``initial`` and ``late`` (serial → size of what was alive at the start), the peak, ``roles`` (serial →
    (category, label) learnt from what freed a block) and ``addr`` (serial → address of the blocks alive at
    the end)."""

    initial: dict[int, int]
    allocs: dict[int, tuple[int, int, tuple[Any, ...], int]] = field(default_factory=dict)
    late: dict[int, int] = field(default_factory=dict)
    events: array = field(default_factory=lambda: array("q"))
    peak: int = 0
    peak_index: int = 0
    current: int = 0
    truncated: bool = False
    roles: dict[int, tuple[str, str]] = field(default_factory=dict)
    addr: dict[int, int] = field(default_factory=dict)
    oom: dict[str, Any] | None = None
    oom_holders: dict[int, str] = field(default_factory=dict)


def replay(rec: Recording, initial: dict[int, tuple[int, int]], next_serial: Any,
           max_events: int = 2_000_000) -> Replayed:
    """``initial``: serial → (address, size) of the storages known to be alive at the start. A free of an
    address that is neither theirs nor allocated in the block is a storage that was alive at the start
    without being known (counted as such, like the tracker's late storages)."""
    out = Replayed(initial={s: size for s, (_, size) in initial.items()})
    at: dict[int, int] = {addr: s for s, (addr, _) in initial.items() if addr}
    phase_of: dict[int, int] = {}
    current = sum(out.initial.values())
    late_total = 0
    peak = current
    peak_index = 0
    events = out.events
    allocs = out.allocs
    sizes: dict[int, int] = dict(out.initial)
    for ev in rec.events:
        if ev.size > 0:
            serial = next_serial()
            old = at.get(ev.addr)
            if old is not None and old in allocs:  # a block reused without its free seen: close it first
                events.append(-old)
                current -= sizes[old]
            at[ev.addr] = serial
            sizes[serial] = ev.size
            phase = ev.phase if ev.phase != ZERO_GRAD else CELL
            allocs[serial] = (ev.size, phase, (), 0)
            phase_of[serial] = ev.phase
            current += ev.size
            if len(events) >= max_events:
                out.truncated = True
                continue
            events.append(serial)
        else:
            serial = at.pop(ev.addr, None)
            size = -ev.size
            if serial is None:  # alive at the start, unknown to the scan
                serial = next_serial()
                out.late[serial] = size
                sizes[serial] = size
                late_total += size
                current += size
                peak += size
            made = phase_of.get(serial)
            if made is not None:
                if ev.phase == ZERO_GRAD and made != OPTIMIZER:
                    out.roles[serial] = ("gradients", "gradients (freed by zero_grad)")
                elif ev.phase == BACKWARD and made not in (BACKWARD, OPTIMIZER):
                    out.roles[serial] = ("activations", "saved for backward")
            current -= sizes.get(serial, size)
            if len(events) >= max_events:
                out.truncated = True
                continue
            events.append(-serial)
        if current > peak:
            peak = current
            peak_index = len(events)
    out.current = current
    out.peak = peak
    out.peak_index = peak_index
    out.addr = {serial: addr for addr, serial in at.items()}
    if rec.oom_requests:
        out.oom = {"requested": rec.oom_requests[-1]}
    return out
