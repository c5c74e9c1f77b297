"""HTML of a cell report, of ``%vram`` (memory now) and of the live view: self-contained, no scripts.

Everything is plain HTML with inline styles (see :mod:`.theme` for what survives which viewer): a saved
notebook shows it with no kernel and no widget state, in light and dark themes, in narrow windows (tables
scroll sideways rather than clip).
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

from ...core.breakdown import CATEGORIES, LABELS, Breakdown, shown_categories
from ...core.events import format_frame
from ...core.units import format_bytes
from ...render.bars import (
    BarRow,
    Extra,
    Scale,
    bars_html,
    code_html,
    nbsp_sizes,
    scale_for,
    swatch,
    values_html,
    zoom_note,
)
from ...render.text import experts_line
from ...render.theme import MUTED, REQUEST, ROOT, SMALL
from .text import title

if TYPE_CHECKING:
    from ..live_status import LiveStatus
    from ..report import CellReport


def _capacity_label(report: Any) -> str:
    return "budget" if getattr(report, "budget", None) else "capacity"


def report_scale(report: CellReport, session: int | None = None) -> Scale:
    totals = [report.before.total, report.after.total, report.peak.total]
    if report.oom is not None and report.oom.requested:
        oom_len = report.oom.live.total + report.oom.requested
        # a request many times the device is drawn cut at the bar's end (its size is in the label)
        totals.append(min(oom_len, 2 * max(report.capacity or 0, report.peak.total, report.oom.live.total)))
    return scale_for(totals, report.capacity, session=session, capacity_label=_capacity_label(report))


def _rows(report: CellReport) -> list[BarRow]:
    rows = [BarRow("before", report.before), BarRow("after", report.after), BarRow("peak", report.peak)]
    oom = report.oom
    if oom is not None:
        extras: tuple[Extra, ...] = ()
        note = ""
        if oom.requested:
            extras = (Extra("failed request", oom.requested, REQUEST, "vram-request"),)
            cap = oom.capacity or report.capacity
            over = oom.live.total + oom.requested - cap if cap else 0
            note = f"+ the failed request of {format_bytes(oom.requested)}" + (
                f": {format_bytes(over)} past the {_capacity_label(report)}" if over > 0 else "")
        rows.append(BarRow("at OOM", oom.live, extras=extras, note=note))
    return rows


def _list(items: list[tuple[str, int]]) -> str:
    return ", ".join(f"<code>{html.escape(name)}</code> {format_bytes(n)}" for name, n in items)


def oom_html(report: CellReport) -> str:
    oom = report.oom
    assert oom is not None
    req = f"<b>{format_bytes(oom.requested)}</b>" if oom.requested else "an unknown amount"
    where = f" at <code>{html.escape(format_frame(oom.site[0]))}</code>" if oom.site else ""
    phase = f" during the {html.escape(oom.phase)}" if oom.phase and oom.phase != "cell" else ""
    alive = ", ".join(f"{swatch(c)}{LABELS[c]} {format_bytes(oom.live[c])}" for c in CATEGORIES if oom.live[c])
    parts = [f"<div><b>Out of memory</b>: a request of {req}{where}{phase}.</div>"]
    if alive:
        parts.append(f"<div>alive then: {alive}</div>")
    if oom.holders:
        parts.append(f"<div>held by: {_list(list(oom.holders[:5]))}</div>")
    return f'<div class="vram-oom" style="margin:4px 0">{"".join(parts)}</div>'


def advice_html(advice: Any) -> str:
    items = []
    for a in advice:
        save = f" (saves ~{format_bytes(a.saving)})" if a.saving else ""
        items.append(f"<li><b>{code_html(a.title)}</b>{save}: {code_html(a.detail)}</li>")
    return (f'<ul class="vram-advice" style="margin:2px 0;padding-left:1.4em">{"".join(items)}</ul>'
            if items else "")


def notes_html(report: CellReport) -> str:
    parts = []
    if report.oom is not None:
        parts.append(oom_html(report))
    elif report.error:
        parts.append(f'<div class="vram-error">the cell raised <code>{html.escape(report.error)}</code></div>')
    experts = experts_line(report.peak)
    if experts:  # a mixture of experts: the routed experts' share of the model states at the peak
        parts.append(f"<div>mixture of experts at the peak: {html.escape(experts)}</div>")
    top = [(label or "?", n) for label, n in report.after.details("other").items() if n][:3]
    if top:
        parts.append(f"<div>other after the cell: {_list(top)}</div>")
    s = report.stats
    if s is not None and s.reserved is not None:
        used = (f", device used {format_bytes(s.used)} of {format_bytes(s.total or 0)}" if s.used is not None else "")
        parts.append(f"<div>allocator: allocated {format_bytes(s.allocated)}, reserved {format_bytes(s.reserved)}"
                     f"{used}</div>")
    sites = report.peak_sites(3)
    if sites:
        parts.append(f"<div>at the peak: {_list(sites)}</div>")
    modules = report.peak_modules(3)
    if modules:
        parts.append(f"<div>by module: {_list(modules)}</div>")
    if report.host is not None and report.host.worth_saying():
        parts.append(f"<div>{html.escape(report.host.line())}</div>")
    if report.advice:
        parts.append(f'<div style="margin-top:2px"><b>advice</b></div>{advice_html(report.advice)}')
    for note in report.notes:
        parts.append(f'<div class="vram-note" style="{MUTED}">note: {code_html(note)}</div>')
    return f'<div class="vram-notes" style="{SMALL};margin-top:2px">{"".join(parts)}</div>' if parts else ""


def _title_html(text: str) -> str:
    return f'<div class="vram-title" style="font-weight:bold;margin-bottom:2px">{html.escape(text)}</div>'


def report_html(report: CellReport, *, session_scale: int | None = None) -> str:
    """The report: bars (before, after, peak, and the state at an OOM), the values, the change, the notes.

    ``session_scale``: the largest total measured in the session, so bars of its cells compare by length.
    """
    scale = report_scale(report, session_scale)
    since = f"cell {report.previous}" if report.previous is not None else "before"
    ref = max(report.after.total, report.before.total, 1)
    if report.previous is None:
        ref = max(ref, report.after.total - report.delta.total)
    rows = [("before", report.before), ("after", report.after), ("peak", report.peak)]
    if report.oom is not None:
        rows.append(("at OOM", report.oom.live))
    return nbsp_sizes(
        f'<div class="vram-report" style="{ROOT}">'
        f"{_title_html(title(report))}"
        f"{bars_html(_rows(report), scale)}"
        f"{zoom_note(scale, report.peak.total)}"
        f"{values_html(rows, delta=(f'Δ vs {since}', report.delta, ref))}"
        f"{notes_html(report)}</div>"
    )


def now_html(now: Any) -> str:
    """``%vram``: the device's memory now, split by category, with what the allocator says."""
    from .text import now_stats_line

    b: Breakdown = now.breakdown
    scale = scale_for([b.total], now.capacity, capacity_label="capacity")
    extra = now_stats_line(now)
    notes = "".join(f'<div style="{MUTED}">note: {code_html(n)}</div>' for n in getattr(now, "notes", ()) or ())
    return nbsp_sizes(f'<div class="vram-report vram-now" style="{ROOT}">'
            f"{_title_html(f'%vram · {now.device} now')}"
            f'{bars_html([BarRow("now", b)], scale)}{zoom_note(scale, b.total)}'
            f"{values_html([('now', b)])}"
            f'<div style="{SMALL}">{html.escape(extra)}</div>{notes}</div>')


