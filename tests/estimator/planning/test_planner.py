"""The planner: every row an exact estimate, ranked by predicted time; the time model's formulas on numbers worked out
by hand; the network; bad input; %vram_plan, %%vram --plan, calibration and the command line."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import vram_magic
from tests.support import TORCH_BEFORE_2_6, run_ok
from vram_magic.estimator.device.gpus import find_gpu
from vram_magic.estimator.timing import cost
from vram_magic.estimator.timing.rates import Rates
from vram_magic.estimator.timing.step_time import network_for
from vram_magic.estimator.tracing.oplog import ATTENTION, MATMUL, POINTWISE, VIEW, OpLog

GB = 1e9
MiB = 1024**2


def mlp(blocks: int = 4, width: int = 256) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                           for _ in range(blocks)])


# --- the time model's formulas --------------------------------------------------------------------------------------
def test_ops_are_timed_by_their_flops_bytes_and_the_devices_floor():
    log = OpLog()
    log.add(1, MATMUL, 1, False, 2e12, 1e9)  # 2 TFLOP at 100 TFLOP/s: 20 ms (its 1 GB at 1 TB/s: 1 ms)
    log.add(1, POINTWISE, 0, False, 0, 4e9)  # 4 GB at 1 TB/s: 4 ms
    log.add(2, ATTENTION, 1, True, 1e12, 0)  # recompute: 10 ms
    log.add(1, VIEW, 0, False, 0, 0)  # nothing moved: the floor, 5 µs
    log.add(3, POINTWISE, 0, False, 0, 1e9)  # the optimizer: 1 ms
    rates = Rates("test", lambda dtype, flops: 100e12 if dtype == "bf16" else 10e12, 1e12, 0.0, 5e-6, "")
    t = cost.time_ops(log, rates)
    assert t.compute == pytest.approx(0.020) and t.recompute == pytest.approx(0.010)
    assert t.memory == pytest.approx(0.004 + 5e-6) and t.optimizer == pytest.approx(0.001) and t.ops == 5
    assert cost.time_ops(log, rates, start=4).optimizer == pytest.approx(0.001)  # the last step's rows only


def test_a_smaller_micro_batch_scales_each_ops_work_and_keeps_its_floor():
    """The screen's time of a micro-batch a quarter of the traced one's: each op's FLOPs and bytes a quarter, each op
    at least the device's floor, the optimizer as traced (a quarter of the totals would be 5.00125 ms)."""
    from types import SimpleNamespace

    from vram_magic.estimator.timing.step_time import scaled_micro_ops

    log = OpLog()
    log.add(1, MATMUL, 1, False, 2e12, 1e9)  # 20 ms; a quarter: 5 ms
    for _ in range(100):
        log.add(1, POINTWISE, 0, False, 0, 1e4)  # 10 ns each at 1 TB/s, below the 5 µs floor: 0.5 ms, scaled or not
    log.add(3, POINTWISE, 0, False, 0, 1e9)  # the optimizer: 1 ms, whatever the micro-batch
    rates = Rates("test", lambda dtype, flops: 100e12, 1e12, 0.0, 5e-6, "")
    trace = SimpleNamespace(ops=log, ops_start=0, micro_steps=1)
    whole = scaled_micro_ops(trace, rates, 1.0)
    quarter = scaled_micro_ops(trace, rates, 0.25)
    assert whole.compute == pytest.approx(0.020) and whole.memory == pytest.approx(100 * 5e-6)
    assert quarter.compute == pytest.approx(0.005) and quarter.memory == pytest.approx(100 * 5e-6)
    assert quarter.optimizer == whole.optimizer == pytest.approx(0.001)


