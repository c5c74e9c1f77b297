"""The host beside the device: a measured block's resident memory, its child processes' included (a data-loader
worker, a forked rank), checked against what the child itself says it holds; and the warning near the limit."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch

import vram_magic
from vram_magic.core.host import HostUsage
from vram_magic.engine.host import procs

MiB = 1 << 20
pytestmark = pytest.mark.skipif(not procs.has_proc(), reason="reads Linux's /proc")


def _child(n: int, up, down) -> None:
    b = bytearray(n)
    for i in range(0, n, 4096):  # touch every page: resident
        b[i] = 1
    up.put(procs.rss(os.getpid()))  # what the child itself holds at its peak
    down.get(timeout=30)  # held until the parent has seen it


def _block_with_a_child(out) -> None:
    ctx = mp.get_context("fork")
    up, down = ctx.Queue(), ctx.Queue()
    with vram_magic.measure() as m:
        p = ctx.Process(target=_child, args=(200 * MiB, up, down))
        p.start()
        child_rss = up.get(timeout=60)
        time.sleep(0.25)  # five samples while the child holds its memory
        down.put("done")
        p.join(30)
    out.put((m.report.host, child_rss, "child processes" in str(m.report)))


def _block_without_children(out) -> None:
    with vram_magic.measure() as m:
        x = torch.ones(64 * MiB // 4)  # 64 MiB, touched
        del x
    out.put(m.report.host)


def _fresh(target):
    """``target`` run in a new process: one with no other children (a test runner's worker may have some) and whose
    high-water mark is its own (a long-lived worker's may already lie above anything a block does)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=target, args=(out,))
    p.start()
    got = out.get(timeout=120)
    p.join(30)
    return got


def test_a_block_s_host_peak_includes_its_child_process():
    host, child_rss, shown = _fresh(_block_with_a_child)
    assert host is not None and host.children_peak > 0
    # the child's share at the peak is the child's own resident size (sampled while it held it)
    assert abs(host.children_peak - child_rss) <= 2 * MiB, (host.children_peak, child_rss)
    assert host.peak >= host.before + child_rss - 2 * MiB
    assert shown


def test_a_block_without_children_reads_its_own_high_water_mark():
    host = _fresh(_block_without_children)
    assert host.children_peak == 0
    assert host.peak - host.before >= 60 * MiB  # freed before the end: caught by the process's own high-water mark


def test_near_the_limit_is_a_warning_worked_out_by_hand():
    ok = HostUsage(before=1000 * MiB, after=1000 * MiB, peak=1800 * MiB, available=1000 * MiB)
    near = HostUsage(before=1000 * MiB, after=1000 * MiB, peak=1900 * MiB, available=1000 * MiB)
    assert not ok.near_limit and near.near_limit  # 800 MiB of 1000 left: fine; 900 MiB: within 10 %
    assert "close to the limit" in near.warning() and ok.warning() == ""
    assert HostUsage(before=1, after=1, peak=1).line() == "host: peak 1 B (+0 B)"
    with vram_magic.measure(host=False) as m:
        pass
    assert m.report.host is None
