"""Mixed precision with fp32 master weights, and ZeRO's sharding of it: the ZeRO paper's Table 1, a real
mixed-precision step on the CPU, and bytes worked out by hand."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vram_magic
from tests.support.zoo import profiled_cpu_peak

# Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", Table 1:
# per-device memory of model states in GB for a 7.5 B-parameter model with Adam (K = 12), mixed precision.
TABLE_1 = {  # N_d: (ZeRO-1 "P_os", ZeRO-2 "P_os+g", ZeRO-3 "P_os+g+p")
    1: (120, 120, 120),
    4: (52.5, 41.3, 30),
    16: (35.6, 21.6, 7.5),
    64: (31.4, 16.6, 1.88),
}


def seven_and_a_half_billion() -> nn.Module:
    # 3 x 50,000 x 50,000 = 7.5e9 parameters, built on fake tensors (no memory)
    return nn.Sequential(*[nn.Linear(50_000, 50_000, bias=False) for _ in range(3)])


@pytest.mark.parametrize("devices", list(TABLE_1))
def test_zero_paper_table_1_model_states_per_device(devices):
    for stage, paper_gb in zip((1, 2, 3), TABLE_1[devices]):
        est = vram_magic.estimate(seven_and_a_half_billion, lambda: torch.randn(1, 50_000), optimizer="adam",
                                  dtype="bf16", master_weights="fp32", zero=stage if devices > 1 else None,
                                  world=devices)
        assert est.parameters == 7_500_000_000
        ours_gb = est.model_states / 1e9
        assert abs(ours_gb - paper_gb) / paper_gb < 0.01, (devices, stage, ours_gb, paper_gb)
        if devices > 1:
            assert any(f"ZeRO-{stage} shards" in n and f"across {devices} ranks" in n for n in est.notes)


def test_table_1_by_formula_to_the_byte():
    # (2 + 2 + K) * psi / N_d for ZeRO-3 with psi = 7.5e9, K = 12 and N_d = 64: the host keeps Adam's step counters
    est = vram_magic.estimate(seven_and_a_half_billion, lambda: torch.randn(1, 50_000), optimizer="adam",
                              dtype="bf16", master_weights="fp32", zero=3, world=64)
    assert est.model_states == 3 * (-(-(2 * 2_500_000_000) // 64)) * 2 + 3 * (-(-(12 * 2_500_000_000) // 64))


# Linear(1024, 4096)
P = 1024 * 4096 + 4096
STEP = 2 * 4


def test_master_weights_bytes_by_hand():
    m = nn.Linear(1024, 4096)
    est = vram_magic.estimate(m, torch.randn(8, 1024), optimizer="adamw", dtype="bf16", master_weights="fp32",
                              device="cpu")
    assert est.peak["parameters"] == 2 * P
    # fp32 master copy + exp_avg + exp_avg_sq (fp32, of the master) + step counters
    assert est.peak["optimizer_state"] == 3 * 4 * P + STEP
    assert est.model_states == 2 * P + 2 * P + 12 * P + STEP
    assert "fp32 master weights" in est.description
    assert any("2 + 2 + 12 bytes per parameter" in n for n in est.notes)
    assert m.weight.dtype == torch.float32 and m.weight.grad is None


def test_master_weights_step_matches_a_real_mixed_precision_step():
    """Two steps as mixed-precision trainers run them: bf16 model, fp32 master copy updated by AdamW, gradients
    cast to fp32 for the update and the result copied back."""
    from torch.profiler import ProfilerActivity, profile

    def build():
        return nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512))

    x = torch.randn(64, 512)
    est = vram_magic.estimate(build, x, optimizer="adamw", dtype="bf16", master_weights="fp32", device="cpu")
    torch.manual_seed(0)
    model = build().to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    params = list(model.parameters())
    masters = [nn.Parameter(p.detach().float()) for p in params]
    base = sum(t.untyped_storage().nbytes() for t in [*params, *masters, xb])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        opt = torch.optim.AdamW(masters, foreach=False)
        for _ in range(2):
            out = model(xb)
            loss = out.sum()
            loss.backward()
            for p, m in zip(params, masters):
                m.grad = p.grad.to(torch.float32)
            opt.step()
            with torch.no_grad():
                for p, m in zip(params, masters):
                    m.grad = None
                    p.copy_(m)
            opt.zero_grad(set_to_none=True)
            for p in params:
                p.grad = None
            del out, loss
    real = base + profiled_cpu_peak(prof)
    assert abs(est.peak.total - real) / real < 0.005, (est.peak.total, real)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"master_weights": "fp32"}, "dtype='bf16'"),
        ({"master_weights": "fp32", "dtype": "fp32"}, "dtype='bf16'"),
        ({"master_weights": "fp8", "dtype": "bf16"}, "'fp32'"),
        ({"master_weights": "fp32", "dtype": "bf16", "inference": True}, "training"),
    ],
)
def test_master_weights_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        vram_magic.estimate(nn.Linear(4, 4), torch.randn(2, 4), **kwargs)


def test_magic_master_weights_and_zero(shell):
    shell.run_cell("import torch, torch.nn as nn\nm = nn.Linear(1024, 4096)")
    r = shell.run_cell("%vram_estimate m --shape 1024 --batch 8 --dtype bf16 --master-weights fp32 --zero 2 "
                       "--world 8 -o est -q")
    assert r.error_in_exec is None
    est = shell.user_ns["est"]
    assert est.model_states == 2 * P + -(-(2 * P) // 8) + -(-(12 * P) // 8)
    assert "ZeRO-2 shards" in str(est)