def test_a_cpu_screen_scales_each_parts_work_and_keeps_each_ops_own_cost():
    """On the CPU, whose per-op rules need shapes a scaled row lacks, the screen scales each part's total less its
    ops' fixed cost (2 µs each): a matmul of 20 ms + 2 µs at a quarter is 5 ms + 2 µs; 100 pointwise ops of 10 ns
    + 2 µs are 100 × (2.5 ns + 2 µs), not a quarter of the whole (50.25 µs); the optimizer as traced."""
    from types import SimpleNamespace

    from vram_magic.estimator.timing.step_time import scaled_micro_ops

    log = OpLog()
    log.add(1, MATMUL, 1, False, 2e12, 1e9)
    for _ in range(100):
        log.add(1, POINTWISE, 0, False, 0, 1e4)
    log.add(3, POINTWISE, 0, False, 0, 1e9)
    def op_time(stage, kind, dtype, again, flops, nbytes, *shape):  # the generic rule, as a device's own
        return max(nbytes / 1e12, flops / 100e12) + 2e-6

    rates = Rates("cpu-like", lambda dtype, flops: 100e12, 1e12, 2e-6, 0.0, "", op_time=op_time)
    trace = SimpleNamespace(ops=log, ops_start=0, micro_steps=1)
    whole = scaled_micro_ops(trace, rates, 1.0)
    assert whole.compute == pytest.approx(0.020 + 2e-6) and whole.memory == pytest.approx(100 * (1e-8 + 2e-6))
    quarter = scaled_micro_ops(trace, rates, 0.25)
    assert quarter.compute == pytest.approx(0.005 + 2e-6)
    assert quarter.memory == pytest.approx(100 * (0.25e-8 + 2e-6))
    assert quarter.optimizer == whole.optimizer == pytest.approx(0.001 + 2e-6)
    # two micro-batches traced (accumulation): the counts per micro-batch are half the log's
    trace2 = SimpleNamespace(ops=log, ops_start=0, micro_steps=2)
    half = scaled_micro_ops(trace2, rates, 0.5)
    assert half.memory == pytest.approx(50 * (0.5e-8 + 2e-6))


def test_a_cpu_plan_with_room_to_spare_ranks_the_whole_batch_first():
    """Everything fits in 1 GiB: the fastest row runs the whole batch at once (the screen used to rank every
    micro-batch of a class alike, and the first it listed, the smallest, were estimated: 1 × 64, 2 × 32 and
    4 × 16 at 143, 74 and 39 ms a step, where the whole batch takes about 7)."""
    plan = vram_magic.plan(mlp(), torch.randn(64, 256), device="cpu", budget="1GiB", top=3)
    assert plan.best.accumulate == 1 and plan.best.micro_batch == 64
    assert all(r.micro_batch >= 16 for r in plan.rows)


def test_ring_collectives_by_hand():
    bw = 300 * GB  # an A100's NVLink per direction, at 80 %: 240 GB/s
    grads = params = 1 * GB
    # DDP: one all-reduce, 2 (N-1)/N of the gradients
    assert cost.data_parallel(None, 8, params, grads, 4, bw) == pytest.approx(2 * 7 / 8 * 1e9 / 240e9)
    # ZeRO-1: a reduce-scatter of the gradients, an all-gather of the parameters
    assert cost.data_parallel(1, 8, params, grads, 4, bw) == pytest.approx(7 / 8 * 2e9 / 240e9)
    # ZeRO-2: a reduce-scatter per micro-batch, one all-gather
    assert cost.data_parallel(2, 8, params, grads, 4, bw) == pytest.approx(7 / 8 * 5e9 / 240e9)
    # ZeRO-3 / FSDP: two all-gathers and a reduce-scatter per micro-batch
    assert cost.data_parallel(3, 8, params, grads, 4, bw) == pytest.approx(7 / 8 * 4 * 3e9 / 240e9)
    assert cost.data_parallel(3, 1, params, grads, 4, bw) == 0.0
    assert cost.ring(100, 2, 1e12) == cost.COLLECTIVE_LATENCY  # a tiny message costs its latency


