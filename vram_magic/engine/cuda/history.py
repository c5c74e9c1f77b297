"""A cell's part of the caching allocator's history, replayed in the allocator's own unit (block sizes).

``torch.cuda.memory._snapshot()`` returns ``device_traces`` (one list of entries per device) and ``segments``
(``torch/csrc/cuda/memory_snapshot.cpp``). Entries are written by ``record_trace`` in
``c10/cuda/CUDACachingAllocator.cpp``:

* ``alloc`` carries the *requested* size (``orig_size``), ``free_requested`` and ``free_completed`` the block's
  requested size; ``allocated_bytes`` — what ``memory_allocated`` reports — counts *block* sizes (the request
  rounded to 512 bytes, plus an unsplit remainder of up to 1 MiB for large blocks) and drops a block at
  ``free_requested``: a block freed while still in use on another stream (``record_stream``) only reaches
  ``free_completed`` later. Replaying allocs against ``free_requested`` in block sizes gives
  ``allocated_bytes`` entry by entry.
* ``segment_alloc`` / ``segment_free`` (``segment_map`` / ``segment_unmap`` with expandable segments) carry the
  segment's size, ``oom`` carries ``device_free`` and the rounded request, ``snapshot`` the active total.

The entries are a ring buffer of ``max_entries``: a long cell, or a user's recording with ``enabled="state"``
(which keeps one entry), loses its start. The cell's entries are found by counting: the allocator's cumulative
counters (``memory_stats()``) say how many allocations, frees and segment calls the cell made.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .alloc_conf import DEFAULT_SETTINGS, AllocatorSettings
from .caching_allocator import block_size, round_size

#: memory_stats() keys whose growth over a cell counts its trace entries, by the action each one writes
COUNTERS: dict[str, tuple[str, ...]] = {
    "alloc": ("allocation.all.allocated",),
    "free_requested": ("allocation.all.freed",),
    "free_completed": ("active.all.freed",),
    "segment": ("num_device_alloc", "num_device_free"),
    "oom": ("num_ooms",),
}
_SEGMENT_ACTIONS = ("segment_alloc", "segment_free", "segment_map", "segment_unmap")


def expected_entries(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, int] | None:
    """How many entries of each kind the cell added to the trace, from two ``memory_stats()`` dicts; ``None``
    when the counters are missing (another allocator backend) or went backwards (reset during the cell)."""
    out: dict[str, int] = {}
    for action, keys in COUNTERS.items():
        n = 0
        for key in keys:
            if key not in before or key not in after:
                return None
            d = int(after[key]) - int(before[key])
            if d < 0:
                return None
            n += d
        out[action] = n
    return out


def _kind(action: str) -> str:
    return "segment" if action in _SEGMENT_ACTIONS else action


@dataclass(frozen=True)
class Window:
    """The cell's entries of one device's trace: ``entries[start:]``; ``complete`` when all of them are there
    (the buffer did not wrap past the cell's start), ``counted`` when the counters confirmed the count."""

    start: int
    complete: bool
    counted: bool
    expected: int


def cell_window(entries: Sequence[Mapping[str, Any]], expected: Mapping[str, int] | None,
                since: int | None = None) -> Window:
    """Which of ``entries`` are the cell's. With ``expected`` (from :func:`expected_entries`): counted back from
    the end, as many entries of the counted kinds as the cell made (entries no counter covers — ``snapshot``,
    annotations — ride along); if the buffer holds fewer, it wrapped (or keeps one entry) and the window is
    incomplete. Without ``expected``: ``entries[since:]`` (a history the cell started itself)."""
    if expected is None:
        return Window(since or 0, since is not None, False, len(entries) - (since or 0))
    total = sum(expected.values())
    seen: dict[str, int] = dict.fromkeys(expected, 0)
    counted = 0
    start = len(entries)
    while counted < total and start > 0:
        start -= 1
        k = _kind(entries[start].get("action", ""))
        if k in seen:
            seen[k] += 1
            counted += 1
    if counted < total:
        return Window(0, False, False, total)
    return Window(start, True, seen == dict(expected), total)


def _proven_skipped(entries: Sequence[Mapping[str, Any]], absent: set[str]) -> bool:
    """Whether the trace itself shows that one of the ``absent`` kinds was never recorded (rather than lost to a
    wrapped buffer, which drops only the oldest entries): a block freed (``free_completed``) after its ``alloc``
    with no ``free_requested`` between, an address allocated again after a ``free_requested`` with no
    ``free_completed`` between, or freed twice with no ``alloc`` between."""
    last: dict[int, str] = {}
    for e in entries:
        action = e.get("action", "")
        if action not in ("alloc", "free_requested", "free_completed"):
            continue
        addr = int(e.get("addr", 0))
        before = last.get(addr)
        if (("free_requested" in absent and action == "free_completed" and before == "alloc")
                or ("free_completed" in absent and action == "alloc" and before == "free_requested")
                or ("alloc" in absent and action == "free_requested" and before in ("free_requested",
                                                                                      "free_completed"))):
            return True
        last[addr] = action
    return False


def skipped_actions(entries: Sequence[Mapping[str, Any]], expected: Mapping[str, int] | None) -> tuple[str, ...]:
    """The kinds of entries a user's recording leaves out (``_record_memory_history(skip_actions=[...])``, PyTorch
    2.6 on): kinds the counters say the cell wrote of which the whole trace holds none, once the trace proves one
    of them skipped (:func:`_proven_skipped`) and every entry the cell wrote of the other kinds is there."""
    if not expected:
        return ()
    present = {_kind(e.get("action", "")) for e in entries}
    missing = tuple(k for k, n in expected.items() if n and k not in present)
    if not missing or not _proven_skipped(entries, set(missing)):
        return ()
    rest = {k: 0 if k in missing else n for k, n in expected.items()}
    return missing if cell_window(entries, rest).complete else ()


def end_blocks(segments: Sequence[Mapping[str, Any]], device: int) -> dict[int, int]:
    """address → size of the blocks allocated (``active_allocated``) on ``device`` in a snapshot's
    ``segments``."""
    out: dict[int, int] = {}
    for seg in segments:
        if seg.get("device", 0) != device:
            continue
        addr = int(seg.get("address", 0))
        for block in seg.get("blocks", ()):
            a = int(block.get("address", addr))
            if block.get("state") == "active_allocated":
                out[a] = int(block["size"])
            addr = a + int(block["size"])
    return out


@dataclass(frozen=True)
class HistoryReplay:
    """A replay of the cell's entries in block sizes. ``start`` is the level before them, ``peak`` the highest
    level and ``peak_entry`` the number of entries applied there, ``end`` the level after them; ``estimated``
    counts the large blocks whose size the trace does not determine (taken as their rounded request: each may
    be up to 1 MiB larger, more with ``max_split_size_mb``); ``slack``: by how much the levels may read high
    (frees of such blocks made before the window, taken as their rounded request); ``live_peak``: the most blocks
    alive at once, above those alive before (``allocation.all.current`` counts them); ``frees``: the action the
    frees were read from; ``oom`` is the rounded size of the last failed request."""

    start: int
    peak: int
    peak_entry: int
    end: int
    entries: int
    estimated: int
    oom: int | None
    slack: int = 0
    live_peak: int = 0
    frees: str = "free_requested"


def replay_blocks(entries: Sequence[Mapping[str, Any]], *, start: int | None = None, end: int | None = None,
                  blocks_at_end: Mapping[int, int] | None = None,
                  settings: AllocatorSettings = DEFAULT_SETTINGS) -> HistoryReplay:
    """Replay ``entries`` (the cell's window) in block sizes, from ``start`` bytes allocated (the counters
    before the cell) or back from ``end`` (the counters after it; for a window that lost its start), under the
    allocator's ``settings`` (the snapshot's ``allocator_settings``).

    A block's size is known exactly when it is small (requests of up to 1 MiB are always split off at their
    rounded size), with expandable segments (every block is split at its rounded size), when a segment was made
    for it (the ``segment_alloc`` just before it, at its address), or when it is still allocated at the end
    (``blocks_at_end``, from the snapshot's segments). Otherwise it is its rounded request. Frees apply at
    ``free_requested`` (where ``allocated_bytes`` drops); a trace without any (``skip_actions``) frees at
    ``free_completed``."""
    blocks_at_end = blocks_at_end or {}
    frees = "free_requested" if any(e.get("action") == "free_requested" for e in entries) else "free_completed"
    last_alloc: dict[int, int] = {}
    for i, e in enumerate(entries):
        if e.get("action") == "alloc":
            last_alloc[int(e["addr"])] = i
    live: dict[int, int] = {}
    deltas: list[int] = []
    estimated = slack = 0
    count = live_peak = 0
    new_segment: dict[int, int] = {}
    oom = None
    for i, e in enumerate(entries):
        action = e.get("action")
        if action in ("segment_alloc", "segment_map"):
            new_segment[int(e["addr"])] = int(e["size"])
            deltas.append(0)
        elif action == "alloc":
            addr, request = int(e["addr"]), int(e["size"])
            segment = new_segment.pop(addr, None)
            if last_alloc.get(addr) == i and addr in blocks_at_end:
                size = blocks_at_end[addr]
            elif segment is not None:
                size = block_size(request, segment, settings)
            else:
                size = round_size(request, settings)
                if settings.max_remainder(size):
                    estimated += 1
            live[addr] = size
            deltas.append(size)
            count += 1
            live_peak = max(live_peak, count)
        elif action == frees:
            addr = int(e["addr"])
            size = live.pop(addr, None)
            if size is None:  # allocated before the window
                size = round_size(int(e["size"]), settings)
                extra = settings.max_remainder(size)
                if extra:
                    estimated += 1
                    slack += extra
            deltas.append(-size)
            count -= 1
        else:
            if action == "oom":
                oom = int(e["size"])
            deltas.append(0)
    total = sum(deltas)
    if start is None:
        start = (end if end is not None else 0) - total
    level = peak = start
    peak_entry = 0
    for i, d in enumerate(deltas, 1):
        level += d
        if level > peak:
            peak, peak_entry = level, i
    return HistoryReplay(start, peak, peak_entry, start + total, len(entries), estimated, oom, slack, live_peak,
                         frees)


__all__ = ["COUNTERS", "HistoryReplay", "Window", "cell_window", "end_blocks", "expected_entries",
           "replay_blocks", "skipped_actions"]
