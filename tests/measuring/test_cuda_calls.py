"""The calls a measured cell makes into ``torch.cuda``, played against an initialised one-GPU machine whose answers
are PyTorch-shaped data: ``memory_stats()`` dicts, ``_snapshot()`` dicts (``tests/engine/cuda/test_history.py`` builds
both from ``c10/cuda/CUDACachingAllocator.cpp`` and ``torch/csrc/cuda/memory_snapshot.cpp``), the history
switch's arguments (``torch/cuda/memory.py``). It checks what the engine asks for, what it puts back, and the
figures of the report; a real GPU runs the same path in ``tests/engine/cuda/test_real_gpu.py``."""

from __future__ import annotations

import contextlib
import types
import weakref

import pytest
import torch

import vram_magic
from tests.support.cuda_shapes import AFTER, BEFORE, CELL, END
from vram_magic.engine.cuda.device import CudaCell

GiB, MiB = 1024**3, 1024**2
TOTAL = 80 * GiB


class FakeGPU:
    """One initialised CUDA device; ``phase`` says whether the cell has run."""

    def __init__(self, user_history: bool = False, snapshot_fails: bool = False, has_getter: bool = True) -> None:
        self.phase = "before"
        self.history = user_history
        self.snapshot_fails = snapshot_fails
        self.has_getter = has_getter
        self.record_calls: list[dict] = []
        self.fraction = 1.0
        self.fraction_calls: list[float] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeGPU:
        mp = monkeypatch
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(torch.cuda, "device_count", lambda: 1)
        mp.setattr(torch.cuda, "is_initialized", lambda: True)
        mp.setattr(torch.cuda, "current_device", lambda: 0)
        mp.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
        mp.setattr(torch.cuda, "memory_stats", lambda index=None: dict(BEFORE if self.phase == "before" else AFTER))
        mp.setattr(torch.cuda, "mem_get_info", lambda index=None: (TOTAL - 30 * GiB, TOTAL))
        mp.setattr(torch.cuda, "get_device_properties", lambda index=None: types.SimpleNamespace(total_memory=TOTAL))
        mp.setattr(torch._C, "_cuda_hasPrimaryContext", lambda index: True, raising=False)
        mp.setattr(torch._C, "_cuda_isHistoryEnabled", lambda: self.history, raising=False)
        mp.setattr(torch.cuda.memory, "_record_memory_history", self.record)
        mp.setattr(torch.cuda.memory, "_snapshot", self.snapshot)
        mp.setattr(torch.cuda, "set_per_process_memory_fraction", self.set_fraction)
        mp.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())  # one device: nothing to switch
        if self.has_getter:
            mp.setattr(torch.cuda, "get_per_process_memory_fraction", lambda index=None: self.fraction, raising=False)
        else:
            mp.delattr(torch.cuda, "get_per_process_memory_fraction", raising=False)
        return self

    def record(self, enabled="all", **kwargs) -> None:
        self.record_calls.append({"enabled": enabled, **kwargs})
        self.history = enabled is not None

    def snapshot(self) -> dict:
        if self.snapshot_fails:
            raise RuntimeError("snapshot failed")
        return {"segments": END, "device_traces": [list(CELL)], "allocator_settings": {}}

    def set_fraction(self, fraction: float, index: int = 0) -> None:
        assert isinstance(fraction, float)
        self.fraction = fraction
        self.fraction_calls.append(fraction)


def test_a_cell_records_history_without_stacks_and_switches_it_off(monkeypatch):
    gpu = FakeGPU().install(monkeypatch)
    cell = CudaCell("cuda:0").start()
    assert gpu.record_calls == [{"enabled": "all", "context": None, "stacks": "python", "max_entries": 300_000,
                                 "clear_history": True}]
    gpu.phase = "after"
    cell.stop()
    assert gpu.record_calls[-1] == {"enabled": None} and not gpu.history
    assert (cell.before, cell.peak) == (8 * MiB, 28 * MiB + 512)
    assert torch.cuda.memory._record_memory_history == gpu.record  # the watcher is gone
    cell.stop()  # a second stop changes nothing
    assert len(gpu.record_calls) == 2


def test_the_users_recording_is_only_read(monkeypatch):
    gpu = FakeGPU(user_history=True).install(monkeypatch)
    cell = CudaCell("cuda:0").start()
    gpu.phase = "after"
    cell.stop()
    assert gpu.record_calls == [] and gpu.history
    assert cell.peak == 28 * MiB + 512


def test_recording_turned_on_in_the_cell_is_left_on(monkeypatch):
    gpu = FakeGPU().install(monkeypatch)
    cell = CudaCell("cuda:0").start()
    torch.cuda.memory._record_memory_history(enabled="all", max_entries=10)  # the cell's own call
    gpu.phase = "after"
    cell.stop()
    assert gpu.history and gpu.record_calls[-1] == {"enabled": "all", "max_entries": 10}
    assert any("turned on memory-history recording itself" in n for n in cell.notes)


def test_budget_sets_and_puts_back_the_fraction_even_when_reading_fails(monkeypatch):
    gpu = FakeGPU(snapshot_fails=True).install(monkeypatch)
    gpu.fraction = 0.5  # the user's own
    cell = CudaCell("cuda:0", budget=4 * GiB).start()
    assert gpu.fraction == 4 * GiB / TOTAL
    gpu.phase = "after"
    cell.stop()  # never raises
    assert gpu.fraction_calls == [4 * GiB / TOTAL, 0.5] and gpu.fraction == 0.5
    assert any("could not be read" in n for n in cell.notes)


