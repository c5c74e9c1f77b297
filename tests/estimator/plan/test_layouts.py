"""The layout planner across GPUs in hosts (``planning/layout_planner.py``, ``planning/mesh.py``,
``planning/screen.py``, ``timing/overlap.py``): the product it searches, where each axis goes, how each collective
overlaps, the layouts it refuses with what to give instead, and that each row shown is
``estimate(**row.options)``."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

import vram_magic
from vram_magic.estimator.device.gpus import find_gpu
from vram_magic.estimator.layouts.pipeline import buffers_per_use
from vram_magic.estimator.options import fsdp2_available, make_options
from vram_magic.estimator.planning.choices import Choice, describe
from vram_magic.estimator.planning.layout_planner import layout_space
from vram_magic.estimator.planning.mesh import Mesh, check_layout, meshes
from vram_magic.estimator.timing.overlap import Link, MeshTiming, RankWork, bubble, mesh_step
from vram_magic.estimator.timing.step_time import network_for

HEADS = (64, 8)  # Llama 3 70B's query and key/value heads


def tiny_llama(layers: int = 4) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2))


# --- the meshes -----------------------------------------------------------------------------------------------------
def test_the_meshes_of_64_gpus_keep_tensor_parallelism_inside_a_host_and_multiply_to_the_gpus() -> None:
    found = meshes(64, 8, 80, HEADS, 8192, None, 512)
    assert found and all(m.world == 64 for m in found)
    assert {m.tp for m in found} == {1, 2, 4, 8}  # 16 spans hosts; 64 heads over 8 kv heads take 1 … 8
    assert {m.pp for m in found} >= {1, 2, 4, 8, 16}  # 80 blocks: 32 does not divide them
    assert 32 not in {m.pp for m in found}
    assert {m.cp for m in found} == {1, 2, 4, 8}
    assert any(m.hsdp for m in found)  # data parallelism across hosts: HSDP beside plain sharding
    hsdp = next(m for m in found if m.hsdp and m.tp == 1 and m.cp == 1 and m.pp == 1)
    assert (hsdp.shard, hsdp.replicas) == (8, 8)


def test_each_axis_goes_over_the_link_it_lies_on() -> None:
    net = network_for(find_gpu("H100-80GB"), 64, "infiniband-400g")
    links = Mesh(tp=8, cp=1, pp=2, dp=4, host=8).links(net, 450e9, "NVLink")
    assert links["tp"].name == "NVLink" and links["dp"].name == net.name and links["pp"].name == net.name
    links = Mesh(tp=2, cp=1, pp=1, dp=4, host=8).links(net, 450e9, "NVLink")
    assert links["dp"].name == "NVLink"  # 2 × 4 ranks: one host


def test_the_search_takes_every_micro_batch_count_dividing_the_batch_including_8() -> None:
    # a 1.3B GPT-2-shaped model on 8 A100s at 64 sequences per GPU: micro-batches 1 … 64, 8 among them
    base = make_options(device="cuda")
    space = layout_space(base, [Mesh(1, 1, 1, 8, 8)], 512, 24, torch.bfloat16)
    assert {c.accumulate for c in space} == {1, 2, 4, 8, 16, 32, 64}
    assert {c.zero for c in space} == {None, 1, 2, 3}
    assert {c.checkpointing for c in space} == {False, True, "ops", 2}
    assert all(c.master is None for c in space)  # data parallelism alone: FSDP2's own policy is the half precision
    # FSDP2's MixedPrecisionPolicy (bf16 gathers, fp32 reduce) beside bf16 autocast, where PyTorch has FSDP2 (2.6 on)
    if not fsdp2_available():
        assert all(c.param_dtype is None for c in space)
        return
    assert any(c.param_dtype == torch.bfloat16 and c.zero == 3 and c.amp is None for c in space)
    fsdp2 = next(c for c in space if c.param_dtype is not None)
    assert fsdp2.options(base, 8).param_dtype == torch.bfloat16


def test_tensor_and_pipeline_layouts_offer_half_weights_with_fp32_master_weights() -> None:
    """Where FSDP2's MixedPrecisionPolicy is not traced (tensor or pipeline parallelism), the ZeRO paper's mixed
    precision stands beside autocast: bf16 weights and gradients, an fp32 master copy in the (sharded) optimizer,
    without autocast's bf16 copy of every weight kept through the forward."""
    base = make_options(device="cuda")
    for mesh in (Mesh(2, 1, 1, 4, 8), Mesh(1, 1, 2, 4, 8)):
        space = layout_space(base, [mesh], 64, 8, torch.bfloat16)
        master = [c for c in space if c.master is not None]
        assert master and {c.zero for c in master} == {None, 1, 2, 3}
        assert all(c.amp is None and c.param_dtype is None for c in master)
        assert len(master) == len([c for c in space if c.amp is not None])  # one beside each autocast combination
        opts = master[0].options(base, 8)
        assert (opts.dtype, opts.master_weights, opts.amp) == (torch.bfloat16, True, None)
        assert "bf16 weights + fp32 master weights" in describe(master[0], base, gpus=8).name
        assert master[0].trace_class() != replace(master[0], master=None, amp=torch.bfloat16).trace_class()


