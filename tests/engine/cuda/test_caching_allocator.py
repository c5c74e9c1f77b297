"""The caching allocator's rules, checked against the constants and branches of PyTorch's
``c10/cuda/CUDACachingAllocator.cpp`` (``kMinBlockSize`` 512, ``kSmallSize`` 1 MiB, ``kSmallBuffer`` 2 MiB,
``kMinLargeAlloc`` 10 MiB, ``kLargeBuffer`` 20 MiB, ``kRoundLarge`` 2 MiB; ``round_size``,
``get_allocation_size``, ``should_split``, best fit in ``get_free_block``, merging in ``free_block``, and
``release_cached_blocks`` before giving up in ``malloc``). Every expected number is worked out by hand."""

from __future__ import annotations

import pytest

from vram_magic.engine.cuda.alloc_conf import parse_alloc_conf, settings_from_env, settings_from_snapshot
from vram_magic.engine.cuda.caching_allocator import (
    CachingAllocator,
    OutOfMemory,
    allocation_size,
    block_size,
    round_size,
    roundup_power2_next_division,
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


# --- non-default settings (PYTORCH_CUDA_ALLOC_CONF): CUDACachingAllocator.cpp's round_size,
# roundup_power2_next_division, should_split, get_free_block, release_available_cached_blocks,
# try_allocate_expandable_block / map_block / unmap_block; AllocatorConfig.cpp's parseArgs -----------------------
EXPANDABLE = parse_alloc_conf("expandable_segments:True")
SPLIT_20 = parse_alloc_conf("max_split_size_mb:20")
DIV_4 = parse_alloc_conf("roundup_power2_divisions:4")


def test_settings_are_parsed_as_pytorch_parses_them():
    assert EXPANDABLE.expandable_segments and EXPANDABLE.describe() == "expandable_segments:True"
    assert SPLIT_20.max_split_size == 20 * MiB
    assert DIV_4.roundup_power2_divisions == (4,) * 16
    # a first interval fills those below it; ">" the ones after the last listed
    table = parse_alloc_conf("roundup_power2_divisions:[256:8,>:4]").roundup_power2_divisions
    assert table == (8,) * 9 + (4,) * 7
    s = parse_alloc_conf(" expandable_segments : True , max_split_size_mb:512,max_non_split_rounding_mb:40")
    assert (s.expandable_segments, s.max_split_size, s.max_non_split_rounding) == (True, 512 * MiB, 40 * MiB)
    assert parse_alloc_conf("").is_default and parse_alloc_conf("backend:native").is_default
    gc = parse_alloc_conf("garbage_collection_threshold:0.6")
    assert gc.garbage_collection_threshold == 0.6 and "garbage_collection_threshold:0.6" in gc.unmodelled[0]
    for bad, why in (("max_split_size_mb:10", "at least 20"), ("expandable_segments:true", "True or False"),
                     ("roundup_power2_divisions:3", "power of 2"), ("expandable_segments", "OPTION:VALUE"),
                     ("foo:1", "unknown allocator option")):
        with pytest.raises(ValueError, match=why):
            parse_alloc_conf(bad)
    assert "foo:1" in parse_alloc_conf("foo:1", strict=False).unmodelled[0]


def test_divisions_are_chosen_per_size_interval():
    s = parse_alloc_conf("roundup_power2_divisions:[256:8,>:4]")
    # intervals start at 1 MiB and double; sizes below 2 MiB take the first
    assert [s.divisions(n) for n in (100 * KiB, 300 * MiB, 511 * MiB, 512 * MiB, 100 * 1024 * MiB)] == [8, 8, 8, 4, 4]


def test_roundup_power2_divisions_round_to_the_next_division():
    assert roundup_power2_next_division(1200, 4) == 1280  # the example in CUDACachingAllocator.cpp
    assert roundup_power2_next_division(8 * MiB, 4) == 8 * MiB  # a power of two stays
    assert round_size(1200, DIV_4) == 1536  # not above 512 x 4 bytes: plain 512-byte rounding
    assert round_size(5 * MiB + 1, DIV_4) == 6 * MiB  # steps of 1 MiB between 4 and 8 MiB
    assert round_size(6 * MiB, DIV_4) == 6 * MiB
    assert round_size(3 * MiB + KiB, parse_alloc_conf("roundup_power2_divisions:8")) == 3 * MiB + 256 * KiB
    assert round_size(5 * MiB + 1, parse_alloc_conf("roundup_power2_divisions:1")) == 5 * MiB + 512  # 1: off
    assert round_size(5 * MiB + 1) == 5 * MiB + 512


def test_expandable_segments_split_every_block():
    assert should_split(20 * MiB, 19 * MiB + 512 * KiB, EXPANDABLE)  # 0.5 MiB left: split in both pools
    assert not should_split(20 * MiB, 19 * MiB + 512 * KiB)
    assert block_size(19 * MiB + 512 * KiB, 20 * MiB, EXPANDABLE) == 19 * MiB + 512 * KiB
    assert block_size(19 * MiB + 512 * KiB, 20 * MiB) == 20 * MiB
    assert block_size(11 * MiB, None, EXPANDABLE) == 11 * MiB  # default: a 12 MiB segment, unsplit


def test_max_split_size_keeps_large_blocks_whole():
    # a 30 MiB request in a 40 MiB cached block: split by default, whole at or above max_split_size
    assert block_size(30 * MiB + 100, 40 * MiB) == 30 * MiB + 512
    assert block_size(30 * MiB + 100, 40 * MiB, SPLIT_20) == 40 * MiB
    assert block_size(8 * MiB, 20 * MiB, SPLIT_20) == 8 * MiB  # below it: split as usual
    assert SPLIT_20.max_remainder(30 * MiB) == 20 * MiB - 512 and SPLIT_20.max_remainder(8 * MiB) == MiB
    assert EXPANDABLE.max_remainder(30 * MiB) == 0 and DIV_4.max_remainder(512) == 0


def test_max_split_size_reuse_rules():
    a = CachingAllocator(settings=SPLIT_20)
    a.free(a.malloc(30 * MiB))  # a 30 MiB segment, whole (30 >= 20 MiB), cached
    small = a.malloc(8 * MiB)  # below max_split_size: never from an oversize block -> a new 20 MiB segment
    assert (a.block_size(small), a.reserved) == (8 * MiB, 50 * MiB)
    a.free(small)
    big = a.malloc(25 * MiB)  # at or above it: the 30 MiB block (less than 25 + 20 MiB), whole
    assert a.block_size(big) == 30 * MiB and a.reserved == 50 * MiB
    b = CachingAllocator(settings=SPLIT_20)
    b.free(b.malloc(60 * MiB))
    b.malloc(30 * MiB)  # 60 >= 30 + 20 MiB (max_non_split_rounding_mb): too much larger, a new segment
    assert b.reserved == 90 * MiB
    d = CachingAllocator()
    d.free(d.malloc(30 * MiB))
    assert d.block_size(d.malloc(8 * MiB)) == 8 * MiB and d.reserved == 30 * MiB  # default: split the cached one


def test_oversize_cached_blocks_are_released_first():
    a = CachingAllocator(capacity=80 * MiB, settings=SPLIT_20)
    a.free(a.malloc(60 * MiB))
    a.free(a.malloc(4 * MiB))  # a new 20 MiB segment (a request below max_split_size never takes the 60 MiB)
    a.malloc(30 * MiB)  # refused the 60 MiB block; 80 + 30 > 80: the smallest oversize block >= 30 MiB goes
    assert (a.reserved, a.peak_reserved) == (50 * MiB, 80 * MiB)


def test_expandable_segments_map_pages_at_the_lowest_address():
    a = CachingAllocator(settings=EXPANDABLE)
    x = a.malloc(4 * MiB)  # one 20 MiB page mapped; the block is 4 MiB, 16 MiB free after it
    assert (a.block_size(x), a.reserved) == (4 * MiB, 20 * MiB)
    y = a.malloc(19 * MiB)  # the free 16 MiB and one more page: 36 MiB free, 19 MiB split off (default: 20 MiB)
    assert (a.block_size(y), a.allocated, a.reserved) == (19 * MiB, 23 * MiB, 40 * MiB)
    a.free(x)
    z = a.malloc(11 * MiB)  # the 4 MiB hole is too small: the 17 MiB at the end
    assert (a.block_size(z), a.allocated, a.reserved) == (11 * MiB, 30 * MiB, 40 * MiB)
    w = a.malloc(100)  # the small pool: its own 2 MiB page
    assert (a.block_size(w), a.reserved) == (512, 42 * MiB)
    assert a.release_cached() == 0  # no free page is whole: each holds part of a live block
    a.free(z)
    a.free(y)
    assert a.release_cached() == 40 * MiB and a.reserved == 2 * MiB  # the large pool's pages, all free now
    a.free(w)
    assert a.release_cached() == 2 * MiB and a.reserved == 0


def test_expandable_segments_grow_by_pages_and_unmap_before_giving_up():
    a = CachingAllocator(capacity=40 * MiB, settings=EXPANDABLE)
    a.free(a.malloc(10 * MiB))  # one 20 MiB page, all free
    y = a.malloc(25 * MiB)  # 20 MiB free + one more page: both pages (default: a new 26 MiB segment, 46 MiB)
    assert (a.block_size(y), a.reserved) == (25 * MiB, 40 * MiB)
    a.free(y)
    z = a.malloc(30 * MiB)  # fits the 40 MiB mapped: no new page
    assert a.reserved == 40 * MiB and a.block_size(z) == 30 * MiB
    with pytest.raises(OutOfMemory):
        a.malloc(20 * MiB)  # 10 MiB free + a page: 60 MiB > 40 MiB, and no whole free page to unmap


def test_a_step_replayed_under_expandable_segments():
    from vram_magic.estimator.device.cuda_model import allocator_layout

    # the step of tests/estimator/device/test_cuda_model.py: 16 MiB weight; 11 MiB activation; 100 bytes; both
    # freed; 19 MiB
    sizes = {1: 16 * MiB, 2: 11 * MiB, 3: 100, 4: 19 * MiB}
    layout = allocator_layout([1], [2, 3, -2, -3, 4], sizes, settings=EXPANDABLE)
    assert layout.blocks == {1: 16 * MiB, 2: 11 * MiB, 3: 512, 4: 19 * MiB}  # default: 16, 12, 512, 20 MiB
    # large pages: 20 (weight), 20 (the 4 MiB left + a page for the activation); the 24 MiB free at the end then
    # holds the 19 MiB; small: one 2 MiB page (default: 16 + 12 + 2 + 20 = 50 MiB)
    assert (layout.peak_allocated, layout.peak_reserved) == (35 * MiB, 42 * MiB)


def test_settings_from_the_snapshot_and_the_environment():
    # torch/csrc/cuda/Module.cpp's "allocator_settings": max_split_size is SIZE_MAX (-1 as int64) when unlimited,
    # roundup_power2_divisions keyed by each interval's start in MiB
    snap = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_non_split_rounding_mb:40",
            "max_split_size": -1, "garbage_collection_threshold": 0.0, "expandable_segments": True,
            "pinned_num_register_threads": 1, "release_lock_on_cudamalloc": False,
            "pinned_use_cuda_host_register": False, "roundup_power2_divisions": {str(1 << i): 0 for i in range(16)}}
    s = settings_from_snapshot(snap)
    assert (s.expandable_segments, s.max_split_size, s.max_non_split_rounding) == (True, None, 40 * MiB)
    assert s.roundup_power2_divisions == () and "snapshot" in s.source
    s = settings_from_snapshot({**snap, "expandable_segments": False, "max_split_size": 512 * MiB,
                                "roundup_power2_divisions": {str(1 << i): 4 for i in range(16)}})
    assert (s.expandable_segments, s.max_split_size, s.roundup_power2_divisions) == (False, 512 * MiB, (4,) * 16)
    assert settings_from_snapshot({}).is_default
    env = settings_from_env({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert env.expandable_segments and env.source == "PYTORCH_CUDA_ALLOC_CONF"
    assert settings_from_env({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}).max_split_size == 64 * MiB
    assert settings_from_env({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:1"}).is_default  # PyTorch refuses it
