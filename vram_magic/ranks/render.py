"""The per-rank view, as text and as HTML: pure functions of a :class:`~vram_magic.ranks.result.RankReports`.

One stacked bar per rank and moment (before, after, peak) on one scale, the five categories in the colours
every report uses, the estimate as a marker on each rank's peak bar (and its own bar below), then the values,
the estimate's error per rank, the imbalance between ranks, and what went wrong where. The HTML is built
from the shared bar and grid pieces (:mod:`vram_magic.render.bars`), so it reads without a kernel and
survives the same sanitizers as a cell report.
"""

from __future__ import annotations

import html
from typing import Any

from ..core.breakdown import LABELS, Breakdown, shown_categories
from ..core.units import format_bytes
from ..render import LETTERS
from ..render.bars import BarRow, Cell, bars_html, grid_html, nbsp_sizes, scale_for, text_bar, values_html
from ..render.text import SHORT_LABELS
from ..render.theme import BAD, MUTED, NUM, ROOT, SMALL
from .result import RankReport, RankReports

#: more ranks than this: only each rank's peak is drawn (the table still has before and after)
ALL_MOMENTS_UP_TO = 4


def title(reports: RankReports) -> str:
    parts = [reports.title, f"{len(reports)} rank{'s' if len(reports) != 1 else ''}"]
    if reports.launcher:
        parts.append(reports.launcher)
    backends = sorted({r.backend for r in reports if r.backend})
    if backends:
        parts.append("/".join(backends))
    devices = sorted({r.device for r in reports if r.device})
    if devices:
        parts.append(devices[0] if len(devices) == 1 else f"{devices[0]} … {devices[-1]}")
    if reports.wall_time:
        parts.append(f"{reports.wall_time:.1f} s")
    return " · ".join(parts)


def _moments(reports: RankReports) -> tuple[str, ...]:
    return ("before", "after", "peak") if len(reports) <= ALL_MOMENTS_UP_TO else ("peak",)


def _rows(reports: RankReports) -> list[tuple[RankReport, str, Breakdown]]:
    rows = []
    for r in reports:
        if r.report is None:
            continue
        for moment in ("before", "after", "peak"):
            rows.append((r, moment, getattr(r.report, moment)))
    return rows


def _estimate(reports: RankReports) -> Any:
    return reports.estimate


def _estimate_label(reports: RankReports) -> str:
    est = reports.estimate
    opts = getattr(est, "options", None)
    what = getattr(opts, "describe", lambda: "")() if opts is not None else ""
    return f"estimate ({what})" if what else "estimate"


def _error_pct(est: int, measured: int) -> str:
    if not measured:
        return "n/a"
    return f"{100.0 * (est - measured) / measured:+.1f} %".replace("-", "\u2212")  # the sign format_bytes uses


def _capacity(reports: RankReports) -> int | None:
    caps = [r.report.capacity for r in reports if r.report is not None]
    if caps and all(caps):
        return min(c for c in caps if c)
    return None


def _world_note(reports: RankReports) -> str:
    est_world = reports.estimate_world()
    if est_world is None or est_world in (1, len(reports)):
        return ""
    return (f"the estimate is for {est_world} ranks, the job ran {len(reports)}: compare with an estimate made "
            f"with world={len(reports)}")


def _imbalance_text(reports: RankReports) -> str:
    imb = reports.imbalance
    if imb is None:
        return ""
    if imb.spread == 0:
        return f"imbalance: none, every rank peaked at {format_bytes(imb.largest)}"
    top = sorted(((n, c) for c, n in imb.by_category.items() if n), reverse=True)[:2]
    why = ", ".join(f"{LABELS[c]} {format_bytes(n)}" for n, c in top)
    return (f"imbalance: peaks from {format_bytes(imb.smallest)} (rank {imb.smallest_rank}) to "
            f"{format_bytes(imb.largest)} (rank {imb.largest_rank}), a spread of {format_bytes(imb.spread)} "
            f"({imb.percent:.1f} % of the largest)" + (f"; it differs most in {why}" if why else ""))


def _other_at_peak(reports: RankReports) -> list[tuple[int, str]]:
    """What "other" holds at each rank's peak (FSDP's buffers, DDP's buckets, inputs): its three largest parts."""
    out = []
    for r in reports:
        if r.report is not None:
            top = [f"{label or 'unattributed'} {format_bytes(n)}" for label, n in r.report.peak.details("other").items()
                   if n][:3]
            if top:
                out.append((r.rank, ", ".join(top)))
    return out


def _problems(reports: RankReports) -> list[str]:
    out = []
    for r in reports:
        if r.report is None:
            out.append(f"rank {r.rank}: {r.error or 'no report'}")
        elif r.error:
            out.append(f"rank {r.rank} raised {r.error}")
        if r.report is not None and r.status == "partial":
            out.append(f"rank {r.rank}: stopped ({r.ended or 'killed'}) before its measurement ended; its figures "
                       "are those measured until then (the peak so far, split approximately)")
    return out


