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

Under a ``--budget`` the scratch must be known as the op returns, to raise ``torch.OutOfMemoryError`` where the
kernel would have run out: each distinct call (the op, its arguments' shapes, strides and dtypes, the threads) is
then measured the first time it runs, in a recording of its own around that call (:meth:`ScratchRecorder.measure`),
and what it found is used for the same call after (the scratch of a call is the same each time: oneDNN's reorders
and buffers follow from the shapes).
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, get_num_threads

from ..torch_private import OpOverload as _OpOverload
from ..torch_private import profiler_event_type
from ..tracker.op_kinds import COMPILER, DYNAMO, LOADED, MM
from ..tracker.scratch_ops import HALF, SCRATCH, gemm_copies, now
from .recorder import AllocatorRecorder, profiler_busy

#: a timed call: (start ns, end ns, events before it, events after it, phase, id of the innermost module or 0)
Window = tuple[int, int, int, int, int, int]


class ScratchRecorder:
    """The CPU allocator's events, recorded by PyTorch's profiler from :meth:`start` (the first timed call of a
    block) to :meth:`stop`. It starts only if no profiler is recording (PyTorch runs one at a time)."""

    def __init__(self) -> None:
        self._recorder: AllocatorRecorder | None = None
        self.started = False
        self.refused = False  # another profiler was recording when a timed call came
        self.known: dict[Any, int] = {}  # a call's signature (call_key) -> its scratch, for measure()'s callers

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

    def measure(self, run: Callable[[], Any]) -> tuple[Any, list[tuple[int, int]] | None]:
        """``run()`` under a recording of its own: its result and the CPU allocator's events inside it (``(ns,
        bytes)`` in order), or ``None`` for the events where another profiler records (or the user's took over)."""
        if self.refused or profiler_busy():
            self.refused = True
            return run(), None
        recorder = AllocatorRecorder("cpu", scopes=False)
        try:
            recorder.start()
        except Exception:
            self.refused = True
            return run(), None
        t0 = now()
        try:
            out = run()
        finally:
            t1 = now()
            roots = recorder.finish()
        if roots is None:
            return out, None
        return out, window_events(roots, [(t0, t1, 0, 0, 0, 0)])[0]


def call_key(func: Any, args: Sequence[Any], kwargs: Any) -> Any:
    """What an op's scratch follows from: the op, its tensors' shapes, strides and dtypes, its other arguments,
    the threads."""
    key: list[Any] = [id(func), get_num_threads()]
    key.extend(_spec(a) for a in args)
    if kwargs:
        key.extend((k, _spec(v)) for k, v in kwargs.items())
    return tuple(key)


def _spec(a: Any) -> Any:
    if isinstance(a, Tensor):
        return (tuple(a.shape), a.stride(), a.dtype, a.device.type)
    if isinstance(a, (list, tuple)):
        return tuple(_spec(v) for v in a)
    try:
        hash(a)
    except TypeError:
        return type(a).__name__
    return a


def call_scratch(inside: Sequence[tuple[int, int]], counted: int) -> int:
    """A call's scratch: the highest its allocations (``inside``, in order) went above ``counted``, the bytes of
    what it returned."""
    running = high = 0
    for _, n in inside:
        running += n
        if running > high:
            high = running
    return max(high - max(counted, 0), 0)


class ScratchOps:
    """The ops whose CPU kernels allocate inside themselves, as the tracker runs them (one of the parts
    :class:`~vram_magic.engine.tracker.mode.Tracker` is made of): an fp32 GEMM's copies added as it returns, every
    other call timed for the end of the block, or measured as it runs under a budget. ``recorder``: the allocator's
    events, started by the first timed op (set by the block that measures: measuring/measurement.py); ``windows``:
    each timed call's window."""

    def __init__(self, counts: Any) -> None:
        self.counts = counts
        self.now = counts.now
        self.recorder: ScratchRecorder | None = None
        self.windows: list[Window] = []

    def gemm(self, func: Any, args: Any, kwargs: Any) -> Any:
        """``mm``/``addmm``: on the CPU, the operand copies BLAS needs follow from the strides (scratch_ops.gemm_copies)
        and are added as the op returns; in half precision oneDNN packs the operands instead, timed as the other
        scratch ops are."""
        if self.recorder is not None and args[0 if func is MM else 1].dtype in HALF:
            return self.scratch_op(func, args, kwargs)
        counts = self.counts
        before = len(counts.events)
        out = (func._op if type(func) is _OpOverload else func)(*args, **(kwargs or {}))
        if DYNAMO in LOADED and COMPILER._is_compiling_flag:
            return out
        if isinstance(out, torch.Tensor):
            counts.see_new(out, 3)
            if counts.cpu and out.is_cpu:
                extra = gemm_copies(func, args, out)
                if extra:
                    if counts.budget is not None and counts.current + extra > counts.budget:
                        counts.raise_oom(extra, depth=3)
                    counts.scratch_block(extra, before)
        return out

    def scratch_op(self, func: Any, args: Any, kwargs: Any) -> Any:
        """An op whose CPU kernel allocates inside itself (engine/tracker/scratch_ops.py), on the CPU: each call is
        timed, so that the allocator's events inside it are found at the end of the block (:func:`spikes`), or,
        under a budget, measured as it runs. Past a budget, the scratch raises ``torch.OutOfMemoryError`` as the op
        returns, as the kernel would have on a full device."""
        recorder, counts = self.recorder, self.counts
        if recorder is not None and counts.budget is not None:
            return self._measured_scratch_op(func, args, kwargs)
        timed = recorder is not None and recorder.start()
        before = len(counts.events)
        t0 = now() if timed else 0
        out = (func._op if type(func) is _OpOverload else func)(*args, **(kwargs or {}))
        t1 = now() if timed else 0
        if DYNAMO in LOADED and COMPILER._is_compiling_flag:
            return out
        counts.see_outputs(out, func)
        if timed:
            self.windows.append((t0, t1, before, len(counts.events), self.now.phase(), self.now.module()))
        return out

    def _measured_scratch_op(self, func: Any, args: Any, kwargs: Any) -> Any:
        """Under a budget: the call's scratch measured as it runs (the first call of its kind) or known from that
        one, checked against the budget, and put in the history after its outputs."""
        recorder, counts = self.recorder, self.counts
        before = len(counts.events)
        key = call_key(func, args, kwargs)
        extra = recorder.known.get(key)  # type: ignore[union-attr]
        op = func._op if type(func) is _OpOverload else func
        inside = None
        if extra is None:
            out, inside = recorder.measure(lambda: op(*args, **(kwargs or {})))  # type: ignore[union-attr]
        else:
            out = op(*args, **(kwargs or {}))
        if DYNAMO in LOADED and COMPILER._is_compiling_flag:
            return out
        counts.see_outputs(out, func)
        if inside is not None:
            extra = recorder.known[key] = call_scratch(  # type: ignore[union-attr]
                inside, counted_between(counts.events, before, len(counts.events), sizes_of(counts)))
        if extra:
            if counts.current + extra > counts.budget:
                counts.raise_oom(extra, depth=4)
            counts.scratch_block(extra, before)
        return out


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
        if not events:
            continue
        extra = call_scratch(events, counted_between(tracker_events, before, after, size))
        if extra > 0:
            out.append((after, extra, phase, module))
    return out


def counted_between(tracker_events: Sequence[int], before: int, after: int, size: Callable[[int], int]) -> int:
    """The bytes the tracker's history gained from event ``before`` to ``after``."""
    counted = 0
    for ev in tracker_events[before:after]:
        counted += size(ev) if ev > 0 else -size(-ev)
    return counted


def add_scratch(tracker: Any, found: Sequence[tuple[int, int, int, int]],
                steps: list[tuple[int, int, int]] | None = None) -> None:
    """Put each call's scratch in ``tracker``'s history (the tracker's counts) right after the call: a block allocated
    and freed at once, its role :data:`SCRATCH`; the peak is found again, and the indices into the history that the
    tracker keeps (an out-of-memory's; ``steps``, generate()'s stages) move past the blocks put before them."""
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
    if steps is not None:
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


def sizes_of(tracker: Any) -> Callable[[int], int]:
    """serial → bytes, for every serial of the tracker's history."""
    allocs, initial, late, freed = tracker.allocs, tracker.initial, tracker.late, tracker.initial_freed

    def size(serial: int) -> int:
        record = allocs.get(serial)
        if record is not None:
            return record[0]
        n = initial.get(serial)
        return n if n is not None else late.get(serial, freed.get(serial, 0))

    return size


__all__ = ["SCRATCH", "ScratchOps", "ScratchRecorder", "Window", "add_scratch", "call_key", "call_scratch",
           "counted_between", "last_site", "sizes_of", "spikes", "window_events"]
