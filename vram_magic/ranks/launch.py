"""The launching side: arm the processes a block of code starts, then collect one report per rank.

``with LaunchedRanks() as launched: <code that starts ranks>`` sets, for the length of the block, the
environment every child inherits (the reports' folder; ``PYTHONPATH`` to :mod:`vram_magic.ranks.boot`, so a
new interpreter arms itself) and arms this process, so a child forked from it measures itself too (see
:mod:`vram_magic.ranks.child`). This process is never measured as a rank. Afterwards ``launched.reports`` holds
a :class:`~vram_magic.ranks.result.RankReports`, with the error each rank raised — from its own report, or
from what the launcher raised here (``torch.multiprocessing``'s ``ProcessRaisedException``, torch elastic's
``ChildFailedError``, also when wrapped by accelerate).

Before the block runs, it asks whether a process forked from this one could run backward (see
:mod:`vram_magic.ranks.forks`): when not, the block's first fork says what to do, and the per-rank view says it
again if the ranks failed for it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import replace
from types import TracebackType

from . import child, forks
from .result import RankReports

BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "boot")
_ENV = (child.ENV_DIR, child.ENV_PARENT, "PYTHONPATH")


class LaunchedRanks:
    """Measure every rank started inside the block. ``directory``: where the ranks write their reports (kept);
    default: a temporary folder, removed once read. ``title``: the heading of the per-rank view.

    ``fork_advice``: what to say when ranks forked now could not run backward (this process has run one on an
    accelerator build; :mod:`.forks`): ``True`` for the general advice, a text of one's own, or ``False`` not to
    ask (a process that starts its ranks only as new programs). ``fork_refused`` then holds the answer (``None``:
    not asked, or it could not be told)."""

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, title: str = "ranks",
                 fork_advice: bool | str = True) -> None:
        self.directory = os.fspath(directory) if directory is not None else None
        self.title = title
        self.fork_advice = fork_advice
        self.fork_refused: bool | None = None
        self.reports: RankReports | None = None
        self._saved: dict[str, str | None] = {}
        self._folder = ""
        self._t0 = 0.0

    def __enter__(self) -> LaunchedRanks:
        if self.fork_advice:
            self.fork_refused = forks.forked_backward_refused()
        if self.directory is not None:
            os.makedirs(self.directory, exist_ok=True)
            for name in os.listdir(self.directory):  # a folder used before: this run's reports only
                if name.startswith("rank-") and name.endswith(".json"):
                    os.remove(os.path.join(self.directory, name))
            self._folder = self.directory
        else:
            self._folder = tempfile.mkdtemp(prefix="vram_magic_ranks_")
        self._saved = {k: os.environ.get(k) for k in _ENV}
        os.environ[child.ENV_DIR] = self._folder
        os.environ[child.ENV_PARENT] = str(os.getpid())
        path = self._saved["PYTHONPATH"]
        os.environ["PYTHONPATH"] = BOOT + (os.pathsep + path if path else "")
        child.install("parent")
        if self.fork_refused:
            forks.notice_at_fork(self._advice())
        self._t0 = time.perf_counter()
        return self

    def _advice(self) -> str:
        return self.fork_advice if isinstance(self.fork_advice, str) else forks.advice()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        wall = time.perf_counter() - self._t0
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        child.unpatch()
        forks.notice_at_fork(None)
        try:
            reports = collect(self._folder, exc, title=self.title, wall_time=wall)
            if forks.refused_in([r.error for r in reports] + [exc]):  # they failed for it: say what to do
                reports = replace(reports, notes=reports.notes + (self._advice(),))
            self.reports = reports
        finally:
            if self.directory is None:
                shutil.rmtree(self._folder, ignore_errors=True)


def collect(folder: str, exc: BaseException | None = None, *, title: str = "ranks",
            wall_time: float = 0.0) -> RankReports:
    """The reports in ``folder``, with the errors ``exc`` (what the launcher raised) names per process."""
    reports = RankReports.load(folder, title=title)
    reports = replace(reports, wall_time=wall_time)
    failures = launcher_failures(exc)
    if failures:
        ranks = list(reports.ranks)
        by_pid = {r.pid: i for i, r in enumerate(ranks) if r.pid is not None}
        for pid, index, text in failures:
            i = by_pid.get(pid)
            if i is None and index is not None and index < len(ranks) and ranks[index].report is None:
                i = index
            if i is not None and (ranks[i].error is None or ranks[i].report is None):
                ranks[i] = replace(ranks[i], error=text)
        reports = replace(reports, ranks=tuple(ranks))
    if not len(reports):
        what = f" (the cell raised {type(exc).__name__})" if exc is not None else ""
        reports = replace(reports, notes=reports.notes + (
            f"no process started here joined a torch.distributed job{what}: --ranks measures the processes that call "
            "torch.distributed.init_process_group (directly, through init_device_mesh, accelerate's Accelerator, …)",))
    return reports


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text.strip()


def launcher_failures(exc: BaseException | None) -> list[tuple[int | None, int | None, str]]:
    """``(pid, process index, error)`` for each failed process a launcher's exception names, looking through
    the exceptions it was raised from (accelerate re-raises torch's)."""
    out: list[tuple[int | None, int | None, str]] = []
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        name = type(exc).__name__
        if name == "ProcessRaisedException":
            out.append((getattr(exc, "error_pid", None), getattr(exc, "error_index", None),
                        _last_line(str(exc.args[0] if exc.args else exc))))
        elif name == "ProcessExitedException":
            signal = getattr(exc, "signal_name", None)
            code = getattr(exc, "exit_code", None)
            out.append((getattr(exc, "error_pid", None), getattr(exc, "error_index", None),
                        f"the process was killed by {signal}" if signal else f"the process exited with code {code}"))
        elif name == "ChildFailedError":
            for rank, failure in (getattr(exc, "failures", None) or {}).items():
                message = getattr(failure, "message", "") or ""
                if isinstance(message, dict):
                    message = str(message.get("message", ""))
                text = _last_line(str(message)) if message and "To enable traceback" not in str(message) else \
                    f"the process exited with code {getattr(failure, 'exitcode', '?')}"
                out.append((getattr(failure, "pid", None), rank, text))
        exc = exc.__cause__ or exc.__context__
    return out


def run(command: list[str], directory: str | None = None, *, title: str = "ranks") -> tuple[int, RankReports]:
    """Run ``command`` (``torchrun … script.py``) with its ranks armed; its exit code and their reports."""
    import subprocess

    with LaunchedRanks(directory, title=title, fork_advice=False) as launched:  # new programs: nothing forked
        code = subprocess.call(command)
    assert launched.reports is not None
    return code, launched.reports