def test_offload_and_the_pipeline_bubble_by_hand():
    transfers, update = cost.offload(1 * GB, 2 * GB, 31.5 * GB, 8, 1e9)
    assert transfers == pytest.approx(3e9 / (31.5e9 * 0.85))
    assert update == pytest.approx(1e9 / (1.4e9 / 8))
    assert cost.pipeline_bubble(4, 8) == pytest.approx(3 / 11)
    assert cost.pipeline_bubble(1, 8) == 0.0


def test_the_network_between_gpus():
    a100, t4 = find_gpu("A100-80GB"), find_gpu("T4")
    assert network_for(a100, 8).link == 300 * GB
    assert network_for(t4, 2).link == pytest.approx(15.75 * GB)  # no NVLink: PCIe gen 3 through the host
    with pytest.raises(ValueError, match="spans hosts"):
        network_for(a100, 16)
    assert network_for(a100, 16, "infiniband-400g").link == 50 * GB  # the hosts' links are the slowest
    assert network_for(a100, 16, 25e9).link == 25e9
    with pytest.raises(ValueError, match="no NVLink"):
        network_for(t4, 2, "nvlink")
    with pytest.raises(ValueError, match="unknown interconnect"):
        network_for(a100, 8, "carrier-pigeon")


# --- plans ---------------------------------------------------------------------------------------------------------
def test_every_row_is_the_estimate_its_options_give_and_rows_are_fastest_first():
    model, x = mlp(), torch.randn(512, 256)
    plan = vram_magic.plan(model, x, device="cpu", budget="42MiB", top=4)
    assert plan.rows and plan.best is plan.rows[0] and all(r.fits for r in plan.rows)
    times = [r.step_time for r in plan.rows]
    assert times == sorted(times)
    for row in plan.rows:
        est = vram_magic.estimate(model, x, **row.options)
        assert est.needed == row.needed and est.peak.total == row.peak.total and est.needed <= 42 * MiB
        assert row.micro_batch * row.accumulate == 512
        assert row.step_time == pytest.approx(sum(row.time.values()))
    # the whole batch in one step needs 46.06 MiB (two micro-batches 43.58: the first one's gradients stay), four
    # micro-batches 38.33, checkpointing 38.57: every fp32 row splits it in four or more, or checkpoints (bf16
    # autocast rows, faster where the CPU has bf16 matmuls, fit otherwise)
    whole = vram_magic.estimate(model, x, device="cpu")
    assert whole.needed > 42 * MiB
    assert vram_magic.estimate(model, x, device="cpu", accumulate=2).needed > 42 * MiB
    assert all(r.accumulate >= 4 or r.options.get("checkpointing") for r in plan.rows if "amp" not in r.options)
    frame = plan.to_frame()
    assert list(frame["needed"]) == [r.needed for r in plan.rows]
    assert len(plan.scored) >= len(plan.rows) and sum(s.exact for s in plan.scored) >= len(plan.rows)


def test_combinations_the_screen_overstates_are_estimated_exactly_and_ranked_by_time(monkeypatch):
    """The screen scales its anchor; where that overstates what a combination needs (an anchor's peak in another
    phase), the closest it ruled out are estimated exactly: those that fit are rows, fastest first, not the
    'nothing fits' list ordered by memory."""
    from vram_magic.estimator.planning.planner import Planner

    screen = Planner.screen
    monkeypatch.setattr(Planner, "screen", lambda self, c: (lambda n, t: (n + 100 * MiB, t))(*screen(self, c)))
    model, x = mlp(), torch.randn(512, 256)
    plan = vram_magic.plan(model, x, device="cpu", budget="42MiB", top=3)
    assert plan.rows and all(r.fits for r in plan.rows) and plan.best is plan.rows[0]
    assert [r.step_time for r in plan.rows] == sorted(r.step_time for r in plan.rows)
    assert not any("nothing fits" in n for n in plan.notes)
    assert any("although the screen put them above the capacity" in n for n in plan.notes)
    for row in plan.rows:
        assert vram_magic.estimate(model, x, **row.options).needed == row.needed <= 42 * MiB


