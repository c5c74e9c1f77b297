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


def _probed(monkeypatch, scratch_of_rows):
    """Every probe the GEMM scratch makes, as (shapes, strides), answered by ``scratch_of_rows(rows)``."""
    from vram_magic.estimator.tracing import scratch as module

    calls: list[tuple[tuple, tuple]] = []

    def fake_probe(op, args):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        calls.append((tuple(t.shape for t in tensors), tuple(t.stride() for t in tensors)))
        left = tensors[1] if op is torch.ops.aten.addmm.default else tensors[0]
        return scratch_of_rows(left.shape[-2])

    monkeypatch.setattr(module, "_probe_op", fake_probe)
    module._gemm_scratch_for.cache_clear()
    return module, calls


def test_a_tall_gemm_whose_scratch_stopped_growing_is_probed_at_the_cap_and_twice_it(monkeypatch) -> None:
    module, calls = _probed(monkeypatch, lambda rows: 1000 + min(rows, 200) * 3)  # constant from 200 rows on
    cap = module.GEMM_ROWS_CAP
    # a transposed left operand (column-major, 4,096 x 768, stride (1, 4096)) and a row-major right one
    spec = (("S", (4096, 768), (1, 4096), torch.bfloat16), ("S", (768, 8192), (8192, 1), torch.bfloat16))
    assert module._gemm_scratch_for("aten.mm.default", spec) == 1000 + 600
    # two probes, not the whole GEMM: the cap and twice it, the left operand still column-major
    assert calls == [(((cap, 768), (768, 8192)), ((1, cap), (8192, 1))),
                     (((2 * cap, 768), (768, 8192)), ((1, 2 * cap), (8192, 1)))]


def test_a_gemm_whose_scratch_still_grows_is_probed_whole(monkeypatch) -> None:
    module, calls = _probed(monkeypatch, lambda rows: rows * 10)
    cap = module.GEMM_ROWS_CAP
    # batched, row-major: (8, 2048, 64) @ (8, 64, 2048); the batch stride steps over all the rows
    spec = (("S", (8, 2048, 64), (2048 * 64, 64, 1), torch.bfloat16),
            ("S", (8, 64, 2048), (64 * 2048, 2048, 1), torch.bfloat16))
    assert module._gemm_scratch_for("aten.bmm.default", spec) == 20480
    assert [c[0][0] for c in calls] == [(8, cap, 64), (8, 2 * cap, 64), (8, 2048, 64)]
    assert calls[0][1][0] == (cap * 64, 64, 1)


def test_addmm_cuts_a_bias_with_rows_and_keeps_a_broadcast_one(monkeypatch) -> None:
    module, calls = _probed(monkeypatch, lambda rows: 77)
    full = (("S", (1024, 32), (32, 1), torch.bfloat16), ("S", (1024, 16), (16, 1), torch.bfloat16),
            ("S", (16, 32), (32, 1), torch.bfloat16))
    assert module._gemm_scratch_for("aten.addmm.default", full) == 77
    assert calls[0][0] == ((256, 32), (256, 16), (16, 32))
    calls.clear()
    row = (("S", (32,), (1,), torch.bfloat16),) + full[1:]
    assert module._gemm_scratch_for("aten.addmm.default", row) == 77
    assert calls[0][0] == ((32,), (256, 16), (16, 32))


def test_small_gemms_are_probed_whole_and_big_ones_only_at_the_cap(monkeypatch) -> None:
    module, calls = _probed(monkeypatch, lambda rows: 5)
    spec = (("S", (512, 64), (64, 1), torch.bfloat16), ("S", (64, 64), (64, 1), torch.bfloat16))
    assert module._gemm_scratch_for("aten.mm.default", spec) == 5 and [c[0][0] for c in calls] == [(512, 64)]
    calls.clear()
    # operands over the probe budget: once measured nowhere (0); now at the cap, where its scratch stopped growing
    huge = (("S", (2**22, 64), (64, 1), torch.bfloat16), ("S", (64, 64), (64, 1), torch.bfloat16))
    assert module._gemm_scratch_for("aten.mm.default", huge) == 5
    assert [c[0][0] for c in calls] == [(256, 64), (512, 64)]


def test_capped_probes_of_real_gemms_agree_with_whole_ones() -> None:
    """On this machine's oneDNN: where the two capped probes agree, the whole GEMM's scratch is theirs (the rule's
    premise, checked on real bf16 GEMMs of a small GPT-2's shapes)."""
    from vram_magic.estimator.tracing import scratch as module

    module._gemm_scratch_for.cache_clear()
    for k, n in ((256, 1000), (1000, 256)):
        spec = (("S", (2048, k), (k, 1), torch.bfloat16), ("S", (k, n), (n, 1), torch.bfloat16))
        small, large, whole = (module._gemm_probe(torch.ops.aten.mm.default, module._with_rows(
            "aten.mm.default", spec, r)) for r in (256, 512, 2048))
        if small == large:
            assert whole == large, (k, n, small, large, whole)
        assert module._gemm_scratch_for("aten.mm.default", spec) == whole
