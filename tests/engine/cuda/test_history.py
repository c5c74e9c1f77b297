"""A cell's part of the CUDA allocator's history, replayed in block sizes, and what the engine makes of a device
over a cell, on the inputs of ``tests/support/cuda_shapes.py`` (PyTorch's shapes; the cell worked by hand there)."""

from __future__ import annotations

from tests.support.cuda_shapes import AFTER, BEFORE, CELL, END, S1, A, MiB, e, segments, stats
from vram_magic.engine.cuda.device import device_usage, touched
from vram_magic.engine.cuda.history import cell_window, end_blocks, expected_entries, replay_blocks
from vram_magic.measuring.snapshot import replay


def test_counters_say_how_many_entries_the_cell_wrote():
    assert expected_entries(BEFORE, AFTER) == {"alloc": 3, "free_requested": 2, "free_completed": 2,
                                               "segment": 1, "oom": 0}
    assert expected_entries(BEFORE, {**AFTER, "allocation.all.allocated": 0}) is None  # reset during the cell
    assert expected_entries({}, AFTER) is None


def test_the_cells_entries_are_counted_back_from_the_end():
    older = [e("alloc", 0x1000, 512), e("free_requested", 0x1000, 512), e("free_completed", 0x1000, 512)]
    user = [*older, *CELL[:4], e("snapshot", 0, 8 * MiB), *CELL[4:]]  # a _snapshot() of the user's in the cell
    w = cell_window(user, expected_entries(BEFORE, AFTER))
    assert (w.start, w.complete, w.counted) == (3, True, True)
    wrapped = cell_window(CELL[4:], expected_entries(BEFORE, AFTER))  # the ring buffer kept the last four
    assert (wrapped.complete, wrapped.expected) == (False, 8)
    assert cell_window(CELL, None, since=0).start == 0


def test_replay_in_block_sizes_matches_the_counters():
    rep = replay_blocks(CELL, start=8 * MiB, blocks_at_end=end_blocks(END, 0))
    # 8 MiB, +4 MiB+512 (new segment, split), +16 MiB-512 (alive at the end: its block), +512, -(4 MiB+512), -512
    assert rep.peak == 28 * MiB + 512 and rep.peak_entry == 4
    assert rep.end == AFTER["allocated_bytes.all.current"] and rep.estimated == 0


def test_a_block_size_the_trace_does_not_show_is_its_rounded_request():
    freed_too = [*CELL, e("free_requested", S1 + 4 * MiB + 512, 15 * MiB + 300, 9)]
    rep = replay_blocks(freed_too, start=8 * MiB, blocks_at_end={})
    assert rep.peak == 8 * MiB + (4 * MiB + 512) + (15 * MiB + 512) + 512  # real block: 16 MiB - 512
    assert rep.end == 8 * MiB and rep.estimated == 1


def test_frees_count_when_requested_not_when_another_stream_is_done():
    # record_stream: the block's free is requested (allocated_bytes drops) long before it completes
    entries = [e("alloc", A, 100), e("free_requested", A, 100), e("alloc", A + 512, 1000),
               e("free_completed", A, 100)]
    assert replay_blocks(entries, start=0).peak == 1024


def test_backwards_from_the_end_when_the_start_is_lost():
    rep = replay_blocks(CELL[4:], end=24 * MiB - 512)
    # frees of blocks allocated before the window: 4 MiB+512 and 512, so the window started at 28 MiB + 512
    assert (rep.start, rep.peak, rep.end) == (28 * MiB + 512, 28 * MiB + 512, 24 * MiB - 512)


def test_oom_entry_size_is_read():
    rep = replay_blocks([*CELL, e("oom", 3 * MiB, 4 * MiB + 512, 9)], start=8 * MiB, blocks_at_end=end_blocks(END, 0))
    assert rep.oom == 4 * MiB + 512 and rep.peak == 28 * MiB + 512


def snap(trace: list[dict], segs: list[dict] = END) -> dict:
    return {"segments": segs, "device_traces": [trace], "allocator_settings": {}}


def test_device_usage_with_our_own_history():
    usage, _ = device_usage("cuda:0", BEFORE, AFTER, snap(CELL), history="ours")
    assert (usage.before, usage.after, usage.peak, usage.touched) == (8 * MiB, 24 * MiB - 512, 28 * MiB + 512, True)
    assert usage.notes == ()


