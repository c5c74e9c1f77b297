"""The host memory of a measured block: the resident memory of this process and of its children (data-loader workers,
forked ranks), sampled by a background thread while the block runs.

A child's memory exists nowhere else but in its own process, so it is read there: every sample (each 50 ms) sums this
process's ``statm`` and each child's (found through ``task/<tid>/children``; a few file reads, about 0.1-0.2 ms): a
child that lives less than a sample's interval can be missed. This process's own high-water mark (``VmHWM``) is read
before and after: where it rose during the block, that is this process's exact peak, caught even between two
samples. The mark is never reset (a tool must not change what the user's own
``resource.getrusage`` reads). A sum of resident sizes counts twice the pages a forked child still shares with its
parent; the child's own figure is what its process says it holds.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from ...core.host import HostUsage
from . import procs

#: seconds between two samples of the children (this process's own peak is its high-water mark, exact)
INTERVAL = 0.05


def _hwm() -> int | None:
    text = procs.status()
    value = procs.status_field(text, "VmHWM") if text else None
    try:
        return int(value.split()[0]) * 1024 if value else None
    except ValueError:
        return None


def resident(pid: int) -> tuple[int, int]:
    """(bytes resident in ``pid``, of which in its children)."""
    own = procs.rss(pid) or 0
    kids = sum(procs.rss(c) or 0 for c in procs.children(pid))
    return own + kids, kids


class HostSampler:
    """``start()`` before the block, ``stop()`` after it: :class:`~vram_magic.core.host.HostUsage` (``None`` where
    this system has no ``/proc``). One thread samples for every block of the process; it waits, costing nothing,
    between blocks (starting a thread per block would cost more than the block's samples)."""

    def __init__(self, interval: float = INTERVAL, pid: int | None = None) -> None:
        self.interval = interval
        self.pid = pid or os.getpid()
        self._peak = (0, 0)
        self._before = 0
        self._hwm: int | None = None
        self._running = False

    def start(self) -> HostSampler:
        if not procs.has_proc():
            return self
        self._before, kids = resident(self.pid)
        self._peak = (self._before, kids)
        self._hwm = _hwm()
        self._running = True
        _thread().add(self)
        return self

    def _sample(self) -> tuple[int, int]:
        now = resident(self.pid)
        if now[0] > self._peak[0]:
            self._peak = now
        return now

    def stop(self) -> HostUsage | None:
        if not self._running:
            return None
        self._running = False
        _thread().remove(self)
        after, _ = self._sample()
        peak, kids = self._peak
        hwm = _hwm()
        if hwm is not None and self._hwm is not None and hwm > self._hwm:  # this process's own peak, exact
            peak = max(peak, hwm + kids)
        left = procs.available()  # read once, at the end: what was left before is that and what the block kept
        return HostUsage(before=self._before, after=after, peak=peak, children_peak=kids,
                         available=None if left is None else left + max(after - self._before, 0), pinned=_pinned())


class _Sampling(threading.Thread):
    """The process's one sampling thread: every :data:`INTERVAL` while some block is measured, asleep otherwise."""

    def __init__(self) -> None:
        super().__init__(name="vram-host", daemon=True)
        self.samplers: list[HostSampler] = []
        self.lock = threading.Lock()
        self.wake = threading.Event()

    def add(self, sampler: HostSampler) -> None:
        with self.lock:
            self.samplers.append(sampler)
        self.wake.set()

    def remove(self, sampler: HostSampler) -> None:
        with self.lock:
            if sampler in self.samplers:
                self.samplers.remove(sampler)

    def run(self) -> None:
        while True:
            self.wake.wait()
            time.sleep(INTERVAL)
            with self.lock:
                samplers = list(self.samplers)
                if not samplers:
                    self.wake.clear()
            for sampler in samplers:
                try:
                    sampler._sample()
                except Exception:  # a process gone between two reads: the next sample reads again
                    pass


_threads: list[_Sampling] = []
_threads_lock = threading.Lock()


def _thread() -> _Sampling:
    with _threads_lock:
        if not _threads or not _threads[0].is_alive() or _threads[0].ident is None:
            t = _Sampling()
            t.start()
            _threads[:] = [t]
        return _threads[0]


def _pinned() -> int | None:
    """Page-locked host memory PyTorch's CUDA host allocator holds (never asked before CUDA is initialised)."""
    from ..cuda import device as cuda

    if not cuda.initialized():
        return None
    try:
        import torch

        stats: Any = torch.cuda.host_memory_stats()
        return int(stats.get("allocated_bytes.all.current", 0)) or None
    except Exception:
        return None


__all__ = ["INTERVAL", "HostSampler", "resident"]
