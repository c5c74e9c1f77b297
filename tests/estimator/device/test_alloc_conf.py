"""The estimate under the CUDA caching allocator's settings (``estimate(..., alloc_conf=...)``, ``%vram_estimate
--alloc-conf``, ``PYTORCH_CUDA_ALLOC_CONF``): the allocator replayed with them (``engine/cuda/caching_allocator.py``,
whose rules ``tests/engine/cuda/test_caching_allocator.py`` checks by hand) and named in the notes. The GPU run
compares the same estimate with a real step under ``expandable_segments:True``
(``tests/engine/cuda/test_real_gpu.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vram_magic
from tests.support import run_ok

KiB, MiB = 1024, 1024**2
# a Linear(1000, 5000) in fp32: a 20,000,000-byte weight (19.07 MiB: its own 20 MiB segment by default, with 0.93 MiB
# left unsplit, so its block is 20 MiB; split at its 512-byte rounding with expandable segments) and a 20,000-byte
# bias (a small-pool block of 20,480 bytes either way)
WEIGHT_DEFAULT, WEIGHT_EXPANDABLE, BIAS = 20 * MiB, 20_000_256, 20_480


def model_and_inputs():
    torch.manual_seed(0)
    return nn.Linear(1000, 5000), torch.randn(8, 1000)


def test_expandable_segments_give_blocks_their_rounded_size():
    model, x = model_and_inputs()
    default = vram_magic.estimate(model, x, gpu="A100-80GB")
    expandable = vram_magic.estimate(model, x, gpu="A100-80GB", alloc_conf="expandable_segments:True")
    assert default.peak["parameters"] == WEIGHT_DEFAULT + BIAS
    assert expandable.peak["parameters"] == WEIGHT_EXPANDABLE + BIAS
    assert any("expandable_segments:True (from alloc_conf=)" in n for n in expandable.notes), expandable.notes
    assert not any("allocator's settings" in n or "with the settings" in n for n in default.notes)


def test_the_environment_is_read_when_alloc_conf_is_not_given(monkeypatch):
    model, x = model_and_inputs()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    est = vram_magic.estimate(model, x, gpu="A100-80GB")
    assert est.peak["parameters"] == WEIGHT_EXPANDABLE + BIAS
    assert any("(from PYTORCH_CUDA_ALLOC_CONF)" in n for n in est.notes), est.notes
    # alloc_conf wins over the environment
    assert vram_magic.estimate(model, x, gpu="A100-80GB", alloc_conf="").peak["parameters"] == WEIGHT_DEFAULT + BIAS


def test_max_split_size_keeps_oversize_blocks_from_smaller_requests():
    model, x = model_and_inputs()
    default = vram_magic.estimate(model, x, gpu="A100-80GB")
    split = vram_magic.estimate(model, x, gpu="A100-80GB", alloc_conf="max_split_size_mb:20")
    # the step's 20 MiB blocks are cached oversize blocks that smaller requests may not take: more is reserved
    assert split.reserved > default.reserved
    assert any("max_split_size_mb:20" in n for n in split.notes)


def test_bad_settings_say_what_is_wrong():
    model, x = model_and_inputs()
    with pytest.raises(ValueError, match="max_split_size_mb must be at least 20"):
        vram_magic.estimate(model, x, alloc_conf="max_split_size_mb:4")
    with pytest.raises(ValueError, match="unknown allocator option 'expandable'"):
        vram_magic.estimate(model, x, alloc_conf="expandable:True")


def test_the_magic_takes_alloc_conf(shell):
    shell.user_ns.update(model=nn.Linear(1000, 5000), x=torch.randn(8, 1000))
    run_ok(shell, "%vram_estimate model --input x --gpu A100-80GB --alloc-conf expandable_segments:True -q -o e")
    est = shell.user_ns["e"]
    assert est.peak["parameters"] == WEIGHT_EXPANDABLE + BIAS
    assert any("expandable_segments:True" in n for n in est.notes)
