"""Kernel scratch on the CPU: what an op allocates and frees inside itself, which a dispatch mode cannot see.

A dispatch mode sees the tensors an op returns, not the buffers its kernel takes from the allocator and gives
back before returning: oneDNN's convolutions reorder their operands into blocked layouts, torch.ao's quantized
linear accumulates in an int32 buffer of the output's shape, a GEMM copies an operand BLAS cannot take, the CPU's
flash attention and the norms' backward keep per-thread buffers. On the CPU that can be what the peak is made of
(a dynamically quantized int8 MLP's forward: 8 % of it; a small ConvNet's training step: 12 % of what the step
adds).

The ops known to do so are listed in ``scratch_ops``. An fp32 GEMM's copies follow from its strides
(``scratch_ops.gemm_copies``): the tracker adds them at once. The others' calls are timed with the clock that
PyTorch's profiler stamps its memory events with (``time.time_ns``), and the profiler records the CPU allocator's
events from the first such call to the end of the block (:class:`ScratchRecorder`; no scopes, so ops record
nothing). At the end, the events inside each call give its scratch: the highest the call's allocations went above
what it returned (:func:`spikes`), put in the history right after the call as a block of its own
(:func:`add_scratch`). A block that runs none of these ops records nothing.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .allocator import AllocatorRecorder, profiler_busy
from .scratch_ops import SCRATCH
from .torch_private import profiler_event_type

if TYPE_CHECKING:
    from .tracker import Tracker

#: a timed call: (start ns, end ns, events before it, events after it, phase, id of the innermost module or 0)
Window = tuple[int, int, int, int, int, int]


class ScratchRecorder:
    """The CPU allocator's events, recorded by PyTorch's profiler from :meth:`start` (the first timed call of a
    block) to :meth:`stop`. It starts only if no profiler is recording (PyTorch runs one at a time)."""

    def __init__(self) -> None:
        self._recorder: AllocatorRecorder | None = None
        self.started = False
        self.refused = False  # another profiler was recording when a timed call came

    def start(self) -> bool:
        if self._recorder is not None:
            return True
        if self.refused:
            return False
        recorder = AllocatorRecorder("cpu", scopes=False)
        try:
            if profiler_busy():
                raise RuntimeError("a profiler is recording")
            recorder.start()
        except Exception:
            self.refused = True
            return False
        self._recorder = recorder
        self.started = True
        return True

    def stop(self) -> Any:
        """The profiler's event tree; ``None`` if it never started or another profiler ended it (then
        :attr:`started` is True)."""
        recorder, self._recorder = self._recorder, None
        return recorder.finish() if recorder is not None else None


def window_events(roots: Sequence[Any], windows: Sequence[Window]) -> list[list[tuple[int, int]]]:
    """The CPU allocator's events (``(ns, bytes)``, negative for a free) inside each window, in order. Only an
    event's time is read unless it falls inside a window (most do not: pybind reads cost)."""
    allocation = profiler_event_type().Allocation
    starts = [w[0] for w in windows]
    ends = [w[1] for w in windows]
    inside: list[list[tuple[int, int]]] = [[] for _ in windows]
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node.tag != allocation:
            stack.extend(node.children)
            continue
        t = node.start_time_ns
        i = bisect.bisect_right(starts, t) - 1
        if i < 0 or t > ends[i]:
            continue
        fields = node.extra_fields
        if fields.device.type == "cpu":
            inside[i].append((t, fields.alloc_size))
    for events in inside:
        events.sort()
    return inside


def spikes(inside: Sequence[Sequence[tuple[int, int]]], windows: Sequence[Window], size: Callable[[int], int],
           tracker_events: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """``[(event index, bytes, phase, module), ...]``: for each call, the highest its allocations went above what
    the tracker counted for it (its events from ``before`` to ``after``: the tensors it returned). Calls that
    made no scratch are left out."""
    out = []
    for events, (_, _, before, after, phase, module) in zip(inside, windows):
        running = high = 0
        for _, n in events:
            running += n
            if running > high:
                high = running
        if not high:
            continue
        counted = 0
        for ev in tracker_events[before:after]:
            counted += size(ev) if ev > 0 else -size(-ev)
        extra = high - max(counted, 0)
        if extra > 0:
            out.append((after, extra, phase, module))
    return out


def add_scratch(tracker: Tracker, found: Sequence[tuple[int, int, int, int]]) -> None:
    """Put each call's scratch in ``tracker``'s history right after the call: a block allocated and freed at once,
    its role :data:`SCRATCH`; the peak is found again, and the indices into the history that the tracker keeps
    (an out-of-memory's, generate()'s steps) move past the blocks put before them."""
    if not found:
        return
    allocs, roles, registry = tracker.allocs, tracker.roles, tracker.registry
    old = tracker.events
    new = array("q")
    at = 0
    for index, size, phase, module in found:
        new.extend(old[at:index])
        at = index
        serial = registry.next_serial()
        allocs[serial] = (size, phase, last_site(old, index, allocs), module)
        roles[serial] = SCRATCH
        new.append(serial)
        new.append(-serial)
    new.extend(old[at:])
    tracker.events = new
    where = [index for index, _, _, _ in found]

    def moved(i: int) -> int:
        return i + 2 * bisect.bisect_right(where, i)

    if tracker.oom and "index" in tracker.oom:
        tracker.oom["index"] = moved(tracker.oom["index"])
    steps = getattr(tracker, "steps", None)
    if isinstance(steps, list):
        steps[:] = [(moved(i), *rest) for i, *rest in steps]
    size = sizes_of(tracker)
    current = peak = sum(tracker.initial.values()) + tracker.grouped_bytes + sum(tracker.late.values())
    peak_index = 0
    for i, ev in enumerate(new, 1):
        current += size(ev) if ev > 0 else -size(-ev)
        if current > peak:
            peak, peak_index = current, i
    tracker.peak, tracker.peak_index = peak, peak_index


def last_site(events: Sequence[int], index: int, allocs: Any) -> tuple[Any, ...]:
    """The site of a call's last output (the line that called the op) among the events before ``index``."""
    for k in range(index - 1, max(index - 8, 0) - 1, -1):
        ev = events[k]
        if ev > 0 and ev in allocs:
            return allocs[ev][2]
    return ()


def sizes_of(tracker: Tracker) -> Callable[[int], int]:
    """serial → bytes, for every serial of the tracker's history."""
    allocs, initial, late, freed = tracker.allocs, tracker.initial, tracker.late, tracker.initial_freed

    def size(serial: int) -> int:
        record = allocs.get(serial)
        if record is not None:
            return record[0]
        n = initial.get(serial)
        return n if n is not None else late.get(serial, freed.get(serial, 0))

    return size


__all__ = ["SCRATCH", "ScratchRecorder", "Window", "add_scratch", "last_site", "sizes_of", "spikes", "window_events"]
