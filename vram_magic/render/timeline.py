"""The timeline: memory over a cell's allocation events, stacked by category (matplotlib, no pyplot)."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

from ..report import CATEGORIES, LABELS
from ..trace import format_frame
from ..units import format_bytes
from . import COLORS

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ..report import CellReport

MAX_POINTS = 4000


def _figure_class() -> Any:
    from matplotlib.figure import Figure

    class TimelineFigure(Figure):
        """A Figure that shows itself in notebooks without pyplot or the inline backend."""

        def _repr_png_(self) -> bytes:
            return figure_png(self)

    return TimelineFigure


def figure_png(fig: Figure) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    if fig.canvas is None or not isinstance(fig.canvas, FigureCanvasAgg):
        FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return buf.getvalue()


def _downsample(n: int, keep: int) -> list[int]:
    if n <= MAX_POINTS:
        return list(range(n))
    step = n / MAX_POINTS
    idx = sorted({int(i * step) for i in range(MAX_POINTS)} | {keep, n - 1})
    return idx


def _binary_step(top: float) -> int:
    """A tick step of 1, 2, 4 … KiB/MiB/GiB giving at most six ticks up to ``top``."""
    step = 1024
    while top / step > 6:
        step *= 2
    return step


def timeline_figure(report: CellReport, top: int = 3) -> Figure:
    from matplotlib.ticker import FuncFormatter, MultipleLocator

    trace = report.trace
    fig = _figure_class()(figsize=(9, 3.6))
    ax = fig.add_subplot(1, 1, 1)
    if trace is None:
        ax.text(0.5, 0.5, "no allocation history recorded (--no-trace)", ha="center", transform=ax.transAxes)
        return fig
    series = trace.totals()
    n = len(series[CATEGORIES[0]])
    idx = _downsample(n, trace.peak_index)
    ys = [[series[c][i] for i in idx] for c in CATEGORIES]
    ax.stackplot(idx, ys, labels=[LABELS[c] for c in CATEGORIES], colors=[COLORS[c] for c in CATEGORIES],
                 step="post", alpha=0.9)
    peak = sum(series[c][trace.peak_index] for c in CATEGORIES)
    ax.axvline(trace.peak_index, color="black", lw=1, ls=":")
    ax.annotate(f"peak {format_bytes(peak)}", (trace.peak_index, peak), xytext=(4, 4),
                textcoords="offset points", fontsize=8, fontweight="bold")
    for i, block in trace.largest_allocations(top):
        where = f" at {format_frame(block.site[0])}" if block.site else ""
        total = sum(series[c][i + 1] for c in CATEGORIES)
        ax.annotate(f"{format_bytes(block.size)}{where}", (i + 1, total), xytext=(0, -12),
                    textcoords="offset points", fontsize=7, ha="center", color="#333")
    if report.capacity:
        ax.axhline(report.capacity, color="black", ls="--", lw=1)
        ax.text(0, report.capacity, f" {'budget' if report.budget else 'capacity'} "
                f"{format_bytes(report.capacity)}", va="bottom", fontsize=8)
    ax.yaxis.set_major_locator(MultipleLocator(_binary_step(max(peak, report.capacity or 0, 1))))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: format_bytes(v)))
    ax.set_xlabel("allocation events in the cell")
    ax.set_ylabel(f"{report.device} memory")
    cell = f"cell {report.cell}" if report.cell is not None else "block"
    ax.set_title(f"{cell}: memory over time by category", fontsize=10)
    ax.set_xlim(0, max(n - 1, 1))
    ax.set_ylim(0, max(peak, report.capacity or 0, 1) * 1.15)
    ax.legend(loc="upper left", fontsize=7, ncol=5, frameon=False)
    fig.tight_layout()
    return fig
