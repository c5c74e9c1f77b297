"""What a cell did to one CUDA device, from plain data: two ``memory_stats()`` dicts (before and after the cell)
and the ``torch.cuda.memory._snapshot()`` taken at its end, in the allocator's own unit (blocks).

The peak is the largest of: the replayed history (``cuda_history``), the global peak counter when it rose during
the cell, before and after. The counter bounds the replay from above — unless the cell reset it: c10's
``reset_peak_stat`` (``c10/cuda/CUDACachingAllocator.cpp``, called by ``torch.cuda.reset_peak_memory_stats()``)
sets every stat's ``peak`` to its ``current``, so after a reset the counter has only seen the rest of the cell,
and the replay is the truth (:func:`peak_was_reset`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...core.units import format_bytes
from .alloc_conf import AllocatorSettings, settings_from_snapshot
from .history import HistoryReplay, cell_window, end_blocks, expected_entries, replay_blocks, skipped_actions


@dataclass(frozen=True)
class DeviceUsage:
    """One device over a cell, in the allocator's blocks: allocated ``before``, ``after`` and at the cell's
    ``peak``; ``touched`` when the cell allocated or freed on it; ``reset`` when the cell reset the peak
    counter."""

    device: str
    before: int
    after: int
    peak: int
    touched: bool
    oom: int | None = None
    notes: tuple[str, ...] = ()
    reset: bool = False


def touched(before: Mapping[str, Any], after: Mapping[str, Any]) -> bool:
    """Whether a cell allocated or freed on a device, from two ``memory_stats()`` dicts (cumulative counters of
    the native allocator; the current and peak bytes, all ``cudaMallocAsync`` reports)."""
    keys = ("allocation.all.allocated", "allocation.all.freed", "allocated_bytes.all.current",
            "allocated_bytes.all.peak", "num_ooms")
    return any(int(after.get(k, 0)) != int(before.get(k, 0)) for k in keys)


def peak_was_reset(before: Mapping[str, Any], after: Mapping[str, Any], replay: HistoryReplay | None = None) -> bool:
    """Whether the peak counters were reset during the cell. A peak never falls and is never below the current
    value, except through ``reset_peak_stat`` (``peak = current``): so a reset shows as any ``*.peak`` lower after
    the cell than before it, or, with the cell's history replayed from its start, as more blocks alive at once
    than ``allocation.all.peak`` says (exact: the replay counts allocs and frees), or a replayed level above
    ``allocated_bytes.all.peak`` by more than the replay's own uncertainty."""
    for key, value in after.items():
        if key.endswith(".peak") and key in before and int(value) < int(before[key]):
            return True
    peak = int(after.get("allocated_bytes.all.peak", 0))
    if int(before.get("allocated_bytes.all.current", 0)) > peak:
        return True
    if replay is None:
        return False
    if replay.frees == "free_requested" and "allocation.all.peak" in after:
        if int(before.get("allocation.all.current", 0)) + replay.live_peak > int(after["allocation.all.peak"]):
            return True
    return replay.peak - replay.slack > peak


def _window_replay(device: str, index: int, before: Mapping[str, Any], after: Mapping[str, Any],
                   snapshot: Mapping[str, Any], history: str, since: int | None, settings: AllocatorSettings,
                   notes: list[str], was: bool) -> HistoryReplay | None:
    """The cell's window of the device's trace replayed (``None`` when nothing usable is left), with the notes
    that say how complete it was."""
    before_alloc = int(before.get("allocated_bytes.all.current", 0))
    after_alloc = int(after.get("allocated_bytes.all.current", 0))
    traces = snapshot.get("device_traces", ())
    entries = traces[index] if index < len(traces) else []
    expected = expected_entries(before, after)
    skipped = skipped_actions(entries, expected) if history == "user" else ()
    if skipped:
        assert expected is not None
        expected = {k: 0 if k in skipped else n for k, n in expected.items()}
        lost = "alloc" in skipped or {"free_requested", "free_completed"} <= set(skipped)
        how = (": the cell's peak comes from the counters" if lost else
               ": frees are replayed when completed (a block another stream still used counts until it is done)"
               if "free_requested" in skipped else "")
        notes.append(f"your memory-history recording leaves out {', '.join(skipped)} entries (skip_actions); the "
                     f"cell's entries on {device} were counted without them{how}")
        if lost:
            return None
    window = cell_window(entries, expected, since=0 if history == "ours" and since is None else since)
    cell = entries[window.start:]
    blocks = end_blocks(snapshot.get("segments", ()), index)
    if window.complete:
        rep = replay_blocks(cell, start=before_alloc, blocks_at_end=blocks, settings=settings)
        if rep.end != after_alloc and was:
            gap = format_bytes(abs(rep.end - after_alloc))
            notes.append(f"the allocator's history and its counters differ by {gap} at the end of the cell on "
                         f"{device} ({rep.estimated} large block(s) whose unsplit remainder the history does not "
                         "show): the peak may be off by up to that")
        if not window.counted and expected is not None:
            notes.append(f"the allocator's history on {device} did not match its counters (counters reset, or "
                         "actions skipped while recording): the peak from the history is approximate")
        return rep
    if not was:
        return None
    kept = len(cell) if len(entries) > 1 else 0  # a 'state' recording's one entry is no trace
    what = ("your memory-history recording keeps no trace of events (enabled='state', or the legacy switch)"
            if len(entries) <= 1 else
            f"the allocator's history holds {len(entries):,} events and this cell made {window.expected:,}: the "
            "buffer wrapped")
    how = f"replayed from the last {kept:,} events and " if kept else ""
    notes.append(f"{what}; on {device} the cell's peak is {how}taken from the counters (exact when the global peak "
                 "rose during the cell)")
    return replay_blocks(cell, end=after_alloc, blocks_at_end=blocks, settings=settings) if kept else None


