"""What a CUDA device tells a measured cell, in the shapes PyTorch gives it, for tests without a GPU:

* trace entries as ``torch/csrc/cuda/memory_snapshot.cpp`` (and ``Module.cpp``'s ``_snapshot``) write them:
  ``{"action", "addr" (``"device_free"`` for ``oom``), "size", "stream", "time_us"}``, with the sizes
  ``record_trace`` passes in ``c10/cuda/CUDACachingAllocator.cpp``: ``orig_size`` for ``alloc``, the block's
  ``requested_size`` for ``free_requested``/``free_completed``, the segment size for ``segment_alloc``, the
  rounded request for ``oom``;
* segments as ``segmentInfoToDict`` writes them (``blocks`` with ``address``, ``size``, ``requested_size``,
  ``state`` of ``active_allocated`` / ``active_pending_free`` / ``inactive``);
* ``memory_stats()`` as ``torch/cuda/memory.py`` flattens it (``allocated_bytes.all.current``,
  ``allocation.all.allocated``, ``num_device_alloc``, ...; zeros for the stats a ``cudaMallocAsync`` backend
  does not keep, per ``CUDAMallocAsyncAllocator.cpp``'s ``getDeviceStats``).

The cell (:data:`CELL`, :data:`BEFORE`, :data:`AFTER`, :data:`END`), worked by hand (8 MiB allocated before it,
a 100 MiB global peak from earlier):
a new 20 MiB segment and a 4 MiB + 100 B request at its start (block 4 MiB + 512: the rest is split off), a
15 MiB + 300 B request from the 16 MiB - 512 left (1 MiB - 1024 would remain: not split, block 16 MiB - 512,
still alive at the end), a 100 B request (512), then both small and 4 MiB blocks freed.
"""

from __future__ import annotations

KiB, MiB = 1024, 1024**2
S1 = 0x7F10_0000_0000  # the new segment
A = 0x7F20_0000_0200  # a small block in an older small segment
T = 1_700_000_000_000_000  # time_us: microseconds since the epoch


def e(action: str, addr: int, size: int, t: int = 0) -> dict:
    key = "device_free" if action == "oom" else "addr"
    return {"action": action, key: addr, "size": size, "stream": 0, "time_us": T + t}


CELL = [
    e("segment_alloc", S1, 20 * MiB, 1),
    e("alloc", S1, 4 * MiB + 100, 2),
    e("alloc", S1 + 4 * MiB + 512, 15 * MiB + 300, 3),
    e("alloc", A, 100, 4),
    e("free_requested", S1, 4 * MiB + 100, 5),
    e("free_completed", S1, 4 * MiB + 100, 6),
    e("free_requested", A, 100, 7),
    e("free_completed", A, 100, 8),
]


def stats(current: int, peak: int, allocs: int, freed: int, completed: int, segments: int, ooms: int = 0,
          live_peak: int = 12) -> dict:
    """``live_peak``: ``allocation.all.peak``, the most blocks alive at once (``allocation.all.current`` is
    ``allocs - freed``)."""
    out = {f"{stat}.{pool}.{kind}": 0 for stat in ("allocation", "allocated_bytes", "active", "reserved_bytes")
           for pool in ("all", "small_pool", "large_pool") for kind in ("current", "peak", "allocated", "freed")}
    out.update({"allocated_bytes.all.current": current, "allocated_bytes.all.peak": peak,
                "allocation.all.allocated": allocs, "allocation.all.freed": freed, "active.all.freed": completed,
                "allocation.all.current": allocs - freed, "allocation.all.peak": live_peak,
                "num_device_alloc": segments, "num_device_free": 0, "num_ooms": ooms, "num_alloc_retries": 0})
    return out


BEFORE = stats(8 * MiB, 100 * MiB, 10, 8, 8, 3)
AFTER = stats(24 * MiB - 512, 100 * MiB, 13, 10, 10, 4)


def segments(blocks: list[tuple[int, int, int, str]], device: int = 0) -> list[dict]:
    """One segment per block list entry group: (address, size, requested_size, state)."""
    out = []
    for addr, size, requested, state in blocks:
        out.append({"device": device, "address": addr, "total_size": size, "allocated_size": size,
                    "active_size": size, "requested_size": requested, "stream": 0, "segment_type": "large",
                    "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
                    "blocks": [{"address": addr, "size": size, "requested_size": requested, "state": state,
                                "frames": []}]})
    return out


END = segments([(S1 + 4 * MiB + 512, 16 * MiB - 512, 15 * MiB + 300, "active_allocated")])
