"""The allocator-level backend: PyTorch's profiler records every allocation and free the device's allocator
makes (CPU allocator or CUDA caching allocator), off the dispatch path.

It sees what the live-storage tracker cannot: compiled (inductor) kernels' buffers and kernel scratch, and it
leaves ``torch.compile`` alone — no dispatch mode on the stack, no global module or optimizer hooks, so a
compiled model runs the same graphs as unmeasured and a first call inside the cell compiles normally. It
does not see which line or module made an allocation; the phase comes from the profiler's own scopes
(autograd's backward functions, ``Optimizer.step#…``, ``Optimizer.zero_grad#…``) and from what freed it.

The profiler is started with only the user-scope and backward-function record scopes, so ordinary ops record
nothing; the cost is the memory events themselves, mostly paid when the recording is read at the end.

The CPU allocator's profiler hook drops the free of every block made before the recording started (c10's
``ProfiledCPUMemoryReporter::Delete`` knows no size for it, and logs a line instead: stderr_filter.py). Those are
the frees of what was alive before the cell, so the recorder also listens to the registry's weakref callbacks while
it records: each storage of the registry that dies is stamped with the clock the profiler's events are converted
to (``time.time_ns``), and :func:`replay` puts its free in the history at that time. Where the profiler reports the
same free (CUDA's caching allocator reports every one), it counts once.
"""

from __future__ import annotations

import os
import time
from array import array
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..phases import Phase
from ..torch_private import (
    profiler_enabled,
    profiler_event_type,
    profiler_record_scope,
    python_profiler_enabled,
    start_memory_profiler,
    stop_profiler,
)
from .stderr_filter import StderrFilter

BACKWARD, CELL, FORWARD, OPTIMIZER = Phase.BACKWARD, Phase.CELL, Phase.FORWARD, Phase.OPTIMIZER

if TYPE_CHECKING:
    from ..scan.registry import Entry, LiveStorages

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
    # (ns, serial) of the registry's storages of the device freed during the recording, in order, and the serials of
    # those alive at its end (None: no registry was listened to)
    released: list[tuple[int, int]] = field(default_factory=list)
    alive: set[int] | None = None


class AllocatorRecorder:
    """Start and stop the profiler's memory recording around a block. ``registry``: the storages known alive at the
    start, whose frees the profiler may not report (see the module's docstring); it is listened to while recording,
    and whoever listened before still hears every free."""

    def __init__(self, device: str, *, scopes: bool = True, registry: LiveStorages | None = None) -> None:
        self.device = device
        self.scopes = scopes  # False: the memory events only (no scopes, so no phases)
        self.registry = registry
        self.released: list[tuple[int, int]] = []
        self._on = False
        self._filter: StderrFilter | None = None
        self._listener: Any = None
        self._before: Any = None

    def start(self) -> AllocatorRecorder:
        with quiet_stderr():
            start_memory_profiler(self.scopes)
        self._on = True
        # from here on, c10 logs a line to stderr when the cell frees a block made before the recording
        self._filter = StderrFilter().start()
        if self.registry is not None:
            self._listen(self.registry)
        return self

    def _listen(self, registry: LiveStorages) -> None:
        device, released, now = self.registry_device(), self.released, time.time_ns
        before = registry.on_free

        def heard(entry: Entry) -> None:
            if entry.device == device:
                released.append((now(), entry.serial))
            if before is not None:
                before(entry)

        self._listener, self._before = heard, before
        registry.on_free = heard

    def registry_device(self) -> str:
        """The device as the registry names it (``cuda`` → ``cuda:0``)."""
        want = torch.device(self.device)
        return f"cuda:{want.index or 0}" if want.type == "cuda" else want.type

    def _unlisten(self) -> set[int] | None:
        """Stop listening; the serials of the registry's storages of the device alive now."""
        registry, listener, self._listener = self.registry, self._listener, None
        if registry is None or listener is None:
            return None
        if registry.on_free is listener:
            registry.on_free = self._before
        device = self.registry_device()
        return {entry.serial for _, entry in registry.live(device)}

    def stop(self) -> Recording:
        """End the recording and read it. If the user's own profiler took over during the block (PyTorch runs
        one at a time: starting theirs ended ours), theirs is left running and the recording is incomplete."""
        alive = self._unlisten()
        roots = self.finish()
        rec = Recording(complete=False) if roots is None else read_events(roots, self.device)
        rec.released, rec.alive = self.released, alive
        return rec

    def finish(self) -> Any:
        """End the recording: the profiler's event tree (its roots), or ``None`` where it is incomplete."""
        self._unlisten()
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
class ReplayedBlock:
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
           max_events: int = 2_000_000) -> ReplayedBlock:
    """``initial``: serial → (address, size) of the storages known to be alive at the start. A free of an
    address that is neither theirs nor allocated in the block is a storage that was alive at the start
    without being known (counted as such, like the tracker's late storages). The frees of ``initial``'s storages
    come from the profiler, from the registry (``rec.released``, at their times) or, for one still alive by neither
    but gone at the end (``rec.alive``), at the end; each counts once."""
    out = _Replay(initial, next_serial, max_events)
    released = rec.released
    i, n = 0, len(released)
    for ev in rec.events:
        while i < n and released[i][0] <= ev.time:  # at the same time, the free first
            out.release(released[i][1])
            i += 1
        if ev.size > 0:
            out.allocated(ev)
        else:
            out.freed(ev)
    for _, serial in released[i:]:
        out.release(serial)
    if rec.alive is not None:  # gone at the end with no free heard (a listener put in the recorder's place)
        for serial in [s for s in out.initial if s not in rec.alive]:
            out.release(serial)
    return out.result(rec)


