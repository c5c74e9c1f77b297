"""The timeline: memory over a cell's allocation events, stacked by category (matplotlib, no pyplot).

Shaded bands mark the phases (forward, backward, optimizer step; a ``generate()`` call's prefill and decode
steps, the latter counted) in which the memory was allocated; the
peak and the largest allocations are marked, the latter by number with their lines listed under the plot,
so no label sits on another. The figure's background is transparent and every text stands on a light
label of its own, so it reads on light and dark notebook themes alike.
"""

from __future__ import annotations

import base64
import io
from typing import TYPE_CHECKING, Any

from ...core.breakdown import CATEGORIES, LABELS, OPTIONAL
from ...core.events import format_frame
from ...core.units import format_bytes
from ...render import COLORS

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ..report import CellReport

MAX_POINTS = 4000
INK = "#222222"
LINE = "#8a8a8a"  # lines: ≥ 3:1 against white and against a near-black background
PAPER = {"boxstyle": "round,pad=0.2", "facecolor": "white", "alpha": 0.85, "edgecolor": "none"}
PHASES = {  # band colour of each phase (tints, distinct from the category colours)
    "forward": ("#009E73", 0.13),
    "backward": ("#F0E442", 0.22),
    "optimizer": ("#CC79A7", 0.16),
    "prefill": ("#0072B2", 0.12),
    "decode": ("#D55E00", 0.10),
}
GENERATION = ("prefill", "decode")  # in the legend only where a cell generated
# allocations inside a KV cache's update belong to the stretch they happen in (a decode step, a forward)
CONTINUES = "cache update"


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
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight", transparent=True)
    return buf.getvalue()


def timeline_bundle(report: CellReport) -> dict[str, Any]:
    """The timeline as a display bundle: a transparent PNG and a line of text."""
    png = figure_png(report.timeline())
    cell = f"cell {report.cell}" if report.cell is not None else "block"
    return {"image/png": base64.b64encode(png).decode("ascii"),
            "text/plain": f"<timeline of {cell}: memory over its allocation events>"}


def _downsample(n: int, keep: int) -> list[int]:
    if n <= MAX_POINTS:
        return list(range(n))
    step = n / MAX_POINTS
    return sorted({int(i * step) for i in range(MAX_POINTS)} | {keep, n - 1})


def _binary_step(top: float) -> int:
    """A tick step of 1, 2, 4 … KiB/MiB/GiB giving at most six ticks up to ``top``."""
    step = 1024
    while top / step > 6:
        step *= 2
    return step


def phase_runs(report: CellReport, min_share: float = 0.01) -> list[tuple[str, int, int]]:
    """``[(phase, first event, end event), ...]``: contiguous stretches of events by the phase that allocated.

    A free belongs to the stretch it happens in, and so does an allocation inside a KV cache's update;
    stretches shorter than ``min_share`` of the events are merged into the one before, so a few stray
    allocations do not paint slivers.
    """
    trace = report.trace
    if trace is None or not len(trace.events):
        return []
    runs: list[list[Any]] = []
    current = ""
    for i, ev in enumerate(trace.events):
        if ev > 0:
            phase = trace.blocks[ev].phase or "cell"
            if phase != CONTINUES or not current:
                current = phase
        if runs and runs[-1][0] == current:
            runs[-1][2] = i + 1
        else:
            runs.append([current, i, i + 1])
    n = len(trace.events)
    merged: list[list[Any]] = []
    for run in runs:
        if merged and (run[2] - run[1] < min_share * n or merged[-1][0] == run[0]):
            merged[-1][2] = run[2]
        else:
            merged.append(run)
    return [(p, a, b) for p, a, b in merged if p]


def decode_steps(report: CellReport, first: int, end: int) -> int:
    """How many decode steps of a ``generate()`` call began between two events."""
    trace = report.trace
    steps = trace.steps if trace is not None else ()
    return sum(1 for i, stage, _ in steps if stage == "decode" and first <= i < end)


