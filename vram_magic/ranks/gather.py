"""``vram_magic.gather(report)``: every rank's report, collected on one rank through the job's own process group.

Each rank puts its report (JSON, a few KiB) into the key-value store its process group rendezvoused through
(the ``TCPStore`` that ``init_process_group`` or ``torchrun`` set up: no new connection, thread or file); the
destination rank reads every rank's key with a deadline. So a rank that raised before reaching ``gather``, hung
in a collective or died is reported as such, and the others' reports still arrive without waiting for the
process group's own timeout (30 minutes by default). Nothing is put on the GPU, so gathering never shows in
the memory it reports.

Why not a collective (``gather_object``, or point-to-point sends): a collective completes for every rank or
fails for all of them, so one missing rank costs everybody's reports; and once a gloo collective has timed out
its connections are closed, so the reports of the ranks that waited could not travel either. The collective
is still there for those who want it: ``via="collective"``.
"""

from __future__ import annotations

import time
import warnings
from datetime import timedelta
from typing import Any

from ..engine.torch_private import group_store_entry
from ..measuring.report import CellReport
from .result import RankReport, RankReports, rank_report

DEFAULT_TIMEOUT = 300.0


def _as_rank_report(report: Any, rank: int, world: int, backend: str) -> RankReport:
    from ..measuring.measurement import Measurement

    if isinstance(report, RankReport):
        return report
    if isinstance(report, Measurement):
        if report.report is None:
            return rank_report(None, rank=rank, world=world, backend=backend, ended="gather", status="missing",
                               error="the measurement of this rank has not finished, or its report could not be "
                                     "built")
        report = report.report
    if isinstance(report, CellReport):
        return rank_report(report, rank=rank, world=world, backend=backend, ended="gather")
    if isinstance(report, BaseException):
        return rank_report(None, rank=rank, world=world, backend=backend, ended="gather", status="missing",
                           error=f"{type(report).__name__}: {report}")
    if report is None:
        return rank_report(None, rank=rank, world=world, backend=backend, ended="gather", status="missing",
                           error="this rank has no report to send")
    raise TypeError(f"gather() takes a vram_magic.measure() result, a report, or the exception the rank raised, not "
                    f"{type(report).__name__}")


def _store(group: Any) -> Any:
    """The key-value store the group rendezvoused through (prefixed for that group)."""
    entry = group_store_entry(group)
    if entry is None or entry[1] is None:
        raise RuntimeError("vram_magic.gather(): this process group has no store to gather through; pass "
                           "via='collective'")
    return entry[1]


_calls = [0]  # gather() calls in this process: the n-th call of every rank shares its keys


def gather(report: Any = None, *, dst: int = 0, group: Any = None, timeout: float = DEFAULT_TIMEOUT,
           via: str = "store") -> RankReports | None:
    """Collect every rank's report on rank ``dst`` (of ``group``, default: the whole job).

    Call it in every rank, after the measured block::

        try:
            with vram_magic.measure() as m:
                train_step()
        finally:
            per_rank = vram_magic.gather(m)   # RankReports on rank 0, None on the others

    ``report``: the ``measure()`` result (or its report; or the exception the rank raised, to report that
    instead). Returns a :class:`~vram_magic.ranks.result.RankReports` ordered by rank on ``dst`` — complete:
    a rank that sent nothing within ``timeout`` seconds is in it with its error — and ``None`` elsewhere.
    ``via``: ``"store"`` (default; see the module's docstring) or ``"collective"`` (``gather_object`` over the
    group: every rank must arrive, and the process group's own timeout applies).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("vram_magic.gather() needs a torch.distributed process group: call it in every rank, "
                           "after torch.distributed.init_process_group()")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
    if via not in ("store", "collective"):
        raise ValueError(f"via must be 'store' or 'collective', not {via!r}")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if not isinstance(dst, int) or isinstance(dst, bool) or not 0 <= dst < world:
        raise ValueError(f"dst must be a rank of the group (0 … {world - 1}), not {dst!r}")
    backend = str(dist.get_backend(group))
    mine = _as_rank_report(report, rank, world, backend)
    if mine.rank != rank:
        raise ValueError(f"this report is rank {mine.rank}'s, but this process is rank {rank}")
    if via == "collective":
        got = _collective(mine, rank, world, dst, group)
    else:
        got = _through_store(mine, rank, world, dst, group, timeout)
    if got is None:
        return None
    return RankReports(ranks=tuple(got[k] for k in range(world)), title="vram_magic.gather",
                       wall_time=max((r.report.wall_time for r in got.values() if r.report is not None), default=0.0))


def _through_store(mine: RankReport, rank: int, world: int, dst: int, group: Any,
                   timeout: float) -> dict[int, RankReport] | None:
    store = _store(group)
    _calls[0] += 1
    prefix = f"vram_magic/gather/{_calls[0]}/"
    if rank != dst:
        try:
            store.set(prefix + str(rank), mine.to_json())
        except Exception as err:  # the store's host (rank 0, or torchrun's agent) is gone: this rank goes on
            warnings.warn(f"vram_magic.gather(): rank {rank} could not hand over its report "
                          f"({type(err).__name__}: {err})", RuntimeWarning, stacklevel=3)
        return None
    started = time.monotonic()
    got: dict[int, RankReport] = {rank: mine}
    for src in range(world):
        if src == rank:
            continue
        key = prefix + str(src)
        left = max(timeout - (time.monotonic() - started), 0.001)
        try:
            store.wait([key], timedelta(seconds=left))
        except Exception as err:
            timed_out = "timeout" in str(err).lower() or "timed out" in str(err).lower()
            got[src] = RankReport(rank=src, world=world, status="missing", error=(
                f"no report within {timeout:g} s: the rank raised before calling gather(), is still running, hung "
                "(in a collective another rank left) or died" if timed_out else
                f"no report: {type(err).__name__}: {_first_line(err)}"))
            continue
        try:
            got[src] = RankReport.from_json(store.get(key))
            store.delete_key(key)
        except Exception as err:
            got[src] = RankReport(rank=src, world=world, status="missing",
                                  error=f"no report: its report could not be read ({type(err).__name__}: "
                                        f"{_first_line(err)})")
    return got


def _collective(mine: RankReport, rank: int, world: int, dst: int, group: Any) -> dict[int, RankReport] | None:
    import torch.distributed as dist

    out: list[Any] | None = [None] * world if rank == dst else None
    dist.gather_object(mine.to_json().decode(), out, dst=_global(group, dst), group=group)
    if out is None:
        return None
    return {k: RankReport.from_json(raw) for k, raw in enumerate(out)}


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else ""


def _global(group: Any, rank: int) -> int:
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        return rank
    return int(dist.get_global_rank(group, rank))
