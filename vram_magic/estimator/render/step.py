"""Text and HTML of an estimate: pure functions of the result.

The HTML uses the same bars, scale and theme-aware styles as ``%%vram`` reports (``vram_magic.render``): the
GPU's capacity (or the budget) is a marker inside the bar area when the step fills enough of it, an estimate
that needs little of a large GPU is drawn zoomed in with its share ("3.4 % of T4"), and one that does not fit
shows its bar running past the marker by the amount it is short.
"""

from __future__ import annotations

import html

from ...breakdown import shown_categories
from ...render.bars import BarRow, Cell, Extra, bars_html, grid_html, nbsp_sizes, scale_for, values_html, zoom_note
from ...render.text import bar, legend, table
from ...render.theme import BAD, GOOD, MUTED, NUM, RESERVE, ROOT, SMALL
from ...units import format_bytes, format_count
from ..result import Estimate, Strategy


def _title(est: Estimate) -> str:
    shape = f" · batch {est.batch}" if est.batch is not None else ""
    if est.micro_batch is not None and est.micro_batch != est.batch:
        shape += f" (micro-batch {est.micro_batch})"
    return (f"%vram_estimate {est.model} · {est.description} · {est.device}{shape} · "
            f"{format_count(est.parameters)} parameters")


def _flops(n: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} FLOP"


def module_path(est: Estimate, name: str) -> str:
    """A module as it is written in code: ``model.1``, ``model.encoder.layers.0`` (the estimate's model name
    first, so a child index never reads as a number)."""
    if not name or name.startswith("(") or not est.model or name == est.model or name.startswith(f"{est.model}."):
        return name
    return f"{est.model}.{name}"


def _traced_line(est: Estimate) -> str:
    modelled = ", ".join(f"{label} {format_bytes(n)}" for label, n in est.modelled)
    line = f"traced {format_bytes(est.traced)} (every tensor of the step on fake tensors)"
    if modelled:
        line += f"; modelled {modelled}"
    if est.device == "cuda":
        line += (f"; reserved ≈ peak × {est.reserved / max(est.peak.total, 1):.2f} = {format_bytes(est.reserved)}, "
                 f"+ CUDA context {format_bytes(est.context)} (modelled)")
    return line


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


def estimate_text(est: Estimate) -> str:
    lines = [_title(est)]
    if est.partial:
        lines.append(f"  PARTIAL: {est.problem}")
    scale = max(est.capacity or 0, est.peak.total, 1)
    lines.append(table([("peak", est.peak), ("after fwd", est.after_forward)]))
    lines.append(f"  peak   |{bar(est.peak, scale)}| {format_bytes(est.peak.total)}")
    lines.append(legend(shown_categories(est.peak, est.after_forward)))
    lines.append("  " + est.verdict())
    lines.append("  " + _traced_line(est))
    lines.extend(f"  {line}" for line in est.summary_lines())
    if est.top_modules:
        lines.append("  largest activations after the forward: " + ", ".join(
            f"{module_path(est, name)} {format_bytes(n)}" for name, n in est.top_modules[:5]))
    if est.flops:
        fwd, bwd = _flops(est.flops["forward"]), _flops(est.flops["backward"])
        lines.append(f"  compute per optimizer step: {_flops(est.total_flops)} (forward {fwd}, backward {bwd})")
    if est.generation is not None:  # generate= (generate_render.py)
        from .generation import generation_lines

        lines.extend(f"  {line}" for line in generation_lines(est))
    elif est.max_batch is not None:
        lines.append(f"  largest batch that fits: {est.max_batch}")
    if est.max_seq is not None and est.generation is None:
        lines.append(f"  longest sequence that fits: {est.max_seq}")
    if est.strategies:
        lines.append(strategies_text(est.strategies))
    for note in est.notes:
        if note != est.problem:
            lines.append(f"  note: {note}")
    return "\n".join(lines)


def strategies_text(rows: tuple[Strategy, ...]) -> str:
    out = ["  what if                                     peak     needed          saves  compute  fits"]
    for r in _sorted(rows):
        fits = "" if r.fits is None else ("yes" if r.fits else "no")
        out.append(f"  {r.name[:38]:<38}{format_bytes(r.peak):>11}{format_bytes(r.needed):>11}"
                   f"{_saves(r):>15}   ×{r.compute:<5.2f} {fits}")
    return "\n".join(out)


