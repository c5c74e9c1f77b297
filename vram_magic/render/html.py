"""HTML rendering: the stacked bars and the diff table, self-contained (inline styles, no scripts)."""

from __future__ import annotations

import html

from ..report import CATEGORIES, LABELS, Breakdown, CellReport
from ..units import format_bytes
from . import COLORS
from .text import title

_GROW, _SHRINK = "#b22222", "#2e7d32"


def bars_html(rows: list[tuple[str, Breakdown]], scale: int, capacity: int | None) -> str:
    out = []
    for name, b in rows:
        segs = []
        for c in CATEGORIES:
            if b[c] <= 0:
                continue
            pct = 100.0 * b[c] / scale
            segs.append(
                f'<div class="vram-seg vram-{c}" title="{LABELS[c]}: {format_bytes(b[c])}" '
                f'style="width:{pct:.3f}%;background:{COLORS[c]};height:100%;display:inline-block"></div>'
            )
        marker = ""
        if capacity:
            left = min(100.0 * capacity / scale, 100.0)
            marker = (f'<div class="vram-capacity" title="capacity {format_bytes(capacity)}" style="position:absolute;'
                      f'left:{left:.3f}%;top:-2px;bottom:-2px;border-left:2px dashed #000"></div>')
        # name, total, then the bar: if a narrow output area clips anything, it is the bar's empty end
        out.append(
            f'<div class="vram-row" style="display:flex;align-items:center;margin:2px 0;padding-right:1em">'
            f'<div style="min-width:4.5em;font-weight:bold;white-space:nowrap">{html.escape(name)}</div>'
            f'<div class="vram-total" style="min-width:6.5em;padding-right:.6em;text-align:right;'
            f'font-family:monospace;white-space:nowrap">{format_bytes(b.total)}</div>'
            f'<div class="vram-bar" style="position:relative;flex:1;min-width:0;height:18px;background:#f3f3f3;'
            f'white-space:nowrap;overflow:hidden;font-size:0">{"".join(segs)}{marker}</div></div>'
        )
    return "".join(out)


def legend_html(b: Breakdown | None = None) -> str:
    items = []
    for c in CATEGORIES:
        val = f" {format_bytes(b[c])}" if b is not None else ""
        items.append(f'<span style="margin-right:1em"><span style="display:inline-block;width:.9em;height:.9em;'
                     f'background:{COLORS[c]};vertical-align:middle"></span> {LABELS[c]}{val}</span>')
    return f'<div class="vram-legend" style="font-size:85%;margin:4px 0">{"".join(items)}</div>'


def diff_html(report: CellReport) -> str:
    since = f"cell {report.previous}" if report.previous is not None else "before"
    cells = []
    for c in CATEGORIES:
        n = report.delta[c]
        color = _GROW if n > 0 else (_SHRINK if n < 0 else "#666")
        cells.append(f'<td style="color:{color};text-align:right;padding:0 .6em">'
                     f'{format_bytes(n, signed=True)}</td>')
    n = report.delta.total
    color = _GROW if n > 0 else (_SHRINK if n < 0 else "#666")
    head = "".join(f'<th style="padding:0 .6em">{LABELS[c]}</th>' for c in CATEGORIES)
    return (f'<table class="vram-diff" style="font-size:85%;border-collapse:collapse"><tr><th></th>{head}'
            f'<th style="padding:0 .6em">total</th></tr><tr><td><b>Δ vs {since}</b></td>{"".join(cells)}'
            f'<td style="color:{color};text-align:right;padding:0 .6em"><b>{format_bytes(n, signed=True)}</b>'
            f'</td></tr></table>')


def notes_html(report: CellReport) -> str:
    from .text import oom_text

    parts = []
    if report.oom is not None:
        parts.append(f'<pre style="color:{_GROW};margin:2px 0">{html.escape(oom_text(report).strip())}</pre>')
    sites = report.peak_sites(3)
    if sites:
        parts.append("<div>at the peak: " + ", ".join(
            f"<code>{html.escape(s)}</code> {format_bytes(n)}" for s, n in sites) + "</div>")
    modules = report.peak_modules(3)
    if modules:
        parts.append("<div>by module: " + ", ".join(
            f"<code>{html.escape(m)}</code> {format_bytes(n)}" for m, n in modules) + "</div>")
    if report.advice:
        parts.append('<ul class="vram-advice" style="margin:2px 0">' + "".join(
            f"<li>{html.escape(str(a))}</li>" for a in report.advice) + "</ul>")
    for note in report.notes:
        parts.append(f'<div style="color:#666">note: {html.escape(note)}</div>')
    return f'<div style="font-size:85%">{"".join(parts)}</div>' if parts else ""


def report_html(report: CellReport) -> str:
    scale = max(report.capacity or 0, report.peak.total, report.before.total, report.after.total, 1)
    rows = [("before", report.before), ("after", report.after), ("peak", report.peak)]
    return (
        f'<div class="vram-report" style="font-family:sans-serif;max-width:56em">'
        f'<div style="font-weight:bold">{html.escape(title(report))}</div>'
        f"{bars_html(rows, scale, report.capacity)}{legend_html()}{diff_html(report)}{notes_html(report)}</div>"
    )


def now_html(now: object) -> str:
    from ..session import MemoryNow
    from .text import now_text

    assert isinstance(now, MemoryNow)
    b = now.breakdown
    scale = max(now.capacity or 0, b.total, 1)
    extra = html.escape(now_text(now).splitlines()[-1]) if now.stats is not None or now.capacity else ""
    return (f'<div class="vram-report" style="font-family:sans-serif;max-width:56em">'
            f'<div style="font-weight:bold">%vram · {html.escape(now.device)} now</div>'
            f'{bars_html([("now", b)], scale, now.capacity)}{legend_html(b)}'
            f'<div style="font-size:85%">{extra}</div></div>')