def test_the_pipeline_searches_its_schedules_and_micro_batches() -> None:
    base = make_options(device="cuda")
    space = layout_space(base, [Mesh(1, 1, 4, 2, 8)], 64, 8, torch.bfloat16)
    # ZB-V where the pipelining runtime is modelled for it (2.6–2.13; not 2.15's, whose estimates refuse it)
    assert {c.schedule for c in space} == {"1f1b", "interleaved"} | (set() if buffers_per_use() else {"zbv"})
    assert all(c.accumulate >= 4 and 32 % c.accumulate == 0 for c in space)
    assert all(c.micro * c.accumulate == 32 for c in space)


def test_the_screens_rows_name_the_sharding_degree() -> None:
    base = make_options(device="cuda")
    c = Choice(1, 8, True, 3, False, torch.bfloat16, None, None, None, 512, tp=8)
    assert "× 8" in describe(c, base, gpus=64).name and "× 1" not in describe(c, base, gpus=64).name
    hsdp = Choice(1, 8, True, 3, False, torch.bfloat16, None, None, None, 512, replicas=8)
    assert "× 8 in each host, 8 replicas (HSDP)" in describe(hsdp, base, gpus=64).name


# --- the overlap ----------------------------------------------------------------------------------------------------
def _work(**kw) -> RankWork:
    fields = dict(forward=1.0, backward=2.0, compute=2.5, memory=0.5, recompute=0.0, optimizer=0.1, blocks=10,
                  gather=10e9, reduce=20e9)
    return RankWork(**{**fields, **kw})


def test_fsdp_prefetch_hides_the_gathers_that_the_blocks_outlast() -> None:
    fast = {"dp": Link(400e9, "NVLink")}
    step, comms = mesh_step(_work(), MeshTiming(1, 1, 1, 8, 3, 1, links=fast))
    gather = next(c for c in comms if c.name == "FSDP all-gather")
    assert 0 < gather.exposed < gather.seconds  # the first of the forward and the backward only
    slow = {"dp": Link(1e9, "slow")}
    _, comms = mesh_step(_work(), MeshTiming(1, 1, 1, 8, 3, 1, links=slow))
    gather = next(c for c in comms if c.name == "FSDP all-gather")
    assert gather.exposed > 0.9 * gather.seconds - 3.0  # on a slow link the blocks' compute hides little of it


def test_ddp_overlaps_its_buckets_with_the_backward_and_tensor_parallelism_is_exposed() -> None:
    links = {"dp": Link(50e9, "IB"), "tp": Link(400e9, "NVLink")}
    _, comms = mesh_step(_work(tp={"all-reduce": 1e9}, tp_count=40), MeshTiming(2, 1, 1, 4, 0, 1, links=links))
    ddp = next(c for c in comms if c.name == "DDP all-reduce")
    tp = next(c for c in comms if c.name == "TP collectives")
    assert ddp.exposed < ddp.seconds and tp.exposed == tp.seconds


def test_the_bubble_by_schedule() -> None:
    t = lambda schedule, m: MeshTiming(1, 4, 1, 1, 0, m, schedule=schedule)  # noqa: E731
    assert bubble(8.0, t("1f1b", 8)) == pytest.approx(8.0 * 3 / 8)
    assert bubble(8.0, t("interleaved", 8)) == pytest.approx(8.0 * 3 / 16)
    assert bubble(8.0, t("zbv", 8)) == 0.0  # m ≥ 2p: the V filled
    assert bubble(8.0, t("zbv", 4)) > 0.0


