"""Errors of this package read as the user's: in IPython their tracebacks run from the user's first frame to their
last — a simulated budget's out-of-memory error ends at the line that allocated, an estimate's error at the
``estimate()`` call, with what it was raised from ending at the model's own line."""

from __future__ import annotations

from IPython.utils.capture import capture_output

from tests.support import run

MODEL = """
import torch, vram_magic
from torch import nn
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)
    def forward(self, x):
        return self.l(x.view(3, 7))
"""


def _shown(shell, cell: str) -> str:
    with capture_output() as cap:
        run(shell, cell)
    return cap.stdout


def test_an_estimates_error_ends_at_the_call_and_its_cause_at_the_models_line(shell):
    run(shell, MODEL)
    text = _shown(shell, "vram_magic.estimate(M(), torch.randn(2, 4), device='cpu')")
    assert "----> 1 vram_magic.estimate(M(), torch.randn(2, 4), device='cpu')" in text
    assert "----> 8     return self.l(x.view(3, 7))" in text  # the cause, at the model's own line
    assert "vram_magic/" not in text and "site-packages" not in text
    assert text.rstrip().splitlines()[-1].startswith("EstimateError: the model raised RuntimeError in module 'M'")


def test_a_budgets_error_inside_the_users_function_ends_at_its_line(shell):
    run(shell, "import torch\ndef grow(n):\n    return torch.ones(n)\n")
    text = _shown(shell, "%%vram --budget 8MiB -q\nx = grow(4 << 20)\n")
    assert "----> 1 x = grow(4 << 20)" in text and "----> 3     return torch.ones(n)" in text
    assert "vram_magic/" not in text and "site-packages" not in text
    assert "BudgetOutOfMemoryError: cpu out of memory under the simulated budget: tried to allocate 16.0 MiB" in text
