"""Text and HTML of an estimate: pure functions of the result."""

from __future__ import annotations

import html

from ..render import COLORS
from ..report import CATEGORIES, LABELS, Breakdown
from ..units import format_bytes
from .result import Estimate, Strategy

_LETTERS = {"parameters": "P", "gradients": "G", "optimizer_state": "O", "activations": "A", "other": "."}
_SHORT = {"parameters": "params", "gradients": "grads", "optimizer_state": "optim", "activations": "activ",
          "other": "other"}


def table(rows: list[tuple[str, Breakdown]]) -> str:
    """Bytes per category, one row per breakdown, with the total."""
    head = f"{'':<12}" + "".join(f"{_SHORT[c]:>11}" for c in CATEGORIES) + f"{'total':>11}"
    lines = [head]
    for name, b in rows:
        lines.append(f"{name:<12}" + "".join(f"{format_bytes(b[c]):>11}" for c in CATEGORIES)
                     + f"{format_bytes(b.total):>11}")
    return "\n".join(lines)


def bar(b: Breakdown, scale: int, width: int = 40) -> str:
    """A bar of letters, one per category, ``width`` characters for ``scale`` bytes."""
    out = "".join(_LETTERS[c] * round(width * b[c] / max(scale, 1)) for c in CATEGORIES)[:width]
    return out.ljust(width)


def bars_html(rows: list[tuple[str, Breakdown]], scale: int, capacity: int | None) -> str:
    out = []
    for name, b in rows:
        segs = "".join(
            f'<div title="{LABELS[c]}: {format_bytes(b[c])}" style="width:{100.0 * b[c] / scale:.3f}%;'
            f'background:{COLORS[c]};height:100%;display:inline-block"></div>' for c in CATEGORIES if b[c] > 0)
        marker = ""
        if capacity:
            left = min(100.0 * capacity / scale, 100.0)
            marker = (f'<div title="capacity {format_bytes(capacity)}" style="position:absolute;left:{left:.3f}%;'
                      'top:-2px;bottom:-2px;border-left:2px dashed currentColor"></div>')
        out.append(
            '<div style="display:flex;align-items:center;margin:2px 0;padding-right:1em">'
            f'<div style="min-width:4.5em;font-weight:bold;white-space:nowrap">{html.escape(name)}</div>'
            '<div style="min-width:6.5em;padding-right:.6em;text-align:right;font-family:monospace;'
            f'white-space:nowrap">{format_bytes(b.total)}</div>'
            '<div style="position:relative;flex:1;min-width:0;height:18px;background:var(--jp-layout-color2,#f3f3f3);'
            f'white-space:nowrap;overflow:hidden;font-size:0">{segs}{marker}</div></div>')
    return "".join(out)


def legend_html(b: Breakdown) -> str:
    items = "".join(
        f'<span style="margin-right:1em"><span style="display:inline-block;width:.9em;height:.9em;'
        f'background:{COLORS[c]};vertical-align:middle"></span> {LABELS[c]} {format_bytes(b[c])}</span>'
        for c in CATEGORIES)
    return f'<div style="font-size:85%;margin:4px 0">{items}</div>'


def _title(est: Estimate) -> str:
    shape = f" · batch {est.batch}" if est.batch is not None else ""
    if est.micro_batch is not None and est.micro_batch != est.batch:
        shape += f" (micro-batch {est.micro_batch})"
    return (f"%vram_estimate {est.model} · {est.description} · {est.device}{shape} · "
            f"{_count(est.parameters)} parameters")


