"""The first step of a fake run remade from the state an earlier fake run's first step left: every estimate it gives
is the one a fake run that runs the first step gives, to the byte, for each optimizer, master weights, LoRA and
frozen parameters; state that cannot be remade exactly runs the real step."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from vram_magic.estimator.device import make_target
from vram_magic.estimator.fake.request import Request
from vram_magic.estimator.options import OptimizerChoice, make_options
from vram_magic.estimator.step import first_step
from vram_magic.estimator.step.workload import StepWorkload


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.LayerNorm(64), nn.Linear(64, 10))


def _options(optimizer, **kwargs):
    batch = kwargs.pop("batch", None)
    return make_options(optimizer=optimizer, device="cpu", **kwargs).with_(batch=batch)


@contextlib.contextmanager
def _real_first_steps():
    """A list that gets one item for each first step run as a real update on stand-in gradients (not remade)."""
    calls = []
    real = first_step._stand_in_step

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    first_step._stand_in_step = counting
    try:
        yield calls
    finally:
        first_step._stand_in_step = real


def _pair(model, x, first: dict, second: dict, optimizer="adamw"):
    """``(estimate of `second` after a fake run of `first` in the same workload, estimate of `second` alone)``; the
    number of first steps the second ran as a real update (0 where it remade the state the first left)."""
    target = make_target(None, "1GiB")
    shared = StepWorkload(Request(model, x), target)
    shared.evaluate(_options(optimizer, **first))
    with _real_first_steps() as calls:
        reused = shared.evaluate(_options(optimizer, **second))
    alone = StepWorkload(Request(model, x), target).evaluate(_options(optimizer, **second))
    return reused, alone, len(calls)


@pytest.mark.parametrize("optimizer", ["adamw", "adam", "sgd", "sgd-momentum", "adagrad", "rmsprop", "adafactor"])
def test_a_remade_first_step_gives_the_same_estimate(optimizer):
    reused, alone, real_steps = _pair(mlp(), torch.randn(32, 64), {}, {"checkpointing": True, "accumulate": 2},
                                      optimizer)
    assert real_steps == 0  # the state was remade, not stepped
    assert reused.needed == alone.needed and reused.peak == alone.peak
    assert reused.after_forward == alone.after_forward and reused.model_states == alone.model_states
    assert reused.peak["optimizer_state"] == alone.peak["optimizer_state"]


def test_adam_state_remade_is_two_moments_and_a_step_counter_a_parameter():
    """AdamW on the MLP: 64·256 + 256 + 256·64 + 64 + 2·64 + 64·10 + 10 = 33,866 parameters in 8 tensors, fp32: two
    moments of 135,464 B each and 8 step counters of 4 B (one a parameter tensor, on the host): 270,960 B."""
    model = mlp()
    reused, alone, real = _pair(model, torch.randn(8, 64), {}, {"batch": 4})
    assert sum(p.numel() for p in model.parameters()) == 33_866
    assert real == 0 and reused.peak == alone.peak
    detail = {(cat, label): n for cat, label, n in reused.peak.detail}
    assert detail[("optimizer_state", "exp_avg")] == detail[("optimizer_state", "exp_avg_sq")] == 135_464
    assert detail[("optimizer_state", "step counters")] == 32
    assert reused.peak.optimizer_state == 270_960


def test_an_optimizer_objects_hyper_parameters_key_the_state():
    """amsgrad=True keeps a third moment: a first step of plain AdamW must not stand in for it."""
    model = mlp()
    x = torch.randn(8, 64)
    target = make_target(None, "1GiB")
    shared = StepWorkload(Request(model, x), target)
    plain = shared.evaluate(make_options(optimizer="adamw", device="cpu"))
    ams = OptimizerChoice.of(torch.optim.AdamW(nn.Linear(1, 1).parameters(), amsgrad=True))
    reused = shared.evaluate(_options(ams, batch=4))
    alone = StepWorkload(Request(model, x), target).evaluate(_options(ams, batch=4))
    assert reused.peak == alone.peak and reused.needed == alone.needed
    n = sum(p.numel() for p in model.parameters())
    assert alone.model_states - plain.model_states == 4 * n  # max_exp_avg_sq, 4 bytes a parameter


def test_master_weights_and_lora_are_remade_exactly():
    x = torch.randn(16, 64)
    reused, alone, real = _pair(mlp(), x, {"dtype": "bf16"}, {"dtype": "bf16", "checkpointing": True})
    assert real == 0 and reused.peak == alone.peak and reused.needed == alone.needed
    masters = {"dtype": "bf16", "master_weights": True}
    reused, alone, real = _pair(mlp(), x, masters, {**masters, "accumulate": 2})
    assert real == 0 and reused.peak == alone.peak and reused.needed == alone.needed
    detail = {(cat, label): n for cat, label, n in reused.peak.detail}
    assert detail[("optimizer_state", "fp32 master weights")] == 4 * 33_866  # the fp32 copy the update works on
    reused, alone, real = _pair(mlp(), x, {"lora": 4}, {"lora": 4, "accumulate": 4})
    assert real == 0 and reused.peak == alone.peak and reused.needed == alone.needed


def test_another_set_of_trainable_parameters_runs_the_real_step():
    """LoRA trains other tensors than the full model: the full model's state does not stand in for them."""
    reused, alone, real = _pair(mlp(), torch.randn(16, 64), {}, {"lora": 4})
    assert real == 1 and reused.peak == alone.peak


def test_state_that_cannot_be_remade_is_not_kept():
    p, q = nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([p, q], lr=0.1)
    shared = torch.zeros(8)
    opt.state[p] = {"buf": shared[:4]}  # a view: offset 0 but a storage of 8 elements
    assert first_step.state_layout(opt, [p, q]) is None
    opt.state[p] = {"buf": torch.zeros(4)}
    opt.state[q] = {"buf": opt.state[p]["buf"]}  # one storage for two parameters
    assert first_step.state_layout(opt, [p, q]) is None
    opt.state[q] = {"buf": torch.zeros(4), "note": object()}  # an object
    assert first_step.state_layout(opt, [p, q]) is None
    opt.state[q] = {"buf": torch.zeros(2, 3).t(), "lr": 0.1, "betas": (0.9, 0.99), "k": None}
    layout = first_step.state_layout(opt, [p, q])
    assert layout == ((("buf", ("T", (4,), (1,), torch.float32, "cpu")),),
                      (("buf", ("T", (3, 2), (1, 3), torch.float32, "cpu")), ("lr", ("V", 0.1)),
                       ("betas", ("V", (0.9, 0.99))), ("k", ("V", None))))


def test_cuda_estimates_always_run_the_first_step():
    """CUDA's simulated caching allocator places blocks by the history before them: the state is made inside a real
    update there, as on a GPU, every time."""
    model, x = mlp(), torch.randn(16, 64)
    target = make_target("A100-80GB")
    shared = StepWorkload(Request(model, x), target)
    shared.evaluate(make_options(optimizer="adamw", device="cuda"))
    with _real_first_steps() as calls:
        shared.evaluate(make_options(optimizer="adamw", device="cuda", checkpointing=True))
    assert calls == [1]
