"""A partial estimate (the fake run stopped at an op whose output depends on values fake tensors do not have) is never
shown as a plain number: its heading says PARTIAL, its figure is a lower bound ("at least … needed"), its ``fits`` is
never ``True``, and the what-if table, the searches, the magic, the command line and the planner's rows say so."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import vram_magic
from vram_magic.estimator.result import fits_of


class Routed(nn.Module):
    """A forward that asks ``torch.nonzero`` of an activation: its output's size depends on values."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.up = nn.Linear(width, width)
        self.down = nn.Linear(width, width)

    def forward(self, x):
        h = self.up(x)
        picked = torch.nonzero(h > 0)
        return self.down(h).sum() + picked.shape[0]


@pytest.fixture
def routed():
    return Routed(), torch.randn(16, 64)


def test_fits_of_never_says_a_partial_step_fits():
    assert fits_of(True, False) is True and fits_of(False, False) is False and fits_of(None, False) is None
    assert fits_of(True, True) is None  # what ran fits, the rest is not known
    assert fits_of(False, True) is False  # even what ran does not fit
    assert fits_of(None, True) is None


def test_partial_estimate_says_partial_and_at_least(routed):
    est = vram_magic.estimate(*routed, device="cpu", budget="1GiB")
    assert est.partial and "aten.nonzero" in est.problem
    assert est.fits is None  # the lower bound fits 1 GiB; whether the whole step does is not known
    text = str(est)
    heading = text.splitlines()[0]
    assert heading.startswith("%vram_estimate Routed") and heading.endswith("· PARTIAL")
    assert "  at least 1" in text and "(partial: the step stopped early), within the budget of 1.00 GiB so far: " \
        "whether the whole step fits is not known" in text
    assert not [line for line in text.splitlines() if line.lstrip().startswith("fits")]  # never the plain verdict
    page = est._html()
    title = page.split('class="vram-title"')[1].split("</div>")[0]
    assert "PARTIAL" in title
    assert "⚠" in page and "at least" in page and "✔" not in page


def test_partial_estimate_that_already_exceeds_the_capacity_does_not_fit(routed):
    est = vram_magic.estimate(*routed, device="cpu", budget="1KiB")
    assert est.partial and est.fits is False
    assert "does NOT fit 1.00 KiB: needs at least" in str(est) and "PARTIAL" in str(est).splitlines()[0]


def test_partial_what_if_rows_and_searches_are_bounds(routed):
    est = vram_magic.estimate(*routed, device="cpu", budget="1GiB", what_if=True, max_batch=True)
    assert est.strategies and all(s.partial for s in est.strategies)
    assert not any(s.fits for s in est.strategies)
    text = str(est)
    table = text[text.index("what if"):]
    assert "partial" in table and " yes" not in table
    assert "⚠ partial" in est._html()
    # each trial's needed is a lower bound: the largest batch whose lower bound fits is an upper bound
    assert est.max_batch is not None and est.max_batch > 16
    assert f"largest batch that fits: at most {est.max_batch} (partial" in text


def test_complete_estimate_is_unchanged():
    est = vram_magic.estimate(nn.Linear(64, 64), torch.randn(16, 64), device="cpu", budget="1GiB")
    assert not est.partial and est.fits is True
    assert "PARTIAL" not in str(est) and "fits 1.00 GiB" in str(est)


def test_magic_shows_partial(shell, capsys):
    shell.user_ns.update(Routed=Routed, torch=torch)
    shell.run_cell("m = Routed()")
    r = shell.run_cell("%vram_estimate m --input 'torch.randn(16, 64)' --device cpu --budget 1GiB -o est")
    assert r.error_in_exec is None
    out = capsys.readouterr().out
    assert "· PARTIAL" in out and "at least" in out and "  fits 1.00 GiB" not in out
    assert shell.user_ns["est"].fits is None


def test_command_line_says_partial_in_text_json_and_exit_status(tmp_path):
    (tmp_path / "routed_models.py").write_text(textwrap.dedent("""
        import torch
        import torch.nn as nn

        class Routed(nn.Module):
            def __init__(self):
                super().__init__()
                self.up, self.down = nn.Linear(64, 64), nn.Linear(64, 64)

            def forward(self, x):
                h = self.up(x)
                return self.down(h).sum() + torch.nonzero(h > 0).shape[0]

        def build():
            return Routed()
    """))
    cmd = [sys.executable, "-m", "vram_magic", "estimate", "routed_models:build", "--shape", "64", "--batch", "16",
           "--device", "cpu", "--budget", "1GiB"]
    text = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert text.returncode == 3, text.stderr  # partial: whether it fits is not known
    assert text.stdout.splitlines()[0].endswith("· PARTIAL") and "at least" in text.stdout
    as_json = subprocess.run(cmd + ["--json"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert as_json.returncode == 3, as_json.stderr
    data = json.loads(as_json.stdout)
    assert data["partial"] is True and data["fits"] is None and data["verdict"].startswith("at least")
    tight = subprocess.run(cmd[:-1] + ["1KiB"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert tight.returncode == 1 and "does NOT fit" in tight.stdout  # even the lower bound is over


def test_plan_never_ranks_a_partial_row_as_fitting(routed):
    plan = vram_magic.plan(*routed, device="cpu", budget="64MiB", top=2)
    assert plan.rows and plan.best is None  # the lower bounds fit 64 MiB; no row is known to
    assert all(r.fits is None for r in plan.rows)
    text = str(plan)
    assert "partial" in text.splitlines()[2] and "≥ " in text and "PARTIAL: the step stopped" in text
    assert " yes " not in text
    page = plan._html()
    assert "⚠ partial" in page and "✔ fits" not in page