def test_checkpointed_classes_are_traced_only_when_their_bound_comes_up(monkeypatch):
    """A checkpointed combination's time is bounded below by the same combination's without checkpointing: the
    bound never exceeds its screened time, the rows are those of a plan that screens every class, and a class
    whose bound stays behind the rows is never traced (fewer fake runs, and the plan says how many it left)."""
    from dataclasses import replace

    from vram_magic.estimator.planning.planner import Planner

    model, x = mlp(), torch.randn(64, 256)
    plan = vram_magic.plan(model, x, device="cpu", budget="1GiB", top=3)
    screens = {}
    screen = Planner.screen

    def recorded(self, c):
        needed, t = screen(self, c)
        screens[c] = t.total
        return needed, t

    monkeypatch.setattr(Planner, "screen", recorded)
    monkeypatch.setattr(Planner, "lazy", lambda self, c: False)
    every = vram_magic.plan(model, x, device="cpu", budget="1GiB", top=3)
    assert [(r.name, r.needed, r.step_time) for r in plan.rows] == [(r.name, r.needed, r.step_time)
                                                                     for r in every.rows]
    # 6 micro-batches (1, 2, 4, 16, 32, 64: at most six of 64's seven divisors) x 3 checkpointing x 2 precisions
    assert len(every.scored) == len(screens) == 36 and every.bounded == 0
    assert plan.bounded > 0 and len(plan.scored) + plan.bounded == 36
    assert plan.traced < every.traced
    assert any("left untraced" in n for n in plan.notes) and f"{plan.bounded} bounded untraced" in str(plan)
    assert f"{plan.bounded} more bounded untraced" in plan.figure().axes[0].get_title()
    from vram_magic.estimator.cli.plan_cmd import as_json

    assert as_json(plan)["bounded"] == plan.bounded and as_json(plan)["scored"] == len(plan.scored)
    checkpointed = [c for c in screens if c.checkpointing]
    assert len(checkpointed) == 24
    for c in checkpointed:  # each one's screened time at least its bound, the same combination's without it
        assert screens[c] >= screens[replace(c, checkpointing=False)] > 0


def test_nothing_fits_says_so_and_shows_the_closest():
    plan = vram_magic.plan(mlp(), torch.randn(8, 256), device="cpu", budget="1MiB", top=3)
    assert plan.best is None and plan.rows and not any(r.fits for r in plan.rows)
    assert any("nothing fits" in n for n in plan.notes)
    needs = [r.needed for r in plan.rows]
    assert min(needs) == min(s.needed for s in plan.scored if s.exact)
    assert "nothing fits" in str(plan)


def test_numerics_changing_rows_and_allowed_changes_are_marked():
    # 1024 wide: bf16 is among the 30 fastest estimated exactly (at 256 wide the launch floors decide, and CUDA's
    # autocast adds the fp32 loss's gradient cast to bf16, which put every bf16 row past the cut; at 512 wide the
    # SGD and 8-bit AdamW rows fill the 30)
    plan = vram_magic.plan(mlp(width=1024), torch.randn(16, 1024), gpu="A100-80GB", gpus=2, allow="optimizer,batch",
                           top=40)
    names = {r.name for r in plan.rows}
    amp = [r for r in plan.rows if r.options.get("amp") == "bf16"]
    assert amp and all("bf16 mixed precision" in r.numerics for r in amp)
    assert any("SGD" in "".join(r.numerics) or "sgd" in r.name for r in plan.rows)
    assert any("ZeRO" in n or "FSDP" in n for n in names) and any("DDP" in n for n in names)
    for r in plan.rows:
        assert r.options["world"] == 2 and r.options["gpu"] == "A100-80GB"
        assert r.time["collectives"] > 0  # two GPUs talk every step


