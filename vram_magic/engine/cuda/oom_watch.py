"""The allocator's state at an out-of-memory error, kept for whoever explains it: armed once, at no per-op cost.

Arming never initialises CUDA. Where the process has not initialised it yet, :meth:`OomWatch.arm` queues the start
behind PyTorch's own lazy initialisation (``torch_private.lazy_call``): the first time the user's code makes a CUDA
tensor, the watch starts a capped allocator history (no stacks unless asked: recording one costs a Python stack walk
per allocation) and attaches an out-of-memory observer. The observer runs after the allocator gave up on a request,
with the allocator's lock released, and keeps a plain copy of what it holds then — its segments and blocks, its
counters and the history — because by the time the cell's exception reaches the kernel the allocator has released
its cached blocks. A history the user already records is read and never changed; an observer cannot be detached, so
one module-level observer serves every watch and does nothing while none is armed.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import torch_private
from . import device as cuda

#: entries the history keeps (a ring: the oldest go first), as many as a measured cell's own: a measured cell reads
#: this history as a recording of the user's, so it must be as long as the one the cell would record itself
MAX_ENTRIES = cuda.HISTORY_ENTRIES


@dataclass(frozen=True)
class AllocatorAtOom:
    """What one device's caching allocator held when a request failed, as plain data (PyTorch's shapes:
    ``segments`` and ``trace`` as ``torch.cuda.memory._snapshot()`` gives them, ``stats`` as ``memory_stats()``).
    ``request``: the block size the allocator asked the device for; ``limit``: the device's total, or the allowed
    maximum under a memory fraction; ``free``: what the device had free; ``history_from_start``: the history was
    recorded from CUDA's initialisation on and never wrapped, so replaying it rebuilds every block."""

    device: int
    request: int
    limit: int
    free: int
    stats: Mapping[str, Any] = field(default_factory=dict)
    segments: Sequence[Mapping[str, Any]] = ()
    trace: Sequence[Mapping[str, Any]] = ()
    settings: Mapping[str, Any] = field(default_factory=dict)
    history_from_start: bool = False
    time: float = 0.0
    snapshot: Mapping[str, Any] = field(default_factory=dict, repr=False)  # all of it, for PyTorch's viewer


_watches: list[OomWatch] = []  # armed watches, newest last
_attached: list[bool] = [False]


def _observer(device: int, request: int, limit: int, free: int) -> None:
    """The one observer PyTorch calls (never raises: an exception here would replace the out-of-memory error)."""
    try:
        for watch in list(_watches):
            watch.observe(int(device), int(request), int(limit), int(free))
    except Exception:
        pass


class OomWatch:
    """Keeps the allocator's state at the latest out-of-memory error of this process. ``max_entries``: the history's
    length; ``stacks``: record each allocation's Python stack (the sites of the biggest blocks; costs a stack walk
    per allocation)."""

    def __init__(self, max_entries: int = MAX_ENTRIES, stacks: bool = False) -> None:
        self.max_entries = max_entries
        self.stacks = stacks
        self.last: AllocatorAtOom | None = None
        self.started = False  # the history and the observer are on
        self.own_history = False  # the history is ours (started here, stopped when disarmed)
        self.from_start = False  # started as CUDA initialised: the history holds every block
        self.armed = False
        self.note = ""

    def arm(self) -> None:
        """Start now if the process's CUDA is initialised, else as soon as the user's code initialises it. A build
        without CUDA arms nothing."""
        if self.armed:
            return
        self.armed = True
        if torch_private.attach_oom_observer() is None:
            self.note = "this PyTorch has no CUDA: out-of-memory errors are explained from the namespace alone"
            return
        _watches.append(self)
        if cuda.initialized():
            self._start(from_start=False)
        else:
            torch_private.lazy_call(lambda: self._start(from_start=True))

    def _start(self, from_start: bool) -> None:
        """Inside PyTorch's initialisation lock when queued: touch nothing of ``torch.cuda``'s lazy machinery, never
        raise."""
        try:
            if not self.armed or self.started:
                return
            if not _attached[0]:
                torch_private.attach_oom_observer()(_observer)
                _attached[0] = True
            if torch_private.cuda_history_enabled():
                self.note = "the allocator's history is the user's own recording (read, never changed)"
            else:
                torch_private.record_memory_history()(
                    enabled="all", context="alloc" if self.stacks else None,
                    stacks="python", max_entries=self.max_entries)
                self.own_history = True
                self.from_start = from_start
            self.started = True
        except Exception as err:  # the user's CUDA goes on; the report says what could not be kept
            self.note = f"the allocator's history could not be started ({type(err).__name__}: {err})"

    def observe(self, device: int, request: int, limit: int, free: int) -> None:
        """The allocator gave up on ``request`` bytes: keep a plain copy of what it holds now."""
        snapshot: Mapping[str, Any] = {}
        stats: Mapping[str, Any] = {}
        try:
            snapshot = torch_private.memory_snapshot()
            stats = dict(cuda.raw_stats(device))
        except Exception:
            pass
        traces = snapshot.get("device_traces") or []
        trace = list(traces[device]) if device < len(traces) else []
        complete = self.from_start and self.own_history and len(trace) < self.max_entries
        self.last = AllocatorAtOom(
            device=device, request=request, limit=limit, free=free, stats=stats,
            segments=[s for s in snapshot.get("segments", ()) if s.get("device", device) == device],
            trace=trace, settings=dict(snapshot.get("allocator_settings") or {}), history_from_start=complete,
            time=time.time(), snapshot=snapshot)

    def take(self) -> AllocatorAtOom | None:
        """The state at the latest failure since the last take (then forgotten)."""
        last, self.last = self.last, None
        return last

    def disarm(self) -> None:
        """Stop the history if it is ours (PyTorch then drops what it recorded) and stop listening."""
        if self in _watches:
            _watches.remove(self)
        if self.own_history and self.started:
            try:
                torch_private.record_memory_history()(enabled=None)
            except Exception:
                pass
        self.armed = self.started = self.own_history = False


__all__ = ["MAX_ENTRIES", "AllocatorAtOom", "OomWatch"]
