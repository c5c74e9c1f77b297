"""The engine's CUDA side without a GPU: looking never initialises CUDA, and what ``--budget`` does to the
allocator. The GPU runs the same paths for real (``tests/engine/cuda/test_real_gpu.py``, ``benchmarks/gpu_check.py``).

A machine with two GPUs on which CUDA is not initialised yet is imitated by answering the questions that do not
initialise anything (``torch/cuda/__init__.py``: ``is_available``, ``device_count``, ``is_initialized``) and
making every call that would initialise CUDA or create a context fail the test: ``current_device`` and
``get_device_properties`` (``_lazy_init``), ``mem_get_info`` (a context on the device), ``init``,
``_record_memory_history`` (``lazyInitCUDA`` in ``torch/csrc/cuda/memory_snapshot.cpp``) and
``set_per_process_memory_fraction`` (``_lazy_init`` in ``torch/cuda/memory.py``).
"""

from __future__ import annotations

import pytest
import torch

import vram_magic
from tests.support import run_ok
from vram_magic.engine.cuda import device as cuda
from vram_magic.engine.cuda.device import budget_plan
from vram_magic.session.state import Session

GiB, MiB = 1024**3, 1024**2


@pytest.fixture
def uninitialised_gpus(monkeypatch):
    calls: list[str] = []

    def forbidden(name):
        def call(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} initialises CUDA or creates a context")
        return call

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    for name in ("current_device", "get_device_properties", "mem_get_info", "init", "_lazy_init",
                 "set_per_process_memory_fraction", "memory_stats"):
        monkeypatch.setattr(torch.cuda, name, forbidden(name))
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", forbidden("_record_memory_history"))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", forbidden("_snapshot"))
    yield calls
    assert calls == []


def test_resolving_the_default_device_does_not_initialise_cuda(uninitialised_gpus):
    assert cuda.resolve_device(None) == "cuda:0"
    assert cuda.resolve_device("cuda") == "cuda:0"
    assert cuda.resolve_device("cuda:1") == "cuda:1"
    torch.set_default_device("cuda:1")  # only recorded: no tensor is made
    try:
        assert cuda.resolve_device(None) == "cuda:1"
    finally:
        torch.set_default_device(None)
    with pytest.raises(ValueError, match="2 GPU"):
        cuda.resolve_device("cuda:2")


def test_reading_a_device_that_cuda_has_not_initialised(uninitialised_gpus):
    assert cuda.device_stats("cuda:1") is None
    assert cuda.capacity("cuda:0") is None
    now = Session({"t": torch.zeros(4)}).now()
    assert now.device == "cuda:0" and now.stats is None
    assert any("not initialised" in n for n in now.notes)


def test_vram_all_and_a_default_measured_cell_create_no_context(uninitialised_gpus, shell):
    nows = shell.run_line_magic("vram", "all")
    assert [n.device for n in nows] == ["cpu", "cuda:0", "cuda:1"]
    assert all(any("not initialised" in note for note in n.notes) for n in nows[1:])
    run_ok(shell, "%%vram -q -o r\nimport torch\nx = torch.ones(1000)")
    r = shell.user_ns["r"]
    assert r.device == "cuda:0" and r.peak.total == 0
    assert any("not initialised" in n for n in r.notes)


def test_measure_on_the_default_device_creates_no_context(uninitialised_gpus):
    with vram_magic.measure(namespace={}) as m:
        y = torch.ones(100)
    del y
    assert m.device == "cuda:0" and m.capacity is None and m.stats is None


def test_budget_limits_the_allocator_and_puts_the_users_fraction_back():
    plan = budget_plan(4 * GiB, 80 * GiB, 0, 1.0, "native")
    assert (plan.fraction, plan.restore, plan.notes) == (0.05, 1.0, ())
    # the user's own, stricter fraction stays in force during the cell and is what is put back
    assert budget_plan(8 * GiB, 80 * GiB, 0, 0.05, "native").fraction == 0.05
    assert budget_plan(100 * GiB, 80 * GiB, 0, 1.0, "native").fraction == 1.0


def test_budget_below_what_the_allocator_already_caches_is_said():
    plan = budget_plan(1 * GiB, 80 * GiB, 3 * GiB, 1.0, "native")
    assert plan.fraction == 1 / 80 and "already reserves 3.00 GiB" in plan.notes[0]
    assert budget_plan(1 * GiB, 80 * GiB, 3 * GiB, 1.0, "cudaMallocAsync").notes == ()  # it limits used bytes


def test_budget_without_the_fraction_getter_leaves_the_allocator_alone():
    # torch < 2.6 has no get_per_process_memory_fraction: the user's fraction could not be restored
    plan = budget_plan(4 * GiB, 80 * GiB, 0, None, "native")
    assert plan.fraction is None and plan.restore is None
    assert "live tensors only" in plan.notes[0]
