"""The caching allocator's rules, checked against the constants and branches of PyTorch's
``c10/cuda/CUDACachingAllocator.cpp`` (``kMinBlockSize`` 512, ``kSmallSize`` 1 MiB, ``kSmallBuffer`` 2 MiB,
``kMinLargeAlloc`` 10 MiB, ``kLargeBuffer`` 20 MiB, ``kRoundLarge`` 2 MiB; ``round_size``,
``get_allocation_size``, ``should_split``, best fit in ``get_free_block``, merging in ``free_block``, and
``release_cached_blocks`` before giving up in ``malloc``). Every expected number is worked out by hand."""

from __future__ import annotations

import pytest

from vram_magic.engine.caching_allocator import (
    CachingAllocator,
    OutOfMemory,
    allocation_size,
    block_size,
    round_size,
    segment_request_range,
    should_split,
)

KiB, MiB = 1024, 1024**2


def test_round_size_is_512_byte_blocks_of_at_least_512():
    assert [round_size(n) for n in (0, 1, 511, 512, 513, 1024, 1025)] == [512, 512, 512, 512, 1024, 1024, 1536]
    assert round_size(4 * MiB + 100) == 4 * MiB + 512


def test_segment_sizes_follow_get_allocation_size():
    assert allocation_size(512) == 2 * MiB  # small pool: 2 MiB segments
    assert allocation_size(1 * MiB) == 2 * MiB  # kSmallSize is still small
    assert allocation_size(1 * MiB + 512) == 20 * MiB  # 1-10 MiB share 20 MiB segments
    assert allocation_size(4 * MiB) == 20 * MiB
    assert allocation_size(10 * MiB - 512) == 20 * MiB
    assert allocation_size(10 * MiB) == 10 * MiB  # from kMinLargeAlloc on: rounded up to 2 MiB
    assert allocation_size(10 * MiB + 512) == 12 * MiB
    assert allocation_size(30 * MiB + 512) == 32 * MiB


def test_should_split_keeps_small_remainders_and_large_ones_above_1_mib():
    assert should_split(2 * MiB, 1 * MiB)  # small pool: 1 MiB left >= 512
    assert should_split(1024, 512)
    assert not should_split(512, 512)
    assert not should_split(20 * MiB, 19 * MiB)  # large pool: exactly 1 MiB left is not > kSmallSize
    assert not should_split(20 * MiB, 19 * MiB + 512)
    assert should_split(20 * MiB, 19 * MiB - 512)  # 1 MiB + 512 left


def test_block_size_of_a_new_segment_includes_the_unsplit_remainder():
    assert block_size(100) == 512
    assert block_size(4 * MiB) == 4 * MiB  # 16 MiB of the 20 MiB segment is split off
    assert block_size(11 * MiB) == 12 * MiB  # 12 MiB segment, 1 MiB left: not split
    assert block_size(int(19.5 * MiB)) == 20 * MiB
    assert block_size(11 * MiB, free_block=16 * MiB) == 11 * MiB  # 5 MiB left in a cached block: split
    assert block_size(15 * MiB + 100, free_block=16 * MiB) == 16 * MiB


def test_segment_request_range_inverts_the_segment_sizes():
    assert segment_request_range(2 * MiB) == (512, 1 * MiB)
    assert segment_request_range(20 * MiB) == (1 * MiB + 512, 20 * MiB)  # 1-10 MiB, or 18-20 MiB
    assert segment_request_range(10 * MiB) == (10 * MiB, 10 * MiB)
    assert segment_request_range(12 * MiB) == (10 * MiB + 512, 12 * MiB)
    assert segment_request_range(1536 * MiB) == (1534 * MiB + 512, 1536 * MiB)


def test_small_requests_share_one_2_mib_segment():
    a = CachingAllocator()
    h1, h2 = a.malloc(100), a.malloc(1000)
    assert (a.block_size(h1), a.block_size(h2)) == (512, 1024)
    assert (a.allocated, a.reserved) == (1536, 2 * MiB)


def test_large_requests_split_a_20_mib_segment_until_the_remainder_is_not_worth_it():
    a = CachingAllocator()
    x, y = a.malloc(4 * MiB), a.malloc(4 * MiB)
    assert (a.allocated, a.reserved) == (8 * MiB, 20 * MiB)
    z = a.malloc(11 * MiB)  # the 12 MiB left: 1 MiB would remain, so the whole 12 MiB is handed out
    assert a.block_size(z) == 12 * MiB
    assert (a.allocated, a.reserved, a.peak_allocated) == (20 * MiB, 20 * MiB, 20 * MiB)
    for h in (x, z, y):  # freed blocks merge back into one free 20 MiB block
        a.free(h)
    assert a.allocated == 0 and a.reserved == 20 * MiB
    w = a.malloc(19 * MiB)  # from the merged block, 1 MiB left: not split
    assert a.block_size(w) == 20 * MiB and a.reserved == 20 * MiB


def test_best_fit_takes_the_smallest_cached_block_that_fits():
    a = CachingAllocator()
    big, small = a.malloc(30 * MiB), a.malloc(12 * MiB)  # segments of 30 and 12 MiB
    a.free(big)
    a.free(small)
    h = a.malloc(11 * MiB)
    assert a.block_size(h) == 12 * MiB  # the 12 MiB block (1 MiB left, not split), not a cut of 30 MiB
    assert a.reserved == 42 * MiB


def test_small_and_large_pools_do_not_serve_each_other():
    a = CachingAllocator()
    a.free(a.malloc(4 * MiB))  # a free 20 MiB large block
    a.malloc(512)
    assert a.reserved == 22 * MiB  # a small request makes its own 2 MiB segment


def test_cached_segments_are_released_before_giving_up():
    a = CachingAllocator(capacity=30 * MiB)
    a.free(a.malloc(15 * MiB))  # 16 MiB segment, cached
    a.malloc(20 * MiB)  # 16 + 20 > 30: the cached 16 MiB goes back, then 20 fits
    assert (a.reserved, a.peak_reserved) == (20 * MiB, 20 * MiB)
    with pytest.raises(OutOfMemory) as err:
        a.malloc(12 * MiB)  # 20 + 12 > 30 and nothing cached to release
    assert (err.value.size, err.value.segment) == (12 * MiB, 12 * MiB)


def test_zero_bytes_allocate_nothing():
    a = CachingAllocator()
    assert a.malloc(0) == 0 and a.allocated == 0 and a.reserved == 0
    a.free(0)
