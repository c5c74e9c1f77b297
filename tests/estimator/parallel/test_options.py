"""Tensor- and pipeline-parallel estimates: the options (impossible layouts refused with what to give instead), the
per-rank result (one entry per rank, shared by ranks of one role; the most loaded as the headline; ``fits`` only if
every rank fits), ZeRO over the data-parallel ranks, the magic, and that the user's process groups stay untouched."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import vram_magic

F32 = 4


def mlp(width: int = 64, hidden: int = 256, blocks: int = 4) -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
                           for _ in range(blocks)])


def plan(blocks: int = 4) -> dict:
    out = {}
    for i in range(blocks):
        out[f"{i}.0"], out[f"{i}.2"] = ColwiseParallel(), RowwiseParallel()
    return out


X = torch.randn(32, 64)


def loss(out: torch.Tensor) -> torch.Tensor:
    return out.sum()


# --- impossible layouts ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(tp=2, pp=2, world=6), "tp × pp × dp must equal world"),
    (dict(tp=3, world=4), "does not divide world"),
    (dict(pp=5), "pp=5 needs at least 5 blocks"),
    (dict(tp=3, parallelize_plan=plan()), "tp=3 does not divide '0.0'"),
    (dict(tp=2, parallelize_plan={"9.0": ColwiseParallel()}), "'9.0', which is no module"),
    (dict(tp=2), "tensor parallelism needs a parallelize_plan for Sequential"),
    (dict(tp=2, parallelize_plan={"0": ColwiseParallel()}), "shards nn.Linear and nn.Embedding only"),
    (dict(pp=2, micro_batches=1), "at least as many micro-batches as stages"),
    (dict(pp=2, micro_batches=5), "does not split into 5 equal micro-batches"),
    (dict(pp=["9"]), "split point '9' is no child"),
    (dict(pp=2, zero=1, world=2), "dp = world / (tp × pp) = 1"),
    (dict(pp=2, accumulate=2), "instead of accumulate"),
    (dict(micro_batches=4), "micro_batches is the pipeline's"),
    (dict(pp=2, schedule="zb"), "schedule must be one of 1f1b, gpipe, interleaved"),
    (dict(parallelize_plan=plan()), "parallelize_plan applies with tp ≥ 2"),
])
def test_impossible_layouts_are_refused_saying_what_to_give(kwargs: dict, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(").replace(")", r"\)")):
        vram_magic.estimate(mlp(), X, device="cpu", loss_fn=loss, **kwargs)


def test_a_plan_must_be_a_dict_of_styles() -> None:
    with pytest.raises(TypeError, match="a dict from module names to parallel styles"):
        vram_magic.estimate(mlp(), X, device="cpu", tp=2, parallelize_plan=[("0.0", ColwiseParallel())])
    with pytest.raises(TypeError, match="each entry must be a module name"):
        vram_magic.estimate(mlp(), X, device="cpu", tp=2, parallelize_plan={"0.0": "colwise"})


def test_pipeline_needs_a_sequential() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = mlp()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.blocks(x)

    with pytest.raises(ValueError, match="splits an nn.Sequential"):
        vram_magic.estimate(Net(), X, device="cpu", pp=2, loss_fn=loss)


# --- the per-rank result ------------------------------------------------------------------------------------------
def test_tensor_parallel_shards_by_hand_and_zero_over_the_data_parallel_ranks() -> None:
    one = vram_magic.estimate(mlp(), X, device="cpu", tp=2, parallelize_plan=plan(), loss_fn=loss)
    # each block: the colwise weight and bias split (128 × 64 + 128), the rowwise weight split (64 × 128), its bias
    # whole (64)
    params = 4 * (128 * 64 + 128 + 64 * 128 + 64) * F32
    assert one.peak["parameters"] == params and one.tp == 2 and one.dp == 1
    assert len(one.ranks) == 2 and one.ranks[0] is one.ranks[1]
    four = vram_magic.estimate(mlp(), X, device="cpu", tp=2, world=4, zero=1, parallelize_plan=plan(), loss_fn=loss)
    assert four.dp == 2 and len(four.ranks) == 4
    # ZeRO-1 over the 2 data-parallel ranks halves each rank's moments (and its 16 four-byte step counters)
    assert params <= four.peak["optimizer_state"] <= params + 16 * 4
    assert "ZeRO-1 over the 2 data-parallel ranks" in " ".join(four.notes)


def test_pipeline_ranks_the_headline_and_fits() -> None:
    est = vram_magic.estimate(mlp(), X, device="cpu", pp=2, loss_fn=loss)
    assert [r.stages for r in est.roles] == [(0,), (1,)] and est.micro_batches == 2
    needs = sorted(r.needed for r in est.roles)
    assert est.needed == needs[-1] and est.ranks[est.most_loaded].needed == needs[-1]
    # a budget between the two ranks' needs: the job does not fit, though one rank would
    tight = vram_magic.estimate(mlp(), X, device="cpu", pp=2, loss_fn=loss, budget=(needs[0] + needs[1]) // 2)
    assert tight.fits is False and sorted(r.fits for r in tight.roles) == [False, True]
    text = str(est)
    assert "per rank: 2 ranks = tp 1 × pp 2 × dp 1" in text and "pipeline stage 1" in text
    assert "<table class='vram-ranks'>" in est._html()
    frame = est.per_rank()
    assert list(frame["peak"]) == [r.peak.total for r in est.roles]


def test_split_points_choose_the_stages() -> None:
    est = vram_magic.estimate(mlp(), X, device="cpu", pp=["3"], loss_fn=loss)  # blocks 0–2, then 3
    block = (64 * 256 + 256 + 256 * 64 + 64) * F32
    assert [r.peak["parameters"] for r in est.roles] == [3 * block, block]


def test_the_users_process_groups_are_left_alone() -> None:
    """A notebook may have a default group: a tensor-parallel estimate neither reads nor changes it (its mesh has a
    group of its own, registered for the trace under a name of its own and gone after it)."""
    if not dist.is_gloo_available():
        pytest.skip("needs gloo")
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        before = dist.group.WORLD
        vram_magic.estimate(mlp(), X, device="cpu", tp=2, parallelize_plan=plan(), loss_fn=loss)
        assert dist.group.WORLD is before and dist.get_world_size() == 1 and dist.get_rank() == 0
        t = torch.ones(3)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()
    vram_magic.estimate(mlp(), X, device="cpu", tp=2, parallelize_plan=plan(), loss_fn=loss)
    assert not dist.is_initialized()


def test_the_magic_takes_tp_and_pp(shell) -> None:
    ip = shell  # (a shell of the tests' own, cleared after: the test shell of IPython's stays for later tests)
    ip.user_ns.update(model=mlp(), x=X, tp_plan=plan(), lossf=loss)
    ip.run_line_magic("vram_estimate", "model --input x --loss lossf --device cpu --pp 2 --schedule gpipe "
                                       "--micro-batches 4 -q -o est")
    est = ip.user_ns["est"]
    assert est.pp == 2 and est.schedule == "gpipe" and est.micro_batches == 4
    ip.run_line_magic("vram_estimate", "model --input x --loss lossf --device cpu --tp 2 --tp-plan tp_plan -q -o est")
    assert ip.user_ns["est"].tp == 2
