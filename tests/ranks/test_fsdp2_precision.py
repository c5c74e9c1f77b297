"""FSDP2 as large runs configure it — ``fully_shard`` with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=…)``,
with ``CPUOffloadPolicy``, and with torchao's float8 linears — on two gloo ranks of this CPU, each rank measured with
``vram_magic.measure()``, against ``vram_magic.estimate(..., zero=3, world=2, param_dtype="bf16", device="cpu")``: per
rank and per category within 2 % (tests/support/fsdp_jobs.py, run by tests/support/parallel_runs.py's launcher).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch.distributed as dist

from tests.support import TORCH_BEFORE_2_6
from tests.support import parallel_runs as pr

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                       reason="needs torch.distributed with gloo"),
    pytest.mark.skipif(TORCH_BEFORE_2_6, reason="transformers 5 needs PyTorch 2.6 or later (FSDP2 on the CPU: 2.7)"),
]
WORLD = 2
# the float8 case where torchao is installed (its float8 training runs on the CPU)
CASES = ("fsdp-llama-bf16", "fsdp-llama-bf16-reduce-bf16", "fsdp-llama-bf16-offload") + \
    (("fsdp-llama-bf16-float8",) if importlib.util.find_spec("torchao") is not None else ())
TOLERANCE = 0.02
#: what FSDP2 names, in the measurement and in the estimate alike
FSDP_LABELS = {("other", "FSDP all-gather buffers"), ("other", "FSDP unsharded parameters (all-gathered)"),
               ("other", "FSDP reduce-scatter buffers"),
               ("gradients", "FSDP unsharded gradients (before reduce-scatter)")}


@pytest.fixture(scope="module")
def measured() -> dict[str, list[dict]]:
    return pr.run_once(WORLD, CASES)


@pytest.mark.parametrize("case", CASES)
def test_each_rank_within_two_percent_per_category(case: str, measured: dict[str, list[dict]]) -> None:
    from tests.support import fsdp_jobs

    est = fsdp_jobs.estimate(case, WORLD)
    assert est.options.fsdp_traced
    for figures in measured[case]:
        errors = pr.errors(figures, est.peak)
        assert not pr.off(figures, est.peak, TOLERANCE), f"rank {figures['rank']}: {errors}"
        # the buffers are told apart as the measurement tells them, at the same sizes
        for cat, label in FSDP_LABELS:
            got = figures["peak_details"][cat].get(label, 0)
            want = est.peak.details(cat).get(label, 0)
            assert abs(want - got) <= TOLERANCE * max(got, 1), (cat, label, want, got)


def test_the_peak_holds_every_fsdp_buffer(measured: dict[str, list[dict]]) -> None:
    """The job is shaped so that the peak falls in the backward with FSDP2's buffers and gradients alive: the check
    covers them, not only the model states."""
    for figures in measured["fsdp-llama-bf16"]:
        peak = figures["peak_details"]
        assert all(peak[cat].get(label, 0) > 0 for cat, label in FSDP_LABELS), peak
        assert figures["peak"]["gradients"] > 0
