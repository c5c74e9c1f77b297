"""Text and HTML of an out-of-memory report (and of several ranks' reports): pure functions of the results.

The bar is what was alive by category with the failed request after it, on the device's capacity; under it the
variables that held the most, the allocator's side on CUDA (allocated, reserved, free, held outside PyTorch, the
largest free block against the request), the settings that would have served it, and the advice with bytes.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

from ..core.breakdown import CATEGORIES, LABELS
from ..core.units import format_bytes
from ..render.bars import BarRow, Extra, bars_html, code_html, scale_for, swatch, values_html
from ..render.text import bar, legend, table
from ..render.theme import MUTED, REQUEST, ROOT, SMALL

if TYPE_CHECKING:
    from .readback import OomReports
    from .report import CudaAtOom, OomReport


def title(r: OomReport) -> str:
    rank = f" · rank {r.rank}" if r.rank is not None else ""
    return f"out of memory in {r.where}{rank} · {r.device}"


def _request_line(r: OomReport) -> str:
    if not r.requested:
        return f"a request failed: {r.request}" if r.request else "a request of an unknown size failed"
    req = format_bytes(r.requested)
    over = ""
    if r.requested and r.capacity:
        past = r.alive.total + r.requested - r.capacity
        if past > 0:
            over = f": {format_bytes(past)} past the capacity of {format_bytes(r.capacity)}"
    return f"a request of {req} failed{over}"


def _cuda_lines(c: CudaAtOom, requested: int | None) -> list[str]:
    lines = [f"allocated {format_bytes(c.allocated)}, reserved {format_bytes(c.reserved)}, free "
             f"{format_bytes(c.free)} of {format_bytes(c.total)}; outside PyTorch (the CUDA context, other processes) "
             f"{format_bytes(c.outside)}"]
    if c.reserved > c.allocated:
        fits = "" if not requested else (" — the request would fit in it" if c.largest_free >= requested
                                         else " — too small for the request")
        lines.append(f"reserved but not allocated {format_bytes(c.fragmented)}; its largest free block "
                     f"{format_bytes(c.largest_free)}{fits} (inactive split blocks {format_bytes(c.inactive_split)}, "
                     f"{c.alloc_retries} allocation retries)")
    if c.recent:
        lines.append("the cell's largest blocks still alive: " + ", ".join(
            f"{site + ' ' if site else ''}{format_bytes(n)}" for site, n in c.recent))
    for setting, fits, margin, how, _ in c.what_ifs:
        verdict = "cannot tell" if fits is None else (f"would fit ({format_bytes(margin)} left)" if fits
                                                      else f"would not fit either ({format_bytes(-margin)} short)")
        lines.append(f"with {setting}: {verdict} — {how}")
    return lines


def oom_text(r: OomReport) -> str:
    lines = [title(r), f"  {r.error}", f"  {_request_line(r)}"]
    shown = tuple(c for c in CATEGORIES if r.alive[c] or c != "kv_cache")
    lines.append(table([("alive", r.alive)], categories=shown))
    scale = max(r.capacity or 0, r.alive.total + (r.requested or 0), 1)
    lines.append(f"  {'alive':<7}|{bar(r.alive, scale)}| {format_bytes(r.alive.total)}")
    lines.append(legend(shown))
    holders = r.holders()
    if holders:
        lines.append("  held by: " + ", ".join(f"{n} {format_bytes(b)}" for n, b in holders))
    if r.cuda is not None:
        lines += [f"  {line}" for line in _cuda_lines(r.cuda, r.requested)]
    if r.host is not None:
        left = f", {format_bytes(r.host.available)} available" if r.host.available is not None else ""
        lines.append(f"  host: {format_bytes(r.host.peak)} resident (child processes "
                     f"{format_bytes(r.host.children_peak)}){left}")
    lines += [f"  advice: {a}" for a in r.advice]
    lines += [f"  note: {n}" for n in r.notes]
    return "\n".join(lines)


def _row(r: OomReport, label: str) -> BarRow:
    extras = (Extra("failed request", r.requested, REQUEST, "vram-request"),) if r.requested else ()
    return BarRow(label, r.alive, extras=extras,
                  note=f"+ the failed request of {format_bytes(r.requested)}" if r.requested else "")


def oom_html(r: OomReport) -> str:
    totals = [r.alive.total + min(r.requested or 0, 2 * max(r.capacity or 0, r.alive.total))]
    scale = scale_for(totals, r.capacity)
    parts = [f'<div class="vram-title" style="font-weight:bold;margin-bottom:2px">{html.escape(title(r))}</div>',
             f'<div class="vram-error"><code>{html.escape(r.error)}</code>: {html.escape(_request_line(r))}</div>',
             bars_html([_row(r, "alive")], scale), values_html([("alive", r.alive)])]
    notes = []
    holders = r.holders()
    if holders:
        notes.append("<div>held by: " + ", ".join(f"<code>{html.escape(n)}</code> {format_bytes(b)}"
                                                 for n, b in holders) + "</div>")
    if r.cuda is not None:
        notes += [f"<div>{html.escape(line)}</div>" for line in _cuda_lines(r.cuda, r.requested)]
    if r.advice:
        items = "".join(f"<li><b>{code_html(a.title)}</b>"
                        f"{f' (saves ~{format_bytes(a.saving)})' if a.saving else ''}: {code_html(a.detail)}</li>"
                        for a in r.advice)
        notes.append(f'<div style="margin-top:2px"><b>advice</b></div><ul style="margin:2px 0;padding-left:1.4em">'
                     f"{items}</ul>")
    notes += [f'<div style="{MUTED}">note: {code_html(n)}</div>' for n in r.notes]
    parts.append(f'<div class="vram-notes" style="{SMALL};margin-top:2px">{"".join(notes)}</div>')
    return f'<div class="vram-report vram-oom-report" style="{ROOT}">{"".join(parts)}</div>'


def ranks_text(reports: OomReports) -> str:
    if not reports.reports:
        return f"no out-of-memory report in {reports.folder}"
    scale = max(max(r.capacity or 0, r.alive.total + (r.requested or 0)) for r in reports.reports)
    lines = [f"out of memory: {len(reports.reports)} report(s) in {reports.folder}"]
    for r in reports.reports:
        name = f"rank {r.rank}" if r.rank is not None else r.where
        lines.append(f"  {name[:12]:<12}|{bar(r.alive, scale)}| {format_bytes(r.alive.total)} alive, "
                     f"{format_bytes(r.requested) if r.requested else '?'} asked")
    lines.append(legend())
    return "\n".join(lines)


def ranks_html(reports: OomReports) -> str:
    if not reports.reports:
        return f"<div>no out-of-memory report in <code>{html.escape(reports.folder)}</code></div>"
    scale = scale_for([r.alive.total + (r.requested or 0) for r in reports.reports],
                      max((r.capacity or 0) for r in reports.reports) or None)
    rows = [_row(r, f"rank {r.rank}" if r.rank is not None else r.where) for r in reports.reports]
    alive = ", ".join(f"{swatch(c)}{LABELS[c]}" for c in CATEGORIES if any(r.alive[c] for r in reports.reports))
    return (f'<div class="vram-report" style="{ROOT}"><div style="font-weight:bold">out of memory: '
            f"{len(reports.reports)} report(s) in <code>{html.escape(reports.folder)}</code></div>"
            f"{bars_html(rows, scale)}<div style=\"{SMALL}\">{alive}</div></div>")


__all__ = ["oom_html", "oom_text", "ranks_html", "ranks_text", "title"]
