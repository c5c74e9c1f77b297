"""The per-rank results without processes: a rank's report survives JSON, the view draws every rank on one
scale with the estimate beside each peak, the imbalance is what the numbers say, and misuse is named."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch

import vram_magic
from vram_magic.ranks import RankReport, RankReports
from vram_magic.ranks.result import rank_report


def _measured(width: int, budget: str | None = None):
    """A real report: a Linear(width, width) trained one step (out of memory under ``budget``)."""
    model = torch.nn.Linear(width, width)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(8, width)
    try:
        with vram_magic.measure(budget=budget) as m:
            loss = model(x).sum()
            loss.backward()
            opt.step()
            if budget:
                big = torch.empty(10 * width * width)  # noqa: F841
    except torch.OutOfMemoryError:
        pass
    return m.report


def test_a_report_survives_json() -> None:
    for report in (_measured(256), _measured(256, budget="3MiB")):
        rr = rank_report(report, rank=3, world=4, backend="gloo", ended="gather")
        back = RankReport.from_json(rr.to_json())
        assert back.rank == 3 and back.world == 4 and back.backend == "gloo" and back.pid == rr.pid
        for name in ("before", "after", "peak", "delta"):
            assert getattr(back, name) == getattr(report, name)
        got, want = back.report, report
        assert (got.device, got.error, got.notes, got.advice, got.budget, got.backend) == \
            (want.device, want.error, want.notes, want.advice, want.budget, want.backend)
        assert got.oom == want.oom
        assert back.peak_sites == tuple(report.peak_sites()) and back.peak_sites
    assert RankReport.from_json(rr.to_json()).report.oom.requested == 10 * 256 * 256 * 4


def test_files_round_trip_and_missing_ranks(tmp_path) -> None:
    rr = rank_report(_measured(128), rank=0, world=3)
    RankReports(ranks=(rr,)).save(tmp_path)
    (tmp_path / "rank-00002.json").write_text("{not json")
    loaded = RankReports.load(tmp_path)
    assert [r.rank for r in loaded] == [0, 1, 2]  # the world rank 0's file names
    assert loaded[0].after == rr.after
    assert all(r.status == "missing" and r.report is None for r in loaded[1:])
    assert any("rank-00002.json" in n for n in loaded.notes)  # unreadable, and said so
    assert [r.rank for r in RankReports.load(tmp_path, world=4)] == [0, 1, 2, 3]
    with pytest.raises(FileNotFoundError):
        RankReports.load(tmp_path / "nowhere")


def _ranks() -> RankReports:
    small, large = _measured(128), _measured(256)
    return RankReports(ranks=(rank_report(small, rank=0, world=2, backend="gloo"),
                              rank_report(large, rank=1, world=2, backend="gloo")), title="%%vram cell 9")


def test_imbalance_is_the_spread_of_the_peaks() -> None:
    reports = _ranks()
    imb = reports.imbalance
    p0, p1 = reports[0].peak, reports[1].peak
    assert (imb.largest, imb.smallest, imb.largest_rank, imb.smallest_rank) == (p1.total, p0.total, 1, 0)
    assert imb.spread == p1.total - p0.total
    assert imb.by_category["parameters"] == (256 * 256 + 256 - 128 * 128 - 128) * 4
    assert imb.percent == pytest.approx(100 * imb.spread / p1.total)
    assert RankReports(ranks=reports.ranks[:1]).imbalance is None


def test_the_view_draws_every_rank_on_one_scale_with_the_estimate() -> None:
    reports = _ranks()
    est = vram_magic.estimate(torch.nn.Linear(256, 256), torch.randn(8, 256), device="cpu")
    shown = reports.with_estimate(est)
    bundle = shown._repr_mimebundle_()
    html, text = bundle["text/html"], bundle["text/plain"]
    assert text.startswith("%%vram cell 9 · 2 ranks · gloo · cpu")
    assert html.count('class="vram-bar"') == 7  # 3 moments × 2 ranks + the estimate
    assert len(set(re.findall(r'data-scale="(\d+)"', html))) == 1
    assert html.count('class="vram-mark"') == 2  # the estimate on each rank's peak
    assert f'data-bytes="{reports[1].peak["parameters"]}"' in html
    assert "vram-imbalance" in html and "vram-ranks-compare" in html
    err = 100 * (est.peak.total - reports[1].peak.total) / reports[1].peak.total
    sign = "+" if err >= 0 else "\u2212"  # the minus sign format_bytes prints
    assert f"estimate {vram_magic.format_bytes(est.peak.total)} ({sign}{abs(err):.1f} %)" in text
    assert html.count('class="vram-rank-other"') == 2  # what "other" holds at each rank's peak
    table = shown.compare()
    assert table.loc[1, "error"] == est.peak.total - reports[1].peak.total
    with pytest.raises(TypeError):
        reports.with_estimate(42)


def test_problems_are_named_per_rank() -> None:
    reports = _ranks()
    ranks = (replace(reports[0], error="ValueError: boom"),
             replace(reports[1], status="partial", ended="SIGTERM"),
             RankReport(rank=2, world=3, status="missing", error="no report within 5 s: …"))
    html = RankReports(ranks=ranks)._repr_mimebundle_()["text/html"]
    assert html.count('class="vram-rank-error"') == 3
    text = str(RankReports(ranks=ranks))
    assert "rank 0 raised ValueError: boom" in text and "rank 2: no report within 5 s" in text
    assert "rank 1: stopped (SIGTERM)" in text
    assert RankReports(ranks=ranks).errors == {0: "ValueError: boom", 2: "no report within 5 s: …"}


def test_an_estimate_for_another_world_size_is_named() -> None:
    est = vram_magic.estimate(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)),
                              torch.randn(4, 64), device="cpu", fsdp=True, world=4)
    text = str(_ranks().with_estimate(est))
    assert "the estimate is for 4 ranks, the job ran 2" in text


def test_gather_needs_a_process_group_and_sane_options() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        vram_magic.gather(None)
    json.dumps(rank_report(None, rank=0, world=1, error="x").to_dict())  # a report-less rank is JSON too
