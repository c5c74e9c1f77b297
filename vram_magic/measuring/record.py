"""From a finished block to its :class:`~vram_magic.measuring.report.CellReport`: the trace (``cell_trace``), before,
after and the peak split by category, reconciled on CUDA with what the allocator itself holds, the out-of-memory
details, the notes and the advice.

:class:`BlockStart` is what ``Measurement.__enter__`` learnt, :class:`BlockEnd` what ``__exit__`` collected;
:func:`build_report` reads nothing else but the block's settings (device, budget, cell, source, backend).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from ..core.breakdown import Breakdown
from ..core.events import Trace
from ..core.host import HostUsage
from ..engine.cuda import device as cuda
from ..engine.profiler.kernel_scratch import add_scratch, sizes_of, spikes, window_events
from ..engine.profiler.recorder import ReplayedBlock
from ..engine.scan.attribution import Scan
from ..engine.scan.categories import UNATTRIBUTED, holder_name
from ..engine.scan.frame_namespace import add_other
from ..engine.scan.registry import LiveStorages
from ..engine.scan.summed import Counted
from ..engine.tracker.counts import StorageCounts
from ..engine.tracker.frames import SiteNamer
from ..engine.tracker.mode import PHASE_NAMES, Tracker
from .cell_trace import alive_replayed, alive_tracked, block_trace, live_rows
from .report import CellReport, OomInfo


class BlockSettings(Protocol):
    """What a block was asked to measure (``Measurement`` has these)."""

    device: str
    budget: int | None
    previous: CellReport | None
    cell: int | None
    source: str
    cell_files: Mapping[str, int] | None
    backend: str
    backend_reason: str


@dataclass
class BlockStart:
    """What a block knew when it started: the registry it counts in, the namespace scan, the storages counted as
    groups or one by one (``counted``) and the split before (``rows``)."""

    registry: LiveStorages
    scan: Scan
    counted: Counted
    rows: dict[tuple[str, str], int]


@dataclass
class BlockEnd:
    """What a block left: its backend's record (``tracker`` or ``replayed``), the namespace scan after it (taken
    after an out-of-memory traceback's frames were released), the kernel scratch's events, the CUDA side."""

    scan: Scan
    wall: float
    exc_type: type[BaseException] | None
    exc: BaseException | None
    tracker: Tracker | None = None
    replayed: ReplayedBlock | None = None
    scratch_roots: Any = None
    cuda_cell: cuda.CudaCell | None = None
    notes: list[str] = field(default_factory=list)
    host: HostUsage | None = None


def kernel_scratch_notes(tracker: Tracker, roots: Any) -> list[str]:
    """What the CPU kernels of the block's ops allocated inside themselves, into the tracker's history
    (engine/profiler/kernel_scratch.py); the notes when it could not be measured."""
    recorder, counts = tracker.scratch.recorder, tracker.counts
    assert recorder is not None
    if recorder.refused:
        return ["kernel scratch inside ops was not measured: another profiler was recording (PyTorch runs one "
                "at a time)"]
    if not recorder.started or counts.truncated:  # no timed op ran (or the history is incomplete)
        return []
    if roots is None:
        return ["PyTorch's profiler was started inside the block and ended the recording of kernel scratch: "
                "the peak counts only the tensors of the ops it times"]
    windows = tracker.scratch.windows
    add_scratch(counts, spikes(window_events(roots, windows), windows, sizes_of(counts), counts.events),
                tracker.generation.steps)
    return []


def reconcile(cell: cuda.CudaCell | None, device: str, before: Breakdown, after: Breakdown, peak: Breakdown,
              notes: list[str]) -> tuple[Breakdown, Breakdown, Breakdown]:
    """On CUDA, add what the allocator holds beyond the tracked storages (workspaces, kernel scratch, unsplit
    remainders of blocks) to before, after and the peak alike: all three in the allocator's blocks."""
    if cell is not None:
        notes.extend(cell.notes)
    usage = cell.usage.get(device) if cell is not None else None
    if usage is None:  # CUDA not initialised, before the block and after it
        return before, after, peak
    label = "allocator: workspaces, rounding and untracked"
    if usage.before > before.total:
        before = add_other(before, label, usage.before - before.total)
    if usage.after > after.total:
        after = add_other(after, label, usage.after - after.total)
    if usage.peak > peak.total:
        peak = add_other(peak, "allocator: kernel scratch, rounding and untracked", usage.peak - peak.total)
    return before, after, peak