# --- text ----------------------------------------------------------------------------------------------
def ranks_text(reports: RankReports) -> str:
    lines = [title(reports)]
    rows = _rows(reports)
    est = _estimate(reports)
    cats = shown_categories(*(b for _, _, b in rows), est.peak if est is not None else None)
    head = ["".ljust(15)] + [SHORT_LABELS[c].rjust(11) for c in cats] + ["total".rjust(11)]
    lines.append("".join(head))
    last = None
    for r, moment, b in rows:
        name = (f"rank {r.rank}" if r.rank != last else "").ljust(8) + moment.ljust(7)
        last = r.rank
        lines.append(name + "".join(format_bytes(b[c]).rjust(11) for c in cats) + format_bytes(b.total).rjust(11))
    if est is not None:
        lines.append("estimate peak".ljust(15) + "".join(format_bytes(est.peak.get(c, 0)).rjust(11) for c in cats)
                     + format_bytes(est.peak.total).rjust(11))
    moments = _moments(reports)
    shown = [(r, m, b) for r, m, b in rows if m in moments]
    totals = [b.total for _, _, b in shown] + ([est.peak.total] if est is not None else [])
    scale = scale_for(totals, _capacity(reports))
    for r, moment, b in shown:
        bar = "".join(s for _, s in text_bar(b, scale.top))
        tail = ""
        if moment == "peak" and est is not None:
            tail = f"  estimate {format_bytes(est.peak.total)} ({_error_pct(est.peak.total, b.total)})"
        lines.append(f"  rank {r.rank:<3} {moment:<7}|{bar}| {format_bytes(b.total)}{tail}")
    if est is not None:
        bar = "".join(s for _, s in text_bar(est.peak, scale.top))
        lines.append(f"  {'estimate':<16}|{bar}| {format_bytes(est.peak.total)}")
    lines.append("  " + "  ".join(f"{LETTERS[c]} {LABELS[c]}" for c in cats))
    imbalance = _imbalance_text(reports)
    if imbalance:
        lines.append(imbalance)
    for rank, top in _other_at_peak(reports):
        lines.append(f"  rank {rank} other at the peak: {top}")
    for problem in _problems(reports):
        lines.append(f"  {problem}")
    note = _world_note(reports)
    for n in ([note] if note else []) + list(reports.notes):
        lines.append(f"  note: {n}")
    return "\n".join(lines)


# --- HTML ----------------------------------------------------------------------------------------------
def _compare_html(reports: RankReports) -> str:
    est = reports.estimate
    if est is None:
        return ""
    head = [Cell("<b>rank</b>", "rank", 6), Cell("<b>measured peak</b>", "measured peak", 14, "right", NUM),
            Cell("<b>estimate</b>", "estimate", 11, "right", NUM), Cell("<b>error</b>", "error", 11, "right", NUM),
            Cell("<b>error %</b>", "error %", 9, "right", NUM)]
    lines = [("vram-head", head)]
    for r in reports:
        if r.report is None:
            continue
        measured = r.report.peak.total
        err = est.peak.total - measured
        lines.append(("vram-compare-row", [
            Cell(str(r.rank), str(r.rank), 6),
            Cell(format_bytes(measured), format_bytes(measured), 14, "right", NUM),
            Cell(format_bytes(est.peak.total), format_bytes(est.peak.total), 11, "right", NUM),
            Cell(format_bytes(err, signed=True), format_bytes(err, signed=True), 11, "right", NUM),
            Cell(_error_pct(est.peak.total, measured), _error_pct(est.peak.total, measured), 9, "right", NUM),
        ]))
    return (f'<div class="vram-ranks-compare" style="margin-top:4px"><div style="{SMALL}"><b>'
            f'{html.escape(_estimate_label(reports))} beside each rank\'s peak</b></div>'
            f'<div class="vram-scroll" style="overflow-x:auto;max-width:100%">'
            f'{grid_html(lines, cls="vram-compare", style=SMALL)}</div></div>')


def ranks_html(reports: RankReports) -> str:
    est = _estimate(reports)
    rows = _rows(reports)
    moments = _moments(reports)
    bar_rows: list[BarRow] = []
    for r, moment, b in rows:
        if moment not in moments:
            continue
        markers: tuple[tuple[int, str], ...] = ()
        note = ""
        if moment == "peak" and est is not None:
            markers = ((est.peak.total, f"estimate {format_bytes(est.peak.total)}"),)
            note = f"estimate {format_bytes(est.peak.total)} ({_error_pct(est.peak.total, b.total)})"
        bar_rows.append(BarRow(f"rank {r.rank} {moment}", b, markers=markers, note=note))
    if est is not None:
        bar_rows.append(BarRow("estimate", est.peak))
    scale = scale_for([row.length for row in bar_rows], _capacity(reports))
    values = [(f"rank {r.rank} {moment}", b) for r, moment, b in rows]
    if est is not None:
        values.append(("estimate peak", est.peak))
    parts = [f'<div class="vram-title" style="font-weight:bold;margin-bottom:2px">{html.escape(title(reports))}</div>']
    if bar_rows:
        parts.append(bars_html(bar_rows, scale))
        parts.append(values_html(values))
    parts.append(_compare_html(reports))
    imbalance = _imbalance_text(reports)
    if imbalance:
        parts.append(f'<div class="vram-imbalance" style="{SMALL};margin-top:2px">{html.escape(imbalance)}</div>')
    for rank, top in _other_at_peak(reports):
        parts.append(f'<div class="vram-rank-other" style="{SMALL}">rank {rank}, other at the peak: '
                     f'{html.escape(top)}</div>')
    for problem in _problems(reports):
        parts.append(f'<div class="vram-rank-error" style="{SMALL};{BAD}">{html.escape(problem)}</div>')
    note = _world_note(reports)
    for n in ([note] if note else []) + list(reports.notes):
        parts.append(f'<div class="vram-note" style="{SMALL};{MUTED}">note: {html.escape(n)}</div>')
    return nbsp_sizes(f'<div class="vram-report vram-ranks" style="{ROOT}">{"".join(parts)}</div>')
