"""FSDP2 as large runs configure it (``param_dtype=``, ``reduce_dtype=``, ``offload="params"``) and torchao's float8
linears (``float8=True``), every figure worked out by hand from the shapes and FSDP2's sources (torch 2.13,
``torch/distributed/fsdp/_fully_shard/``; layouts/fsdp.py says which buffer is which).

The model: two ``Linear(64, 64)`` blocks in a ``ModuleList`` (FSDP units) and a ``Linear(64, 64)`` head (the root's),
on 2 ranks: each parameter's shard is 32 rows (a weight 32 × 64, a bias 32), one unit's 2,080 elements.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vram_magic
from vram_magic.estimator.layouts.fsdp import FsdpLayout
from vram_magic.estimator.timing.cost import OpTimes, data_parallel, fsdp_traffic
from vram_magic.estimator.timing.step_time import Network, step_time

F32, BF16 = 4, 2
WIDTH, WORLD = 64, 2
SHARD = WIDTH // WORLD * WIDTH + WIDTH // WORLD  # a Linear's shard: 2,080 elements (weight 2,048 + bias 32)
LINEARS = 3
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.relu(b(x))
        return self.head(x)


def _estimate(**kw):
    return vram_magic.estimate(Net, torch.randn(4, WIDTH), device=kw.pop("device", "cpu"), zero=3, world=WORLD, **kw)


def _sizes(est) -> dict[tuple[str, str], set[int]]:
    """The sizes of the storages alive before the step (the shards) and of those the traced last step made (not the
    first step's stand-in gradients), by what they count as."""
    trace = est.rerun.trace(est.options)
    made = {e for e in trace.events[trace.marks["step_start"]:] if e > 0}
    out: dict[tuple[str, str], set[int]] = {}
    for s in made | set(trace.initial):
        if trace.sizes.get(s, 0):
            out.setdefault(trace.owner.get(s, ("other", "temporaries")), set()).add(trace.sizes[s])
    return out


def test_mixed_precision_buffers_by_hand() -> None:
    est = _estimate(param_dtype="bf16", reduce_dtype="fp32")
    sizes = _sizes(est)
    # fp32 shards, one storage a parameter; AdamW's two moments like them, a 4-byte step a parameter
    assert sizes[("parameters", "parameters")] == {32 * WIDTH * F32, 32 * F32}
    assert est.model_states == LINEARS * SHARD * F32 * (1 + 1 + 2) + 2 * LINEARS * 4
    # a unit's all-gather input (its shards cast to bf16, one flat buffer) and output (world × that); and the root's
    # forward input cast to bf16 (MixedPrecisionPolicy.cast_forward_inputs), made in FSDP's pre-forward scope, which
    # %%vram's tracker names after that scope too
    assert sizes[("other", "FSDP all-gather buffers")] == {SHARD * BF16, WORLD * SHARD * BF16, 4 * WIDTH * BF16}
    # each parameter's unsharded bf16 tensor, and autograd's bf16 gradient of it
    assert sizes[("other", "FSDP unsharded parameters (all-gathered)")] == {WIDTH * WIDTH * BF16, WIDTH * BF16}
    assert sizes[("gradients", "FSDP unsharded gradients (before reduce-scatter)")] == {WIDTH * WIDTH * BF16,
                                                                                      WIDTH * BF16}
    # the fp32 reduce-scatter input of a unit; its output, a unit's shard, is the sharded gradients
    assert sizes[("other", "FSDP reduce-scatter buffers")] == {WORLD * SHARD * F32}
    assert sizes[("gradients", "gradients")] == {SHARD * F32}
    assert "FSDP2 traced for real" in " ".join(est.notes)


def test_bf16_reduction_casts_back_to_fp32_gradients() -> None:
    sizes = _sizes(_estimate(param_dtype="bf16", reduce_dtype="bf16"))
    # a bf16 reduce-scatter input and output; the output cast to the parameters' fp32 is the sharded gradients
    assert sizes[("other", "FSDP reduce-scatter buffers")] == {WORLD * SHARD * BF16, SHARD * BF16}
    assert sizes[("gradients", "gradients")] == {SHARD * F32}


def test_fp32_weights_under_autocast_gather_twice_the_bytes() -> None:
    """The time model: FSDP2's all-gathers move bf16, the fp32-weights-under-autocast model fp32; the reduction is
    fp32 by default (the recipes'), bf16 when asked."""
    assert fsdp_traffic((b := _estimate(param_dtype="bf16", reduce_dtype="bf16")).options,
                        b.rerun.trace(b.options)).reduce == LINEARS * SHARD * WORLD * BF16
    est = _estimate(param_dtype="bf16")
    assert est.options.reduce_dtype is torch.float32
    trace = est.rerun.trace(est.options)
    t = fsdp_traffic(est.options, trace)
    assert t.gather == LINEARS * SHARD * WORLD * BF16
    assert t.reduce == LINEARS * SHARD * WORLD * F32
    link = 100e9
    net = Network(link, 25e9, 1, "test")
    got = step_time(OpTimes(), est.options, trace, net)
    assert got.collectives == pytest.approx(data_parallel(3, WORLD, t.gather, t.reduce, 1, link))
    old = _estimate(amp="bf16")
    old_trace = old.rerun.trace(old.options)
    assert old_trace.param_bytes == LINEARS * (WIDTH * WIDTH + WIDTH) * F32 == 2 * t.gather
    assert got.transfers == 0


def test_parameter_offload_on_a_gpu_by_hand() -> None:
    est = _estimate(param_dtype="bf16", offload="params", device="cuda", gpu="A100-80GB")
    state = 2 * LINEARS * SHARD * F32 + 2 * LINEARS * 4  # AdamW's moments and steps
    assert est.host == LINEARS * SHARD * F32 * 2 + state  # the fp32 shards, their gradients, the state
    assert est.pinned == LINEARS * SHARD * F32 * 2  # CPUOffloadPolicy pins the shards and the gradients
    assert est.peak["parameters"] == 0 and est.peak["optimizer_state"] == 0
    assert est.model_states == 0
    trace = est.rerun.trace(est.options)
    buffers = FsdpLayout.of(est.options, trace).buffers(True)
    assert sorted(buffers.values()) == [32 * WIDTH * F32, SHARD * F32]  # a weight's shard; a unit's RS output
    bf16 = _estimate(param_dtype="bf16", reduce_dtype="bf16", offload="params", device="cuda", gpu="A100-80GB")
    rs = FsdpLayout.of(bf16.options, bf16.rerun.trace(bf16.options)).largest_unit_shard
    assert rs == SHARD * (BF16 + F32)  # the bf16 output and its fp32 cast, both on the device before the copy
    # the shards cross PCIe for both all-gathers, the gradients come back
    t = fsdp_traffic(est.options, trace)
    assert (t.to_device, t.to_host) == (2 * LINEARS * SHARD * F32, LINEARS * SHARD * F32)
    assert "on the host" in str(est)


def test_parameter_offload_on_the_cpu_changes_no_byte() -> None:
    """On a CPU the host is the device: CPUOffloadPolicy's copies are no-ops, and a real run measures the same."""
    plain, off = _estimate(param_dtype="bf16"), _estimate(param_dtype="bf16", offload="params")
    assert off.peak.total == plain.peak.total and off.host == 0


def test_the_options_say_what_they_need() -> None:
    x = torch.randn(4, WIDTH)
    with pytest.raises(ValueError, match="zero=3"):
        vram_magic.estimate(Net, x, device="cpu", param_dtype="bf16")
    with pytest.raises(ValueError, match="replaces autocast"):
        _estimate(param_dtype="bf16", amp="bf16")
    with pytest.raises(ValueError, match="offload must be"):
        _estimate(offload="everything")
    with pytest.raises(ValueError, match="CPUOffloadPolicy"):
        vram_magic.estimate(Net, x, device="cpu", offload="params")
    with pytest.raises(ValueError, match="bf16 or fp16"):
        _estimate(param_dtype="fp32")
    with pytest.raises(ValueError, match="training"):
        vram_magic.estimate(Net, x, device="cpu", inference=True, float8=True)
    assert not _estimate(amp="bf16").options.fsdp_traced


def test_planner_offers_fsdp2_mixed_precision() -> None:
    from vram_magic.estimator.options import make_options
    from vram_magic.estimator.planning.choices import describe
    from vram_magic.estimator.planning.planner import choices

    base = make_options(device="cuda")
    space = choices(base, 8, 16, 2, frozenset(), torch.bfloat16, 4)
    fsdp2 = [c for c in space if c.param_dtype is not None]
    assert fsdp2 and all(c.zero == 3 and c.amp is None for c in fsdp2)
    opts = fsdp2[0].options(base, 2)
    assert opts.fsdp_traced and opts.param_dtype is torch.bfloat16 and opts.reduce_dtype is torch.float32
    facts = describe(fsdp2[0], base, gpus=2)
    assert "MixedPrecisionPolicy" in facts.name and any("mp_policy=mp" in c for c in facts.code)


# --- float8 (torchao) ----------------------------------------------------------------------------------------------
class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(256, 1024, bias=False), nn.ReLU(),
                                                  nn.Linear(1024, 256, bias=False)) for _ in range(2))
        self.head = nn.Linear(256, 100)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def test_float8_keeps_the_activations_of_the_plain_layers() -> None:
    """Float8Linear saves its input and weight in high precision: after the forward the activations are the plain
    model's, by hand: per block ReLU's output (kept by ReLU and by the second linear) and the block's sum (the next
    layer's input); the head's output and the loss (a 4-byte scalar)."""
    pytest.importorskip("torchao.float8")
    x = torch.randn(512, 256)
    f8, plain = vram_magic.estimate(Blocks, x, device="cpu", float8=True), vram_magic.estimate(Blocks, x, device="cpu")
    rows = 512
    by_hand = 2 * (rows * 1024 * F32 + rows * 256 * F32) + rows * 100 * F32 + 4
    assert plain.after_forward["activations"] == f8.after_forward["activations"] == by_hand
    assert f8.peak["parameters"] == plain.peak["parameters"]  # no float8 copy of the weights is kept
    assert "convert_to_float8_training on 4 linear layers" in " ".join(f8.notes)  # not the head


def test_float8_against_a_real_cpu_step() -> None:
    """torchao's float8 training runs on the CPU here: the estimate against the measured step, to the byte."""
    pytest.importorskip("torchao.float8")
    from torchao.float8 import convert_to_float8_training

    x = torch.randn(512, 256)
    est = vram_magic.estimate(Blocks, x, device="cpu", float8=True)
    torch.manual_seed(0)
    model = Blocks()
    convert_to_float8_training(model, module_filter_fn=lambda m, name: name != "head")
    opt = torch.optim.AdamW(model.parameters())
    with vram_magic.measure() as m:
        for _ in range(2):
            out = model(x)
            loss = out.sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            del out, loss
    for c in ("parameters", "gradients", "optimizer_state", "activations", "other"):
        assert est.peak[c] == m.report.peak[c], c
