"""The state that lives across cells: history, the previous report, the weak storage registry, settings.

One ``Session`` is created per extension load (or by a script); there are no module globals.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.breakdown import Breakdown
from ..core.device_stats import DeviceStats
from ..core.rendered import Rendered
from ..core.units import parse_size
from ..measuring.report import CellReport

if TYPE_CHECKING:
    import pandas as pd

    from ..measuring.measurement import Measurement


@dataclass(frozen=True)
class MemoryNow(Rendered):
    """What ``%vram`` shows: the device's memory at this moment, split by category."""

    device: str
    breakdown: Breakdown
    stats: DeviceStats | None
    capacity: int | None
    notes: tuple[str, ...] = ()

    def _text(self) -> str:
        from ..measuring.render.text import now_text

        return now_text(self)

    def _html(self) -> str:
        from ..measuring.render.html import now_html

        return now_html(self)


class Session:
    """Measured cells of one notebook, in order."""

    def __init__(self, namespace: Mapping[str, Any] | None = None, *, history_size: int = 200) -> None:
        from ..engine.scan.registry import LiveStorages

        self.namespace = namespace
        self.registry = LiveStorages()
        self.history: deque[CellReport] = deque(maxlen=history_size)
        self.ooms: deque[Any] = deque(maxlen=history_size)  # out-of-memory reports of cells nobody measured
        self.budget: int | None = None
        self.record_sites = True
        self.active: Measurement | None = None
        self.cell_files: Mapping[str, int] | None = None  # compiled cell file name -> cell number
        self.on_report: list[Callable[[CellReport], Any]] = []  # told of each new report (JupyterLab's figures)
        # what the shell keeps between cells: auto mode (every cell measured), the live view of the cell auto
        # mode measures, whether it skips the running cell, and the %vram watch monitor
        self.auto = False
        self.auto_skip = False
        self.auto_live: Any = None
        self.watch: Any = None

    # --- measuring -------------------------------------------------------------------------------
    def start(self, device: Any = None, *, budget: int | str | None = None, cell: int | None = None,
              source: str = "", backend: str = "auto") -> Measurement:
        """Begin measuring; ``finish`` ends it. Refuses to nest."""
        from ..measuring.measurement import Measurement

        if self.active is not None:
            raise RuntimeError("a measurement is already running in this session (nested %%vram is not supported; "
                               "remove the inner %%vram or measure the outer cell only)")
        budget = parse_size(budget) if budget is not None else self.budget
        m = Measurement(device, namespace=self.namespace, budget=budget, previous=self.last,
                        registry=self.registry, record_sites=self.record_sites, cell=cell, source=source,
                        cell_files=self.cell_files, backend=backend)
        m.__enter__()
        self.active = m
        return m

    def finish(self, exc: BaseException | None = None) -> CellReport | None:
        """End the measurement and return its report. A failure to build the report is a warning (``None`` is
        returned), never an error: what the cell itself did or raised is what the user must see."""
        m = self.active
        if m is None:  # already finished (the extension was unloaded inside the measured cell)
            return None
        self.active = None
        try:
            m.__exit__(type(exc) if exc is not None else None, exc, exc.__traceback__ if exc is not None else None)
        except Exception as err:
            import warnings

            warnings.warn(f"vram_magic could not build this cell's report: {type(err).__name__}: {err}",
                          RuntimeWarning, stacklevel=2)
            return None
        finally:
            m.namespace = None
        if m.report is None:
            return None
        self.history.append(m.report)
        for listener in list(self.on_report):
            listener(m.report)
        return m.report

    @property
    def last(self) -> CellReport | None:
        return self.history[-1] if self.history else None

    def resize(self, history_size: int) -> None:
        if history_size < 1:
            raise ValueError("history_size must be at least 1")
        self.history = deque(self.history, maxlen=history_size)
        self.ooms = deque(self.ooms, maxlen=history_size)

    # --- reading ---------------------------------------------------------------------------------
    def now(self, device: Any = None) -> MemoryNow:
        from ..engine.cuda import device as cuda
        from ..engine.scan.frame_namespace import snapshot

        dev = cuda.resolve_device(device)  # never initialises CUDA: looking must not create a context
        breakdown, stats, notes = snapshot(dev, self.namespace, self.registry)
        if dev.startswith("cuda") and stats is None:
            notes = (*notes, cuda.not_initialised_note(dev))
        return MemoryNow(dev, breakdown, stats, self.budget or cuda.capacity(dev), notes)

    def report(self, cell: int | str) -> CellReport:
        """The report of measured cell ``cell`` (its execution count); ``-1`` is the last one."""
        try:
            n = int(cell)
        except (TypeError, ValueError) as err:
            raise ValueError(f"cell must be a number, got {cell!r}") from err
        if n < 0:
            if -n > len(self.history):
                raise ValueError(f"only {len(self.history)} measured cell(s) in the history")
            return self.history[n]
        for r in reversed(self.history):
            if r.cell == n:
                return r
        known = ", ".join(str(r.cell) for r in self.history) or "none yet"
        raise ValueError(f"cell {n} was not measured (measured cells: {known})")

    def history_frame(self) -> pd.DataFrame:
        from .tables import history_frame

        return history_frame(list(self.history), list(self.ooms))

    def diff(self, a: int | str | None = None, b: int | str | None = None) -> pd.DataFrame:
        from .tables import diff_frame

        if a is None and b is None:
            if len(self.history) < 2:
                raise ValueError("%vram diff needs two measured cells (or name them: %vram diff A B)")
            ra, rb = self.history[-2], self.history[-1]
        elif a is None or b is None:
            raise ValueError("give two cell numbers: %vram diff A B")
        else:
            ra, rb = self.report(a), self.report(b)
        return diff_frame(ra, rb)

    def reset(self) -> None:
        self.history.clear()

    def stop_watch(self) -> None:
        """Stop the ``%vram watch`` monitor, if there is one (its last picture stays, marked as stopped)."""
        current, self.watch = self.watch, None
        if current is not None:
            current.stop()

    def close(self) -> None:
        """Forget every weakref and report; nothing of this session stays alive or called back."""
        self.stop_watch()
        if self.active is not None:
            try:
                self.finish()
            except Exception:
                pass
        self.history.clear()
        from ..engine.scan.containers import forget

        forget(self.registry)  # what the scans remembered of the namespace's big containers
        self.registry.clear()
        self.namespace = None
