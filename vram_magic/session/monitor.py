"""``%vram watch``: a standing monitor of a device's memory over time, updated from a background thread while
other (unmeasured) cells run, until ``%vram watch off``.

On CUDA it shows what the caching allocator holds (allocated, reserved) and what the whole device uses,
other processes included (``cudaMemGetInfo``). It never initialises CUDA and never creates a context: until
this process has initialised CUDA itself it waits, and the device-wide figure is read only on a device that
already has a context. On the CPU it shows the tensors vram_magic knows of (those measured or seen in the
namespace) and the process's resident memory (RSS).

Like the live view it is a display updated by ``display_id`` (no widget), so what the notebook saves is the
last picture of it as plain HTML.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..engine.cuda.device import has_context, resolve_device
from .live import LiveView, Publisher, ipython_publisher


@dataclass(frozen=True)
class Sample:
    """One reading: ``values`` in bytes by series name (None: not known now); ``total``: the device's size."""

    t: float
    values: dict[str, int | None]
    total: int | None = None
    note: str = ""


# --- CPU ------------------------------------------------------------------------------------------------------
def process_rss() -> int | None:
    """Resident memory of this process in bytes (Linux /proc, else psutil if installed, else None)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError, IndexError):
        pass
    try:
        import psutil  # type: ignore[import-untyped]

        return int(psutil.Process().memory_info().rss)
    except Exception:
        return None


def cpu_sampler(registry: Any) -> Callable[[], Sample]:
    def sample() -> Sample:
        tracked = sum(entry.size for _, entry in registry.entries("cpu"))
        return Sample(time.perf_counter(), {"tracked tensors": tracked, "process RSS": process_rss()})

    return sample


# --- CUDA -----------------------------------------------------------------------------------------------------
def cuda_reading(index: int, torch_cuda: Any, context: Callable[[int], bool] = has_context) -> Sample:
    """One reading of CUDA device ``index`` through ``torch_cuda`` (``torch.cuda``), touching nothing that would
    initialise CUDA or create a context: allocator counters only once CUDA is initialised, device-wide use
    only on a device that has a context already."""
    now = time.perf_counter()
    if not torch_cuda.is_initialized():
        return Sample(now, {"allocated": None, "reserved": None, "device used": None},
                      note="CUDA is not initialised by this process yet; watching starts when it is")
    allocated = int(torch_cuda.memory_allocated(index))
    reserved = int(torch_cuda.memory_reserved(index))
    used = total = None
    note = ""
    if context(index):
        free, total = (int(v) for v in torch_cuda.mem_get_info(index))
        used = total - free
    else:
        note = f"no CUDA context on cuda:{index} yet (one is not created just to watch it)"
    return Sample(now, {"allocated": allocated, "reserved": reserved, "device used": used}, total=total, note=note)


def cuda_sampler(index: int) -> Callable[[], Sample]:
    import torch

    return lambda: cuda_reading(index, torch.cuda)


def watch_device(device: str | None) -> str:
    """``cpu`` or ``cuda:N`` for ``device`` (None: the current GPU if one is visible, else the CPU), without
    initialising CUDA: the engine's own device resolution (``engine/cuda/device.py``)."""
    return resolve_device(device, what="%vram watch: device")


# --- the monitor ----------------------------------------------------------------------------------------------
class Watch:
    """Samples every ``interval`` seconds and redraws the monitor with the last ``keep`` samples."""

    def __init__(self, device: str, sampler: Callable[[], Sample], *, interval: float = 0.5, keep: int = 120,
                 publish: Publisher = ipython_publisher) -> None:
        self.device = device
        self.interval = interval
        self.samples: deque[Sample] = deque(maxlen=keep)
        self._sampler = sampler
        self._started = time.perf_counter()
        self._view = LiveView(self._sample, self._render, delay=0.0, interval=interval, publish=publish,
                              name="vram-watch")

    @property
    def updates(self) -> int:
        return self._view.updates

    @property
    def running(self) -> bool:
        return self._view._thread is not None and self._view._thread.is_alive()

    def _sample(self) -> Sample:
        s = self._sampler()
        self.samples.append(s)
        return s

    def _render(self, _: Sample, stopped: bool = False) -> dict[str, Any]:
        from .monitor_html import watch_html, watch_text

        samples = list(self.samples)
        return {"text/plain": watch_text(self.device, samples, self.interval, stopped=stopped),
                "text/html": watch_html(self.device, samples, self.interval, self._started, stopped=stopped)}

    def start(self) -> Watch:
        self._view.start(show_now=True)
        return self

    def stop(self) -> None:
        """Stop sampling and leave the last picture, marked as stopped, in the notebook."""
        self._view.stop()
        if self.samples:
            self._view.finish(self._render(self.samples[-1], stopped=True))


# --- reading the command, starting a monitor ------------------------------------------------------------------
WATCH_USAGE = "usage: %vram watch [cpu|cuda|cuda:N] [--interval SECONDS] | %vram watch off"


def parse_watch(words: list[str], interval: float) -> tuple[str | None, float]:
    """``(device or None, seconds between samples)`` from ``%vram watch``'s words (``interval`` unless
    ``--interval S`` is given); a ``ValueError`` with the usage on anything else."""
    device = None
    rest = list(words)
    while rest:
        word = rest.pop(0)
        if word in ("--interval", "-i") and rest:
            try:
                interval = float(rest.pop(0))
            except ValueError:
                raise ValueError(WATCH_USAGE) from None
            if not 0.05 <= interval <= 3600:
                raise ValueError("%vram watch: --interval takes seconds between 0.05 and 3600")
        elif device is None and not word.startswith("-"):
            device = word
        else:
            raise ValueError(WATCH_USAGE)
    return device, interval


def start_watch(device: str | None, interval: float, registry: Any) -> Watch:
    """A monitor of ``device`` (see :func:`watch_device`), started; on the CPU it counts ``registry``'s tensors."""
    dev = watch_device(device)
    sampler = cpu_sampler(registry) if dev == "cpu" else cuda_sampler(int(dev.split(":")[1]))
    return Watch(dev, sampler, interval=interval).start()