def test_device_usage_reads_the_users_longer_history():
    older = [e("alloc", 0x1000, 512), e("free_requested", 0x1000, 512), e("free_completed", 0x1000, 512)]
    usage, _ = device_usage("cuda:0", BEFORE, AFTER, snap([*older, *CELL]), history="user")
    assert usage.peak == 28 * MiB + 512 and usage.notes == ()


def test_a_wrapped_buffer_is_said_and_the_peak_kept_from_what_is_left():
    usage, _ = device_usage("cuda:0", BEFORE, AFTER, snap(CELL[4:]), history="user")
    assert usage.peak == 28 * MiB + 512
    assert "the buffer wrapped" in usage.notes[0] and "holds 4 events and this cell made 8" in usage.notes[0]


def test_a_state_only_recording_leaves_the_counters():
    usage, _ = device_usage("cuda:0", BEFORE, AFTER, snap(CELL[-1:]), history="user")
    assert usage.peak == 24 * MiB - 512  # the global peak did not rise: before and after are all that is known
    assert "keeps no trace" in usage.notes[0]
    risen = {**AFTER, "allocated_bytes.all.peak": 150 * MiB}
    before = {**BEFORE, "allocated_bytes.all.peak": 8 * MiB}
    assert device_usage("cuda:0", before, risen, snap(CELL[-1:]), history="user")[0].peak == 150 * MiB


