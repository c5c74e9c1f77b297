"""The drawing kit in plain text: tables of bytes per category, bars of letters and their legend. Pure functions of
breakdowns; every result's text (a cell's report, an estimate, a plan) is drawn with them."""

from __future__ import annotations

from ..core.breakdown import CATEGORIES, LABELS, Breakdown, shown_categories
from ..core.units import format_bytes
from . import LETTERS

#: the categories as column heads
SHORT_LABELS = {"parameters": "params", "gradients": "grads", "optimizer_state": "optim", "activations": "activ",
                "kv_cache": "kv cache", "other": "other"}


def _signed(n: int, reference: int | None) -> str:
    from .bars import is_negligible

    if reference is not None and (n == 0 or is_negligible(n, reference)):
        return "±0"
    return format_bytes(n, signed=True)


def table(rows: list[tuple[str, Breakdown]], signed: bool = False, reference: int | None = None,
          categories: tuple[str, ...] | None = None) -> str:
    """Rows of bytes per category; with ``signed``, changes negligible next to ``reference`` read ±0.
    ``categories``: the columns (default: those the rows have, see
    :func:`~vram_magic.core.breakdown.shown_categories`)."""
    shown = categories if categories is not None else shown_categories(*[b for _, b in rows])
    head = ["".ljust(12)] + [SHORT_LABELS[c].rjust(11) for c in shown] + ["total".rjust(11)]
    lines = ["".join(head)]
    for name, b in rows:
        fmt = (lambda n: _signed(n, reference)) if signed else format_bytes
        cells = [name.ljust(12)] + [fmt(b[c]).rjust(11) for c in shown]
        cells.append(fmt(b.total).rjust(11))
        lines.append("".join(cells))
    return "\n".join(lines)


def bar(b: Breakdown, scale: int, width: int = 40) -> str:
    out = ""
    for c in CATEGORIES:
        out += LETTERS[c] * round(width * b[c] / scale) if scale else ""
    return out[:width].ljust(width)


def legend(categories: tuple[str, ...] | None = None) -> str:
    """The letters of the text bars; by default the categories every report has (not the KV cache)."""
    shown = categories if categories is not None else shown_categories()
    return "  " + "  ".join(f"{LETTERS[c]} {LABELS[c]}" for c in shown)


def experts_line(b: Breakdown) -> str:
    """``parameters 1.20 GiB, of which experts 921 MiB; gradients …; optimizer state …``: a mixture of experts' model
    states with the routed experts' share (``Breakdown.experts``), "" for a dense model."""
    experts = b.experts
    parts = [f"{LABELS[c]} {format_bytes(b[c])}, of which experts {format_bytes(n)}" for c, n in experts.items() if n]
    return "; ".join(parts)