# --- the layouts refused --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(tp=2, pp=3), "does not divide gpus=64"),
    (dict(pp=128), "more stages than the model's 80 blocks"),
    (dict(tp=3), "does not fit a host of 8"),
    (dict(tp=16), "does not fit a host of 8"),
    (dict(cp=2, attention="this model's attention is not one context parallelism shards"), "cp=2: this model"),
])
def test_layouts_that_cannot_run_are_refused_saying_what_to_give(kwargs: dict, message: str) -> None:
    attention = kwargs.pop("attention", None)
    with pytest.raises(ValueError, match=message):
        check_layout(64, 8, 80, HEADS, 8192, attention, **kwargs)


def test_tensor_parallelism_must_divide_the_heads() -> None:
    with pytest.raises(ValueError, match="does not divide the model's 12 attention heads"):
        check_layout(16, 16, 12, (12, 12), 1024, None, tp=8)


def test_the_gpus_must_fill_whole_hosts() -> None:
    with pytest.raises(ValueError, match="no whole number of hosts"):
        check_layout(12, 8, 80, HEADS, 8192, None)


def test_a_plan_refuses_bad_layouts_with_clear_errors() -> None:
    model = tiny_llama()
    ids = torch.randint(0, 512, (1, 64))
    kw = dict(gpu="H100-80GB", gpus=16, global_batch=16, interconnect="infiniband-400g")
    with pytest.raises(ValueError, match="more stages than the model's 4 blocks"):
        vram_magic.plan(model, ids, pp=8, **kw)
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        vram_magic.plan(model, ids, tp=8, **kw)
    with pytest.raises(ValueError, match="does not fit a host of 4"):
        vram_magic.plan(model, ids, tp=8, host_size=4, **kw)
    with pytest.raises(ValueError, match="does not divide gpus=16"):
        vram_magic.plan(model, ids, tp=2, pp=3, **kw)
    seq = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
    with pytest.raises(ValueError, match="cp=2"):
        vram_magic.plan(seq, torch.randn(16, 32), cp=2, loss_fn=lambda o: o.sum(), **kw)


# --- whole plans ----------------------------------------------------------------------------------------------------
def test_a_plan_across_hosts_shows_rows_each_the_estimate_of_its_options() -> None:
    model = tiny_llama()
    ids = torch.randint(0, 512, (1, 64))
    plan = vram_magic.plan(model, {"input_ids": ids, "labels": ids}, gpu="H100-80GB", gpus=16, global_batch=32,
                           interconnect="infiniband-400g", top=3)
    assert len(plan.scored) > 100 and plan.rows
    assert any("hosts of 8" in a for a in plan.assumptions)
    assert any("interpolated" in n for n in plan.notes)
    for row in plan.rows[:2]:
        again = vram_magic.estimate(model, {"input_ids": ids, "labels": ids}, **row.options)
        assert again.needed == row.needed, row.name
        assert row.collectives  # each collective with its exposed part
        assert all(0 <= c.exposed <= c.seconds + 1e-12 for c in row.collectives)


def test_tensor_parallelism_of_a_llama_given_ids_without_positions() -> None:
    """transformers' rotary cos/sin follow the positions: made whole beside a sequence-sharded input, not cut."""
    model = tiny_llama(2)
    ids = torch.randint(0, 512, (2, 64))
    est = vram_magic.estimate(model, ids, tp=2, device="cuda", gpu="H100-80GB")
    assert est.needed > 0 and not est.partial
    # with labels and checkpointing (the planner's rows): the causal mask over the whole sequence, not the shard
    est = vram_magic.estimate(model, {"input_ids": ids, "labels": ids}, tp=2, checkpointing=True, amp="bf16",
                              device="cuda", gpu="H100-80GB")
    assert est.needed > 0 and not est.partial


def test_a_category_that_shrinks_from_one_block_to_two_is_held_not_extrapolated_down() -> None:
    """The peak of a one-block trace may lie at another moment of the step than a two-block one's (the loss's logits,
    then the backward): a category that shrinks is held at its larger value, never extrapolated below it."""
    from vram_magic.estimator.planning.screen import breakdown_fits

    low = dict(parameters=10.0, gradients=0.0, optimizer_state=20.0, activations=5.0, other=12.0)
    high = dict(parameters=20.0, gradients=0.0, optimizer_state=40.0, activations=7.0, other=8.0)
    fits = breakdown_fits(low, high, 1, 2)
    assert fits["parameters"].at(80) == 800.0 and fits["activations"].at(80) == 3.0 + 2.0 * 80
    assert fits["other"].at(80) == 12.0
