"""An estimate is plain data: the handle that re-runs it (what-ifs, searches) is kept beside its numbers, stays
behind when it is pickled or copied, and nothing in it holds the user's optimizer or its tensors."""

from __future__ import annotations

import copy
import gc
import pickle
import weakref

import pytest
import torch
from torch import nn

import vram_magic

# Linear(64, 16): 64 * 16 weights + 16 biases, fp32
P = 64 * 16 + 16
F32 = 4 * P


@pytest.fixture
def linear():
    torch.manual_seed(0)
    return nn.Linear(64, 16), torch.randn(4, 64)


def test_an_estimate_pickles_and_copies_as_its_numbers(linear):
    model, x = linear
    est = vram_magic.estimate(model, x, optimizer="sgd-momentum", device="cpu", budget="1MiB")
    assert est.peak["parameters"] == F32 and est.peak["optimizer_state"] == F32  # the momentum buffer
    for twin in (pickle.loads(pickle.dumps(est)), copy.deepcopy(est), copy.copy(est)):
        assert twin == est and twin.peak.total == est.peak.total and twin.options == est.options
        assert twin.rerun is None
        with pytest.raises(ValueError, match="cannot be re-run .*copied or unpickled"):
            twin.what_if()
    frame = est.what_if()  # the original keeps its handle: the table is computed on demand
    assert frame.index[0] == "baseline: training, sgd-momentum" and frame["needed"].iloc[0] == est.needed
    assert frame.loc["half batch", "needed"] < est.needed  # half of the batch's activations and inputs


def test_a_follow_up_runs_through_the_handle_and_returns_one(linear):
    model, x = linear
    est = vram_magic.estimate(model, x, device="cpu")
    again = est.rerun.evaluate(est.options.with_(batch=8))
    assert again.batch == 8 and again.rerun is est.rerun
    other = {label: n for c, label, n in again.peak.detail if c == "other"}
    assert other["inputs"] == 8 * 64 * 4  # the inputs resized: 8 * 64 fp32 values instead of 4 * 64
    assert {label: n for c, label, n in est.peak.detail if c == "other"}["inputs"] == 4 * 64 * 4


def test_an_optimizer_object_is_kept_as_its_class_and_hyper_parameters(linear):
    model, x = linear
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    est = vram_magic.estimate(model, x, optimizer=opt, device="cpu")
    assert est.peak["optimizer_state"] == F32  # momentum=0.9 reused: one buffer per parameter
    assert "SGD" in est.description
    assert est.options.optimizer.cls is torch.optim.SGD and est.options.optimizer.defaults["momentum"] == 0.9
    gone = weakref.ref(opt)
    del opt
    gc.collect()
    assert gone() is None  # the estimate holds neither the optimizer nor, through it, the model's parameters
    assert est.what_if().loc["baseline: " + est.options.describe(), "needed"] == est.needed