def _count(n: int) -> str:
    """``1_234`` → ``1.2 K``, ``6_738_415_616`` → ``6.74 B``: parameter counts as people say them."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            value = n / scale
            return f"{value:.{2 if value < 10 else 1}f} {unit}"
    return str(n)


def _flops(n: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} FLOP"


def _traced_line(est: Estimate) -> str:
    modelled = ", ".join(f"{label} {format_bytes(n)}" for label, n in est.modelled)
    line = f"traced {format_bytes(est.traced)} (every tensor of the step on fake tensors)"
    if modelled:
        line += f"; modelled {modelled}"
    if est.device == "cuda":
        line += (f"; reserved ≈ peak × {est.reserved / max(est.peak.total, 1):.2f} = {format_bytes(est.reserved)}, "
                 f"+ CUDA context {format_bytes(est.context)} (modelled)")
    return line


def estimate_text(est: Estimate) -> str:
    lines = [_title(est)]
    if est.partial:
        lines.append(f"  PARTIAL: {est.problem}")
    scale = max(est.capacity or 0, est.peak.total, 1)
    lines.append(table([("peak", est.peak), ("after fwd", est.after_forward)]))
    lines.append(f"  peak   |{bar(est.peak, scale)}| {format_bytes(est.peak.total)}")
    lines.append("  P parameters  G gradients  O optimizer state  A activations  . other")
    lines.append("  " + est.verdict())
    lines.append("  " + _traced_line(est))
    if est.loss:
        lines.append(f"  loss: {est.loss}")
    if est.top_modules:
        lines.append("  largest activations after the forward: " + ", ".join(
            f"{name} {format_bytes(n)}" for name, n in est.top_modules[:5]))
    if est.flops:
        fwd, bwd = _flops(est.flops["forward"]), _flops(est.flops["backward"])
        lines.append(f"  compute per optimizer step: {_flops(est.total_flops)} (forward {fwd}, backward {bwd})")
    if est.max_batch is not None:
        lines.append(f"  largest batch that fits: {est.max_batch}")
    if est.max_seq is not None:
        lines.append(f"  longest sequence that fits: {est.max_seq}")
    if est.strategies:
        lines.append(strategies_text(est.strategies))
    for note in est.notes:
        if note != est.problem:
            lines.append(f"  note: {note}")
    return "\n".join(lines)


def strategies_text(rows: tuple[Strategy, ...]) -> str:
    out = ["  what if                                     peak     needed     saving  compute  fits"]
    for r in rows:
        fits = "" if r.fits is None else ("yes" if r.fits else "no")
        out.append(f"  {r.name[:38]:<38}{format_bytes(r.peak):>11}{format_bytes(r.needed):>11}"
                   f"{format_bytes(r.saving, signed=True):>11}   ×{r.compute:<5.2f} {fits}")
    return "\n".join(out)


def estimate_html(est: Estimate) -> str:
    scale = max(est.capacity or 0, est.peak.total, est.needed, 1)
    color = "#2e7d32" if est.fits else ("#b22222" if est.fits is False else "#333")
    parts = [
        '<div class="vram-estimate" style="font-family:sans-serif;max-width:56em">',
        f'<div style="font-weight:bold">{html.escape(_title(est))}</div>',
    ]
    if est.partial:
        parts.append(f'<div style="color:#b22222">PARTIAL: {html.escape(est.problem or "")}</div>')
    parts.append(bars_html([("peak", est.peak), ("after fwd", est.after_forward)], scale, est.capacity))
    parts.append(legend_html(est.peak))
    parts.append(f'<div style="color:{color};font-weight:bold">{html.escape(est.verdict())}</div>')
    parts.append(f'<div style="font-size:85%;color:#555">{html.escape(_traced_line(est))}</div>')
    if est.loss:
        parts.append(f'<div style="font-size:85%">loss: {html.escape(est.loss)}</div>')
    if est.top_modules:
        parts.append('<div style="font-size:85%">largest activations after the forward: ' + ", ".join(
            f"<code>{html.escape(n)}</code> {format_bytes(b)}" for n, b in est.top_modules[:5]) + "</div>")
    if est.flops:
        parts.append(f'<div style="font-size:85%">compute per optimizer step: {_flops(est.total_flops)}</div>')
    if est.max_batch is not None:
        parts.append(f"<div><b>largest batch that fits: {est.max_batch}</b></div>")
    if est.max_seq is not None:
        parts.append(f"<div><b>longest sequence that fits: {est.max_seq}</b></div>")
    if est.strategies:
        parts.append(strategies_html(est.strategies))
    for note in est.notes:
        if note != est.problem:
            parts.append(f'<div style="font-size:85%;color:#666">note: {html.escape(note)}</div>')
    parts.append("</div>")
    return "".join(parts)


def strategies_html(rows: tuple[Strategy, ...]) -> str:
    head = "".join(f'<th style="padding:0 .6em">{h}</th>' for h in
                   ("what if", "peak", "needed", "saving", "compute", "steps", "fits", ""))
    body = []
    for r in rows:
        fits = "" if r.fits is None else ("✔" if r.fits else "✘")
        body.append(
            f"<tr><td>{html.escape(r.name)}</td><td style='text-align:right'>{format_bytes(r.peak)}</td>"
            f"<td style='text-align:right'>{format_bytes(r.needed)}</td>"
            f"<td style='text-align:right'>{format_bytes(r.saving, signed=True)}</td>"
            f"<td style='text-align:right'>×{r.compute:.2f}</td><td style='text-align:right'>×{r.steps:g}</td>"
            f"<td>{fits}</td><td style='font-size:85%;color:#555'>{html.escape(r.note)}</td></tr>")
    return (f'<table class="vram-what-if" style="font-size:85%;border-collapse:collapse"><tr>{head}</tr>'
            f'{"".join(body)}</table>')
