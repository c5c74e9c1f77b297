"""The allocator's state at an out-of-memory error, without a GPU: arming never initialises CUDA (it queues behind
PyTorch's lazy initialisation), the observer keeps a plain copy of what the allocator holds (PyTorch's shapes, as
``tests/support/cuda_shapes.py`` writes them), and the recorded history replayed says whether other settings
would have served the failed request (block sizes worked by hand)."""

from __future__ import annotations

import torch

import vram_magic.engine.cuda.oom_watch as watch_module
from tests.support.cuda_shapes import MiB, segments, stats
from vram_magic.engine import torch_private
from vram_magic.engine.cuda import device as cuda
from vram_magic.engine.cuda.alloc_conf import AllocatorSettings
from vram_magic.engine.cuda.oom_watch import AllocatorAtOom, OomWatch
from vram_magic.engine.cuda.settings_replay import replay, room, what_ifs
from vram_magic.engine.scan.registry import LiveStorages
from vram_magic.oom.build import build_oom_report

GiB = 1 << 30


def fragmented_history() -> list[dict]:
    """Ten 8 MiB tensors (20 MiB segments, two tensors each: 4 MiB of each segment left over), every second one
    freed: 40 MiB free in 8 MiB holes, none of the five segments entirely free."""
    entries = [{"action": "alloc", "addr": 0x1000 + i, "size": 8 * MiB, "stream": 0, "time_us": i} for i in range(10)]
    entries += [{"action": "free_completed", "addr": 0x1000 + i, "size": 8 * MiB, "stream": 0, "time_us": 10 + i}
                for i in range(0, 10, 2)]
    return entries


def test_a_fragmented_history_replayed_under_expandable_segments():
    trace = fragmented_history()
    # five 20 MiB segments (100 MiB reserved, 40 MiB allocated): a 30 MiB request needs a new segment of 30 MiB
    assert replay(trace, AllocatorSettings(), 120 * MiB, 30 * MiB) == (False, -10 * MiB)
    # one expandable segment per pool: the holes are reused as pages are mapped where there is room
    assert replay(trace, AllocatorSettings(expandable_segments=True), 120 * MiB, 30 * MiB) == (True, 0)
    assert room(stats(40 * MiB, 80 * MiB, 10, 5, 5, 5) | {"reserved_bytes.all.current": 100 * MiB},
                limit=2 * GiB, free=2 * GiB - 300 * MiB) == 2 * GiB - 200 * MiB  # 200 MiB held outside PyTorch


def test_what_ifs_from_the_whole_history_and_from_a_bound():
    trace = fragmented_history()
    st = {"reserved_bytes.all.current": 100 * MiB, "allocated_bytes.all.current": 40 * MiB}
    tries, notes = what_ifs(trace, {}, st, limit=120 * MiB, free=20 * MiB, request=30 * MiB, whole=True)
    assert [(w.setting, w.fits, w.margin) for w in tries] == [("expandable_segments:True", True, 0),
                                                              ("max_split_size_mb:128", False, -10 * MiB)]
    assert notes == []
    # part of the history only: expandable segments judged by a bound (40 MiB allocated + the request in 20 MiB
    # pages, 40 MiB, against the 120 MiB room); max_split_size_mb cannot be told
    tries, notes = what_ifs(trace[-3:], {}, st, limit=120 * MiB, free=20 * MiB, request=30 * MiB, whole=False)
    assert [(w.setting, w.fits, w.margin) for w in tries] == [("expandable_segments:True", True, 40 * MiB),
                                                              ("max_split_size_mb:128", None, 0)]
    assert "bound" in notes[0]
    # a replay that serves what the device refused is not this allocator: no what-if is given
    tries, notes = what_ifs(trace, {}, st, limit=1 * GiB, free=900 * MiB, request=30 * MiB, whole=True)
    assert tries == [] and "not be trustworthy" in notes[0]


