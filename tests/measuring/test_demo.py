"""The README's main job: ``python -m vram_magic demo``."""

from __future__ import annotations

import io
import subprocess
import sys

from vram_magic.measuring.demo import run_demo

P = (1024 * 4096 + 4096 + 4096 * 1024 + 1024) * 4  # the demo's two Linear layers, float32


def test_demo_reports_each_cell():
    out = io.StringIO()
    session = run_demo(out)
    reports = list(session.history)
    assert [r.cell for r in reports] == [1, 2, 3, 4, 5, 6]
    assert reports[0].after.parameters == P
    assert reports[2].after.gradients == P
    assert reports[3].after.optimizer_state == 2 * P + 4 * 4  # AdamW: two moments and four step counters
    assert reports[4].after.gradients == 0
    last = reports[5]
    assert last.oom is not None and last.oom.requested == 4096 * 4096 * 4  # the first layer's output
    text = out.getvalue()
    assert "OUT OF MEMORY" in text and "at the peak: cell 2:1" in text


def test_command_line_usage():
    bad = subprocess.run([sys.executable, "-m", "vram_magic", "frobnicate"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown command" in bad.stderr
    help_ = subprocess.run([sys.executable, "-m", "vram_magic", "--help"], capture_output=True, text=True)
    assert help_.returncode == 0 and "demo" in help_.stdout
