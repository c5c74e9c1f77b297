"""Kernel scratch on the CPU under the default (tracker) backend: what ops allocate and free inside themselves
counts at the peak, against PyTorch's profiler on the same runs unmeasured."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import vram_magic
from tests.support import run_ok
from tests.support.zoo import convnet, profiled_cpu_peak, real_peak, storage_bytes

F32 = 4
SCRATCH = "kernel scratch (inside ops)"
TOLERANCE = 0.01


def _int8_mlp() -> nn.Module:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(
            nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024)), {nn.Linear}, dtype=torch.qint8)


def _profiled_forward(model: nn.Module, x: torch.Tensor) -> int:
    with torch.no_grad():
        model(x)  # the first call may pack or cache: the measured call is the second, as here
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            y = model(x)
            del y
    return profiled_cpu_peak(prof)


def test_int8_forward_counts_the_quantized_kernels_accumulator():
    model, x = _int8_mlp(), torch.randn(64, 1024)
    real = _profiled_forward(model, x)
    with vram_magic.measure(namespace={"model": model, "x": x}) as m, torch.no_grad():
        y = model(x)
        del y
    assert m.backend == "tracker"
    # fbgemm's linear_dynamic accumulates in an int32 buffer of the output's shape: 64 x 1024 x 4 bytes, alive
    # with the second layer's input and output (64 x 1024 fp32 each)
    assert m.peak.details("other")[SCRATCH] == 64 * 1024 * 4
    assert m.peak.total - m.before.total == 3 * 64 * 1024 * F32 == real
    assert m.peak_sites(1)[0][1] == real  # the block's own line holds it all


def test_int8_forward_in_a_cell(shell):
    run_ok(shell, "import torch, torch.nn as nn, warnings\nwarnings.simplefilter('ignore')\ntorch.manual_seed(0)\n"
                  "q = torch.ao.quantization.quantize_dynamic(nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), "
                  "nn.Linear(1024, 1024)), {nn.Linear}, dtype=torch.qint8)\nx = torch.randn(64, 1024)")
    run_ok(shell, "%%vram -q -o r\nwith torch.no_grad():\n    y = q(x)")
    r = shell.user_ns["r"]
    assert r.backend == "tracker"
    assert r.peak.total - r.before.total == 3 * 64 * 1024 * F32  # y, the second layer's input, the int32 buffer
    assert r.after.total - r.before.total == 64 * 1024 * F32


def test_conv_net_training_step_within_one_percent_of_the_profiler():
    build, inputs = convnet, lambda: torch.randn(8, 3, 32, 32)
    real = real_peak(build, inputs, steps=2)  # the same two AdamW steps, unmeasured, under the profiler
    torch.manual_seed(0)
    model, x = build(), inputs()
    base = storage_bytes(*model.parameters(), *model.buffers(), x)
    with vram_magic.measure(namespace={"model": model, "x": x}) as m:
        opt = torch.optim.AdamW(model.parameters(), foreach=False)
        for _ in range(2):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert m.backend == "tracker"
    measured = m.peak.total - m.before.total
    assert abs(measured - (real - base)) <= TOLERANCE * (real - base), (measured, real - base)
    # oneDNN's reorders are a good part of it: without them the tracker would read low by far more than 1 %
    assert m.peak.details("other")[SCRATCH] > 0.05 * measured
    assert any(b.label == SCRATCH and b.phase == "backward" for b in m.trace.blocks.values())


def test_gemm_operand_copy_by_hand():
    x, w = torch.randn(512, 1024), torch.randn(512, 256)
    strided = x[:, ::2]  # 512 x 512, strides (1024, 2): BLAS cannot take it, the GEMM copies it contiguous first
    for backend in ("tracker", "allocator"):
        with vram_magic.measure(namespace={"x": x, "w": w}, backend=backend) as m:
            out = strided @ w
            del out
        assert m.peak.total - m.before.total == 512 * 256 * F32 + 512 * 512 * F32, backend
    assert m.after.total == m.before.total


def test_a_profiler_started_inside_the_block_wins():
    x, w = torch.randn(8, 3, 16, 16), torch.randn(4, 3, 3, 3)
    with vram_magic.measure() as m:
        torch.nn.functional.conv2d(x, w)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            y = torch.nn.functional.conv2d(x, w)
        del y
    assert len(prof.key_averages()) > 0  # the user's profiler recorded
    assert any("ended the recording of kernel scratch" in n for n in m.notes)
    with profile(activities=[ProfilerActivity.CPU]):
        with vram_magic.measure() as m:
            torch.nn.functional.conv2d(x, w)
    assert any("another profiler was recording" in n for n in m.notes)


def test_nested_blocks():
    """The inner block cannot record while the outer one does (one profiler at a time) and says so; the outer one
    counts the scratch of every op, the inner block's too."""
    torch.manual_seed(0)
    conv, x = nn.Conv2d(16, 32, 3), torch.randn(8, 16, 32, 32)
    ns = {"conv": conv, "x": x}
    with torch.no_grad():
        conv(x)
        with vram_magic.measure(namespace=ns) as flat:
            y = conv(x)
            z = conv(x)
            del y, z
        with vram_magic.measure(namespace=ns) as outer:
            y = conv(x)
            with vram_magic.measure(namespace=ns) as inner:
                z = conv(x)
            del y, z
    assert flat.peak.details("other")[SCRATCH] > 0
    assert any("another profiler was recording" in n for n in inner.notes)
    assert not any("profiler" in n for n in outer.notes)
    assert outer.peak.total - outer.before.total == flat.peak.total - flat.before.total