def device_usage(device: str, before: Mapping[str, Any] | None, after: Mapping[str, Any],
                 snapshot: Mapping[str, Any] | None, *, history: str | None,
                 since: int | None = None) -> tuple[DeviceUsage, HistoryReplay | None]:
    """The cell on one device. ``before``/``after``: ``memory_stats()`` of that device at the cell's start and
    end (``None`` before: CUDA was initialised by the cell, whose allocator then started at zero). ``snapshot``:
    ``torch.cuda.memory._snapshot()`` at the end (its ``allocator_settings`` size the blocks), ``history``:
    ``"ours"`` (recorded for the cell, cleared when it started), ``"user"`` (the user's own recording), or
    ``None``.

    The peak is the largest of: the replayed history (block sizes), the global peak counter when it rose during
    the cell (then exact), before and after; and never above the global peak counter, unless the cell reset it
    (then the counter saw only the rest of the cell)."""
    index = int(device.split(":")[1]) if ":" in device else 0
    after_alloc = int(after.get("allocated_bytes.all.current", 0))
    global_peak = int(after.get("allocated_bytes.all.peak", after_alloc))
    notes: list[str] = []
    if before is None:  # the allocator was created inside the cell: its counters are the cell's
        used = global_peak > 0
        note = (f"CUDA was initialised by this cell: {device}'s peak is the allocator's own peak counter, which "
                "started with it",) if used else ()
        return DeviceUsage(device, 0, after_alloc, max(global_peak, after_alloc), used, None, note), None
    before_alloc = int(before.get("allocated_bytes.all.current", 0))
    was = touched(before, after)
    candidates = [before_alloc, after_alloc]
    before_peak = int(before.get("allocated_bytes.all.peak", before_alloc))
    rep = None
    if snapshot is not None and history is not None:
        settings = settings_from_snapshot(snapshot.get("allocator_settings"))
        if was and not settings.is_default:
            notes.append(settings.note(f"the allocator's history on {device} was replayed"))
        rep = _window_replay(device, index, before, after, snapshot, history, since, settings, notes, was)
    reset = was and peak_was_reset(before, after, rep)
    if global_peak > before_peak or reset:
        candidates.append(global_peak)  # a level the cell reached: after a reset, or a new global peak
    if rep is not None:
        candidates.append(rep.peak if reset else min(rep.peak, global_peak))
    if reset:
        notes.append(f"the cell reset the allocator's peak counter on {device} (torch.cuda.reset_peak_memory_stats): "
                     + ("the cell's peak is the replayed history's, not the counter's" if rep is not None else
                        "the counter saw only what followed, so the cell's peak may have been higher"))
    elif was and rep is None and global_peak <= before_peak and not notes:
        notes.append(f"without the allocator's history the cell's peak on {device} is the larger of before and after "
                     "(the global peak counter did not rise; it was left untouched)")
    return DeviceUsage(device, before_alloc, after_alloc, max(candidates), was, rep.oom if rep is not None else None,
                       tuple(notes), reset), rep


__all__ = ["DeviceUsage", "device_usage", "peak_was_reset", "touched"]
