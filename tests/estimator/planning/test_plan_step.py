"""``plan(model, inputs, step=fn)``: the user's own step planned as written — only what the step leaves to the planner
searched, each row's memory ``estimate(model, inputs, step=fn, **row.options)`` and its difference from the plain
plan's worked out by hand; the conflicts refused; ``%vram_plan --step``; a partial row marked in ``Plan.figure()``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vram_magic
from tests.support import run_ok
from vram_magic.core.breakdown import Breakdown
from vram_magic.estimator.planning.result import Plan, PlanRow

#: the extra buffer the hand-written step holds from before its forward to after its update: 1 MiB of fp32
HELD = 262_144


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))


def batch() -> torch.Tensor:
    return torch.randn(8, 256, generator=torch.Generator().manual_seed(1))


def holding_step(model, batch, optimizer):
    """The built-in step (output kept through backward, the sum as the loss) with 1 MiB held across the whole step."""
    held = torch.zeros(HELD, device=batch.device)
    out = model(batch)
    loss = out.sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    del held


def test_a_step_plan_is_its_estimate_and_one_buffer_above_the_plain_plan():
    """On the CPU nothing is left to search but the step itself: its one row is ``estimate(step=fn)``, 1 MiB (the
    buffer held through the step, 262,144 × 4 bytes) above the plain plan's row of the same batch, whose step is
    the built-in one."""
    plain = vram_magic.plan(mlp, batch(), device="cpu", budget="1GiB")
    mine = vram_magic.plan(mlp, batch(), device="cpu", budget="1GiB", step=holding_step)
    assert mine.step == "holding_step" and len(mine.rows) == 1 and len(mine.scored) == 1
    row = mine.rows[0]
    assert row.name == "your holding_step as written" and row.micro_batch == 8 and row.accumulate == 1
    assert "step" not in row.options
    est = vram_magic.estimate(mlp, batch(), step=holding_step, **row.options)
    assert row.peak == est.peak and row.needed == est.needed and row.fits is est.fits is True
    same = next(r for r in plain.rows if r.name == "as it is")
    assert row.peak.total - same.peak.total == HELD * 4 == 1024 * 1024
    assert row.step_time > 0 and sum(row.time.values()) == pytest.approx(row.step_time)
    text = str(mine)
    assert "your step holding_step() as written" in text.splitlines()[0]
    assert "estimate(model, inputs, step=holding_step, **plan.best.options)" in text
    assert "checkpointing, precision, accumulation, the loss and the recipes' levers are the step's" in text
    from vram_magic.estimator.cli.plan_cmd import as_json

    assert as_json(mine)["step"] == "holding_step" and as_json(plain)["step"] is None


def test_over_gpus_only_the_sharding_and_the_offload_are_searched():
    """Over two GPUs: the step as written with DDP, ZeRO-1/2/3, each with the optimizer's state on the host — no
    checkpointing, autocast, accumulation or lever; every row its exact estimate with step=, 1 MiB above the plain
    plan's row of the same options."""
    mine = vram_magic.plan(mlp, batch(), gpu="A100-80GB", gpus=2, step=holding_step)
    plain = vram_magic.plan(mlp, batch(), gpu="A100-80GB", gpus=2, top=30)
    assert len(mine.scored) == 8 and len(mine.rows) == 8
    assert {(r.options.get("zero"), bool(r.options.get("offload"))) for r in mine.rows} == \
        {(z, o) for z in (None, 1, 2, 3) for o in (False, True)}
    by_options = {tuple(sorted(r.options.items())): r for r in plain.rows}
    twins = 0
    for row in mine.rows:
        assert not {"checkpointing", "amp", "accumulate", "param_dtype"} & set(row.options), row.options
        assert not row.numerics and row.options["batch"] == 4 and row.options["world"] == 2
        est = vram_magic.estimate(mlp, batch(), step=holding_step, **row.options)
        assert row.peak == est.peak and row.needed == est.needed, row.name
        twin = by_options.get(tuple(sorted(row.options.items())))
        if twin is not None:
            twins += 1
            assert row.peak.total - twin.peak.total == 1024 * 1024, row.name
    assert twins >= 4  # (the plain plan's other rows checkpoint, autocast or accumulate)


