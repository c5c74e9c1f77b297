"""The allocator backend's count of what was alive before the block: PyTorch's profiler does not report the CPU
allocator's free of a block made before the recording (c10's ``ProfiledCPUMemoryReporter::Delete`` logs a line
instead), so those frees come from the registry's weakref callbacks, at their times; CUDA's caching allocator
reports every free (``CUDACachingAllocator.cpp``, ``reportMemoryUsageToProfiler`` in ``free``), and each counts
once. Both backends must give the same figures, worked out by hand."""

from __future__ import annotations

import pytest
import torch

import vram_magic
from vram_magic.engine.profiler.recorder import FORWARD, AllocatorRecorder, MemoryEvent, Recording, replay
from vram_magic.engine.scan.registry import LiveStorages
from vram_magic.measuring.measurement import Measurement

MiB = 1 << 20
N = 1 << 20  # floats: 4 MiB

# (the block's code, peak, after) with `big` (4 MiB) alive before it
CASES = [
    ("del big\ny = torch.empty(N)", 4 * MiB, 4 * MiB),  # freed, the same size made again
    ("del big", 4 * MiB, 0),  # freed, nothing made
    ("del big\ny = torch.empty(2 * N)", 8 * MiB, 8 * MiB),  # freed, a bigger one made
    ("v = big[:10]\ndel big\ny = torch.empty(N)", 8 * MiB, 8 * MiB),  # a view keeps the storage alive
    ("y = torch.empty(N)\ndel big", 8 * MiB, 4 * MiB),  # made first, then freed
    ("big = torch.empty(N)", 8 * MiB, 4 * MiB),  # replaced: the new one is made before the old one goes
]


def _measure(ns: dict, backend: str) -> Measurement:
    """A block on a registry of its own: what another test left alive is no part of its ``before``."""
    return Measurement("cpu", namespace=ns, registry=LiveStorages(), backend=backend)


@pytest.mark.parametrize("backend", ["allocator", "tracker"])
@pytest.mark.parametrize(("code", "peak", "after"), CASES)
def test_frees_of_what_was_alive_before(backend, code, peak, after):
    ns = {"torch": torch, "N": N, "big": torch.empty(N)}
    with _measure(ns, backend) as m:
        exec(code, ns)
    assert m.backend == backend
    assert m.before.total == 4 * MiB
    assert (m.peak.total, m.after.total) == (peak, after), m.trace.events
    assert m.delta.total == after - 4 * MiB


def test_the_free_is_in_the_history_at_its_time():
    ns = {"torch": torch, "N": N, "big": torch.empty(N)}
    with _measure(ns, "allocator") as m:
        exec("del big\ny = torch.empty(N)\nz = torch.empty(N // 2)", ns)
    trace = m.trace
    assert [trace.blocks[abs(ev)].size * (1 if ev > 0 else -1) for ev in trace.events] == \
        [-4 * MiB, 4 * MiB, 2 * MiB]
    assert m.peak.total == 6 * MiB  # y and z, not big beside them


def test_nested_in_a_tracked_block():
    """With the default registry: the inner block has one of its own, as the outer one listens to the shared one."""
    ns = {"torch": torch, "N": N, "big": torch.empty(N)}
    with vram_magic.measure(namespace=ns) as outer:
        with vram_magic.measure(namespace=ns, backend="allocator") as inner:
            exec("del big\ny = torch.empty(N)", ns)
    assert (outer.backend, inner.backend) == ("tracker", "allocator")
    for m in (outer, inner):
        assert (m.before.total, m.peak.total, m.after.total) == (4 * MiB, 4 * MiB, 4 * MiB), m.backend


def test_the_recorder_listens_beside_whoever_listened_before():
    registry = LiveStorages()
    heard: list[int] = []
    registry.on_free = lambda entry: heard.append(entry.serial)
    listening = registry.on_free
    a, b = torch.empty(16), torch.empty(16)
    first, second = registry.add(a.untyped_storage()), registry.add(b.untyped_storage())
    recorder = AllocatorRecorder("cpu", registry=registry).start()
    try:
        del a
    finally:
        rec = recorder.stop()
    assert registry.on_free is listening
    assert heard == [first.serial]
    assert [serial for _, serial in rec.released] == [first.serial]
    assert rec.alive == {second.serial}
    del b
    assert heard == [first.serial, second.serial]


def test_a_free_no_listener_heard_counts_at_the_end():
    """A block measured inside on the same registry takes the registry's listener and does not give it back: a
    storage of before freed after it is found gone at the end."""
    registry = LiveStorages()
    ns = {"torch": torch, "N": N, "big": torch.empty(N)}
    with Measurement("cpu", namespace=ns, registry=registry, backend="allocator") as outer:
        with Measurement("cpu", namespace={}, registry=registry, backend="tracker"):
            pass
        assert registry.on_free is None
        exec("del big", ns)
    assert (outer.report.before.total, outer.report.after.total) == (4 * MiB, 0)


# --- the replay on recordings shaped as the profiler gives them (allocator.read_events: sorted MemoryEvents) ------
A, B = 0x7F00_0000_0000, 0x7F00_1000_0000  # the addresses of a storage alive at the start and of a new block


def _replay(events, released, alive=None):
    serials = iter(range(100, 200))
    rec = Recording(events=events, released=released, alive=alive)
    return replay(rec, {1: (A, 4 * MiB)}, lambda: next(serials))


def test_replay_counts_a_free_reported_twice_once():
    """CUDA: the profiler reports the free of a block made before the recording, and the registry hears it too
    (before or after it, by the clocks)."""
    for released_at in (5, 15):
        rep = _replay([MemoryEvent(10, A, -4 * MiB, FORWARD), MemoryEvent(20, B, 4 * MiB, FORWARD)],
                      [(released_at, 1)], alive=set())
        assert list(rep.events) == [-1, 100], released_at
        assert (rep.peak, rep.current, rep.late) == (4 * MiB, 4 * MiB, {}), released_at


def test_replay_a_free_heard_late_on_reused_memory():
    """The CPU allocator hands the freed block's address to the next allocation; the registry's time for the free
    comes after it (the two clocks disagree by a little): the memory was free before it was reused."""
    rep = _replay([MemoryEvent(20, A, 4 * MiB, FORWARD)], [(21, 1)], alive=set())
    assert list(rep.events) == [-1, 100]
    assert (rep.peak, rep.current) == (4 * MiB, 4 * MiB)
    assert rep.addr == {100: A}


def test_replay_without_the_registry_as_before():
    rep = _replay([MemoryEvent(20, B, 4 * MiB, FORWARD)], [], alive=None)
    assert list(rep.events) == [100]
    assert (rep.peak, rep.current) == (8 * MiB, 8 * MiB)
    gone = _replay([MemoryEvent(20, B, 4 * MiB, FORWARD)], [], alive=set())  # gone at the end, never heard
    assert list(gone.events) == [100, -1]
    assert (gone.peak, gone.current) == (8 * MiB, 4 * MiB)


@pytest.mark.cuda
def test_frees_of_what_was_alive_before_on_cuda():
    """On a GPU the profiler reports the free as well as the registry: counted once (sizes are whole 512 B blocks
    here, and the caching allocator's own counters agree)."""
    ns = {"torch": torch, "N": N, "big": torch.empty(N, device="cuda")}
    torch.cuda.synchronize()
    with vram_magic.measure("cuda", namespace=ns, backend="allocator") as m:
        exec("del big\ny = torch.empty(N, device='cuda')", ns)
    assert m.backend == "allocator"
    assert m.peak.total - m.before.total == 0
    assert m.after.total == m.before.total