def test_the_replay_never_goes_above_the_global_peak_counter_by_its_own_uncertainty():
    # a 12 MiB block (11 MiB asked, 1 MiB unsplit) allocated before the cell is freed, then 11.5 MiB is asked at
    # its address (the whole 12 MiB block again: 0.5 MiB left is not split off). The replay takes both as their
    # rounded requests: 20 - 11 + 11.5 = 20.5 MiB, half a MiB above the counter, within the 1 MiB the freed block's
    # unknown remainder allows: the counter, which was not reset, bounds it
    old = 0x7F30_0000_0000
    before = stats(20 * MiB, 20 * MiB, 5, 0, 0, 2, live_peak=5)
    after = stats(20 * MiB, 20 * MiB, 6, 1, 1, 2, live_peak=5)
    cell = [e("free_requested", old, 11 * MiB), e("free_completed", old, 11 * MiB),
            e("alloc", old, 11 * MiB + MiB // 2)]
    usage, rep = device_usage("cuda:0", before, after, snap(cell, []), history="ours")
    assert (rep.peak, rep.slack) == (20 * MiB + MiB // 2, MiB)
    assert usage.peak == 20 * MiB and not usage.reset


def test_counters_and_history_that_disagree_are_said():
    old = 0x7F30_0000_0000  # a 12 MiB block (11 MiB asked, 1 MiB unsplit) allocated before the cell
    before = stats(20 * MiB, 100 * MiB, 5, 0, 0, 2)
    after = stats(8 * MiB, 100 * MiB, 5, 1, 1, 2)
    cell = [e("free_requested", old, 11 * MiB), e("free_completed", old, 11 * MiB)]
    usage, _ = device_usage("cuda:0", before, after, snap(cell, []), history="ours")
    assert usage.peak == 20 * MiB
    assert "differ by 1.00 MiB" in usage.notes[0] or "differ by 1.0 MiB" in usage.notes[0]


def test_cuda_initialised_by_the_cell_takes_the_allocators_own_peak():
    usage, _ = device_usage("cuda:0", None, stats(1 * MiB, 5 * MiB, 3, 2, 2, 1), None, history=None)
    assert (usage.before, usage.after, usage.peak, usage.touched) == (0, MiB, 5 * MiB, True)
    assert "initialised by this cell" in usage.notes[0]


def test_cuda_malloc_async_has_only_current_and_peak_bytes():
    before = stats(8 * MiB, 8 * MiB, 0, 0, 0, 0)
    after = stats(8 * MiB, 40 * MiB, 0, 0, 0, 0)  # the driver's high-water mark rose: that is the cell's peak
    usage, _ = device_usage("cuda:0", before, after, None, history=None)
    assert usage.touched and usage.peak == 40 * MiB and usage.notes == ()
    flat = stats(8 * MiB, 50 * MiB, 0, 0, 0, 0)
    usage, _ = device_usage("cuda:0", flat, stats(12 * MiB, 50 * MiB, 0, 0, 0, 0), None, history=None)
    assert usage.peak == 12 * MiB and "larger of before and after" in usage.notes[0]


def test_an_untouched_device():
    assert not touched(BEFORE, dict(BEFORE))
    usage, _ = device_usage("cuda:1", BEFORE, dict(BEFORE), snap([], []), history="ours")
    assert not usage.touched and usage.peak == 8 * MiB and usage.notes == ()


def test_snapshot_replay_is_in_requested_sizes_with_frees_when_requested():
    # PyTorch's own snapshot: at the end one block alive (asked 15 MiB + 300) and one pending on another stream
    segs = segments([(S1 + 4 * MiB + 512, 16 * MiB - 512, 15 * MiB + 300, "active_allocated"),
                     (0x7F40_0000_0000, 2 * MiB, 100, "active_pending_free")])
    trace = [*CELL, e("alloc", 0x7F40_0000_0000, 100, 9), e("free_requested", 0x7F40_0000_0000, 100, 10)]
    start, peak, at = replay(snap(trace, segs))
    # requested sizes: end 15 MiB+300; deltas +4 MiB+100, +15 MiB+300, +100, -(4 MiB+100), -100, +100, -100
    assert start == 0
    assert (peak, at) == (4 * MiB + 100 + 15 * MiB + 300 + 100, 4)


# --- the cell resets the peak counter (c10's reset_peak_stat: every stat's peak = its current) ---------------------
def reset_at_the_end(after: dict) -> dict:
    """``after`` as ``torch.cuda.reset_peak_memory_stats()`` at the cell's end leaves it: each peak is its current."""
    return {k: (after[k.removesuffix(".peak") + ".current"] if k.endswith(".peak") else v) for k, v in after.items()}


def test_a_peak_reset_inside_the_cell_leaves_the_replay_as_the_peak():
    # warm up (the cell's 28.5 MiB), reset, timed step (less): the counter reads only what followed the reset
    after = reset_at_the_end(AFTER)
    assert after["allocated_bytes.all.peak"] == 24 * MiB - 512
    usage, rep = device_usage("cuda:0", BEFORE, after, snap(CELL), history="ours")
    assert usage.peak == 28 * MiB + 512  # min(replay, counter) read 24 MiB - 512
    assert usage.reset and rep.peak == 28 * MiB + 512
    assert any("reset the allocator's peak counter on cuda:0" in n for n in usage.notes), usage.notes


def test_a_reset_when_no_peak_falls_is_seen_by_the_replay():
    # the user's counter had been reset before the cell too, so no peak falls; but the replay has 2 + 3 blocks alive
    # at once (allocation.all.current before, then the cell's three allocs) where allocation.all.peak says 3, and
    # reaches 28.5 MiB where allocated_bytes.all.peak says 24 MiB
    before = stats(8 * MiB, 8 * MiB, 10, 8, 8, 3, live_peak=2)
    after = reset_at_the_end(stats(24 * MiB - 512, 0, 13, 10, 10, 4, live_peak=0))
    usage, rep = device_usage("cuda:0", before, after, snap(CELL), history="ours")
    assert usage.peak == 28 * MiB + 512
    assert usage.reset and rep.live_peak == 3 and after["allocation.all.peak"] == 3


def test_no_reset_when_the_counter_rose_and_held_everything():
    before = {**BEFORE, "allocated_bytes.all.peak": 8 * MiB}
    usage, _ = device_usage("cuda:0", before, {**AFTER, "allocated_bytes.all.peak": 28 * MiB + 512}, snap(CELL),
                            history="ours")
    assert not usage.reset and usage.peak == 28 * MiB + 512 and usage.notes == ()


def test_a_reset_without_history_is_said():
    usage, _ = device_usage("cuda:0", BEFORE, reset_at_the_end(AFTER), None, history=None)
    assert "the counter saw only what followed" in usage.notes[0]
    assert usage.reset and usage.peak == 24 * MiB - 512


# --- block sizes under the allocator settings the snapshot recorded ----------------------------------------------
def settings_snap(trace: list[dict], segs: list[dict], **settings) -> dict:
    """A snapshot whose ``allocator_settings`` are as ``torch/csrc/cuda/Module.cpp`` writes them."""
    base = {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1, "garbage_collection_threshold": 0.0,
            "expandable_segments": False, "pinned_num_register_threads": 1, "release_lock_on_cudamalloc": False,
            "pinned_use_cuda_host_register": False, "roundup_power2_divisions": {str(1 << i): 0 for i in range(16)}}
    return {"segments": segs, "device_traces": [trace], "allocator_settings": {**base, **settings}}


def test_expandable_segments_in_the_snapshot_size_the_blocks():
    # segment_map of one 20 MiB page, 19.5 MiB asked (split at 19.5 MiB with expandable segments: the default rule
    # keeps the 0.5 MiB and makes it 20 MiB), 100 bytes, the large block freed
    s2 = 0x7F50_0000_0000
    cell = [e("segment_map", s2, 20 * MiB), e("alloc", s2, 19 * MiB + MiB // 2), e("alloc", A, 100),
            e("free_requested", s2, 19 * MiB + MiB // 2), e("free_completed", s2, 19 * MiB + MiB // 2)]
    before = stats(8 * MiB, 8 * MiB, 10, 8, 8, 3, live_peak=2)
    after = stats(8 * MiB + 512, 27 * MiB + MiB // 2 + 512, 12, 9, 9, 4, live_peak=4)
    snapshot = settings_snap(cell, [], expandable_segments=True, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    usage, rep = device_usage("cuda:0", before, after, snapshot, history="ours")
    assert (rep.peak, rep.estimated, rep.end) == (27 * MiB + MiB // 2 + 512, 0, 8 * MiB + 512)
    assert usage.peak == 27 * MiB + MiB // 2 + 512
    assert any("expandable_segments:True (from the allocator's snapshot)" in n for n in usage.notes), usage.notes
    default = replay_blocks(cell, start=8 * MiB)
    assert default.peak == 28 * MiB + 512  # what the default rules said


def test_max_split_size_and_roundup_in_the_snapshot_size_the_blocks():
    from vram_magic.engine.cuda.alloc_conf import settings_from_snapshot

    s3 = 0x7F60_0000_0000
    cell = [e("segment_alloc", s3, 32 * MiB), e("alloc", s3, 30 * MiB + 100)]
    split = settings_from_snapshot(settings_snap([], [], max_split_size=20 * MiB)["allocator_settings"])
    assert replay_blocks(cell, start=0, settings=split).peak == 32 * MiB  # whole: 30 MiB >= max_split_size
    assert replay_blocks(cell, start=0).peak == 30 * MiB + 512  # default: the 2 MiB - 512 left is split off
    divs = settings_from_snapshot(settings_snap([], [], roundup_power2_divisions={str(1 << i): 4 for i in range(16)})
                                  ["allocator_settings"])
    cell = [e("segment_alloc", s3, 20 * MiB), e("alloc", s3, 5 * MiB + 1)]
    assert replay_blocks(cell, start=0, settings=divs).peak == 6 * MiB  # rounded to 1 MiB steps between 4 and 8
    assert replay_blocks(cell, start=0).peak == 5 * MiB + 512


# --- a user's recording with skip_actions -------------------------------------------------------------------------
def test_a_recording_that_skips_free_requested_is_said_not_blamed_on_a_wrapped_buffer():
    # _record_memory_history(skip_actions=["free_requested"]): the counters say 2 were made, the trace has none
    cell = [x for x in CELL if x["action"] != "free_requested"]
    usage, rep = device_usage("cuda:0", BEFORE, AFTER, snap(cell), history="user")
    assert not any("wrapped" in n for n in usage.notes), usage.notes
    assert any("leaves out free_requested entries (skip_actions)" in n for n in usage.notes), usage.notes
    assert usage.peak == 28 * MiB + 512 and rep.frees == "free_completed"
    # a wrapped buffer that kept only the cell's frees proves nothing skipped: still a wrapped buffer
    assert "the buffer wrapped" in device_usage("cuda:0", BEFORE, AFTER, snap(CELL[4:]), history="user")[0].notes[0]