def live_html(status: LiveStatus, *, cell: int | None, capacity: int | None = None, budget: bool = False,
              session_scale: int | None = None, allocated: int | None = None) -> str:
    """The live view of a running cell: memory now and the peak so far (by category where known)."""
    from .text import live_text

    head = live_text(status, cell=cell, allocated=allocated)
    b = status.breakdown
    now = status.now if status.now is not None else allocated
    peak = status.peak
    body = ""
    if b is not None or now is not None:
        markers = ((peak, f"peak so far {format_bytes(peak)}"),) if peak else ()
        row = BarRow("now", b, total=now if b is None else None, markers=markers)
        scale = scale_for([row.length, peak or 0], capacity, session=session_scale,
                          capacity_label="budget" if budget else "capacity")
        body = bars_html([row], scale) + zoom_note(scale, max(now or 0, peak or 0))
        if b is not None:
            items = " ".join(f'<span style="white-space:nowrap;margin-right:0.8em">{swatch(c)}{LABELS[c]} '
                             f"{format_bytes(b[c])}</span>" for c in shown_categories(b))
            body += (f'<div style="{SMALL}">{items}</div><div style="{SMALL};{MUTED}">the split is approximate '
                     "while the cell runs: memory made in forward and backward counts as activations until the "
                     "end</div>")
    else:
        body = (f'<div style="{SMALL};{MUTED}">the {html.escape(status.backend)} backend reports its numbers when '
                "the cell ends</div>")
    return nbsp_sizes(f'<div class="vram-report vram-live" style="{ROOT}">'
            f'{_title_html(head.splitlines()[0])}{body}</div>')
