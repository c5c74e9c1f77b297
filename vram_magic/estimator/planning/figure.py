"""A plan as a picture: memory against step time for every combination scored, the GPU's capacity as a line, the rows
shown marked (a partial row, an estimate that stopped early, hatched and labelled) and the fastest that fits named
(matplotlib, imported when drawn)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...core.units import format_bytes

if TYPE_CHECKING:
    from .result import Plan


def plan_figure(p: Plan) -> Any:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    gib = 1024**3
    screened = [s for s in p.scored if not s.exact]
    exact = [s for s in p.scored if s.exact]
    if screened:
        ax.scatter([s.step_time for s in screened], [s.needed / gib for s in screened], s=10, color="#9e9e9e",
                   alpha=0.6, label="scored (interpolated)")
    if exact:
        ax.scatter([s.step_time for s in exact], [s.needed / gib for s in exact], s=22,
                   c=["#1f77b4" if s.fits else "#d62728" for s in exact], label="estimated exactly")
    if p.capacity:
        ax.axhline(p.capacity / gib, color="#444444", linestyle="--", linewidth=1)
        ax.annotate(f"{p.gpu or 'budget'} {format_bytes(p.capacity)}", (0.99, p.capacity / gib), xycoords=("axes "
                    "fraction", "data"), ha="right", va="bottom", fontsize=8)
    partial = [r for r in p.rows if r.fits is None]  # stopped early: needed is a lower bound, the fit not known
    if partial:
        ax.scatter([r.step_time for r in partial], [r.needed / gib for r in partial], s=70, marker="s",
                   facecolors="none", edgecolors="#ff7f0e", hatch="////", linewidths=1.2,
                   label="PARTIAL: stopped early (needed ≥, fit unknown)")
        for r in partial:
            ax.annotate("partial", (r.step_time, r.needed / gib), textcoords="offset points", xytext=(6, 4),
                        fontsize=7, color="#ff7f0e")
    best = p.best
    if best is not None:
        ax.scatter([best.step_time], [best.needed / gib], s=90, facecolors="none", edgecolors="#2ca02c", linewidths=2,
                   label=f"fastest that fits: {best.name[:40]}")
    ax.set_xscale("log")
    ax.set_xlabel("step time (s, predicted)")
    ax.set_ylabel("memory needed per GPU (GiB)")
    bounded = f" ({p.bounded} more bounded untraced)" if p.bounded else ""
    ax.set_title(f"{p.model}: memory against time, {len(p.scored)} combinations{bounded}", fontsize=10)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    plt.close(fig)
    return fig
