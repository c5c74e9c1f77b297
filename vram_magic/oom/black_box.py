"""The out-of-memory black box of a notebook: armed by ``%load_ext vram_magic``, at no per-op cost.

It listens to IPython's ``pre_run_cell`` and ``post_run_cell`` events only. When an out-of-memory error leaves a cell
— measured or not, raised by the cell itself or by code it called (``raise … from`` included), shown by IPython's own
traceback or by ``%run``'s — the report follows the traceback: IPython has shown the traceback before
``post_run_cell`` fires, so a display from there lands under it. The report is read while the failed frames are
still alive (their locals are named), then those frames are released as a measured cell releases them, so the memory
they held is freed; the exception object itself is left alone (a kernel reads it after the event to answer the
frontend). A cell run inside another (``%%capture``, a magic's ``run_cell``) has its report shown when the outermost
cell ends, so nothing captures it. On CUDA the allocator's state at the failure comes from
:class:`~vram_magic.engine.cuda.oom_watch.OomWatch`, armed alongside.
"""

from __future__ import annotations

import gc
import sys
import time
from typing import Any

from ..engine.cuda.oom_watch import OomWatch
from ..engine.tracker.oom_frames import release_traceback
from .build import build_oom_report, find_oom
from .report import OomReport

_REPORTED = "_vram_magic_oom_reported"
_last: list[OomReport] = []  # the process's latest explained out-of-memory error (vram_magic.last_oom)


def remember(report: OomReport) -> None:
    _last[:] = [report]


def last_oom() -> OomReport | None:
    """The report of the latest out-of-memory error this process explained (a notebook cell's, measured or not, or
    a script's run by ``python -m vram_magic run``), or ``None``."""
    return _last[-1] if _last else None


class BlackBox:
    """The black box of one shell. ``session``: the extension's session (its registry, its history of reports);
    ``show``: how a report reaches the notebook (``IPython.display.display`` by default)."""

    def __init__(self, shell: Any, session: Any, show: Any = None) -> None:
        self.shell = shell
        self.session = session
        self.show = show
        self.watch = OomWatch()
        self.enabled = False
        self._stack: list[tuple[Any, Any, float]] = []  # (the cell's ExecutionInfo, sys.last_value then, its start)
        self._pending: list[OomReport] = []

    # --- arming ------------------------------------------------------------------------------------
    def arm(self) -> None:
        if self.enabled:
            return
        self.shell.events.register("pre_run_cell", self._pre)
        self.shell.events.register("post_run_cell", self._post)
        self.watch.arm()
        self.enabled = True

    def disarm(self) -> None:
        if not self.enabled:
            return
        for name, cb in (("pre_run_cell", self._pre), ("post_run_cell", self._post)):
            try:
                self.shell.events.unregister(name, cb)
            except ValueError:
                pass
        self.watch.disarm()
        self.enabled = False
        self._stack.clear()

    # --- the cells ---------------------------------------------------------------------------------
    def _pre(self, info: Any) -> None:
        self._stack.append((info, getattr(sys, "last_value", None), time.time()))

    def _post(self, result: Any) -> None:
        """Never raises: an exception here would print a second traceback and replace ``sys.last_value``."""
        try:
            self._cell_ended(result)
        except Exception as err:  # the user's error stays what they see
            print(f"vram_magic: the out-of-memory report could not be made ({type(err).__name__}: {err})",
                  file=sys.stderr)

    def _cell_ended(self, result: Any) -> None:
        info = getattr(result, "info", None)
        last_before, start = getattr(sys, "last_value", None), None
        while self._stack:  # a blank cell fires post_run_cell without pre_run_cell: match on the cell's info
            entry = self._stack.pop()
            if info is None or entry[0] is info:
                last_before, start = entry[1], entry[2]
                break
        exc = getattr(result, "error_in_exec", None)
        if exc is None and getattr(sys, "last_value", None) is not last_before:
            exc = sys.last_value  # shown by %run's own traceback, or by a cell run inside this one
        oom = find_oom(exc)
        if oom is not None and not getattr(oom, _REPORTED, False):
            report = self._explain(exc, oom, getattr(result, "execution_count", None), start)
            if report is not None:
                self._pending.append(report)
        if not self._stack and self._pending:  # the outermost cell ended: nothing can capture the display now
            pending, self._pending = self._pending, []
            for report in pending:
                self._display(report)

    def _explain(self, exc: BaseException, oom: BaseException, cell: int | None, start: float | None
                 ) -> OomReport | None:
        try:
            setattr(oom, _REPORTED, True)
        except Exception:
            pass
        measured = self.session.last
        if measured is not None and measured.oom is not None and measured.cell == cell and cell is not None:
            report = from_measured(measured)  # the measured cell's own report shows it: not displayed twice
            self._record(report)
            return None
        report = build_oom_report(exc, where=f"cell {cell}" if cell is not None else "a cell",
                                  namespace=self.shell.user_ns, registry=self.session.registry,
                                  state=self.watch.take(), cell=cell, cell_start=start,
                                  notes=(self.watch.note,) if self.watch.note else ())
        release_traceback(oom.__traceback__)
        gc.collect()
        self._record(report)
        return report

    def _record(self, report: OomReport) -> None:
        remember(report)
        self.session.ooms.append(report)

    def _display(self, report: OomReport) -> None:
        if self.show is not None:
            self.show(report)
            return
        from IPython.display import display

        display(report)


def from_measured(measured: Any) -> OomReport:
    """The report of a measured cell that ran out of memory, as an out-of-memory report (its own numbers)."""
    oom = measured.oom
    return OomReport(
        where=f"cell {measured.cell}", error=measured.error or oom.message, device=measured.device,
        alive=oom.live, requested=oom.requested, capacity=oom.capacity, host=measured.host,
        advice=measured.advice, notes=measured.notes, cell=measured.cell, time=time.time())


__all__ = ["BlackBox", "from_measured", "last_oom", "remember"]
