"""The traces a workload keeps: one fake run per configuration that changes the trace, the rest replays."""

from __future__ import annotations

import torch
from torch import nn

from vram_magic.estimator.device import make_target
from vram_magic.estimator.fake.request import Request
from vram_magic.estimator.options import make_options
from vram_magic.estimator.step.workload import StepWorkload
from vram_magic.estimator.tracing.kept import KeptTraces


def test_kept_traces_drop_the_least_recently_used():
    made: list[str] = []
    kept: KeptTraces[str] = KeptTraces(2)

    def make(key: str):
        return lambda: made.append(key) or key.upper()

    assert kept.get("a", make("a")) == "A" and kept.get("b", make("b")) == "B"
    assert kept.get("a", make("a")) == "A"  # kept, and now the most recent
    assert kept.get("c", make("c")) == "C"  # "b" dropped
    assert kept.get("b", make("b")) == "B"
    assert made == ["a", "b", "c", "b"] and kept.made == 4 and len(kept) == 2


def test_a_step_workload_traces_once_for_what_only_replays_change():
    model, x = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)), torch.randn(8, 64)
    workload = StepWorkload(Request(model, x), make_target("A100-80GB", None))
    base = make_options()
    states = [workload.evaluate(base.with_(zero=z, world=4 if z else 1)).model_states for z in (None, 1, 2, 3)]
    assert workload.traced == 1  # ZeRO's stages and the world are applied to the one trace
    params = (64 * 256 + 256 + 256 * 64 + 64) * 4
    # AdamW: weights, gradients and two moments; ZeRO-1 shards the moments, -2 the gradients too, -3 everything
    assert states[0] == 4 * params
    assert states[1:] == [2 * params + params // 2, params + params // 4 + params // 2, params]
    workload.evaluate(base.with_(checkpointing=True))
    assert workload.traced == 2
