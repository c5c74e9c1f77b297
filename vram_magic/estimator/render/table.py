"""The what-if table of an estimate, in text and HTML: the baseline first, then each change by the memory it saves."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

from ...core.units import format_bytes
from ...render.bars import Cell, grid_html
from ...render.theme import BAD, GOOD, MUTED, NUM, SMALL

if TYPE_CHECKING:
    from ..result import Strategy


def _sorted(rows: tuple[Strategy, ...]) -> list[Strategy]:
    """The baseline first, then the strategies by the memory they save, largest first."""
    if not rows:
        return []
    return [rows[0], *sorted(rows[1:], key=lambda r: r.saving)]


def _saves(r: Strategy) -> str:
    if r.saving < 0:
        return format_bytes(-r.saving)
    if r.saving > 0:
        return f"costs {format_bytes(r.saving)}"
    return "±0"


def strategies_text(rows: tuple[Strategy, ...]) -> str:
    out = ["  what if                                     peak     needed          saves  compute  fits"]
    for r in _sorted(rows):
        fits = "" if r.fits is None else ("yes" if r.fits else "no")
        if r.partial and r.fits is not False:
            fits = "partial"
        out.append(f"  {r.name[:38]:<38}{format_bytes(r.peak):>11}{format_bytes(r.needed):>11}"
                   f"{_saves(r):>15}   ×{r.compute:<5.2f} {fits}")
    return "\n".join(out)


def strategies_html(rows: tuple[Strategy, ...]) -> str:
    """The what-if table: every column headed, numbers right-aligned, fit marks coloured, sorted by saving."""
    ordered = _sorted(rows)
    name_w = max([len(r.name) for r in ordered] + [7])
    num = f"{NUM};padding-right:0.9em"
    fits_w = 9 if any(r.partial for r in ordered) else 7
    heads = [("what if", "left", name_w), ("peak", "right", 10), ("needed", "right", 10), ("saves", "right", 14),
             ("compute", "right", 8), ("steps", "right", 6), ("fits", "left", fits_w), ("note", "left", 0)]
    lines = [("vram-what-if-head", [Cell(h, h, w, align, "font-weight:bold;white-space:nowrap;padding-right:0.9em")
                                    for h, align, w in heads])]
    for r in ordered:
        if r.partial and r.fits is not False:  # stopped early: what it needs is a lower bound, its fit not known
            fits = Cell(f'<span class="vram-partial" style="{BAD};font-weight:bold">⚠ partial</span>', "⚠ partial", 9)
        elif r.fits is None:
            fits = Cell("", "", 7)
        elif r.fits:
            fits = Cell(f'<span class="vram-fits" style="{GOOD};font-weight:bold">✔ fits</span>', "✔ fits", 7)
        else:
            fits = Cell(f'<span class="vram-fails" style="{BAD};font-weight:bold">✘ no</span>', "✘ no", 7)
        peak, needed, saves = format_bytes(r.peak), format_bytes(r.needed), _saves(r)
        compute, steps = f"×{r.compute:.2f}", f"×{r.steps:g}"
        lines.append(("vram-what-if-row", [
            Cell(html.escape(r.name), r.name, name_w, style="white-space:nowrap;padding-right:0.9em"),
            Cell(peak, peak, 10, "right", num), Cell(needed, needed, 10, "right", num),
            Cell(saves, saves, 14, "right", num), Cell(compute, compute, 8, "right", num),
            Cell(steps, steps, 6, "right", num),
            Cell(fits.markup, fits.plain, fits_w, style="white-space:nowrap;padding-right:0.9em"),
            Cell(html.escape(r.note), r.note, style=f"min-width:12em;white-space:normal;{MUTED}"),
        ]))
    return (f'<div class="vram-scroll" style="overflow-x:auto;max-width:100%;margin-top:4px">'
            f'{grid_html(lines, cls="vram-what-if", style=SMALL, row_styles=_HEAD_ROW)}</div>')


_HEAD_ROW = {"vram-what-if-head": "border-bottom:1px solid rgba(128,128,128,0.55)"}