def oom_info(block: BlockSettings, source: StorageCounts | ReplayedBlock, trace: Trace, index: int, end: BlockEnd,
             notes: list[str]) -> OomInfo:
    """Who held what when the block ran out of memory, and the request that failed."""
    info = source.oom or {}
    exc = end.exc
    if not info.get("requested") and exc is not None:  # raised by the CUDA allocator itself
        traced = end.cuda_cell.oom_request if end.cuda_cell is not None else None
        requested, note = cuda.oom_requested(str(exc), traced)
        info = {**info, "requested": requested}
        if note:
            notes.append(note)
    live = trace.breakdown_at(index)
    names = source.oom_holders
    holders: dict[str, int] = {}
    for _, label, n in trace.base:
        name = holder_name(label)
        if name:
            holders[name] = holders.get(name, 0) + n
    for serial in trace.alive_at(index):
        b = trace.blocks[serial]
        name = names.get(serial) or holder_name(b.label)
        if name:
            holders[name] = holders.get(name, 0) + b.size
    return OomInfo(
        message=str(exc) if exc is not None else "",
        requested=info.get("requested"),
        capacity=block.budget if block.budget is not None else cuda.capacity(block.device),
        live=live,
        holders=tuple(sorted(holders.items(), key=lambda kv: -kv[1])),
        site=SiteNamer(block.cell_files)(info.get("site", ())),
        phase=PHASE_NAMES[info["phase"]] if "phase" in info else "",
    )


def _backend_notes(block: BlockSettings, start: BlockStart, end: BlockEnd,
                   source: StorageCounts | ReplayedBlock) -> list[str]:
    notes = list(end.notes)
    if source.truncated:
        notes.append("history was truncated after 2,000,000 events; the peak split is approximate")
    notes.extend(start.scan.notes)
    notes.extend(n for n in end.scan.notes if n not in start.scan.notes)
    if block.backend == "allocator":
        notes.append(f"measured at the allocator ({block.backend_reason}): memory is split by phase, not by "
                     "line or module")
    elif block.backend_reason and block.backend_reason != "asked for":
        notes.append(block.backend_reason)
    return notes


def build_report(block: BlockSettings, start: BlockStart, end: BlockEnd) -> CellReport:
    """The block's report (with its advice) from what it started with and what it left."""
    tracker, replayed = end.tracker, end.replayed
    counts = tracker.counts if tracker is not None else None
    source: StorageCounts | ReplayedBlock | None = counts if counts is not None else replayed
    assert source is not None
    scratch = kernel_scratch_notes(tracker, end.scratch_roots) \
        if tracker is not None and tracker.scratch.recorder is not None else []
    oom_index = (source.oom or {}).get("index", len(source.events))
    is_oom = end.exc_type is not None and issubclass(end.exc_type, torch.OutOfMemoryError)
    expanded = start.counted.settle(counts, end.scan)
    if counts is not None:
        alive = alive_tracked(start.counted, counts)
    else:
        assert replayed is not None
        alive = alive_replayed(start.registry, block.device, replayed)
    trace = block_trace(block.device, source, (start.scan, end.scan), alive, expanded, start.counted, counts,
                        tracker.generation.steps if tracker is not None else (),
                        block.cell_files)
    stats_after = cuda.device_stats(block.device) if block.device.startswith("cuda") else None
    after = trace.breakdown_at(len(trace.events)) if not trace.truncated else Breakdown.from_rows(
        live_rows(start.registry, block.device, end.scan, source.allocs))
    peak = after if trace.peak_index == len(trace.events) else trace.breakdown_at(trace.peak_index)
    notes = scratch + _backend_notes(block, start, end, source)
    before_rows = dict(start.rows)
    for size in source.late.values():
        before_rows[UNATTRIBUTED] = before_rows.get(UNATTRIBUTED, 0) + size
    before, after, peak = reconcile(end.cuda_cell, block.device, Breakdown.from_rows(before_rows), after, peak, notes)
    base = block.previous.after if block.previous is not None else before
    oom = oom_info(block, source, trace, oom_index, end, notes) if is_oom else None
    from .advice import advise

    report = CellReport(
        device=block.device,
        before=before,
        after=after,
        peak=peak,
        delta=after - base,
        cell=block.cell,
        previous=block.previous.cell if block.previous is not None else None,
        wall_time=end.wall,
        capacity=block.budget if block.budget is not None else cuda.capacity(block.device),
        budget=block.budget,
        stats=stats_after,
        error=None if end.exc_type is None else f"{end.exc_type.__name__}: {end.exc}",
        oom=oom,
        notes=tuple(dict.fromkeys([*notes, *([end.host.warning()] if end.host and end.host.near_limit else [])])),
        source=block.source,
        trace=trace,
        backend=block.backend,
        host=end.host,
    )
    return replace(report, advice=tuple(advise(report)))


__all__ = ["BlockEnd", "BlockSettings", "BlockStart", "build_report", "kernel_scratch_notes", "oom_info",
           "reconcile"]
