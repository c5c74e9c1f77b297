"""Stacked bars, their scale and axis, and the table of values under them: the HTML every report shares.

One scale per display, chosen by :func:`scale_for`:

- the bars run up to a round size (a tick of the axis drawn under them) at least as large as the largest
  total shown, and as large as the session's largest measured total when one is given, so outputs of the
  same session keep comparable lengths; the axis says what the length means when the scale had to grow;
- a device capacity or ``--budget`` that the content fills to at least :data:`ZOOM_FRACTION` is part of the
  scale and drawn as a dashed marker inside the bar area, with its label, so what is past it shows;
- memory that fills less of a capacity than that is drawn zoomed in, with "x % of CAPACITY" beside it,
  instead of as a sliver on an empty track.
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..core.breakdown import CATEGORIES, LABELS, Breakdown, shown_categories
from ..core.units import format_bytes
from . import COLORS, LETTERS
from .theme import GRID, MUTED, NUM, SMALL, TRACK

ZOOM_FRACTION = 0.15
"""Below this share of the capacity, bars zoom in on the content rather than show the whole device."""

TEXT_BAR_WIDTH = 40
"""Characters of a bar drawn in text (terminals, and HTML whose styles were stripped)."""

# ANSI colour classes that JupyterLab's and nbconvert's stylesheets define inside ``.jp-RenderedText pre``:
# they colour the text bars where a sanitizer dropped every inline style.
_ANSI = {"parameters": "ansi-blue-fg", "gradients": "ansi-yellow-fg", "optimizer_state": "ansi-magenta-fg",
         "activations": "ansi-cyan-fg", "kv_cache": "ansi-green-fg", "other": "ansi-white-fg"}


@dataclass(frozen=True)
class Scale:
    """What 100 % of a bar means, and where the ticks and the capacity marker are."""

    top: int
    step: int
    capacity: int | None = None  # drawn as a marker inside the bars (None: none, or off the scale)
    capacity_label: str = ""
    zoomed_from: int | None = None  # the capacity the bars are zoomed in from

    def pct(self, n: int | float) -> float:
        return 100.0 * n / self.top

    @property
    def ticks(self) -> list[int]:
        return list(range(0, self.top + 1, self.step))


def _binary_step(span: float, most: int = 5) -> int:
    """A tick step of 2^k bytes giving at most ``most`` intervals up to ``span``."""
    step = 1
    while span / step > most:
        step *= 2
    return step


def scale_for(totals: Sequence[int], capacity: int | None = None, *, session: int | None = None,
              capacity_label: str = "capacity") -> Scale:
    """The scale of one display: ``totals`` are the lengths it draws; ``session`` the session's largest."""
    content = max([*totals, 1])
    span = max(content, session or 0)
    marker = None
    zoomed = None
    if capacity:
        if span >= ZOOM_FRACTION * capacity:
            # the marker sits inside the bar area, with room for what goes past it
            span = max(span, capacity)
            marker = capacity
        else:
            zoomed = capacity
    step = _binary_step(span * 1.04)
    top = -(-int(span * 1.04) // step) * step
    if marker is not None and top - marker < step // 4:
        top += step
    return Scale(top=max(top, step), step=step, capacity=marker, capacity_label=capacity_label, zoomed_from=zoomed)


@dataclass(frozen=True)
class Extra:
    """A segment drawn after the five categories: a failed request, an allocator reserve."""

    label: str
    size: int
    style: str
    cls: str


@dataclass(frozen=True)
class BarRow:
    name: str
    breakdown: Breakdown | None
    extras: tuple[Extra, ...] = ()
    total: int | None = None  # default: the breakdown's total plus the extras
    note: str = ""  # shown after the bar
    markers: tuple[tuple[int, str], ...] = field(default=())  # (bytes, title): thin lines (a peak so far)

    @property
    def length(self) -> int:
        base = self.breakdown.total if self.breakdown is not None else (self.total or 0)
        return base + sum(e.size for e in self.extras)

    @property
    def shown_total(self) -> int:
        return self.total if self.total is not None else self.length


_SIZE = re.compile(r"(\d) (B|KiB|MiB|GiB|TiB|PiB)\b")


def nbsp_sizes(markup: str) -> str:
    """Join every number to its unit with a no-break space: a narrow window never splits ``56.7 MiB``."""
    return _SIZE.sub("\\1\u00a0\\2", markup)


def code_html(text: str) -> str:
    """Escape ``text`` and show its ``backticked`` parts as code."""
    parts = text.split("`")
    if len(parts) % 2 == 0:  # an unmatched backtick: leave the text as it is
        return html.escape(text)
    return "".join(html.escape(p) if i % 2 == 0 else f"<code>{html.escape(p)}</code>" for i, p in enumerate(parts))


def text_bar(b: Breakdown | None, scale: int, width: int = TEXT_BAR_WIDTH, extra: int = 0) -> list[tuple[str, str]]:
    """``[(category or "", characters), ...]`` of a bar drawn in ``width`` characters."""
    out: list[tuple[str, str]] = []
    used = 0
    if b is not None:
        for c in CATEGORIES:
            n = min(round(width * b[c] / scale), width - used) if scale else 0
            if n > 0:
                out.append((c, LETTERS[c] * n))
                used += n
    if extra:
        n = min(round(width * extra / scale), width - used)
        if n > 0:
            out.append(("", "x" * n))
            used += n
    out.append(("", " " * (width - used)))
    return out


@dataclass(frozen=True)
class Cell:
    """One cell of a :func:`grid_html`: markup, its plain text (to pad the text layout) and how to lay it out."""

    markup: str
    plain: str = ""
    width: int = 0  # characters in the text layout (sanitized viewers); 0: as long as it is
    align: str = "left"
    style: str = ""
    cls: str = ""


_GRID_BOX = "padding:0;margin:2px 0;font-family:inherit;font-size:100%;line-height:1.35;text-align:left"
_GRID = ("display:table;border-collapse:collapse;white-space:normal;word-break:normal;overflow:visible;margin:0;"
         "padding:0;border:0;background:transparent;font-family:inherit;font-size:100%;line-height:1.35")
_GRID_CELL = "display:table-cell;padding:1px 0.6em 1px 0;vertical-align:middle"


def grid_html(rows: Sequence[tuple[str, Sequence[Cell]]], *, cls: str, style: str = "", wide: bool = False,
              row_styles: dict[str, str] | None = None) -> str:
    """Rows of cells laid out as a table by CSS, inside a ``<pre>``: where a sanitizer strips the styles the
    same markup reads as aligned monospace text (cells padded with spaces, one line per row), and no
    ``<table>`` is left for it to escape. ``rows``: ``(row class, cells)``; ``row_styles``: extra style of the
    cells of rows of a class; ``wide``: as wide as the output."""
    out = []
    for row_cls, cells in rows:
        extra = (row_styles or {}).get(row_cls, "")
        parts = []
        for c in cells:
            pad = " " * max(c.width - len(c.plain), 0)
            left, right = (pad, "") if c.align == "right" else ("", pad)
            klass = f' class="{c.cls}"' if c.cls else ""
            parts.append(f'<span{klass} style="{_GRID_CELL};text-align:{c.align};{c.style};{extra}">{left}{c.markup}'
                         f"{right}</span>")
        out.append(f'<div class="{row_cls}" style="display:table-row">{" ".join(parts)}</div>')
    width = ";width:100%" if wide else ""
    return (f'<div class="{cls} jp-RenderedText" style="{_GRID_BOX};{style}{width}"><pre style="{_GRID}{width}">'
            f'{"".join(out)}</pre></div>')


def _text_bar_html(row: BarRow, scale: Scale) -> str:
    extra = sum(e.size for e in row.extras)
    runs = text_bar(row.breakdown, scale.top, extra=extra)
    inner = "".join(f'<span class="{_ANSI[c]}">{html.escape(s)}</span>' if c else html.escape(s) for c, s in runs)
    return f'<span class="vram-textbar" hidden="hidden">|{inner}|</span>'


def _bar_html(row: BarRow, scale: Scale) -> str:
    parts = []
    for t in scale.ticks[1:-1]:
        parts.append(f'<span style="display:block;position:absolute;left:{scale.pct(t):.3f}%;top:0;bottom:0;'
                     f'width:1px;{GRID}"></span>')
    left = 0.0
    segs: list[tuple[str, int, str, str]] = []
    if row.breakdown is not None:
        segs = [(f"vram-seg vram-{c}", row.breakdown[c], f"background:{COLORS[c]}", LABELS[c])
                for c in CATEGORIES if row.breakdown[c] > 0]
    segs += [(f"vram-extra {e.cls}", e.size, e.style, e.label) for e in row.extras if e.size > 0]
    for cls, n, style, label in segs:
        width = min(scale.pct(n), 100.0 - left)
        if width <= 0:
            break
        parts.append(f'<span class="{cls}" title="{html.escape(label)}: {format_bytes(n)}" data-bytes="{n}" '
                     f'style="display:block;position:absolute;box-sizing:border-box;left:{left:.3f}%;width:{width:.3f}%;'
                     f'top:0;bottom:0;{style}"></span>')
        left += width
    for n, title in row.markers:
        parts.append(f'<span class="vram-mark" title="{html.escape(title)}" style="display:block;position:absolute;'
                     f'left:{min(scale.pct(n), 100):.3f}%;top:-3px;bottom:-3px;border-left:2px solid"></span>')
    if scale.capacity is not None:
        parts.append(f'<span class="vram-limit" title="{html.escape(scale.capacity_label)} '
                     f'{format_bytes(scale.capacity)}" style="display:block;position:absolute;'
                     f'left:{scale.pct(scale.capacity):.3f}%;top:-4px;bottom:-4px;margin-left:-1px;'
                     'border-left:2px dashed"></span>')
    return (f'<span class="vram-bar" data-scale="{scale.top}" style="display:block;position:relative;height:15px;'
            f'min-width:7em;{TRACK}">{"".join(parts)}</span>')


def _axis_html(scale: Scale) -> str:
    """Tick labels under the bars, and the capacity marker's label at its place."""
    labels = []
    limit_at = scale.pct(scale.capacity) if scale.capacity is not None else None
    ticks = scale.ticks
    # labels at the two ends only (gridlines mark every tick): a bar may be 150 px wide in a narrow window, where
    # a middle label runs into the end's; with a capacity marker, its own label replaces the far end's
    for i, t in enumerate(ticks):
        if i not in (0, len(ticks) - 1):
            continue
        if limit_at is not None and i == len(ticks) - 1:
            continue  # the marker's label says the size that matters
        pos = "left:0;text-align:left" if i == 0 else "right:0;text-align:right"
        labels.append(f'<span class="vram-tick" style="display:block;position:absolute;{pos};white-space:nowrap">'
                      f'{"0" if t == 0 else format_bytes(t)}</span><span hidden="hidden"> · </span>')
    if limit_at is not None:
        text = f"{scale.capacity_label} {format_bytes(scale.capacity or 0)}"
        if limit_at > 55:  # the label ends at the marker
            pos = f"right:{100 - limit_at:.3f}%;margin-right:-1px;padding-right:4px;text-align:right"
        else:
            pos = f"left:{limit_at:.3f}%;padding-left:4px"
        labels.append(f'<span class="vram-limit-label" style="display:block;position:absolute;{pos};'
                      f'white-space:nowrap;font-weight:bold">{html.escape(text)}</span>'
                      '<span hidden="hidden"> · </span>')
    return (f'<span class="vram-axis" style="display:block;position:relative;height:1.35em;{SMALL};{MUTED}">'
            f'{"".join(labels)}</span>')


def bars_html(rows: Sequence[BarRow], scale: Scale) -> str:
    """The bars: name, total, bar (with its text twin for sanitized viewers), then the axis."""
    name_w = max([len(r.name) for r in rows] + [1])
    totals = [format_bytes(r.shown_total) for r in rows]
    total_w = max(len(t) for t in totals)
    lines = []
    for row, total in zip(rows, totals):
        note = (f'<span class="vram-bar-note" style="display:block;{SMALL}">{html.escape(row.note)}</span>'
                if row.note else "")
        lines.append(("vram-row", [
            Cell(html.escape(row.name), row.name, name_w, style="font-weight:bold;white-space:nowrap", cls="vram-name"),
            Cell(total, total, total_w, "right", NUM, "vram-total"),
            Cell(f"{_bar_html(row, scale)}{_text_bar_html(row, scale)}{note}", style="width:100%;padding-right:2px",
                 cls="vram-track"),
        ]))
    lines.append(("vram-axis-row", [Cell("", "", name_w), Cell("", "", total_w),
                                    Cell(_axis_html(scale), style="width:100%;padding-right:2px")]))
    return grid_html(lines, cls="vram-bars", wide=True)


def swatch(category: str) -> str:
    return (f'<span class="vram-swatch" style="display:inline-block;width:0.8em;height:0.8em;margin-right:0.3em;'
            f'vertical-align:-0.05em;background:{COLORS[category]}"></span>')


def is_negligible(n: int, reference: int) -> bool:
    """A change too small to matter next to ``reference`` bytes (under 1 KiB, or under 0.1 % of it)."""
    return abs(n) < max(1024, reference // 1000)


def signed_cell(n: int, reference: int, width: int = 0, bold: bool = False) -> Cell:
    from .theme import GROW, SHRINK

    weight = ";font-weight:bold" if bold else ""
    if n == 0 or is_negligible(n, reference):
        exact = "" if n == 0 else f' title="{format_bytes(n, signed=True)} ({n:+d} bytes): below the threshold"'
        return Cell(f'<span class="vram-same" style="{MUTED}"{exact}>±0</span>', "±0", width, "right", NUM + weight)
    style, cls = (GROW, "vram-grow") if n > 0 else (SHRINK, "vram-shrink")
    text = format_bytes(n, signed=True)
    return Cell(f'<span class="{cls}" style="{style}">{text}</span>', text, width, "right", NUM + weight)


_DELTA_ROW = {"vram-delta": "border-top:1px solid rgba(128,128,128,0.55)"}


def values_html(rows: Sequence[tuple[str, Breakdown]], delta: tuple[str, Breakdown, int] | None = None) -> str:
    """Bytes per category for each row (what the bars show, without hovering), and the change below them; the KV
    cache's column only where a row or the change has one.

    ``delta`` is ``(label, change, reference bytes)``: changes negligible next to the reference read ±0.
    """
    names = [name for name, _ in rows] + ([delta[0]] if delta else [])
    name_w = max(len(n) for n in names)
    shown = shown_categories(*[b for _, b in rows], delta[1] if delta else None)
    widths = {c: max(len(LABELS[c]) + 1, 10) for c in shown}
    bold = "font-weight:bold"
    head = [Cell("", "", name_w)] + [
        Cell(f"{swatch(c)}{LABELS[c]}", " " + LABELS[c], widths[c], "right", f"{NUM};{bold}") for c in shown
    ] + [Cell("total", "total", 10, "right", f"{NUM};{bold}")]
    lines = [("vram-head", head)]
    for name, b in rows:
        cells = [Cell(html.escape(name), name, name_w, style="white-space:nowrap")]
        cells += [Cell(format_bytes(b[c]), format_bytes(b[c]), widths[c], "right", NUM) for c in shown]
        cells.append(Cell(format_bytes(b.total), format_bytes(b.total), 10, "right", f"{NUM};{bold}"))
        lines.append(("vram-values-row", cells))
    if delta is not None:
        label, d, ref = delta
        cells = [Cell(html.escape(label), label, name_w, style=f"white-space:nowrap;{bold}")]
        cells += [signed_cell(d[c], ref, widths[c]) for c in shown]
        cells.append(signed_cell(d.total, ref, 10, bold=True))
        lines.append(("vram-delta", cells))
    return (f'<div class="vram-scroll" style="overflow-x:auto;max-width:100%">'
            f'{grid_html(lines, cls="vram-values", style=SMALL, row_styles=_DELTA_ROW)}</div>')


def zoom_note(scale: Scale, total: int, name: str | None = None) -> str:
    """"57.0 MiB is 0.4 % of T4 (15.0 GiB), zoomed in" when the bars do not show the whole capacity."""
    if scale.zoomed_from is None:
        return ""
    cap = scale.zoomed_from
    share = 100.0 * total / cap
    what = f"{name} ({format_bytes(cap)})" if name else format_bytes(cap)
    pct = f"{share:.1f}" if share < 10 else f"{share:.0f}"
    return (f'<div class="vram-zoom" style="{SMALL};{MUTED}">bars zoomed in: {format_bytes(total)} is {pct} % of '
            f"{html.escape(what)}</div>")