def test_arming_never_initialises_cuda_and_the_observer_keeps_what_the_allocator_holds(monkeypatch):
    attached, queued, recorded = [], [], []
    monkeypatch.setattr(torch_private, "attach_oom_observer", lambda: attached.append)
    monkeypatch.setattr(torch_private, "lazy_call", queued.append)
    monkeypatch.setattr(torch_private, "cuda_history_enabled", lambda: False)
    monkeypatch.setattr(torch_private, "record_memory_history", lambda: lambda **kw: recorded.append(kw))
    monkeypatch.setattr(cuda, "initialized", lambda: False)
    w = OomWatch(max_entries=1000)
    w.arm()
    assert queued and not attached and not recorded  # nothing before the user's code initialises CUDA
    queued.pop()()  # PyTorch initialises CUDA: the queued start runs
    assert attached == [watch_module._observer]
    assert recorded == [{"enabled": "all", "context": None, "stacks": "python", "max_entries": 1000}]
    seg = segments([(0x7F00_0000_0000, 20 * MiB, 8 * MiB, "active_allocated")])
    seg[0]["blocks"].append({"address": 0x7F00_0140_0000, "size": 12 * MiB, "requested_size": 0,
                             "state": "inactive", "frames": []})
    snap = {"segments": seg, "device_traces": [fragmented_history()], "allocator_settings": {}}
    monkeypatch.setattr(torch_private, "memory_snapshot", lambda: snap)
    monkeypatch.setattr(cuda, "raw_stats", lambda index: stats(8 * MiB, 40 * MiB, 10, 5, 5, 1))
    watch_module._observer(0, 30 * MiB, 16 * GiB, 5 * MiB)
    state = w.take()
    assert isinstance(state, AllocatorAtOom) and w.take() is None
    assert (state.device, state.request, state.limit, state.free) == (0, 30 * MiB, 16 * GiB, 5 * MiB)
    assert state.history_from_start and len(state.trace) == 15 and state.segments == seg
    w.disarm()
    assert recorded[-1] == {"enabled": None}  # our history stopped; the observer stays, silent
    watch_module._observer(0, 1, 1, 1)
    assert w.take() is None


def test_a_cuda_report_reads_the_allocator_at_the_failure():
    seg = segments([(0x7F00_0000_0000, 20 * MiB, 8 * MiB, "active_allocated")])
    seg[0]["blocks"].append({"address": 0x7F00_0140_0000, "size": 12 * MiB, "requested_size": 0,
                             "state": "inactive", "frames": []})
    st = stats(8 * MiB, 40 * MiB, 10, 5, 5, 1) | {"reserved_bytes.all.current": 20 * MiB,
                                                  "inactive_split_bytes.all.current": 12 * MiB,
                                                  "num_alloc_retries": 1, "num_ooms": 1}
    state = AllocatorAtOom(device=0, request=30 * MiB, limit=16 * GiB, free=2 * MiB, stats=st, segments=seg,
                           trace=[{"action": "alloc", "addr": 1, "size": 8 * MiB, "time_us": 5}],
                           history_from_start=False)
    err = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 30.00 MiB. GPU 0 has a total capacity of "
                                 "16.00 GiB of which 2.00 MiB is free.")
    report = build_oom_report(err, where="cell 3", namespace={}, registry=LiveStorages(), state=state)
    c = report.cuda
    assert (c.allocated, c.reserved, c.fragmented, c.largest_free) == (8 * MiB, 20 * MiB, 12 * MiB, 12 * MiB)
    assert c.outside == 16 * GiB - 2 * MiB - 20 * MiB  # the context and other processes
    assert report.capacity == 20 * MiB + 2 * MiB and report.requested == 30 * MiB
    assert report.alive.other == 8 * MiB  # nothing in the namespace: all of it unattributed allocator memory
    assert c.recent == (("", 8 * MiB),)
    assert c.what_ifs[0][:3] == ("expandable_segments:True", False, 22 * MiB - 8 * MiB - 40 * MiB)
    assert any(a.kind == "other-processes" for a in report.advice)
    text = str(report)
    assert "its largest free block 12.0 MiB — too small for the request" in text
    assert report.to_dict() == type(report).from_dict(report.to_dict()).to_dict()
