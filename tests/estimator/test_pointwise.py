"""A model made of pointwise chains between matmuls, estimated eager and compiled, against real CPU steps.

Each layer is ``x + gelu(h) * sigmoid(h) + tanh(h) * 0.5 - h.pow(2) * 0.01`` on ``h = lin(x)``: in eager mode
autograd saves a tensor for nearly every op; compiled, Inductor fuses each chain into one kernel and the
min-cut partitioner saves only ``h`` (and the layer's input), recomputing the rest in the backward.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import vram_magic
from tests.support.models import BATCH, LAYERS, D, PointwiseMLP, pointwise_batch
from tests.support.zoo import real_peak
from vram_magic.estimator.tracing.compiled.backend import supported

MIB = 2**20
TENSOR = BATCH * D * 4  # one (4096, 512) float32 activation: 8 MiB
PARAMS = LAYERS * (D * D + D) * 4


def test_eager_pointwise_mlp_within_half_a_percent_of_the_real_steps():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        real = real_peak(PointwiseMLP, pointwise_batch)
    est = vram_magic.estimate(PointwiseMLP, pointwise_batch, device="cpu")
    assert est.peak["parameters"] == PARAMS
    assert est.peak["optimizer_state"] == 2 * PARAMS + LAYERS * 2 * 4  # exp_avg, exp_avg_sq, the step counters
    assert abs(est.peak.total - real) / real < 0.005, (est.peak.total, real)
    # a single real step peaks before AdamW has made its state (8 MiB here): the estimate is the steady state
    one = real_peak(PointwiseMLP, pointwise_batch, steps=1)
    assert abs(real - one - 2 * PARAMS) <= 64 * 1024, (real, one)
    first = vram_magic.estimate(PointwiseMLP, pointwise_batch, device="cpu", steps=1)
    assert abs(first.peak.total - one) / one < 0.005, (first.peak.total, one)


@pytest.mark.slow
@pytest.mark.skipif(not supported(), reason="compiled code under a dispatch mode needs PyTorch 2.9")
def test_compiled_pointwise_mlp_within_five_percent_of_a_real_inductor_step():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        real = real_peak(PointwiseMLP, pointwise_batch, compiled=True)
        eager = real_peak(PointwiseMLP, pointwise_batch)
    est = vram_magic.estimate(lambda: torch.compile(PointwiseMLP()), pointwise_batch, device="cpu")
    assert not est.partial, est.problem
    assert abs(est.peak.total - real) / real < 0.05, (est.peak.total / MIB, real / MIB)
    # compiled, each layer keeps h and its input for the backward (not one tensor per op): far below eager
    assert real < 0.5 * eager
    assert est.peak["activations"] < 12 * TENSOR, est.peak["activations"] / MIB
