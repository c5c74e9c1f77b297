"""Tensor parallelism (DTensor, ``parallelize_module``) and pipeline parallelism (``torch.distributed.pipelining``)
on real gloo ranks on the CPU: what ``vram_magic.measure()`` inside each rank reports, by category and detail,
against bytes worked out by hand from the shapes, and against PyTorch's profiler in the same rank.

The jobs are tests/support/parallel_runs.py's (the same figures the benchmark prints): two AdamW steps of each case
on 2 ranks (and on 4, marked slow), every rank measured, then the same steps profiled on a fresh copy.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.support import TORCH_BEFORE_2_6
from tests.support import parallel_runs as pr
from vram_magic.estimator.layouts.pipeline import buffers_per_use

F32 = 4
pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with gloo")
# transformers 5 builds no model on a PyTorch older than 2.6 (conftest.skip_module_without_transformers_5); the
# pipelining of PyTorch 2.5 takes static shapes, and its 1F1B schedules hang on gloo (parallel_runs.static_stages)
STATIC_STAGES = pr.static_stages()
SKIPPED = tuple(n for n, c in pr.CASES.items()
                if (c.model == "llama" and TORCH_BEFORE_2_6) or (c.kind == "pp" and STATIC_STAGES))
_LLAMA = pytest.mark.skipif(TORCH_BEFORE_2_6, reason="transformers 5 needs PyTorch 2.6 or later")
_PIPELINES = pytest.mark.skipif(STATIC_STAGES, reason="this PyTorch's PipelineStage takes static shapes, and its "
                                "1F1B schedules do not finish a step on gloo (2.5.1); checked from 2.13 on")
WORLDS = [2, pytest.param(4, marks=pytest.mark.slow)]


def _pipelining_of_this_torch() -> tuple[bool, bool]:
    """(a stage makes a micro-batch's receive buffer just before the receive and lets go of it once used, rather
    than keeping one per micro-batch from the first step on; a stage lets go of an output once its send is done,
    backward starting from the output's autograd edge): both new in PyTorch 2.15, neither in 2.13."""
    try:
        from torch.distributed.pipelining import PipelineStage, stage
    except ImportError:
        return False, False
    return hasattr(getattr(stage, "_RecvInfo", None), "allocate_buffer"), \
        hasattr(PipelineStage, "release_fwd_send_outputs")


RECEIVE_PER_MICRO_BATCH, RELEASES_SENT_OUTPUTS = _pipelining_of_this_torch()
# The measurement counts a tensor freed when Python lets go of it; a collective's input is still held by gloo's work
# until gloo's worker thread is done with it, sometimes after the caller went on: the profiler (in the same run too)
# then sees a higher peak, by an amount that varies from run to run. The most seen here, as a share of the measured
# rise: 0 (the MLP, the pipelines), 10 % (the Llama), 20 % (the Llama with sequence parallelism); the bounds leave
# room for a loaded machine.
LATE = {"tp-mlp": 0.10, "tp-llama": 0.25, "tp-llama-sp": 0.40}


def late(figures: dict) -> int:
    """How much higher the profiler's peak of the same steps was than the measured one."""
    return figures["profiler_rise"] - figures["measured_rise"]


@pytest.fixture(scope="module")
def runs() -> dict[int, dict[str, list[dict]]]:
    return {}


def _runs(runs: dict, world: int) -> dict[str, list[dict]]:
    """Every case on ``world`` ranks, once per module (one launch: about 40 s with 2 ranks here); a launch that
    failed fails every test that needs it, without being run again."""
    if world not in runs:
        try:
            runs[world] = pr.run_once(world, [n for n in pr.cases_for(world) if n not in SKIPPED])
        except Exception as err:
            runs[world] = err
    if isinstance(runs[world], Exception):
        raise runs[world]
    return runs[world]


# --- tensor parallelism: the MLP, by hand --------------------------------------------------------------------------
def mlp_figures(t: int) -> dict[str, dict[str, int]]:
    """What each of ``t`` ranks holds: 3 blocks Linear(256, 1024) colwise → GELU → Linear(1024, 256) rowwise."""
    h, w, b, blocks = pr.HIDDEN // t, pr.WIDTH, pr.TP_BATCH, pr.MLP_BLOCKS
    sharded = blocks * (h * w + h + w * h) * F32  # the colwise weight and bias, the rowwise weight: 1/t each
    replicated = blocks * w * F32  # the rowwise bias, whole on every rank
    params = sharded + replicated
    return {
        "parameters": {"model (sharded)": sharded, "model (replicated)": replicated},
        # two moments of every parameter, and a 4-byte step counter for each of the 12
        "optimizer_state": {"opt (sharded)": 2 * sharded, "opt (replicated)": 2 * replicated, "opt": 4 * blocks * 4},
        # at the peak, the first matmul of the second step's backward (the last block's rowwise linear): what the
        # forward saved — each block's colwise output and GELU output (b × h), the all-reduced outputs of the first
        # two blocks that the next blocks' matmuls saved —, that linear's weight gradient and input gradient, and
        # the GEMM's contiguous copy of the loss's expanded gradient (b × 256)
        "peak_activations": {"forward intermediates": blocks * 2 * b * h * F32,
                             "tensor-parallel all-reduce output (saved for backward)": (blocks - 1) * b * w * F32,
                             "activation gradients (backward)": b * h * F32,
                             # the loss out.sum() and the ones backward starts from, made between the forward and
                             # the backward outside any module: one fp32 scalar each
                             "loss (outside modules)": 2 * F32},
        "peak_gradients": {"sharded gradients": w * h * F32},
        # the step's output (the last block's all-reduced output, which the step keeps until it returns)
        "peak_other": {"x": b * w * F32, "tensor-parallel all-reduce buffers": b * w * F32,
                       "kernel scratch (inside ops)": b * w * F32},
        "sizes": {"params": params, "all-reduce": b * w * F32},
    }


@pytest.mark.parametrize("world", WORLDS)
def test_tensor_parallel_mlp_per_rank_by_hand(runs, world: int) -> None:
    figures = _runs(runs, world)["tp-mlp"]
    want = mlp_figures(world)
    assert [f["rank"] for f in figures] == list(range(world))
    if world == 2:  # the 3.15 MB of DESIGN.md: half the weights, the row-wise biases whole
        assert want["sizes"]["params"] == 3_154_944
    for f in figures:
        after, peak = f["after_details"], f["peak_details"]
        assert after["parameters"] == want["parameters"]
        assert after["optimizer_state"] == want["optimizer_state"]
        assert f["after"]["gradients"] == 0 and f["after"]["activations"] == 0  # zero_grad(set_to_none=True)
        assert peak["parameters"] == want["parameters"]
        assert peak["activations"] == want["peak_activations"]
        assert peak["gradients"] == want["peak_gradients"]
        assert {k: v for k, v in peak["other"].items() if v > 64} == want["peak_other"]
        # the step's output (the forward's last all-reduce, kept by the step) beside one of backward's all-reduced
        # input gradients
        assert f["highest"]["other"]["tensor-parallel all-reduce buffers"] == 2 * want["sizes"]["all-reduce"]
        # the profiler, on a fresh copy of the same steps, sees the same peak to the byte (or that and what gloo
        # let go of late, see LATE)
        assert 0 <= late(f) <= LATE["tp-mlp"] * f["measured_rise"], late(f)


# --- tensor parallelism: a transformers Llama -------------------------------------------------------------------------
def llama_parameters(t: int, sequence_parallel: bool) -> dict[str, int]:
    """Parameters per rank: torchtitan's plan shards q/k/v/gate/up by rows and o/down by columns (1/t each, no
    biases); the embeddings, the norms and the head stay whole, unless sequence parallelism shards the embedding
    (rowwise: by vocabulary rows) and the head (colwise), and makes the norms replicated DTensors."""
    cfg = pr.llama_config_kwargs(t)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    layer = h * h + 2 * kv * h + h * h + 3 * inter * h  # q, k, v, o, gate, up, down
    sharded = cfg["num_hidden_layers"] * layer // t * F32
    norms = (2 * cfg["num_hidden_layers"] + 1) * h * F32
    if sequence_parallel:
        return {"model (sharded)": sharded + 2 * v * h // t * F32, "model (replicated)": norms}
    return {"model (sharded)": sharded, "model": 2 * v * h * F32 + norms}


@_LLAMA
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", ["tp-llama", "tp-llama-sp"])
def test_tensor_parallel_llama_per_rank(runs, world: int, case: str) -> None:
    figures = _runs(runs, world)[case]
    sp = case.endswith("-sp")
    b, s, h, v = pr.LLAMA_BATCH, pr.LLAMA_SEQ, pr.LLAMA["hidden_size"], pr.LLAMA["vocab_size"]
    hidden_state = b * s * h * F32
    for f in figures:
        assert f["after_details"]["parameters"] == llama_parameters(world, sp)
        assert f["peak"]["parameters"] == sum(llama_parameters(world, sp).values())
        high = f["highest"]
        if not sp:
            # o and down all-reduce a (batch, seq, hidden) output each, which the residual add consumes at once; in
            # backward q, k and v each all-reduce the gradient of the same input, which autograd sums as they
            # come: two at once
            assert high["other"]["tensor-parallel all-reduce buffers"] == 2 * hidden_state
            assert not any("gather" in k or "scatter" in k for k in high["other"])
            # the profiler: the same peak, or a few all-reduce inputs more, which gloo let go of late (see LATE)
            assert 0 <= late(f) <= LATE[case] * f["measured_rise"], late(f)
            continue
        # sequence parallelism: the norms' outputs are sequence shards, all-gathered before attention and MLP
        # (DTensor lays a dim-1 gather out again with a copy, so the gather's own output is a buffer); o and down
        # reduce-scatter; the head all-gathers the logits, and gloo stages every all-gather in a buffer of the
        # output's size
        assert {"tensor-parallel all-gather buffers", "tensor-parallel reduce-scatter buffers",
                "gloo all-gather staging buffer (CPU)", "gloo reduce-scatter input copy (CPU)"} <= set(high["other"])
        assert high["other"]["gloo all-gather staging buffer (CPU)"] == b * s * v * F32  # the logits'
        # the embedding's reduce-scattered sequence shard: the first norm's input, kept for backward
        assert high["activations"]["tensor-parallel reduce-scatter output (saved for backward)"] == \
            hidden_state // world
        # the profiler: the same peak or more, by what gloo let go of late (the logits' staging buffer beside the
        # logits laid out again, a few hidden states; see LATE)
        assert 0 <= late(f) <= LATE[case] * f["measured_rise"], late(f)


@_LLAMA
def test_sequence_parallelism_holds_less_per_rank(runs) -> None:
    figures = _runs(runs, 2)
    tp, sp = figures["tp-llama"][0], figures["tp-llama-sp"][0]
    assert sp["peak"]["parameters"] < tp["peak"]["parameters"]  # the embedding and head sharded too
    assert sp["peak"]["activations"] < tp["peak"]["activations"]


# --- pipeline parallelism ------------------------------------------------------------------------------------------
def pipeline_figures(world: int, rank: int, schedule: str) -> dict[str, int]:
    """What stage ``rank`` of ``world`` holds: its blocks, its receive buffers, the micro-batches in flight."""
    m = pr.MICRO_BATCHES
    mb = pr.PP_BATCH // m
    k = pr.PP_BLOCKS // world  # blocks per stage
    block = (pr.HIDDEN * pr.WIDTH + pr.HIDDEN + pr.WIDTH * pr.HIDDEN + pr.WIDTH) * F32
    out = mb * pr.WIDTH * F32  # one micro-batch's activation between blocks (and stages)
    last = rank == world - 1
    # per micro-batch: each block's first linear output and GELU output (mb × 1024, saved for backward) and its
    # output (the next block's saved input, or the stage's output, which the stage keeps until its backward and
    # sends); the first stage's input is a view of the batch, a later stage's its receive buffer; the last
    # stage's output is kept for the merged output instead
    per_mb = k * (2 * mb * pr.HIDDEN * F32 + out) - (out if last else 0)
    w = m if schedule == "gpipe" else min(m, world - rank)  # 1F1B's warm-up forwards: p - i on stage i
    in_flight = w * per_mb  # GPipe: every forward before any backward
    if schedule != "gpipe" and not last:
        if RELEASES_SENT_OUTPUTS:  # 2.15: the outputs of the warm-up's first w - 2 sends are let go of already
            in_flight -= max(w - 2, 0) * out
        elif w >= 2 and 2 * w - 2 < m:
            # 2.13: the send of micro-batch w - 2, fired in the warm-up, keeps its output until the 1B1F phase ends
            # (its finished work is held), and a forward runs after that micro-batch's backward
            in_flight += out
    # the activations' receive buffers alive at once when they are made per receive (2.15): one per micro-batch in
    # flight; on the last stage every micro-batch's, which its loss's graph holds until the step ends
    received_at_once = (m if last else w) * out
    return {"parameters": k * block, "optimizer_state": 2 * k * block + 4 * k * 4, "in_flight": in_flight,
            "received": m * out, "received_at_once": received_at_once, "outputs": m * out if last else 0}


@_PIPELINES
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_stages_per_rank_by_hand(runs, world: int, schedule: str) -> None:
    figures = _runs(runs, world)[f"pp-{schedule}"]
    for f in figures:
        rank = f["rank"]
        assert f["stages"] == [rank]
        want = pipeline_figures(world, rank, schedule)
        after, high = f["after_details"], f["highest"]
        assert f["after"]["parameters"] == want["parameters"] and f["after"]["optimizer_state"] == \
            want["optimizer_state"]
        received = {k: v for k, v in after["other"].items() if "receive buffers" in k}
        activations = f"pipeline stage {rank}: receive buffers (activations)"  # from the stage before
        gradients = f"pipeline stage {rank}: receive buffers (gradients)"  # from the stage after
        if RECEIVE_PER_MICRO_BATCH:  # made before each receive, let go of once used: none left after the step
            assert received == {}
            if rank > 0:
                assert high["other"][activations] == want["received_at_once"]
            if rank < world - 1:  # the next micro-batch's made before the last one's is let go of, at most
                assert high["other"][gradients] in (out_bytes(), 2 * out_bytes())
        else:  # one per micro-batch, kept from the first step on
            expected = {}
            if rank > 0:
                expected[activations] = want["received"]
            if rank < world - 1:
                expected[gradients] = want["received"]
            assert received == expected
        assert high["activations"][f"pipeline stage {rank}: micro-batch activations"] == want["in_flight"]
        assert f"pipeline stage {rank}: activation gradients (backward)" in high["activations"]
        assert f"pipeline stage {rank}: shape inference (first step)" in high["other"]  # the first step only
        if rank == world - 1:
            assert after["other"][f"pipeline stage {rank}: outputs kept for the merged output"] == want["outputs"]
            assert high["other"]["pipeline: merged output of the last stage"] == pr.PP_BATCH * pr.WIDTH * F32
        assert not any(k in ("forward intermediates", "unattributed") for k in f["peak_details"]["activations"])
        # the profiler sees the same peak, but for the few bytes of the stages' pickled shapes (and a sent tensor,
        # now and then, that gloo let go of late)
        assert 0 <= late(f) <= 1024 + 4 * pr.PP_BATCH // pr.MICRO_BATCHES * pr.WIDTH * F32, late(f)


@_PIPELINES
def out_bytes() -> int:
    """One micro-batch's activation between blocks and stages (64 × 256 fp32)."""
    return pr.PP_BATCH // pr.MICRO_BATCHES * pr.WIDTH * F32


def test_one_f_one_b_holds_fewer_micro_batches_than_gpipe(runs) -> None:
    figures = _runs(runs, 2)
    for rank in (0, 1):
        gpipe = figures["pp-gpipe"][rank]["highest"]["activations"][f"pipeline stage {rank}: micro-batch activations"]
        one = figures["pp-1f1b"][rank]["highest"]["activations"][f"pipeline stage {rank}: micro-batch activations"]
        assert one < gpipe
        assert figures["pp-1f1b"][rank]["peak"]["activations"] < figures["pp-gpipe"][rank]["peak"]["activations"]


@_PIPELINES
def test_the_interleaved_schedule_names_each_stage_of_a_rank(runs) -> None:
    """Two stages a rank (rank r holds stages r and r + 2 of four, one block each): each stage's receive buffers and
    micro-batches are named with it."""
    figures = _runs(runs, 2)["pp-interleaved"]
    m, out = pr.MICRO_BATCHES, pr.PP_BATCH // pr.MICRO_BATCHES * pr.WIDTH * F32
    block = (pr.HIDDEN * pr.WIDTH + pr.HIDDEN + pr.WIDTH * pr.HIDDEN + pr.WIDTH) * F32
    for f in figures:
        stages = pr.interleaved_stages(2, f["rank"])
        assert f["stages"] == stages == [f["rank"], f["rank"] + 2]
        assert f["after"]["parameters"] == 2 * block
        received = {k: v for k, v in f["after_details"]["other"].items() if "receive buffers" in k}
        expected = {}
        for stage in stages:
            if stage > 0:
                expected[f"pipeline stage {stage}: receive buffers (activations)"] = m * out
            if stage < pr.PP_BLOCKS - 1:
                expected[f"pipeline stage {stage}: receive buffers (gradients)"] = m * out
            assert f"pipeline stage {stage}: micro-batch activations" in f["highest"]["activations"]
        if RECEIVE_PER_MICRO_BATCH:  # made before each receive (2.15): named while they lived
            assert received == {} and set(expected) <= set(f["highest"]["other"])
        else:
            assert received == expected
        assert 0 <= late(f) <= 1024 + 4 * out, late(f)


@_PIPELINES
def test_a_ranks_cell_names_what_pipeline_stages_hold() -> None:
    """The ranks measured as ``%%vram --ranks`` measures them (from joining the job to leaving it, the rank's
    function's variables scanned at ``destroy_process_group``)."""
    reports = pr.run_armed(2, "pp-1f1b")
    assert [r.rank for r in reports] == [0, 1]
    for r in reports:
        assert r.status == "complete" and r.error is None and r.ended == "destroy_process_group"
        want = pipeline_figures(2, r.rank, "1f1b")
        kind = "gradients" if r.rank == 0 else "activations"
        received = r.after.details("other").get(f"pipeline stage {r.rank}: receive buffers ({kind})")
        assert received == (None if RECEIVE_PER_MICRO_BATCH else want["received"])
        assert r.after["parameters"] == want["parameters"]
        assert f"pipeline stage {r.rank}: micro-batch activations" in r.peak.details("activations")


# --- in this process ------------------------------------------------------------------------------------------------
def test_stage_methods_are_wrapped_while_measuring_only() -> None:
    import torch.distributed.pipelining  # noqa: F401

    import vram_magic
    from vram_magic.engine.hooks import pipeline

    assert not pipeline.is_wrapped()
    with vram_magic.measure():
        assert pipeline.is_wrapped() and pipeline.is_wrapped("backward_one_chunk")
        with vram_magic.measure():  # nested: one wrapper
            assert pipeline.is_wrapped()
        assert pipeline.is_wrapped()
    assert not pipeline.is_wrapped() and not pipeline.is_wrapped("backward_one_chunk")


def test_the_functional_collectives_are_told_apart() -> None:
    import torch.distributed._functional_collectives  # noqa: F401  (registers the ops)

    from vram_magic.engine.hooks.collectives import tp_collective

    ops = torch.ops._c10d_functional
    assert tp_collective(ops.all_reduce.default) == "all-reduce"
    assert tp_collective(ops.all_gather_into_tensor.default) == "all-gather"
    assert tp_collective(ops.reduce_scatter_tensor.default) == "reduce-scatter"
    assert tp_collective(ops.all_reduce_.default) is None  # in place: no memory of its own
    assert tp_collective(ops.wait_tensor.default) is None
    assert tp_collective(torch.ops.aten.mm.default) is None


# --- pipeline stages cut from transformers decoders ------------------------------------------------------------------
@_LLAMA
@_PIPELINES
@pytest.mark.slow
def test_decoder_stages_hold_their_own_layers_by_hand() -> None:
    """The package's stage builder on real ranks (8 layers, hidden 64, vocab 256; 4 micro-batches of 2 × 64 tokens):
    each rank holds its stages' layers, the first stage the embedding, the last the norm and the head; a rank
    receives one buffer per micro-batch; Gemma's tied weight is held by the embedding and the head of the V's ends
    (rank 0 under ZBV), a copy each; the middle of the V passes its tensors on the rank, its buffers the outputs."""
    from tests.support import decoder_pipelines as dp

    figures = pr.run_once(2, pr.cases_for(2, ("stages", "tp-pp")))
    h, v = dp.DECODER["hidden_size"], dp.DECODER["vocab_size"]
    layer = (2 * h * h + 2 * h * h // 2 + 3 * h * dp.DECODER["intermediate_size"] + 2 * h) * F32
    embed, norm = v * h * F32, h * F32
    hidden = dp.BATCH // dp.MICRO_BATCHES * dp.SEQ * h * F32  # one micro-batch's hidden state
    r0, r1 = figures["stages-llama-1f1b"]
    assert sum(r0["after_details"]["parameters"].values()) == embed + 4 * layer
    assert sum(r1["after_details"]["parameters"].values()) == 4 * layer + norm + embed
    # torch 2.6–2.13 keep one receive buffer per micro-batch after the step; 2.15's runtime lets go of each after use
    kept = 0 if buffers_per_use() else dp.MICRO_BATCHES * hidden
    assert r0["after_details"]["other"].get("pipeline stage 0: receive buffers (gradients)", 0) == kept
    assert r1["after_details"]["other"].get("pipeline stage 1: receive buffers (activations)", 0) == kept
    assert r1["after_details"]["other"]["pipeline stage 1: outputs kept for the merged output"] == \
        dp.BATCH * dp.SEQ * v * F32
    gemma = figures["stages-gemma-zbv"][0]
    assert gemma["stages"] == [0, 3]
    assert sum(gemma["after_details"]["parameters"].values()) == 2 * embed + 4 * layer + norm
    middle = figures["stages-llama-zbv"][1]
    assert middle["stages"] == [1, 2]
    if not buffers_per_use():  # (2.15's runtime of the V is not modelled: estimates refuse it there)
        assert middle["after_details"]["other"]["pipeline stage 2: receive buffers (activations)"] == \
            dp.MICRO_BATCHES * hidden
