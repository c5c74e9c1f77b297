"""The size of a failed CUDA request. Messages are built the way PyTorch builds them: the native allocator's
``TORCH_CHECK_WITH(OutOfMemoryError, ..., "CUDA out of memory. Tried to allocate ", format_size(alloc_size), ...)``
in ``c10/cuda/CUDACachingAllocator.cpp`` (``alloc_size`` is the *segment*, from ``get_allocation_size``), the
``cudaMallocAsync`` backend's ``"Requested               : ", format_size(size)`` in
``c10/cuda/CUDAMallocAsyncAllocator.cpp``, and c10's ``format_size`` ("N bytes" up to 1024, then KiB, MiB, GiB
with two decimals). Trace entries follow ``torch/csrc/cuda/memory_snapshot.cpp``: an ``oom`` entry carries
``device_free`` instead of ``addr`` and the request rounded by ``round_size`` as ``size``."""

from __future__ import annotations

from vram_magic.core.units import format_bytes
from vram_magic.engine.cuda.caching_allocator import allocation_size, round_size
from vram_magic.engine.cuda.device import oom_requested
from vram_magic.engine.cuda.oom_message import format_size, oom_from_trace, parse_oom_message, requested_bytes

KiB, MiB, GiB = 1024, 1024**2, 1024**3


def native_message(request: int, device_total: int = 80 * GiB, free: int = 3 * MiB) -> str:
    segment = allocation_size(round_size(request))
    return (f"CUDA out of memory. Tried to allocate {format_size(segment)}. GPU 0 has a total capacity of "
            f"{format_size(device_total)} of which {format_size(free)} is free. Including non-PyTorch memory, this "
            f"process has {format_size(device_total - free)} memory in use. Of the allocated memory 78.00 GiB is "
            "allocated by PyTorch, and 1.00 GiB is reserved by PyTorch but unallocated. If reserved but unallocated "
            "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")


def async_message(request: int, used: int = 10 * GiB) -> str:
    return (f"Allocation on device 0 would exceed allowed memory. (out of memory)\nCurrently allocated     : "
            f"{format_size(used)}\nRequested               : {format_size(request)}\nDevice limit            : "
            f"{format_size(80 * GiB)}\nFree (according to CUDA): {format_size(2 * MiB)}\nPyTorch limit (set by "
            f"user-supplied memory fraction)\n                        : {format_size(16 * GiB)}")


def test_format_size_matches_c10():
    assert [format_size(n) for n in (0, 100, 1024, 1025, MiB, MiB + 1, GiB, 3 * GiB // 2)] == [
        "0 bytes", "100 bytes", "1024 bytes", "1.00 KiB", "1024.00 KiB", "1.00 MiB", "1024.00 MiB", "1.50 GiB"]


def test_native_message_names_the_segment_not_the_request():
    # a request of up to 1 MiB asks for a 2 MiB segment: the request is only known to be 512 B .. 1 MiB
    small = parse_oom_message(native_message(100))
    assert (small.low, small.high, small.segment, small.requested) == (512, MiB, 2 * MiB, None)
    # 1-10 MiB: a 20 MiB segment. A 4 MiB request must not read as 20 MiB
    mid = parse_oom_message(native_message(4 * MiB))
    assert (mid.low, mid.high, mid.segment, mid.requested) == (MiB + 512, 20 * MiB, 20 * MiB, None)
    assert requested_bytes(native_message(4 * MiB)) is None
    assert mid.describe().endswith("the request itself is not in the message")
    # exactly 10 MiB is its own segment; 18.5 MiB rounds up to a 20 MiB segment too
    assert parse_oom_message(native_message(10 * MiB)).requested == 10 * MiB
    assert parse_oom_message(native_message(18 * MiB + MiB // 2)).segment == 20 * MiB
    # above 10 MiB the segment is the request rounded up to 2 MiB: known to within 2 MiB
    big = parse_oom_message(native_message(30 * MiB + 100))
    assert (big.segment, big.requested) == (32 * MiB, 32 * MiB)
    assert requested_bytes(native_message(3 * GiB // 2)) == 3 * GiB // 2


def test_cuda_malloc_async_message_names_the_request_itself():
    assert parse_oom_message(async_message(512)).requested == 512  # "512 bytes"
    assert parse_oom_message(async_message(1000)).requested == 1000
    assert parse_oom_message(async_message(4 * MiB)).requested == 4 * MiB
    assert parse_oom_message(async_message(3 * KiB)).requested == 3 * KiB
    exact = parse_oom_message(async_message(4 * MiB))
    assert exact.exact and exact.segment is None


def test_messages_without_a_size():
    assert parse_oom_message("CUDA out of memory. Tried to allocate more than 1EB memory.") is None
    assert requested_bytes("something else") is None


def test_trace_oom_entry_wins_over_the_message():
    entries = [
        {"action": "alloc", "addr": 0x7F0000000000, "size": 60 * MiB, "stream": 0, "time_us": 1},
        {"action": "oom", "device_free": 1 * MiB, "size": round_size(4 * MiB + 100), "stream": 0, "time_us": 2},
    ]
    assert oom_from_trace(entries) == 4 * MiB + 512
    assert oom_requested(native_message(4 * MiB + 100), oom_from_trace(entries)) == (4 * MiB + 512, "")
    requested, note = oom_requested(native_message(4 * MiB + 100), None)
    assert requested is None and f"{format_bytes(20 * MiB)} segment" in note
    assert oom_requested(async_message(4 * MiB), None) == (4 * MiB, "")