@pytest.mark.parametrize("raises", [False, True])
def test_the_cells_exception_and_the_history(shell, raises):
    run_ok(shell, "import torch\nconv = torch.nn.Conv2d(16, 32, 3)\nx = torch.randn(8, 16, 32, 32)")
    body = "y = conv(x)\nz = y.sum()" + ("\nraise ValueError('stop')" if raises else "")
    result = shell.run_cell(f"%%vram -q -o r\n{body}", store_history=True)
    assert isinstance(result.error_in_exec, ValueError) if raises else result.error_in_exec is None
    r = shell.user_ns["r"]
    trace = r.trace
    assert all(abs(ev) in trace.blocks for ev in trace.events)
    totals = trace.totals()
    assert max(sum(v[i] for v in totals.values()) for i in range(len(trace.events) + 1)) == r.peak.total


# --- --budget: the scratch counts in the simulated out-of-memory --------------------------------------------------
MiB = 1 << 20


def test_budget_sees_a_gemms_operand_copy():
    """2.5 MiB alive; the GEMM returns 512 KiB and copies its strided 1 MiB operand inside: 3 MiB by tensors, 4 MiB
    with the copy."""
    x, w = torch.randn(512, 1024), torch.randn(512, 256)
    ns = {"x": x, "w": w}
    with pytest.raises(torch.OutOfMemoryError, match="tried to allocate 1.00 MiB"):
        with vram_magic.measure(namespace=ns, budget=int(3.5 * MiB)) as m:
            out = x[:, ::2] @ w
    assert m.oom and m.oom.requested == 512 * 512 * F32
    assert m.oom.live.total == 3 * MiB  # the inputs and the GEMM's result, when its copy was asked for
    with vram_magic.measure(namespace=ns, budget=4 * MiB) as m:
        out = x[:, ::2] @ w
        del out
    assert not m.oom and m.peak.total == 4 * MiB and m.peak.details("other")[SCRATCH] == 1 * MiB


def _conv_block(budget: int | None, calls: int = 1) -> tuple[object, Exception | None]:
    torch.manual_seed(0)
    conv, x = nn.Conv2d(16, 32, 3), torch.randn(8, 16, 32, 32)
    ns = {"conv": conv, "x": x}
    error = None
    with torch.no_grad():
        conv(x)
        try:
            with vram_magic.measure(namespace=ns, budget=budget) as m:
                ys = [conv(x) for _ in range(calls)]
                del ys
        except torch.OutOfMemoryError as err:
            error = err
    return m, error


@pytest.mark.parametrize("calls", [1, 2])
def test_budget_sees_a_convolutions_scratch(calls):
    """oneDNN's reorders inside the convolution: measured at the allocator for the first call and known for the
    second (the same shapes); a budget one byte short of the peak with them raises, where the tensors alone fit."""
    free, error = _conv_block(None, calls)
    assert error is None
    scratch, peak = free.peak.details("other")[SCRATCH], free.peak.total
    assert scratch > 0
    fits, error = _conv_block(peak, calls)
    assert error is None and not fits.oom
    assert (fits.peak.total, fits.peak.details("other")[SCRATCH]) == (peak, scratch)
    tight, error = _conv_block(peak - 1, calls)
    assert isinstance(error, torch.OutOfMemoryError) and tight.oom
    assert tight.oom.requested <= scratch  # what the kernel asked for beyond what the op returned
    assert peak - scratch <= peak - 1  # by its tensors alone the block fits


def test_budget_in_a_cell_raises_at_the_convolution(shell):
    run_ok(shell, "import torch\ntorch.manual_seed(0)\nconv = torch.nn.Conv2d(16, 32, 3)\n"
                  "x = torch.randn(8, 16, 32, 32)\nwith torch.no_grad():\n    conv(x)")
    run_ok(shell, "%%vram -q -o free\nwith torch.no_grad():\n    y = conv(x)\ndel y")
    free = shell.user_ns["free"]
    budget = free.peak.total - 1
    result = shell.run_cell(f"%%vram -q -o r --budget {budget}\nwith torch.no_grad():\n    y = conv(x)")
    assert isinstance(result.error_in_exec, torch.OutOfMemoryError)
    r = shell.user_ns["r"]
    assert r.oom and r.after.total == r.before.total
