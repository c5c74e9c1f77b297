"""The estimate's text view: the legend names every letter its bar draws, and the what-if table's columns stay
apart when a row costs memory."""

from __future__ import annotations

import re

import torch

import vram_magic
from vram_magic.core.units import format_bytes
from vram_magic.estimator.render.table import strategies_text
from vram_magic.estimator.result import Strategy

KiB, MiB = 1024, 1024**2


def test_legend_names_the_kv_cache_the_bar_draws() -> None:
    from tests.support.generate_zoo import TupleGPT  # benchmarks/: a hand-written decoder with a tuple cache

    torch.manual_seed(0)
    model = TupleGPT(vocab=500, d=64, layers=2, heads=2, context=256).eval()
    est = vram_magic.estimate(model, torch.randint(0, 500, (2, 128)), generate=4, device="cpu")
    text = str(est)
    # K and V of 2 layers, batch 2, 64 wide, fp32, prompt + 3 tokens fed back in
    assert est.generation.kv_cache == 2 * 2 * 2 * 64 * 4 * (128 + 3)
    bar_line = next(line for line in text.splitlines() if line.lstrip().startswith("peak   |"))
    legend = next(line for line in text.splitlines() if "P parameters" in line)
    assert "K" in bar_line and "K KV cache" in legend


def test_training_estimate_legend_has_no_kv_cache() -> None:
    est = vram_magic.estimate(torch.nn.Linear(64, 64), torch.randn(8, 64), device="cpu")
    legend = next(line for line in str(est).splitlines() if "P parameters" in line)
    assert "KV cache" not in legend and "A activations" in legend


def test_what_if_row_that_costs_memory_keeps_its_columns_apart() -> None:
    base = Strategy("baseline: generate 32 tokens", 33 * MiB, 33 * MiB, 0, 1.0, 1.0, None)
    static = Strategy("static cache", 33 * MiB + 124 * KiB, 33 * MiB + 124 * KiB, 124 * KiB, 1.0, 1.0, None)
    row = strategies_text((base, static)).splitlines()[-1]
    needed = format_bytes(static.needed)
    assert re.search(rf"{re.escape(needed)} +costs 124 KiB +×1\.00", row), row