def _rows(est: Estimate) -> list[BarRow]:
    rows = [BarRow("peak", est.peak)]
    extra = est.needed - est.peak.total
    if extra > 0:
        label = "allocator reserve and CUDA context" if est.device == "cuda" else "reserve"
        note = ""
        if est.capacity and est.needed > est.capacity:
            where = est.gpu or "the budget"
            note = f"{format_bytes(est.needed - est.capacity)} over {where}"
        rows.append(BarRow("needed", est.peak, extras=(Extra(label, extra, RESERVE, "vram-reserve"),), note=note))
    elif est.capacity and est.needed > est.capacity:
        rows[0] = BarRow("peak", est.peak, note=f"{format_bytes(est.needed - est.capacity)} over "
                                                   f"{est.gpu or 'the budget'}")
    rows.append(BarRow("after fwd", est.after_forward))
    return rows


def estimate_html(est: Estimate) -> str:
    rows = _rows(est)
    label = est.gpu or "budget"
    scale = scale_for([r.length for r in rows], est.capacity, capacity_label=label)
    verdict_style = GOOD if est.fits else (BAD if est.fits is False else "")
    mark = "✔ " if est.fits else ("✘ " if est.fits is False else "")
    parts = [f'<div class="vram-report vram-estimate" style="{ROOT}">',
             f'<div class="vram-title" style="font-weight:bold;margin-bottom:2px">{html.escape(_title(est))}</div>']
    if est.partial:
        parts.append(f'<div class="vram-partial" style="{BAD}"><b>partial</b>: {html.escape(est.problem or "")}'
                     "</div>")
    parts.append(bars_html(rows, scale))
    parts.append(zoom_note(scale, est.needed, est.gpu))
    parts.append(f'<div class="vram-verdict" style="{verdict_style};font-weight:bold">{mark}'
                 f"{html.escape(est.verdict())}</div>")
    parts.append(values_html([("peak", est.peak), ("after fwd", est.after_forward)]))
    notes = [f'<div style="{MUTED}">{html.escape(_traced_line(est))}</div>']
    notes += [f"<div>{html.escape(line)}</div>" for line in est.summary_lines()]
    if est.top_modules:
        notes.append("<div>largest activations after the forward: " + ", ".join(
            f"<code>{html.escape(module_path(est, n))}</code> {format_bytes(b)}" for n, b in est.top_modules[:5])
            + "</div>")
    if est.flops:
        notes.append(f"<div>compute per optimizer step: {_flops(est.total_flops)} (forward "
                     f"{_flops(est.flops['forward'])}, backward {_flops(est.flops['backward'])})</div>")
    if est.generation is not None:  # generate= (generate_render.py)
        from .generation import generation_html

        notes.append(generation_html(est))
    elif est.max_batch is not None:
        notes.append(f"<div><b>largest batch that fits: {est.max_batch}</b></div>")
    if est.max_seq is not None and est.generation is None:
        notes.append(f"<div><b>longest sequence that fits: {est.max_seq}</b></div>")
    parts.append(f'<div class="vram-notes" style="{SMALL}">{"".join(notes)}</div>')
    if est.strategies:
        parts.append(strategies_html(est.strategies))
    for note in est.notes:
        if note != est.problem:
            parts.append(f'<div class="vram-note" style="{SMALL};{MUTED}">note: {html.escape(note)}</div>')
    parts.append("</div>")
    return nbsp_sizes("".join(parts))


def strategies_html(rows: tuple[Strategy, ...]) -> str:
    """The what-if table: every column headed, numbers right-aligned, fit marks coloured, sorted by saving."""
    ordered = _sorted(rows)
    name_w = max([len(r.name) for r in ordered] + [7])
    num = f"{NUM};padding-right:0.9em"
    heads = [("what if", "left", name_w), ("peak", "right", 10), ("needed", "right", 10), ("saves", "right", 14),
             ("compute", "right", 8), ("steps", "right", 6), ("fits", "left", 7), ("note", "left", 0)]
    lines = [("vram-what-if-head", [Cell(h, h, w, align, "font-weight:bold;white-space:nowrap;padding-right:0.9em")
                                    for h, align, w in heads])]
    for r in ordered:
        if r.fits is None:
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
            Cell(fits.markup, fits.plain, 7, style="white-space:nowrap;padding-right:0.9em"),
            Cell(html.escape(r.note), r.note, style=f"min-width:12em;white-space:normal;{MUTED}"),
        ]))
    return (f'<div class="vram-scroll" style="overflow-x:auto;max-width:100%;margin-top:4px">'
            f'{grid_html(lines, cls="vram-what-if", style=SMALL, row_styles=_HEAD_ROW)}</div>')


_HEAD_ROW = {"vram-what-if-head": "border-bottom:1px solid rgba(128,128,128,0.55)"}
