"""Text and HTML of a tensor- or pipeline-parallel step's estimate: the most loaded rank's report (as a step's), then
one row per role: its ranks, its peak by category, what it needs and whether it fits. Pure functions of the result."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

from ...core.breakdown import CATEGORIES
from ...core.units import format_bytes
from .step import estimate_html as step_html
from .step import estimate_text as step_text

if TYPE_CHECKING:
    from ..result import ParallelEstimate

SHORT = {"parameters": "params", "gradients": "grads", "optimizer_state": "optim", "activations": "activ",
         "other": "other", "kv_cache": "kv"}


def layout_line(est: ParallelEstimate) -> str:
    parts = [f"{est.tp * est.pp * est.dp} ranks = tp {est.tp} × pp {est.pp} × dp {est.dp}"]
    if est.pp > 1:
        parts.append(f"{est.micro_batches} micro-batches, schedule {est.schedule}")
    parts.append(f"the most loaded: rank {est.most_loaded}")
    return "per rank: " + "; ".join(parts)


def ranks_of(ranks: tuple[int, ...]) -> str:
    """``0`` / ``0, 1`` / ``0–3`` / ``0, 2, 4 … (8 ranks)``."""
    if len(ranks) <= 2:
        return ", ".join(map(str, ranks))
    if ranks == tuple(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}–{ranks[-1]}"
    return f"{ranks[0]}, {ranks[1]} … ({len(ranks)} ranks)"


def rows(est: ParallelEstimate) -> list[list[str]]:
    cats = [c for c in CATEGORIES if any(r.peak[c] for r in est.roles)]
    out = [["ranks", "role", *[SHORT.get(c, c) for c in cats], "peak", "needed", "fits"]]
    for r in est.roles:
        fits = ("partial" if r.capacity is not None else "") if r.fits is None else ("yes" if r.fits else "no")
        out.append([ranks_of(r.ranks), r.role, *[format_bytes(r.peak[c]) for c in cats], format_bytes(r.peak.total),
                    format_bytes(r.needed), fits])
    return out


def estimate_text(est: ParallelEstimate) -> str:
    table = rows(est)
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = [layout_line(est)]
    for row in table:
        lines.append("  " + "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    return step_text(est) + "\n" + "\n".join(lines)


def estimate_html(est: ParallelEstimate) -> str:
    table = rows(est)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in table[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in table[1:])
    return (step_html(est) + f"<div>{html.escape(layout_line(est))}</div>"
            f"<table class='vram-ranks'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")


__all__ = ["estimate_html", "estimate_text", "layout_line", "ranks_of", "rows"]