def test_budget_without_the_getter_leaves_the_fraction_alone(monkeypatch):
    gpu = FakeGPU(has_getter=False).install(monkeypatch)
    cell = CudaCell("cuda:0", budget=4 * GiB).start()
    gpu.phase = "after"
    cell.stop()
    assert gpu.fraction_calls == []
    assert any("live tensors only" in n for n in cell.notes)


def test_a_start_that_fails_puts_back_the_fraction(monkeypatch):
    gpu = FakeGPU().install(monkeypatch)

    def broken(*args, **kwargs):
        raise ValueError("broken history switch")

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", broken)
    with pytest.raises(ValueError):
        CudaCell("cuda:0", budget=4 * GiB).start()
    assert gpu.fraction_calls == [4 * GiB / TOTAL, 1.0]


def test_measure_reports_the_allocators_figures(monkeypatch):
    gpu = FakeGPU().install(monkeypatch)
    with vram_magic.measure("cuda:0", namespace={}) as m:
        gpu.phase = "after"
    # nothing tracked (no CUDA tensor): before, after and the peak are the allocator's, as "other"
    assert (m.before.total, m.after.total, m.peak.total) == (8 * MiB, 24 * MiB - 512, 28 * MiB + 512)
    assert m.delta.total == 16 * MiB - 512
    assert m.before.details("other") == {"allocator: workspaces, rounding and untracked": 8 * MiB}
    assert m.capacity == TOTAL and m.stats.allocated == 24 * MiB - 512


# --- an out-of-memory cell: the allocator is read after the failed frames are released ----------------------------
class Held:
    """Stands for the CUDA tensors a failed cell's frame held when the allocation ran out of memory."""


def test_an_out_of_memory_cell_reads_the_allocator_after_releasing_its_frames(monkeypatch):
    gpu = FakeGPU().install(monkeypatch)
    held: list[weakref.ref] = []

    def memory_stats(index=None):  # the frame's 1 GiB is allocated while anything holds it
        if gpu.phase == "before":
            return dict(BEFORE)
        alive = sum(1 for r in held if r() is not None)
        return {**AFTER, "allocated_bytes.all.current": AFTER["allocated_bytes.all.current"] + alive * GiB}

    monkeypatch.setattr(torch.cuda, "memory_stats", memory_stats)

    def step():
        activations = Held()
        held.append(weakref.ref(activations))
        gpu.phase = "after"
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                                     "80.00 GiB of which 1.00 GiB is free.")

    m = vram_magic.measure("cuda:0", namespace={})
    with pytest.raises(torch.OutOfMemoryError):
        with m:
            step()
    assert held[0]() is None  # released by the measurement, as a real out-of-memory error leaves it
    # the allocator's figures once the frame's 1 GiB is gone: no 1 GiB of "workspaces, rounding and untracked"
    assert m.after.total == 24 * MiB - 512 and m.delta.total == 16 * MiB - 512
    assert m.oom and not any("differ by" in n for n in m.notes), m.notes


# --- --budget on another device: the current device is left as it was -------------------------------------------
class Devices:
    """``torch.cuda.device(i)`` and the current device of a two-GPU machine whose ``set_per_process_memory_fraction``
    calls ``SetDevice(device)`` and never restores it (``NativeCachingAllocator::setMemoryFraction`` in the 2.5-era
    ``c10/cuda/CUDACachingAllocator.cpp``)."""

    def __init__(self, gpu: FakeGPU) -> None:
        self.current = 0
        self.gpu = gpu
        self.seen: list[int] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> Devices:
        devices = self

        class device:
            def __init__(self, index):
                self.index, self.prev = int(index), None

            def __enter__(self):
                self.prev, devices.current = devices.current, self.index

            def __exit__(self, *exc):
                devices.current = self.prev

        def set_fraction(fraction, index=0):
            self.gpu.set_fraction(fraction, index)
            self.seen.append(self.current)
            self.current = index  # SetDevice(device), never put back

        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "device", device)
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
        return self


def test_budget_on_another_device_leaves_the_current_device(monkeypatch):
    gpu = FakeGPU().install(monkeypatch)
    devices = Devices(gpu).install(monkeypatch)
    cell = CudaCell("cuda:1", budget=4 * GiB).start()
    assert devices.current == 0  # the cell's device="cuda" tensors still go to cuda:0
    gpu.phase = "after"
    cell.stop()
    assert devices.current == 0 and devices.seen == [1, 1]  # both calls made under cuda:1's guard
    assert gpu.fraction_calls == [4 * GiB / TOTAL, 1.0]


def test_budget_leaves_the_allocator_alone_where_a_fraction_would_turn_on_collection(monkeypatch):
    # garbage_collection_threshold collects only once a fraction is set, and setting one cannot be undone
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.6")
    gpu = FakeGPU().install(monkeypatch)
    cell = CudaCell("cuda:0", budget=4 * GiB).start()
    gpu.phase = "after"
    cell.stop()
    assert gpu.fraction_calls == []
    assert any("garbage_collection_threshold:0.6" in n and "live tensors only" in n for n in cell.notes)
    gpu = FakeGPU().install(monkeypatch)
    gpu.fraction = 0.5  # the user set one already: the flag is on anyway, and their fraction is put back
    cell = CudaCell("cuda:0", budget=4 * GiB).start()
    gpu.phase = "after"
    cell.stop()
    assert gpu.fraction_calls == [4 * GiB / TOTAL, 0.5]
