"""The estimator's kernel probes (one real op under PyTorch's profiler, to measure a kernel's scratch) leave nothing
on the process's stderr: the profiler's C++ side prints a line at every start and stop on some builds (torch 2.13's
``USDT: ... profiler_start``), which a notebook shows under the user's ``%vram_estimate`` cell."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from vram_magic.estimator.tracing.scratch import gemm_scratch


def _operand(rows: int, cols: int) -> tuple[str, tuple[int, int], tuple[int, int], torch.dtype]:
    return ("S", (rows, cols), (cols, 1), torch.bfloat16)


def test_gemm_probe_writes_nothing_to_stderr(capfd) -> None:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True):  # the control: what this build prints
        torch.ones(3)
    printed = capfd.readouterr().err
    # shapes no other test probes (the probe's results are cached per shape, so a repeat would not run it)
    scratch = gemm_scratch([(0, "aten.mm.default", (_operand(37, 53), _operand(53, 41)))])
    captured = capfd.readouterr()
    assert captured.err == "" and captured.out == "", (captured.err, "the control printed:", printed)
    assert all(isinstance(n, int) and n > 0 for n in scratch.values())