def _phase_label(report: CellReport, phase: str, a: int, b: int) -> str:
    if phase == "decode":
        n = decode_steps(report, a, b)
        return f"decode · {n} step{'s' if n != 1 else ''}" if n else phase
    return phase


def _legend_handles(report: CellReport, series: dict[str, list[int]]) -> list[Any]:
    """The categories and phase bands; the KV cache, prefill and decode only where the cell had them, and a
    generating cell names only the phases it had."""
    from matplotlib.patches import Patch

    handles = [Patch(color=COLORS[c], label=LABELS[c]) for c in CATEGORIES if c not in OPTIONAL or any(series[c])]
    seen = {p for p, _, _ in phase_runs(report)}
    generated = any(p in seen for p in GENERATION)
    handles += [Patch(color=PHASES[p][0], alpha=PHASES[p][1] * 2.5, label=p) for p in PHASES
                if (p in seen if generated else p not in GENERATION)]
    return handles


def _overlaps(a: Any, b: Any) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def timeline_figure(report: CellReport, top: int = 3) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.ticker import FuncFormatter, MultipleLocator

    trace = report.trace
    listed = trace.largest_allocations(top) if trace is not None else []
    # room under the plot for the list of the largest allocations, a line each
    fig = _figure_class()(figsize=(9, 3.4 + 0.16 * (len(listed) + 1) if listed else 3.6))
    FigureCanvasAgg(fig)
    fig.patch.set_alpha(0)
    ax = fig.add_subplot(1, 1, 1)
    ax.set_facecolor("none")
    if trace is None:
        ax.text(0.5, 0.5, "no allocation history recorded (--no-trace)", ha="center", transform=ax.transAxes,
                color=INK, bbox=PAPER)
        ax.set_axis_off()
        return fig
    series = trace.totals()
    n = len(series[CATEGORIES[0]])
    idx = _downsample(n, trace.peak_index)
    ys = [[series[c][i] for i in idx] for c in CATEGORIES]
    ax.stackplot(idx, ys, colors=[COLORS[c] for c in CATEGORIES], step="post", alpha=0.95, zorder=2)
    peak = sum(series[c][trace.peak_index] for c in CATEGORIES)
    top_y = max(peak, report.capacity or 0, 1) * 1.3
    ax.set_xlim(0, max(n - 1, 1))
    ax.set_ylim(0, top_y)

    # phase bands, labelled where the band is wide enough for its name
    renderer = fig.canvas.get_renderer()
    placed = []
    for phase, a, b in phase_runs(report):
        if phase not in PHASES:
            continue
        color, alpha = PHASES[phase]
        ax.axvspan(a, b, color=color, alpha=alpha, lw=0, zorder=1)
    height = fig.get_figheight() * fig.dpi
    below = (30 + 14 * (len(listed) + 1)) / height if listed else 0.02
    fig.tight_layout(rect=(0, below, 1, 0.9))
    for phase, a, b in phase_runs(report):
        if phase not in PHASES:
            continue
        label = ax.text((a + b) / 2, 0.975, _phase_label(report, phase, a, b), transform=ax.get_xaxis_transform(),
                        ha="center", va="top",
                        fontsize=8, color=INK, bbox=PAPER, zorder=5)
        box = label.get_window_extent(renderer)
        left, right = ax.transData.transform((a, 0))[0], ax.transData.transform((b, 0))[0]
        if box.x0 < left or box.x1 > right or any(_overlaps(box, p) for p in placed):
            label.remove()
        else:
            placed.append(box)

    ax.axvline(trace.peak_index, color=LINE, lw=1.5, ls=":", zorder=3)
    offsets = (((4, 4), "bottom"), ((4, -6), "top"), ((-4, 4), "bottom"))
    if trace.peak_index > 0.8 * n:  # a peak near the end (a generate() call's last step): its label to the left
        offsets = (((-4, 4), "bottom"), ((-4, -6), "top"), ((4, 4), "bottom"))
    for offset, va in offsets:
        ha = "left" if offset[0] > 0 else "right"
        label = ax.annotate(f"peak {format_bytes(peak)}", (trace.peak_index, peak), xytext=offset,
                            textcoords="offset points", fontsize=8, fontweight="bold", color=INK, ha=ha, va=va,
                            bbox=PAPER, zorder=6)
        box = label.get_window_extent(renderer)
        if not any(_overlaps(box, p) for p in placed):
            placed.append(box)
            break
        label.remove()
    if report.capacity:
        ax.axhline(report.capacity, color=LINE, ls="--", lw=1.5, zorder=3)
        cap = ax.text(0.005, report.capacity, f"{'budget' if report.budget else 'capacity'} "
                      f"{format_bytes(report.capacity)}", transform=ax.get_yaxis_transform(), va="bottom",
                      fontsize=8, color=INK, bbox=PAPER, zorder=6)
        box = cap.get_window_extent(renderer)
        if any(_overlaps(box, p) for p in placed):
            cap.set_va("top")
            box = cap.get_window_extent(renderer)
        placed.append(box)

    # the largest allocations: a number on the plot, the line that made it in the list below
    lines = []
    for k, (i, block) in enumerate(listed, start=1):
        where = f" at {format_frame(block.site[0])}" if block.site else ""
        phase = f" ({block.phase})" if block.phase and block.phase != "cell" else ""
        total = sum(series[c][i + 1] for c in CATEGORIES)
        ax.plot([i + 1], [total], marker="o", ms=11, mfc="white", mec=INK, mew=1, zorder=6, clip_on=False)
        ax.text(i + 1, total, str(k), ha="center", va="center", fontsize=7, fontweight="bold", color=INK,
                zorder=7)
        lines.append(f"{k}  {format_bytes(block.size)}{where}{phase}")
    if lines:
        fig.text(0.01, 0.005, "largest allocations:\n" + "\n".join(lines), fontsize=8, color=INK, va="bottom",
                 ha="left", bbox=PAPER, linespacing=1.4)

    ax.yaxis.set_major_locator(MultipleLocator(_binary_step(top_y / 1.3)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: format_bytes(v)))
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    for side in ("left", "bottom"):
        ax.spines[side].set_color(LINE)
    ax.tick_params(colors=LINE, labelcolor=INK, labelsize=8)
    for lab in [*ax.get_xticklabels(), *ax.get_yticklabels()]:
        lab.set_bbox(PAPER)
    ax.set_xlabel("allocation events in the cell", color=INK, fontsize=9, bbox=PAPER)
    ax.set_ylabel(f"{report.device} memory", color=INK, fontsize=9, bbox=PAPER)
    cell = f"cell {report.cell}" if report.cell is not None else "block"
    legend = fig.legend(handles=_legend_handles(report, series), loc="upper center", bbox_to_anchor=(0.5, 0.955),
                        ncol=8, fontsize=8, frameon=True, handlelength=1.2, columnspacing=1.0)
    legend.get_frame().set_facecolor("white")
    legend.get_frame().set_alpha(0.85)
    legend.get_frame().set_edgecolor("none")
    for t in legend.get_texts():
        t.set_color(INK)
    fig.suptitle(f"{cell}: memory over time by category", fontsize=10, color=INK, y=0.995,
                 bbox=PAPER)
    return fig


def text_boxes(fig: Figure) -> list[tuple[str, Any]]:
    """``[(text, window extent), ...]`` of every text drawn in ``fig`` (for checks that labels do not overlap)."""
    from matplotlib.text import Text

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    hidden = set()
    for ax in fig.axes:  # tick labels outside the view limits are not drawn
        for axis, (lo, hi) in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            for tick in axis.get_major_ticks():
                if not lo <= tick.get_loc() <= hi:
                    hidden.add(id(tick.label1))
    out = []
    for t in fig.findobj(Text):
        if t.get_visible() and t.get_text().strip() and id(t) not in hidden:
            out.append((t.get_text(), t.get_window_extent(renderer)))
    return out
