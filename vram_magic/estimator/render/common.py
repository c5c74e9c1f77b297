"""What every estimate's report shows, for the workloads' renderers (``step.py``, ``generation.py``): its title, the
bars and values, the verdict against the GPU, what was traced and what modelled, the notes.

The HTML uses the same bars, scale and theme-aware styles as ``%%vram`` reports (``vram_magic.render``): the
GPU's capacity (or the budget) is a marker inside the bar area when the workload fills enough of it, an estimate
that needs little of a large GPU is drawn zoomed in with its share ("3.4 % of T4"), and one that does not fit
shows its bar running past the marker by the amount it is short.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

from ...core.breakdown import shown_categories
from ...core.units import format_bytes, format_count
from ...render.bars import BarRow, Extra, bars_html, nbsp_sizes, scale_for, values_html, zoom_note
from ...render.text import bar, legend, table
from ...render.theme import BAD, GOOD, MUTED, RESERVE, ROOT, SMALL
from .table import strategies_html, strategies_text

if TYPE_CHECKING:
    from ..result import Estimate


def title(est: Estimate, shape: str) -> str:
    """``%vram_estimate MODEL · what · device · shape · parameters``, and ``· PARTIAL`` when the step stopped early."""
    return (f"%vram_estimate {est.model} · {est.description} · {est.device}{shape} · "
            f"{format_count(est.parameters)} parameters" + (" · PARTIAL" if est.partial else ""))


def flops_text(n: float) -> str:
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


def top_modules_line(est: Estimate, code: bool = False) -> str:
    """The modules whose activations hold the most after the forward (in ``<code>`` for HTML)."""
    if not est.top_modules:
        return ""
    if code:
        return "largest activations after the forward: " + ", ".join(
            f"<code>{html.escape(module_path(est, n))}</code> {format_bytes(b)}" for n, b in est.top_modules[:5])
    return "largest activations after the forward: " + ", ".join(
        f"{module_path(est, name)} {format_bytes(n)}" for name, n in est.top_modules[:5])


def traced_line(est: Estimate) -> str:
    modelled = ", ".join(f"{label} {format_bytes(n)}" for label, n in est.modelled)
    line = f"traced {format_bytes(est.traced)} (every tensor of the step on fake tensors)"
    if modelled:
        line += f"; modelled {modelled}"
    if est.device == "cuda":
        line += (f"; reserved ≈ peak × {est.reserved / max(est.peak.total, 1):.2f} = {format_bytes(est.reserved)}, "
                 f"+ CUDA context {format_bytes(est.context)} (modelled)")
    return line


def verdict(est: Estimate) -> str:
    """What the device needs, and whether it fits the GPU or the budget, by how much. A partial estimate's figure is a
    lower bound, said as one: never a plain "fits"."""
    where = est.gpu or (format_bytes(est.capacity) if est.capacity else None)
    on = " on the device" if est.device == "cuda" else ""
    if est.partial:
        return partial_verdict(est, where, on)
    if est.capacity is None or where is None:
        return f"needs {format_bytes(est.needed)}{on}"
    room = est.capacity - est.needed
    if room >= 0:
        return (f"fits {where}: needs {format_bytes(est.needed)} of {format_bytes(est.capacity)}, "
                f"headroom {format_bytes(room)} ({100 * room / est.capacity:.0f} %)")
    return (f"does NOT fit {where}: needs {format_bytes(est.needed)} of {format_bytes(est.capacity)}, "
            f"{format_bytes(-room)} short")


def partial_verdict(est: Estimate, where: str | None, on: str) -> str:
    """A partial estimate's verdict: at least what ran before the stop needs; short of the capacity even so, or not
    known to fit."""
    stopped = "(partial: the step stopped early)"
    least = f"at least {format_bytes(est.needed)} needed{on} {stopped}"
    if est.capacity is None or where is None:
        return least
    if est.needed > est.capacity:
        return (f"does NOT fit {where}: needs at least {format_bytes(est.needed)} of {format_bytes(est.capacity)}, "
                f"at least {format_bytes(est.needed - est.capacity)} short {stopped}")
    room = f"{est.gpu}'s {format_bytes(est.capacity)}" if est.gpu else f"the budget of {format_bytes(est.capacity)}"
    return f"{least}, within {room} so far: whether the whole step fits is not known"


def report_text(est: Estimate, heading: str, lines: list[str]) -> str:
    """The text report: ``heading``, the table and bar of the peak, the verdict, what was traced, the workload's own
    ``lines``, the what-if table and the notes."""
    out = [heading]
    if est.partial:
        out.append(f"  PARTIAL: {est.problem}")
    scale = max(est.capacity or 0, est.peak.total, 1)
    out.append(table([("peak", est.peak), ("after fwd", est.after_forward)]))
    out.append(f"  peak   |{bar(est.peak, scale)}| {format_bytes(est.peak.total)}")
    out.append(legend(shown_categories(est.peak, est.after_forward)))
    out.append("  " + verdict(est))
    out.append("  " + traced_line(est))
    out.extend(f"  {line}" for line in lines)
    if est.strategies:
        out.append(strategies_text(est.strategies))
    for note in est.notes:
        if note != est.problem:
            out.append(f"  note: {note}")
    return "\n".join(out)


def bar_rows(est: Estimate) -> list[BarRow]:
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


def report_html(est: Estimate, heading: str, notes_html: list[str]) -> str:
    """The HTML report: ``heading``, the bars on the session's scale with the GPU's capacity, the verdict, the values,
    what was traced, the workload's own ``notes_html`` (each a ``<div>``), the what-if table and the notes."""
    rows = bar_rows(est)
    label = est.gpu or "budget"
    scale = scale_for([r.length for r in rows], est.capacity, capacity_label=label)
    verdict_style = GOOD if est.fits else (BAD if est.fits is False or est.partial else "")
    mark = "✔ " if est.fits else ("✘ " if est.fits is False else ("⚠ " if est.partial else ""))
    parts = [f'<div class="vram-report vram-estimate" style="{ROOT}">',
             f'<div class="vram-title" style="font-weight:bold;margin-bottom:2px">{html.escape(heading)}</div>']
    if est.partial:
        parts.append(f'<div class="vram-partial" style="{BAD}"><b>PARTIAL</b>: {html.escape(est.problem or "")}'
                     "</div>")
    parts.append(bars_html(rows, scale))
    parts.append(zoom_note(scale, est.needed, est.gpu))
    parts.append(f'<div class="vram-verdict" style="{verdict_style};font-weight:bold">{mark}'
                 f"{html.escape(verdict(est))}</div>")
    parts.append(values_html([("peak", est.peak), ("after fwd", est.after_forward)]))
    notes = [f'<div style="{MUTED}">{html.escape(traced_line(est))}</div>', *notes_html]
    parts.append(f'<div class="vram-notes" style="{SMALL}">{"".join(notes)}</div>')
    if est.strategies:
        parts.append(strategies_html(est.strategies))
    for note in est.notes:
        if note != est.problem:
            parts.append(f'<div class="vram-note" style="{SMALL};{MUTED}">note: {html.escape(note)}</div>')
    parts.append("</div>")
    return nbsp_sizes("".join(parts))
