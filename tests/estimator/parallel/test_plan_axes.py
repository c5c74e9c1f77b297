"""Tensor and pipeline parallelism as axes of the planner (``allow="parallel"``): their time costs on hand-worked
formulas (the ring all-reduces of tensor parallelism, the pipeline bubble (p − 1)/(m + p − 1)), the collectives a
traced tensor-parallel rank makes, and real plans whose pipeline rows are estimated exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import vram_magic
from vram_magic.estimator.layouts.tensor import collective_volumes
from vram_magic.estimator.options import make_options
from vram_magic.estimator.planning.planner import model_parallel_choices
from vram_magic.estimator.timing.cost import (
    COLLECTIVE_LATENCY,
    LINK_EFFICIENCY,
    bubble_time,
    pipeline_bubble,
    tensor_parallel,
)

F32 = 4


def test_tensor_parallel_all_reduces_are_two_ring_passes() -> None:
    """Megatron's 2 all-reduces per block forward and 2 backward of b·s·h activations: an all-reduce moves
    2(t − 1)/t of its bytes over each link."""
    b, s, h, blocks, t = 8, 1024, 4096, 32, 4
    volume = 4 * blocks * b * s * h * 2  # bf16
    bw = 300e9
    seconds = tensor_parallel({"all-reduce": volume}, t, bw, count=4 * blocks)
    assert seconds == pytest.approx(2 * (t - 1) / t * volume / (bw * LINK_EFFICIENCY))
    # gathers and scatters are one pass of the whole (a reduce-scatter returns 1/t of it)
    assert tensor_parallel({"all-gather": 1e9}, 2, 1e9) == pytest.approx(0.5 / LINK_EFFICIENCY)
    assert tensor_parallel({"reduce-scatter": 0.5e9}, 2, 1e9) == pytest.approx(0.5 / LINK_EFFICIENCY)
    assert tensor_parallel({"all-reduce": 10.0}, 8, 1e12, count=100) == pytest.approx(100 * COLLECTIVE_LATENCY)
    assert tensor_parallel({"all-reduce": volume}, 1, bw) == 0.0


def test_the_pipeline_bubble() -> None:
    assert pipeline_bubble(4, 8) == pytest.approx(3 / 11)
    # a stage busy 1 s idles the bubble's share of a step of 1 / (1 − 3/11) s: (p − 1)/m of its work
    assert bubble_time(1.0, 4, 8) == pytest.approx(3 / 8)
    assert bubble_time(1.0, 1, 8) == 0.0


def test_a_traced_tensor_parallel_rank_names_its_collectives() -> None:
    """The MLP of tests/support/parallel_runs.py, 3 blocks on 2 ranks, batch 256: each block's rowwise output is
    all-reduced in the forward (3), and each colwise layer's input gradient in the backward but the first's, whose
    input needs none (2): five all-reduces of 256 × 256 fp32."""
    blocks = nn.Sequential(*[nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(3)])
    plan = {}
    for i in range(3):
        plan[f"{i}.0"], plan[f"{i}.2"] = ColwiseParallel(), RowwiseParallel()
    est = vram_magic.estimate(blocks, torch.randn(256, 256), device="cpu", tp=2, parallelize_plan=plan,
                              loss_fn=lambda out: out.sum())
    trace = est.rerun.trace(est.options)
    volumes, count = collective_volumes(trace)
    assert volumes == {"all-reduce": 5 * 256 * 256 * F32} and count == 5


def test_a_tensor_parallel_rank_keeps_fp32_master_weights_of_its_own_shard() -> None:
    """bf16 weights with an fp32 master copy (Megatron's mixed precision) on 2 tensor-parallel ranks: each master is
    the rank's shard, not the whole weight (it was, and AdamW's update failed on the shapes). Per block a rank holds
    the column-wise Linear(256, 1024)'s 512 × 256 weight and 512 biases, the row-wise Linear(1024, 256)'s 256 × 512
    weight and its 256 biases whole: 262,912 values, 788,736 over 3 blocks."""
    blocks = nn.Sequential(*[nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(3)])
    plan = {}
    for i in range(3):
        plan[f"{i}.0"], plan[f"{i}.2"] = ColwiseParallel(), RowwiseParallel()
    est = vram_magic.estimate(blocks, torch.randn(256, 256), device="cpu", tp=2, parallelize_plan=plan, dtype="bf16",
                              master_weights="fp32", loss_fn=lambda out: out.float().sum())
    values = 3 * (512 * 256 + 512 + 256 * 512 + 256)
    assert values == 788_736
    detail = dict(((cat, what), n) for cat, what, n in est.peak.detail)
    assert est.peak.parameters == 2 * values and est.peak.gradients == 2 * values
    assert detail["optimizer_state", "fp32 master weights"] == F32 * values
    assert detail["optimizer_state", "exp_avg"] == detail["optimizer_state", "exp_avg_sq"] == F32 * values
    assert est.peak.optimizer_state == 3 * F32 * values + 6 * 2 * 4  # and AdamW's step counter per parameter


def test_the_planner_offers_tensor_and_pipeline_parallelism_when_allowed() -> None:
    base = make_options()
    assert model_parallel_choices(base, 16, 4, allowed=False) == []
    space = model_parallel_choices(base, 16, 4, allowed=True)
    layouts = {(c.tp, c.pp) for c in space}
    assert layouts == {(2, 1), (4, 1), (1, 2), (2, 2), (1, 4)}
    # a pipeline's micro-batches: p, 2p and 4p of the data-parallel group's batch
    assert sorted({c.accumulate for c in space if c.pp == 2 and c.tp == 1}) == [2, 4, 8]
    assert all(c.micro * c.accumulate * 4 // (c.tp * c.pp) == 16 for c in space)


def test_a_plan_with_pipeline_rows_reproduced_by_estimate() -> None:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(4)])
    plan = vram_magic.plan(model, torch.randn(32, 256), gpu="A100-80GB", gpus=2, allow="parallel", top=40,
                           loss_fn=lambda out: out.sum())
    piped = [r for r in plan.rows if r.options.get("pp")]
    assert piped, [r.name for r in plan.rows]
    row = piped[0]
    assert row.time["bubble"] > 0 and "pipeline × 2" in row.name
    assert any("bubble" in t for t in row.tradeoffs)
    again = vram_magic.estimate(model, torch.randn(32, 256), loss_fn=lambda out: out.sum(), **row.options)
    assert again.needed == row.needed
    # the Sequential has no tensor-parallel plan: those combinations never fit, and say why
    assert not any(r.options.get("tp") for r in plan.rows)
