"""Export a cell's history in PyTorch's memory-snapshot format, and replay such a snapshot.

The pickle has ``segments`` (blocks alive at the end) and ``device_traces`` (``alloc`` / ``free_completed``
entries with ``addr``, ``size``, ``frames`` and our ``category``), so PyTorch's memory viewer
(``torch.cuda._memory_viz`` or its web page) opens CPU cells too. ``replay`` is the same event model read
back: it is how a CUDA cell's peak is found from the allocator's own history without resetting counters.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..core.events import peak_of

if TYPE_CHECKING:
    from ..core.events import Block
    from .report import CellReport

_SYNTHETIC_BASE = 0x7F00_0000_0000  # blocks get addresses from their serials (the tracker keeps no pointers)


def device_index(device: str) -> int:
    return int(device.split(":")[1]) if ":" in device else 0


def _frames(block: Block) -> list[dict[str, Any]]:
    return [{"filename": f, "line": line, "name": name} for f, line, name in block.site]


def to_snapshot(report: CellReport) -> dict[str, Any]:
    trace = report.trace
    if trace is None:
        raise ValueError("this report has no allocation history (it was measured with --no-trace off?)")
    index = device_index(report.device)

    def addr(block: Block) -> int:
        # one address per block, distinct from every other block's (the viewer pairs alloc and free by it)
        return _SYNTHETIC_BASE + block.serial * 512

    events = []
    for ev in trace.events:
        b = trace.blocks[abs(ev)]
        a = addr(b)
        entry = {"action": "alloc" if ev > 0 else "free_completed", "addr": a, "size": b.size, "stream": 0,
                 "frames": _frames(b), "category": b.category, "label": b.label}
        events.append(entry)
    if report.oom is not None:
        events.append({"action": "oom", "addr": 0, "size": report.oom.requested or 0, "stream": 0,
                       "frames": [{"filename": f, "line": n, "name": m} for f, n, m in report.oom.site],
                       "device_free": max((report.oom.capacity or 0) - report.oom.live.total, 0)})
    segments = []
    for serial in sorted(trace.alive_at(len(trace.events))):
        b = trace.blocks[serial]
        a = addr(b)
        block = {"address": a, "size": b.size, "requested_size": b.size, "state": "active_allocated",
                 "frames": _frames(b)}
        segments.append({"device": index, "address": a, "total_size": b.size, "allocated_size": b.size,
                         "active_size": b.size, "requested_size": b.size, "stream": 0, "segment_type": "large",
                         "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": [block]})
    for i, (cat, label, n) in enumerate(trace.base):  # storages alive throughout, one block per holder
        a = _SYNTHETIC_BASE - (i + 1) * 2**40
        block = {"address": a, "size": n, "requested_size": n, "state": "active_allocated", "frames": [],
                 "category": cat, "label": f"{label} (alive before the cell)"}
        segments.append({"device": index, "address": a, "total_size": n, "allocated_size": n, "active_size": n,
                         "requested_size": n, "stream": 0, "segment_type": "large", "segment_pool_id": (0, 0),
                         "is_expandable": False, "frames": [], "blocks": [block]})
    if any("category" in e for e in events):
        # PyTorch's viewer (MemoryViz.js) colours by category and adds 'unknown' (for blocks that have none, such
        # as those alive before the trace) only through a misspelt name that throws: a snapshot whose trace
        # names categories must name 'unknown' too, as PyTorch's own do. A 'snapshot' entry (the moment the
        # snapshot was taken, which PyTorch records too) carries it without touching memory.
        events.append({"action": "snapshot", "addr": 0, "size": 0, "stream": 0, "frames": [], "category": "unknown"})
    device_traces: list[list[dict[str, Any]]] = [[] for _ in range(index + 1)]
    device_traces[index] = events
    return {"segments": segments, "device_traces": device_traces, "allocator_settings": {},
            "vram_magic": {"device": report.device, "cell": report.cell}}


def save_snapshot(report: CellReport, path: str) -> str:
    with open(path, "wb") as f:
        pickle.dump(to_snapshot(report), f)
    return path


def replay(snapshot: Mapping[str, Any], device: int = 0, since: int = 0) -> tuple[int, int, int]:
    """``(start, peak, peak_entry)``: bytes live before the trace, the highest, and the number of trace
    entries applied at the peak. ``since`` skips the first entries. Works for PyTorch's own snapshots and for ours.

    One unit throughout, the one the trace is written in: ``alloc`` and ``free_*`` entries carry the *requested*
    size (``c10/cuda/CUDACachingAllocator.cpp``), so the blocks alive at the end count their ``requested_size``
    (ours equal their ``size``). A block is gone at ``free_requested`` where the trace has those (PyTorch's: a
    block still in use on another stream reaches ``free_completed`` later and is ``active_pending_free`` in the
    segments meanwhile), else at ``free_completed`` (ours). ``oom``, ``segment_*`` and ``snapshot`` entries change
    nothing. (A CUDA cell's peak in the allocator's block sizes is ``engine.cuda_history``'s job.)"""
    end = 0
    for seg in snapshot.get("segments", ()):
        if seg.get("device", 0) != device:
            continue
        for block in seg.get("blocks", ()):
            if block.get("state") == "active_allocated":
                end += int(block.get("requested_size", block["size"]))
    traces = snapshot.get("device_traces", ())
    entries = traces[device][since:] if device < len(traces) else []
    frees = "free_requested" if any(e["action"] == "free_requested" for e in entries) else "free_completed"
    deltas = [e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == frees else 0 for e in entries]
    start = end - sum(deltas)
    peak, peak_entry = peak_of(deltas, start)
    return start, peak, peak_entry