def test_what_would_rewrite_the_step_is_refused():
    for kwargs, named in ((dict(allow="recipes"), "allow='recipes'"), (dict(allow="lora,batch"), "allow='lora'"),
                          (dict(generate=4), "generate="), (dict(loss_fn=lambda out: out.sum()), "loss_fn=")):
        with pytest.raises(ValueError, match="step= plans your step as you wrote it") as caught:
            vram_magic.plan(mlp, batch(), device="cpu", budget="1GiB", step=holding_step, **kwargs)
        assert named in str(caught.value)
    with pytest.raises(ValueError, match="tp="):
        vram_magic.plan(mlp, batch(), gpu="A100-80GB", gpus=2, tp=2, step=holding_step)
    with pytest.raises(TypeError, match="step must be a function"):
        vram_magic.plan(mlp, batch(), device="cpu", budget="1GiB", step="holding_step")
    halves = vram_magic.plan(mlp, batch(), device="cpu", budget="1GiB", step=holding_step, allow="batch")
    assert sorted(r.options["batch"] for r in halves.rows) == [4, 8]


def test_the_magic_takes_a_step_from_the_namespace(shell):
    run_ok(shell, "import torch\nfrom torch import nn\n"
                  "model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))\n"
                  "x = torch.randn(8, 256)\n"
                  "def train(model, batch, optimizer):\n"
                  "    model(batch).sum().backward()\n"
                  "    optimizer.step()\n"
                  "    optimizer.zero_grad()\n")
    run_ok(shell, "%vram_plan model --input x --device cpu --budget 1GiB --step train -q -o p")
    plan = shell.user_ns["p"]
    assert plan.step == "train" and plan.rows[0].name == "your train as written"
    est = vram_magic.estimate(shell.user_ns["model"], shell.user_ns["x"], step=shell.user_ns["train"],
                              **plan.rows[0].options)
    assert plan.rows[0].peak == est.peak
    result = shell.run_cell("%vram_plan model --input x --device cpu --budget 1GiB --step train --allow recipes")
    assert "step= plans your step as you wrote it" in str(result.error_in_exec)
    result = shell.run_cell("%vram_plan model --input x --device cpu --budget 1GiB --step nothing")
    assert result.error_in_exec is not None and "nothing" in str(result.error_in_exec)


def test_a_partial_row_is_marked_in_the_figure():
    """A row whose estimate stopped early (``fits is None``) is hatched and labelled "partial" in the figure."""
    peak = Breakdown(activations=3 * 1024**3)

    def row(name: str, fits: bool | None, needed: int) -> PlanRow:
        return PlanRow(name=name, options={}, changes=(), peak=peak, needed=needed, fits=fits, step_time=0.5,
                       throughput=16.0, time={"compute": 0.5}, micro_batch=8, accumulate=1)

    plan = Plan(model="m", device="cuda", gpu="L4", gpus=1, capacity=2 * 1024**3, global_batch=8, unit="samples/s",
                rows=(row("stopped", None, 3 * 1024**3), row("too big", False, 4 * 1024**3)))
    ax = plan.figure().axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(label.startswith("PARTIAL") for label in labels)
    assert [t.get_text() for t in ax.texts if t.get_text() == "partial"] == ["partial"]
    hatched = [c for c in ax.collections if c.get_hatch()]
    assert len(hatched) == 1 and hatched[0].get_offsets().tolist() == [[0.5, 3.0]]
    assert "partial" in str(plan) and not any("partial" in t.get_text() for t in
                                              vram_magic.plan(mlp, batch(), device="cpu", budget="1GiB")
                                              .figure().axes[0].texts)
