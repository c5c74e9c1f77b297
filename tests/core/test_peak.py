"""The peak over a stream of allocation events (``vram_magic.core.events.peak_of``), on deltas worked out by hand."""

from __future__ import annotations

from vram_magic.core.events import Peak, event_deltas, peak_of


def test_the_highest_level_and_the_deltas_applied_there():
    # 100 -> 4196 -> 5220 -> 1124 -> 9316 -> 8292
    assert peak_of([4096, 1024, -4096, 8192, -1024], start=100) == Peak(level=9316, index=4)


def test_a_level_reached_again_counts_where_it_was_first_reached():
    assert peak_of([10, -10, 10]) == (10, 1)


def test_nothing_above_the_start_is_a_peak_at_the_start():
    assert peak_of([-5, -5], start=20) == (20, 0)
    assert peak_of([], start=7) == (7, 0)
    assert peak_of(iter([0, 0])) == (0, 0)  # events that change nothing (an oom or segment entry)


def test_a_spike_counts_only_at_its_index():
    # levels 100, 0, 50; 200 bytes of scratch alive only after the second delta: 0 + 200 is the peak
    assert peak_of([100, -100, 50], spikes={2: 200}) == (200, 2)
    # a spike that does not beat the level leaves the peak where it was
    assert peak_of([100, -100, 50], spikes={3: 10}) == (100, 1)


def test_a_skipped_stretch_is_no_candidate_but_the_level_moves_through_it():
    # levels 100, 400 (skipped), 100, 150
    assert peak_of([100, 300, -300, 50], skip=range(2, 3)) == (150, 4)
    assert peak_of([100, 300, -300, 50], skip=range(2, 3), spikes={4: 1}) == (151, 4)


def test_event_deltas_from_serials_and_their_sizes():
    sizes = {1: 4096, 2: 1024, 3: 512}
    deltas = list(event_deltas([1, 2, -1, 3, -2], sizes))
    assert deltas == [4096, 1024, -4096, 512, -1024]
    assert peak_of(deltas) == (5120, 2)