class _Replay:
    """The state of :func:`replay` as it goes through the events."""

    def __init__(self, initial: dict[int, tuple[int, int]], next_serial: Any, max_events: int) -> None:
        self.out = ReplayedBlock(initial={s: size for s, (_, size) in initial.items()})
        self.initial = self.out.initial
        self.addr_of = {s: addr for s, (addr, _) in initial.items()}
        self.at: dict[int, int] = {addr: s for s, addr in self.addr_of.items() if addr}
        self.gone: dict[int, int] = {}  # address -> serial of a storage of `initial` the registry saw freed
        self.done: set[int] = set()  # the serials of `initial` freed so far
        self.phase_of: dict[int, int] = {}
        self.sizes: dict[int, int] = dict(self.initial)
        self.current = self.peak = sum(self.initial.values())
        self.peak_index = 0
        self.next_serial = next_serial
        self.max_events = max_events

    def _event(self, ev: int) -> None:
        events = self.out.events
        if len(events) >= self.max_events:
            self.out.truncated = True
            return
        events.append(ev)
        if self.current > self.peak:
            self.peak = self.current
            self.peak_index = len(events)

    def release(self, serial: int) -> None:
        """A storage of ``initial`` is freed (once: the registry and the profiler may both say so)."""
        if serial not in self.initial or serial in self.done:
            return
        self.done.add(serial)
        addr = self.addr_of.get(serial, 0)
        if addr and self.at.get(addr) == serial:
            del self.at[addr]
            self.gone[addr] = serial
        self.current -= self.initial[serial]
        self._event(-serial)

    def allocated(self, ev: MemoryEvent) -> None:
        at, allocs = self.at, self.out.allocs
        serial = self.next_serial()
        old = at.get(ev.addr)
        if old is not None and old in allocs:  # a block reused without its free seen: close it first
            self.out.events.append(-old)
            self.current -= self.sizes[old]
        elif old is not None:  # memory of a storage of `initial` reused: it was freed before (the clocks disagree)
            self.release(old)
        self.gone.pop(ev.addr, None)
        at[ev.addr] = serial
        self.sizes[serial] = ev.size
        allocs[serial] = (ev.size, ev.phase if ev.phase != ZERO_GRAD else CELL, (), 0)
        self.phase_of[serial] = ev.phase
        self.current += ev.size
        self._event(serial)

    def freed(self, ev: MemoryEvent) -> None:
        serial = self.at.pop(ev.addr, None)
        size = -ev.size
        if serial is None:
            if self.gone.pop(ev.addr, None) is not None:  # its free already heard from the registry
                return
            serial = self.next_serial()  # alive at the start, unknown to the scan
            self.out.late[serial] = size
            self.sizes[serial] = size
            self.current += size
            self.peak += size
        elif serial in self.initial:
            self.done.add(serial)
        made = self.phase_of.get(serial)
        if made is not None:
            if ev.phase == ZERO_GRAD and made != OPTIMIZER:
                self.out.roles[serial] = ("gradients", "gradients (freed by zero_grad)")
            elif ev.phase == BACKWARD and made not in (BACKWARD, OPTIMIZER):
                self.out.roles[serial] = ("activations", "saved for backward")
        self.current -= self.sizes.get(serial, size)
        self._event(-serial)

    def result(self, rec: Recording) -> ReplayedBlock:
        out = self.out
        out.current, out.peak, out.peak_index = self.current, self.peak, self.peak_index
        out.addr = {serial: addr for addr, serial in self.at.items()}
        if rec.oom_requests:
            out.oom = {"requested": rec.oom_requests[-1]}
        return out
