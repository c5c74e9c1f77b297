"""The ``%vram watch`` monitor: the latest reading and a small chart of the last ones (plain HTML, no scripts)."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

from ..core.units import format_bytes
from ..render.bars import Cell, grid_html, nbsp_sizes
from ..render.theme import MUTED, NUM, ROOT, SMALL, TRACK

# Drawn back to front: the series that contains the others first.
SERIES_STYLE = {
    "device used": "background:rgba(128,128,128,0.45)",
    "process RSS": "background:rgba(128,128,128,0.45)",
    "reserved": "background:#56B4E9",
    "allocated": "background:#0072B2",
    "tracked tensors": "background:#0072B2",
}
_ORDER = ("device used", "process RSS", "reserved", "allocated", "tracked tensors")


def _since(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


def watch_text(device: str, samples: Sequence[Any], interval: float, *, stopped: bool = False) -> str:
    state = "stopped" if stopped else f"every {interval:g} s"
    head = f"%vram watch · {device} · {state}"
    if not samples:
        return head
    last = samples[-1]
    parts = [f"{name} {format_bytes(v) if v is not None else '—'}" for name, v in last.values.items()]
    line = "  " + " · ".join(parts) + (f" (of {format_bytes(last.total)})" if last.total else "")
    return "\n".join([head, line] + ([f"  note: {last.note}"] if last.note else []))


def watch_html(device: str, samples: Sequence[Any], interval: float, started: float, *,
               stopped: bool = False, keep: int = 120) -> str:
    state = "stopped" if stopped else f"every {interval:g} s"
    elapsed = _since(samples[-1].t - started) if samples else "0 s"
    title = f"%vram watch · {device} · {state} · {elapsed}"
    if not samples:
        return f'<div class="vram-report vram-watch" style="{ROOT}"><b>{html.escape(title)}</b></div>'
    last = samples[-1]
    names = [n for n in _ORDER if n in last.values]
    items = []
    for name in reversed(names):
        v = last.values[name]
        items.append(f'<span style="white-space:nowrap;margin-right:1em"><span style="display:inline-block;'
                     f'width:0.8em;height:0.8em;margin-right:0.3em;{SERIES_STYLE[name]}"></span>{name} '
                     f'<b class="vram-watch-value">{format_bytes(v) if v is not None else "—"}</b></span>')
    of = f'<span style="white-space:nowrap;{MUTED}">of {format_bytes(last.total)}</span>' if last.total else ""
    width = 100.0 / keep
    start = keep - len(samples)
    charts = []
    label_w = max(len(n) for n in names)
    for name in reversed(names):  # one chart per series, each on its own scale (RSS dwarfs tensors)
        values = [s.values.get(name) for s in samples]
        top = max([v for v in values if v] + [1])
        cols = []
        for i, v in enumerate(values):
            if v:
                cols.append(f'<span style="display:block;position:absolute;left:{(start + i) * width:.3f}%;'
                            f'width:{width:.3f}%;bottom:0;height:{100.0 * v / top:.2f}%;{SERIES_STYLE[name]}"></span>')
        biggest = format_bytes(top)
        charts.append(("vram-watch-row", [
            Cell(name, name, label_w, style=f"white-space:nowrap;{SMALL}"),
            Cell(biggest, biggest, 9, "right", f"{NUM};{SMALL};{MUTED}"),
            Cell(f'<span class="vram-watch-chart" data-series="{name}" style="display:block;position:relative;'
                 f'height:26px;min-width:10em;{TRACK}">{"".join(cols)}</span>', style="width:100%"),
        ]))
    chart = (f'{grid_html(charts, cls="vram-watch-charts", wide=True)}'
             f'<div style="{SMALL};{MUTED}">the last {_since(keep * interval)}, newest on the right; each chart '
             "up to its largest value (left)</div>")
    note = f'<div style="{SMALL};{MUTED}">note: {html.escape(last.note)}</div>' if last.note else ""
    return nbsp_sizes(f'<div class="vram-report vram-watch" style="{ROOT};max-width:44em">'
            f'<div class="vram-title" style="font-weight:bold">{html.escape(title)}</div>'
            f'<div style="{SMALL}">{"".join(items)}{of}</div>{chart}{note}</div>')