def test_bad_input():
    model, x = mlp(2), torch.randn(12, 256)
    with pytest.raises(ValueError, match="does not split over 8 GPUs"):
        vram_magic.plan(model, x, gpu="A100-80GB", gpus=8)
    with pytest.raises(ValueError, match="needs the GPU"):
        vram_magic.plan(model, x)
    with pytest.raises(ValueError, match="allow names wings"):
        vram_magic.plan(model, x, gpu="T4", allow="wings")
    with pytest.raises(ValueError, match="spans hosts"):
        vram_magic.plan(model, torch.randn(16, 256), gpu="A100-80GB", gpus=16)
    with pytest.raises(ValueError, match="global_batch must be"):
        vram_magic.plan(model, x, gpu="T4", global_batch=0)


def test_calibration_scales_every_time_by_the_measured_step():
    model, x = mlp(2), torch.randn(16, 256)
    plan = vram_magic.plan(model, x, device="cpu", budget="64MiB", top=3)

    class Report:  # what calibrate reads of a report
        wall_time, cell, peak, device = 0.5, 7, None, "cpu"

    cal = plan.calibrate(Report(), row=1)
    factor = 0.5 / plan.rows[1].step_time
    assert cal.rows[1].step_time == pytest.approx(0.5)
    assert cal.rows[0].step_time == pytest.approx(plan.rows[0].step_time * factor)
    assert cal.calibration[0] == pytest.approx(factor) and "cell 7" in cal.calibration[1]
    assert "calibrated" in str(cal)
    with pytest.raises(TypeError, match="calibrate"):
        plan.calibrate(object())
    fig = plan.figure()
    assert fig.axes[0].get_xlabel().startswith("step time")


def test_magics_plan_and_cell_beside_its_row(shell):
    run_ok(shell, "import torch\nfrom torch import nn\n"
                  "model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))\n"
                  "x = torch.randn(8, 256)")
    run_ok(shell, "%vram_plan model --input x --device cpu --budget 64MiB --top 2 -q -o p")
    plan = shell.user_ns["p"]
    assert plan.model == "model" and len(plan.rows) <= 2
    run_ok(shell, "%%vram --plan p:0 -q -o rep\nopt = torch.optim.AdamW(model.parameters())\n"
                  "model(x).sum().backward()\nopt.step()")
    from vram_magic.estimator.planning.result import check

    c = check(plan, 0, shell.user_ns["rep"])
    assert c.measured_time == shell.user_ns["rep"].wall_time and "predicted" in str(c)
    result = shell.run_cell("%%vram --plan nothing:0\nx = 1")
    assert "no variable 'nothing'" in str(result.error_in_exec)
    result = shell.run_cell("%%vram --plan p:9\nx = 1")
    assert "has rows 0" in str(result.error_in_exec)
    result = shell.run_cell("%vram_plan model --input x --gpu T4 --gpus 3")
    assert "does not split over 3 GPUs" in str(result.error_in_exec)


def test_command_line_plan(capsys, tmp_path, monkeypatch):
    from vram_magic.__main__ import main

    (tmp_path / "tiny_plan_model.py").write_text(
        "import torch\nfrom torch import nn\n\ndef build():\n    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), "
        "nn.Linear(256, 64))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["plan", "tiny_plan_model:build", "--input", "torch.randn(8, 64)", "--device", "cpu",
                 "--budget", "32MiB", "--top", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["rows"] and out["rows"][0]["fits"] and out["unit"] == "samples/s"
    assert math.isclose(sum(out["rows"][0]["time"].values()), out["rows"][0]["step_time"], rel_tol=1e-9)
    assert main(["plan", "tiny_plan_model:build", "--input", "torch.randn(8, 64)", "--gpu", "T4", "--gpus",
                 "3"]) == 2


@pytest.mark.slow
def test_a_generate_plan_ranks_weights_caches_and_the_largest_batch_by_tokens_per_second():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=128, intermediate_size=256,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)).eval()
    ids = torch.randint(0, 1000, (2, 32))
    plan = vram_magic.plan(model, ids, generate=8, device="cpu", budget="48MiB", top=6)
    assert plan.unit == "tokens/s" and plan.rows and all(r.fits for r in plan.rows)
    speeds = [r.throughput for r in plan.rows]
    assert speeds == sorted(speeds, reverse=True)
    for row in plan.rows[:3]:  # each row is the estimate its options give, at a batch that fits
        est = vram_magic.estimate(model, ids, **row.options)
        assert est.needed == row.needed <= 48 * MiB and est.generation.batch == row.micro_batch
        assert row.throughput == pytest.approx(row.micro_batch * 8 / row.step_time)
    assert plan.best.micro_batch > 2  # the inputs' batch of 2 leaves room: the batch is where throughput comes from
    assert any("bf16 weights" in r.numerics for r in plan.rows)


