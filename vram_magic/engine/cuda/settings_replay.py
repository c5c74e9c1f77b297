"""Would other allocator settings have saved a failed request? The recorded history replayed under them.

With a history recorded from CUDA's initialisation on (and never wrapped), every block the allocator held is
rebuilt: each ``alloc`` and ``free_completed`` entry is replayed through :class:`~.caching_allocator.CachingAllocator`
with the device's room for PyTorch as its capacity (the limit, less what the CUDA context and other processes held),
then the failed request is asked for. The replay under the settings the process ran with must fail too — else the
what-if is not trusted and says so. Without a whole history the answer is a bound from what was allocated: with
``expandable_segments`` the allocator maps pages where it has room, so a request fits if what is allocated plus the
request (rounded up to the pool's page) fits the room; ``max_split_size_mb`` needs the history.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .alloc_conf import LARGE_BUFFER, AllocatorSettings, parse_alloc_conf, settings_from_snapshot
from .caching_allocator import CachingAllocator, OutOfMemory, round_size


@dataclass(frozen=True)
class WhatIf:
    """One setting tried: ``fits`` (``None``: cannot tell), ``margin`` (bytes left after the request, or missing when
    negative), ``how`` (the replay, or the bound) and what to set."""

    setting: str
    fits: bool | None
    margin: int
    how: str
    conf: str


def room(stats: Mapping[str, Any], limit: int, free: int) -> int:
    """What PyTorch could reserve at the failure: the limit, less what was in use on the device outside its reserved
    segments (the CUDA context, other processes)."""
    reserved = int(stats.get("reserved_bytes.all.current", 0))
    outside = max(limit - free - reserved, 0)
    return max(limit - outside, 0)


def replay(trace: Sequence[Mapping[str, Any]], settings: AllocatorSettings, capacity: int, request: int
           ) -> tuple[bool, int]:
    """The history's allocations and frees replayed under ``settings`` with ``capacity``, then ``request``: (whether
    it was served, the bytes left then or missing)."""
    sim = CachingAllocator(capacity=capacity, settings=settings)
    handles: dict[int, int] = {}
    try:
        for entry in trace:
            action = entry.get("action")
            if action == "alloc":
                handles[int(entry["addr"])] = sim.malloc(int(entry["size"]))
            elif action == "free_completed":
                handle = handles.pop(int(entry.get("addr", -1)), None)
                if handle is not None:
                    sim.free(handle)
            elif action == "oom":
                break
    except OutOfMemory:  # an earlier request would already have failed under these settings
        return False, capacity - sim.reserved
    try:
        sim.malloc(request)
    except OutOfMemory as err:
        return False, -(err.segment - (capacity - sim.reserved))
    return True, capacity - sim.reserved


def what_ifs(trace: Sequence[Mapping[str, Any]], snapshot_settings: Mapping[str, Any], stats: Mapping[str, Any],
             limit: int, free: int, request: int, *, whole: bool) -> tuple[list[WhatIf], list[str]]:
    """``expandable_segments:True`` and a ``max_split_size_mb`` tried against a failed ``request`` (bytes); the notes
    say what the answer rests on."""
    capacity = room(stats, limit, free)
    current = settings_from_snapshot(snapshot_settings) if snapshot_settings else AllocatorSettings()
    tries = []
    if not current.expandable_segments:
        tries.append(("expandable_segments:True", replace(current, expandable_segments=True)))
    if current.max_split_size is None and not current.expandable_segments:
        tries.append(("max_split_size_mb:128", parse_alloc_conf("max_split_size_mb:128", strict=False)))
    notes: list[str] = []
    out: list[WhatIf] = []
    if whole:
        served, _ = replay(trace, current, capacity, request)
        if served:  # the replay serves what the device refused: the model is not this allocator
            notes.append("the history replayed under the settings the process ran with serves the failed request: "
                         "the what-ifs below would not be trustworthy and are left out")
            return [], notes
        for name, settings in tries:
            fits, margin = replay(trace, settings, capacity, request)
            out.append(WhatIf(name, fits, margin, "the whole history replayed", f"PYTORCH_CUDA_ALLOC_CONF={name}"))
        return out, notes
    allocated = int(stats.get("allocated_bytes.all.current", 0))
    page = LARGE_BUFFER if round_size(request) > 1 << 20 else 2 << 20
    need = allocated + -(-round_size(request) // page) * page
    notes.append("the allocator's history does not reach back to CUDA's start: expandable segments are judged by a "
                 "bound (what was allocated plus the request, in whole pages, against the room)")
    for name, _ in tries:
        if name.startswith("expandable"):
            out.append(WhatIf(name, need <= capacity, capacity - need, "a bound from what was allocated",
                              f"PYTORCH_CUDA_ALLOC_CONF={name}"))
        else:
            out.append(WhatIf(name, None, 0, "needs the whole history", f"PYTORCH_CUDA_ALLOC_CONF={name}"))
    return out, notes


__all__ = ["WhatIf", "replay", "room", "what_ifs"]
