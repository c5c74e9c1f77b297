"""An eval-mode ``nn.Dropout`` under ``inference_mode`` returns its input itself (ATen's ``_dropout_impl``). There
the op reaches a dispatch mode whole, and PyTorch's Python decomposition of it, which ``OpOverload.decompose``
runs, returns a clone: measured and estimated, such a model read one activation too many (T5's encoder keeps
its embeddings alive through every block beside their dropout, +8.6 % of its generate() peak above the weights)."""

from __future__ import annotations

import torch
from torch import nn

import vram_magic
from tests.support.zoo import real_peak

MIB = 2**20


class KeepsItsInput(nn.Module):
    """``h`` stays alive beside ``y = drop(h)``, which in eval mode is ``h`` (T5's encoder does so)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.drop, self.b = nn.Linear(1024, 1024), nn.Dropout(0.1), nn.Linear(1024, 1024)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        y = self.drop(h)
        return self.b(y) + h + y


def batch() -> torch.Tensor:
    return torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))


def test_eval_dropout_is_its_input_when_measured():
    model, x = KeepsItsInput().eval(), batch()
    with torch.inference_mode():
        with vram_magic.measure(device="cpu") as m:
            h = model.a(x)
            same = model.drop(h)
            assert same is h  # what eager returns, and what the measured block must be given
            del h, same
    assert m.peak["activations"] == 4 * MIB  # h, once


def test_eval_dropout_is_its_input_when_estimated():
    x = batch()
    est = vram_magic.estimate(KeepsItsInput().eval(), x, device="cpu", inference=True)
    # 4 MiB each: h (y is h), b's output and the first sum, then h, the first sum and the second (a y of its own
    # would be a fourth)
    assert est.peak["activations"] == 3 * 4 * MIB, est.peak.detail
    real = real_peak(KeepsItsInput, lambda: x, inference=True)
    assert abs(est.peak.total - real) <= 0.005 * real, (est.peak.total, real)
