"""The host beside the device: a measured block's resident memory, its child processes' included (a data-loader
worker, a forked rank), checked against what the child itself says it holds; and the warning near the limit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import vram_magic
from vram_magic.core.host import HostUsage
from vram_magic.engine.host import procs

MiB = 1 << 20
pytestmark = pytest.mark.skipif(not procs.has_proc(), reason="reads Linux's /proc")


# Each block runs in a new Python process (``python -c``): one with no other children (a test runner's worker may
# have some) and whose high-water mark is its own (a long-lived worker's may already lie above anything a block does).
# It prints the report's host figures as JSON on its last line.
_WITH_A_CHILD = """
import json, multiprocessing as mp, os, time
import vram_magic
from vram_magic.engine.host import procs
MiB = 1 << 20

def child(n, up, down):
    b = bytearray(n)
    for i in range(0, n, 4096):  # touch every page: resident
        b[i] = 1
    up.put(procs.rss(os.getpid()))  # what the child itself holds at its peak
    down.get(timeout=30)  # held until the parent has seen it

if __name__ == "__main__":
    ctx = mp.get_context("fork")
    up, down = ctx.Queue(), ctx.Queue()
    with vram_magic.measure() as m:
        p = ctx.Process(target=child, args=(200 * MiB, up, down))
        p.start()
        child_rss = up.get(timeout=60)
        time.sleep(0.25)  # five samples while the child holds its memory
        down.put("done")
        p.join(30)
    h = m.report.host
    print(json.dumps([h.before, h.peak, h.children_peak, child_rss, "child processes" in str(m.report)]))
"""

_WITHOUT_CHILDREN = """
import json, torch, vram_magic
MiB = 1 << 20
with vram_magic.measure() as m:
    x = torch.ones(64 * MiB // 4)  # 64 MiB, touched
    del x
h = m.report.host
print(json.dumps([h.before, h.peak, h.children_peak]))
"""


def _fresh(code: str) -> list:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_block_s_host_peak_includes_its_child_process():
    before, peak, children_peak, child_rss, shown = _fresh(_WITH_A_CHILD)
    assert children_peak > 0
    # the child's share at the peak is the child's own resident size (sampled while it held it)
    assert abs(children_peak - child_rss) <= 2 * MiB, (children_peak, child_rss)
    assert peak >= before + child_rss - 2 * MiB
    assert shown


def test_a_block_without_children_reads_its_own_high_water_mark():
    before, peak, children_peak = _fresh(_WITHOUT_CHILDREN)
    assert children_peak == 0
    assert peak - before >= 60 * MiB  # freed before the end: caught by the process's own high-water mark


def test_near_the_limit_is_a_warning_worked_out_by_hand():
    ok = HostUsage(before=1000 * MiB, after=1000 * MiB, peak=1800 * MiB, available=1000 * MiB)
    near = HostUsage(before=1000 * MiB, after=1000 * MiB, peak=1900 * MiB, available=1000 * MiB)
    assert not ok.near_limit and near.near_limit  # 800 MiB of 1000 left: fine; 900 MiB: within 10 %
    assert "close to the limit" in near.warning() and ok.warning() == ""
    assert HostUsage(before=1, after=1, peak=1).line() == "host: peak 1 B (+0 B)"
    with vram_magic.measure(host=False) as m:
        pass
    assert m.report.host is None
