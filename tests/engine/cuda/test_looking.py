"""Looking initialises nothing at the driver: ``torch.cuda.is_available()`` calls ``cudaGetDeviceCount``, which runs
``cuInit`` (``torch/cuda/__init__.py``: "the default availability inspection ... initializes the CUDA Driver API
via cuInit", unless ``PYTORCH_NVML_BASED_CUDA_CHECK=1``), and a process that ran it cannot use CUDA in forked
children (``%%vram --ranks``, DataLoader workers). Nothing the package does when no CUDA work is asked for may call
it: devices are counted with ``torch.cuda.device_count()``, which asks NVML while CUDA is not initialised. The GPU
run checks the same in a fresh process (``tests/engine/cuda/test_real_gpu.py``)."""

from __future__ import annotations

import traceback

import pytest
import torch
from torch import nn

import vram_magic
from tests.support import run_ok
from vram_magic.engine.cuda import device as cuda
from vram_magic.session.monitor import watch_device


@pytest.fixture
def is_available_calls(monkeypatch):
    """Every call of ``torch.cuda.is_available`` (answered as a CPU-only machine would), with where it came from."""
    calls: list[str] = []

    def counted() -> bool:
        calls.append("".join(traceback.format_stack(limit=14)[:-1]))
        return False

    monkeypatch.setattr(torch.cuda, "is_available", counted)
    return calls


def test_nothing_that_only_looks_calls_is_available(is_available_calls, shell):
    run_ok(shell, "%unload_ext vram_magic")
    run_ok(shell, "%load_ext vram_magic")
    shell.run_line_magic("vram", "")
    shell.run_line_magic("vram", "all")
    run_ok(shell, "%%vram -q -o r1\nimport torch\nx = torch.ones(1000)")
    run_ok(shell, "%%vram -q -o r2\ny = x * 2")
    assert shell.user_ns["r2"].device == "cpu"
    with vram_magic.measure(namespace={}) as m:
        z = torch.ones(100)
    del z
    assert m.device == "cpu"
    est = vram_magic.estimate(nn.Linear(64, 64), torch.randn(4, 64))
    assert est.peak.total > 0
    assert watch_device(None) == "cpu"
    assert is_available_calls == [], f"{len(is_available_calls)} call(s), the first from:\n{is_available_calls[0]}"


def test_devices_are_counted_through_nvml(monkeypatch, is_available_calls):
    # a machine with two GPUs that NVML sees, CUDA not initialised: device_count() answers, nothing else is asked
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert cuda.device_count() == 2
    assert (cuda.resolve_device(None), cuda.resolve_device("cuda:1")) == ("cuda:0", "cuda:1")
    assert watch_device("cuda") == "cuda:0" and watch_device(None) == "cuda:0"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # a CPU-only build, or no GPU
    assert cuda.resolve_device(None) == "cpu"
    with pytest.raises(ValueError, match="CUDA is not available here; use --device cpu"):
        cuda.resolve_device("cuda")
    with pytest.raises(ValueError, match="%vram watch: device 'cuda' asked for"):
        watch_device("cuda")
    assert is_available_calls == []


@pytest.mark.skipif(not hasattr(torch, "accelerator"), reason="torch.accelerator is 2.6+")
def test_the_estimators_optimizer_step_asks_no_accelerator(monkeypatch):
    """Each optimizer step checks for a CUDA graph being captured, which asks whether an accelerator is there
    (``torch.cuda.is_available()`` on 2.5, ``torch.accelerator.current_accelerator`` later): the estimator's
    own optimizer, on fake tensors, skips that check; a real optimizer still makes it."""
    calls = []
    real = torch.accelerator.current_accelerator

    def counted(*args, **kwargs):
        calls.append(args or kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.accelerator, "current_accelerator", counted)
    vram_magic.estimate(nn.Linear(64, 64), torch.randn(4, 64), optimizer="adamw")
    assert calls == []
    real_step = torch.optim.AdamW(nn.Linear(4, 4).parameters())
    for p in real_step.param_groups[0]["params"]:
        p.grad = torch.zeros_like(p)
    real_step.step()
    assert len(calls) >= 1  # the counter sees the check where it is made