@pytest.mark.parametrize("keyed", [False, True], ids=["tensor batch", "dict batch"])
@pytest.mark.parametrize("amp", [None, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_a_rows_accumulation_code_runs_as_written(amp, keyed):
    """Accumulation (with autocast where the row has it: one loop, each micro-batch's forward under autocast, fp16
    scaled) runs as written on the CPU for a tensor batch and for a dict of tensors (a transformers model's), and
    trains as the row says: every sample seen once, one update a step."""
    from vram_magic.estimator.options import Options
    from vram_magic.estimator.planning.choices import Choice, describe

    choice = Choice(micro=2, accumulate=4, checkpointing=False, zero=None, offload=False, amp=amp, lora=None,
                    quantize=None, optimizer=None, global_batch=8)
    code = describe(choice, Options(device="cpu"), keyed=keyed).code
    loops = [c for c in code if "micro-batches" in c]
    assert len(loops) == 1 and not any("model(**batch)" in c or "model(batch)" in c for c in code), code
    loop = loops[0]
    if amp is not None:
        assert loop.count("torch.autocast('cpu'") == 1 and loop.index("torch.autocast") > loop.index("for ")

    class Out:
        def __init__(self, loss):
            self.loss = loss

    seen = []

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x=None, *, input_ids=None):
            x = input_ids if x is None else x
            seen.append(len(x))
            return Out(self.lin(x).float().square().mean())

    torch.manual_seed(0)
    model, calls = Net(), []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.register_step_post_hook(lambda *a: calls.append(1))
    before = model.lin.weight.detach().clone()
    x = torch.randn(8, 4)
    exec(loop, {"torch": torch, "model": model, "batch": {"input_ids": x} if keyed else x, "optimizer": optimizer})
    assert seen == [2, 2, 2, 2] and calls == [1] and not torch.equal(before, model.lin.weight)
    assert all(p.grad is None for p in model.parameters())  # zero_grad after the step


@pytest.mark.skipif(TORCH_BEFORE_2_6, reason="transformers 5 needs PyTorch 2.6 or later")
def test_a_plan_of_a_dict_batch_writes_code_for_a_dict():
    """The plan knows its inputs: a transformers model's dict batch gets a loop over slices of every key."""
    transformers = pytest.importorskip("transformers")
    GPT2Config, GPT2LMHeadModel = transformers.GPT2Config, transformers.GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=16))
    ids = torch.randint(0, 100, (8, 16))
    plan = vram_magic.plan(model, {"input_ids": ids, "labels": ids}, device="cpu", budget="1GiB", top=20)
    accumulated = [r for r in plan.rows if r.accumulate > 1]
    assert accumulated, [r.name for r in plan.rows]
    for r in accumulated:
        assert any("for k, v in batch.items()" in c and "model(**micro)" in c for c in r.code), r.code


def test_combinations_left_when_the_exact_estimates_run_out_are_said_so(monkeypatch):
    """With room for one exact estimate, the checkpointed classes are left for want of it, not because they are
    slower, and the note says so."""
    from vram_magic.estimator.planning import planner as planning

    monkeypatch.setattr(planning, "MAX_EXACT", 1)
    plan = vram_magic.plan(mlp(), torch.randn(64, 256), device="cpu", budget="1GiB", top=3)
    assert len(plan.rows) == 1 and plan.bounded > 0
    assert any("1 exact estimates a plan makes at most were made first" in n for n in plan.notes)
    assert not any("already screened slower" in n for n in plan.notes)
