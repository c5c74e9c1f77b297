"""Per-rank results: one :class:`RankReport` per process of a distributed job, gathered in a :class:`RankReports`.

Both are frozen and hold plain numbers in bytes. ``RankReports`` is an ordered sequence (``reports[1]`` is rank
1's report) that renders itself: a stacked bar per rank on one scale, the imbalance between ranks, and an
estimate beside each rank's peak when one is attached.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, overload

from ..core.breakdown import CATEGORIES, Breakdown
from ..core.rendered import Rendered
from ..measuring.report import CellReport
from .payload import FORMAT, dumps, loads, report_from_dict, report_to_dict

if TYPE_CHECKING:
    import pandas as pd


@dataclass(frozen=True)
class RankReport:
    """What one rank measured (``report``), or why it has no report (``error`` without ``report``).

    ``status``: ``"complete"`` (the measurement ended normally), ``"partial"`` (the process was stopped — a
    launcher terminating the other ranks after one failed — and ``report`` holds what was measured until then:
    the peak so far and an approximate split), or ``"missing"`` (no report arrived).
    ``error``: the exception the rank raised (``"ValueError: …"``), also when it has a report.
    """

    rank: int
    world: int
    report: CellReport | None = None
    error: str | None = None
    status: str = "complete"
    host: str = ""
    pid: int | None = None
    backend: str = ""  # the process group's backend: gloo, nccl, …
    ended: str = ""  # what ended the measurement: "gather", "destroy_process_group", "exit", "SIGTERM"
    launched_by: str = ""  # how the process was started, when vram_magic measured it as a launched rank
    peak_sites: tuple[tuple[str, int], ...] = ()
    peak_modules: tuple[tuple[str, int], ...] = ()

    @property
    def ok(self) -> bool:
        return self.report is not None and self.error is None and self.status == "complete"

    @property
    def before(self) -> Breakdown | None:
        return self.report.before if self.report is not None else None

    @property
    def after(self) -> Breakdown | None:
        return self.report.after if self.report is not None else None

    @property
    def peak(self) -> Breakdown | None:
        return self.report.peak if self.report is not None else None

    @property
    def delta(self) -> Breakdown | None:
        return self.report.delta if self.report is not None else None

    @property
    def device(self) -> str:
        return self.report.device if self.report is not None else ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "rank": self.rank, "world": self.world, "status": self.status, "error": self.error,
            "host": self.host, "pid": self.pid, "backend": self.backend, "ended": self.ended,
            "launched_by": self.launched_by,
            "peak_sites": [list(s) for s in self.peak_sites], "peak_modules": [list(m) for m in self.peak_modules],
            "report": report_to_dict(self.report) if self.report is not None else None,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RankReport:
        report = d.get("report")
        return cls(
            rank=int(d["rank"]), world=int(d.get("world") or 0),
            report=report_from_dict(report) if report else None,
            error=d.get("error"), status=str(d.get("status") or "complete"), host=str(d.get("host") or ""),
            pid=d.get("pid"), backend=str(d.get("backend") or ""), ended=str(d.get("ended") or ""),
            launched_by=str(d.get("launched_by") or ""),
            peak_sites=tuple((str(s), int(n)) for s, n in d.get("peak_sites", ())),
            peak_modules=tuple((str(m), int(n)) for m, n in d.get("peak_modules", ())),
        )

    def to_json(self) -> bytes:
        return dumps(self.to_dict())

    @classmethod
    def from_json(cls, raw: bytes | str) -> RankReport:
        return cls.from_dict(loads(raw))


def rank_report(report: CellReport | None, *, rank: int, world: int, error: str | None = None,
                status: str = "complete", backend: str = "", ended: str = "") -> RankReport:
    """A :class:`RankReport` of this process (host, pid, the peak's lines and modules read from the trace)."""
    import socket

    sites = tuple(report.peak_sites()) if report is not None else ()
    modules = tuple(report.peak_modules()) if report is not None else ()
    if error is None and report is not None:
        error = report.error
    return RankReport(rank=rank, world=world, report=report, error=error, status=status, host=socket.gethostname(),
                      pid=os.getpid(), backend=backend, ended=ended, peak_sites=sites, peak_modules=modules)


@dataclass(frozen=True)
class Imbalance:
    """How the ranks' peaks differ: ``spread`` = largest − smallest peak, in bytes and as a share of the largest;
    ``by_category``: the same spread per category at the peak (what makes the difference)."""

    largest: int
    smallest: int
    largest_rank: int
    smallest_rank: int
    by_category: Mapping[str, int] = field(default_factory=dict)

    @property
    def spread(self) -> int:
        return self.largest - self.smallest

    @property
    def percent(self) -> float:
        return 100.0 * self.spread / self.largest if self.largest else 0.0


@dataclass(frozen=True)
class RankReports(Rendered, Sequence[RankReport]):
    """Every rank's report, ordered by rank (a sequence: ``reports[0]``, ``len(reports)``, iteration).

    ``estimate``: a per-rank estimate (``vram_magic.estimate(..., fsdp=True, world=N)`` or ``%vram_estimate …
    -o est``) shown beside each rank's measured peak; attach one with :meth:`with_estimate`.
    """

    ranks: tuple[RankReport, ...]
    title: str = "ranks"
    launcher: str = ""
    wall_time: float = 0.0
    estimate: Any = field(default=None, repr=False, compare=False)
    notes: tuple[str, ...] = ()

    # --- sequence ----------------------------------------------------------------------------------
    @overload
    def __getitem__(self, index: int) -> RankReport: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[RankReport]: ...

    def __getitem__(self, index: Any) -> Any:
        return self.ranks[index]

    def __len__(self) -> int:
        return len(self.ranks)

    def __iter__(self) -> Iterator[RankReport]:
        return iter(self.ranks)

    # --- reading -----------------------------------------------------------------------------------
    @property
    def world(self) -> int:
        return max([r.world for r in self.ranks] + [len(self.ranks)])

    @property
    def measured(self) -> list[RankReport]:
        return [r for r in self.ranks if r.report is not None]

    @property
    def errors(self) -> dict[int, str]:
        """``{rank: error}`` of the ranks that raised or sent no report."""
        return {r.rank: r.error or f"no report ({r.status})" for r in self.ranks if r.error or r.report is None}

    @property
    def peaks(self) -> dict[int, int]:
        return {r.rank: r.report.peak.total for r in self.measured}  # type: ignore[union-attr]

    @property
    def imbalance(self) -> Imbalance | None:
        """The spread of the peaks across the measured ranks (``None`` with fewer than two)."""
        measured = self.measured
        if len(measured) < 2:
            return None
        peaks = [(r.report.peak.total, r.rank) for r in measured]  # type: ignore[union-attr]
        hi, lo = max(peaks), min(peaks)
        by_cat = {}
        for c in CATEGORIES:
            values = [r.report.peak[c] for r in measured]  # type: ignore[union-attr]
            by_cat[c] = max(values) - min(values)
        return Imbalance(largest=hi[0], smallest=lo[0], largest_rank=hi[1], smallest_rank=lo[1], by_category=by_cat)

    def with_estimate(self, estimate: Any) -> RankReports:
        """The same reports with ``estimate`` shown beside each rank's peak."""
        if estimate is not None and not isinstance(getattr(estimate, "peak", None), Mapping):
            raise TypeError(f"estimate must be a vram_magic estimate (with a peak breakdown), not "
                            f"{type(estimate).__name__}")
        return replace(self, estimate=estimate)

    def estimate_world(self) -> int | None:
        """The number of ranks the attached estimate was made for (1: unsharded, each rank holds everything)."""
        opts = getattr(self.estimate, "options", None)
        if self.estimate is None:
            return None
        return int(getattr(opts, "world", 1) or 1) if getattr(opts, "zero", None) else 1

    def compare(self, estimate: Any = None) -> pd.DataFrame:
        """One row per rank: measured peak, the estimate, the error (bytes and %), and the peak per category."""
        import pandas as pd

        est = estimate if estimate is not None else self.estimate
        rows = []
        for r in self.ranks:
            row: dict[str, Any] = {"rank": r.rank}
            peak = r.peak
            row["peak"] = peak.total if peak is not None else None
            if est is not None:
                row["estimate"] = est.peak.total
                row["error"] = est.peak.total - peak.total if peak is not None else None
                row["error %"] = 100.0 * (est.peak.total - peak.total) / peak.total if peak else float("nan")
            for c in CATEGORIES:
                row[c] = peak[c] if peak is not None else None
            row["status"] = r.status if r.error is None else f"error: {r.error}"
            rows.append(row)
        return pd.DataFrame(rows).set_index("rank")

    # --- files -------------------------------------------------------------------------------------
    def save(self, directory: str | os.PathLike[str]) -> str:
        """Write one ``rank-NNNNN.json`` per rank into ``directory`` (created); ``python -m vram_magic ranks DIR``
        and :meth:`load` read it back."""
        path = os.fspath(directory)
        os.makedirs(path, exist_ok=True)
        for r in self.ranks:
            write_rank_file(path, r)
        return path

    @classmethod
    def load(cls, directory: str | os.PathLike[str], *, world: int | None = None, title: str | None = None,
             launcher: str = "") -> RankReports:
        """Read the per-rank files of ``directory``; ranks below ``world`` (default: the largest world a file
        names) without a file are listed as missing."""
        path = os.fspath(directory)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"no such folder: {path!r}")
        found: dict[int, RankReport] = {}
        bad: list[str] = []
        for name in sorted(os.listdir(path)):
            if not (name.startswith("rank-") and name.endswith(".json")):
                continue
            try:
                with open(os.path.join(path, name), "rb") as f:
                    r = RankReport.from_json(f.read())
            except (OSError, ValueError, KeyError, TypeError) as err:
                bad.append(f"{name} ({type(err).__name__})")
                continue
            if r.rank not in found or found[r.rank].status != "complete":
                found[r.rank] = r
        n = max([world or 0] + [r.world for r in found.values()] + [k + 1 for k in found])
        ranks = tuple(found.get(k) or RankReport(rank=k, world=n, status="missing",
                                                 error="no report: the rank did not start measuring, or was killed "
                                                       "before it could write one") for k in range(n))
        notes = (f"unreadable files: {', '.join(bad)}",) if bad else ()
        launched = sorted({r.launched_by for r in ranks if r.launched_by})
        return cls(ranks=ranks, title=title or f"ranks of {path}", launcher=launcher or ", ".join(launched),
                   notes=notes)

    # --- rendering ---------------------------------------------------------------------------------
    def _text(self) -> str:
        from .render import ranks_text

        return ranks_text(self)

    def _html(self) -> str:
        from .render import ranks_html

        return ranks_html(self)


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def write_rank_file(directory: str, report: RankReport) -> str:
    """Write ``report`` atomically (a reader never sees half a file)."""
    path = os.path.join(directory, rank_file_name(report.rank))
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(report.to_json())
    os.replace(tmp, path)
    return path
