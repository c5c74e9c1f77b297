"""The live view of a measured cell: memory now, the peak so far, elapsed time and phase, updated from a
background thread while the cell runs, then replaced in place by the final report.

It is a display with a ``display_id`` (``display_data`` then ``update_display_data`` messages), not a
widget: frontends update it without a widget manager, and what a notebook saves is always plain HTML and
text — the final report, or, if the kernel died mid-cell, the last numbers seen. ipykernel routes displays
made from another thread to the cell that is running.

The thread only reads: :meth:`Measurement.status` (plain numbers, safe from another thread) and, for the
allocator backend on CUDA, ``torch.cuda.memory_allocated`` when CUDA is already initialised. It is stopped
before the measurement ends, so the report is built exactly as without it.
"""

from __future__ import annotations

import contextvars
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

Publisher = Callable[[dict[str, Any], str, bool], None]
"""``publish(bundle, display_id, update)``: show a bundle, or replace the one shown under ``display_id``."""


def ipython_publisher(bundle: dict[str, Any], display_id: str, update: bool) -> None:
    from IPython.display import display

    display(bundle, raw=True, display_id=display_id, update=update)


def polled_allocated(device: str) -> int | None:
    """``torch.cuda.memory_allocated(device)`` if CUDA is initialised (never initialises it), else None."""
    if not device.startswith("cuda"):
        return None
    import torch

    if not torch.cuda.is_initialized():
        return None
    try:
        return int(torch.cuda.memory_allocated(device))
    except Exception:
        return None


class LiveView:
    """Shows ``render(status)`` every ``interval`` seconds once ``delay`` seconds have passed.

    ``status()`` returns the current :class:`~vram_magic.measuring.live_status.LiveStatus` (``None`` when the block is
    not
    running). Call :meth:`stop` before the measurement ends, then :meth:`finish` with the final bundle.
    """

    def __init__(self, status: Callable[[], Any], render: Callable[[Any], dict[str, Any]], *,
                 delay: float = 1.0, interval: float = 0.25, publish: Publisher = ipython_publisher,
                 name: str = "vram-live") -> None:
        self.name = name
        self._status = status
        self._render = render
        self.delay = delay
        self.interval = interval
        self._publish = publish
        self.display_id = f"vram-live-{uuid.uuid4().hex}"
        self.updates = 0  # bundles published (the first display included)
        self.shown = False
        self.error: BaseException | None = None
        self._failures = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def start(self, show_now: bool = False) -> LiveView:
        """Start the thread; with ``show_now`` the first picture is published here, before this returns (a
        monitor that appears in its own cell's output however loaded the machine is), the next after ``interval``."""
        if show_now:
            self._tick()
        # The thread runs in a copy of this thread's context: the kernel's "parent" (the cell that started the
        # view) is a context variable, so what the thread displays stays under that cell even once the next cell
        # runs (a plain thread would send it to whichever cell is running at the time).
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._run, self.interval if show_now else self.delay),
                                        name=self.name, daemon=True)
        self._thread.live_view = self  # type: ignore[attr-defined]  # who runs it, for whoever lists the threads
        self._thread.start()
        return self

    def _tick(self) -> bool:
        """Publish one picture; False once the view is stopped or has failed three times."""
        try:
            status = self._status()
            if status is not None:
                bundle = self._render(status)
                with self._lock:
                    if self._stopped:
                        return False
                    self._publish(bundle, self.display_id, self.shown)
                    self.shown = True
                    self.updates += 1
        except Exception as err:  # never disturb the cell: the final report still replaces the view
            self.error = err
            self._failures += 1
            if self._failures >= 3:  # not a passing hiccup: stop trying
                return False
        return True

    def _run(self, first_wait: float) -> None:
        if self._stop.wait(first_wait):
            return
        while True:
            started = time.perf_counter()
            if not self._tick():
                return
            # a steady rate: the time spent rendering counts against the interval
            if self._stop.wait(max(self.interval - (time.perf_counter() - started), 0.01)):
                return

    def stop(self, timeout: float = 2.0) -> None:
        """Stop updating (idempotent); after it returns, nothing more is published by the thread."""
        self._stop.set()
        with self._lock:
            self._stopped = True
        if self._thread is not None and self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def finish(self, bundle: dict[str, Any] | None) -> None:
        """Stop, then put ``bundle`` where the live view is (or show it, if the view never appeared).
        With ``None`` (a quiet cell, or no report), the live view is emptied."""
        self.stop()
        if bundle is None:
            if self.shown:
                self._publish({"text/plain": ""}, self.display_id, True)
            return
        self._publish(bundle, self.display_id, self.shown)


# --- a measured cell's view ----------------------------------------------------------------------------------
def session_scale(history: Any, device: str) -> int | None:
    """The largest total measured so far in the session on ``device``: the length all its bars share."""
    best = 0
    for r in history:
        if r.device == device:
            best = max(best, r.before.total, r.after.total, r.peak.total)
    return best or None


def cell_view(m: Any, history: Any, *, delay: float = 1.0, interval: float = 0.25,
              publish: Publisher = ipython_publisher) -> LiveView:
    """The live view (not started) of the measurement ``m`` (a running
    :class:`~vram_magic.measuring.measurement.Measurement`), its bars on the scale of the session's ``history``."""
    from ..engine.cuda import device as cuda
    from ..measuring.render.html import live_html
    from ..measuring.render.text import live_text

    device = m.device
    budget = getattr(m, "budget", None)
    capacity = budget if budget is not None else cuda.capacity(device)
    scale = session_scale(history, device)
    cell = m.cell

    def render(status: Any) -> dict[str, Any]:
        allocated = polled_allocated(device) if status.now is None else None
        return {"text/plain": live_text(status, cell=cell, allocated=allocated),
                "text/html": live_html(status, cell=cell, capacity=capacity, budget=budget is not None,
                                       session_scale=scale, allocated=allocated)}

    return LiveView(m.status, render, delay=delay, interval=interval, publish=publish)
