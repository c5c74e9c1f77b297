"""Text and HTML of a step's estimate (a training or an inference step): pure functions of the result."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

from ...core.units import format_bytes
from ...render.text import experts_line
from .common import flops_text, report_html, report_text, title, top_modules_line

if TYPE_CHECKING:
    from ..result import StepEstimate


def heading(est: StepEstimate) -> str:
    shape = f" · batch {est.batch}" if est.batch is not None else ""
    if est.micro_batch is not None and est.micro_batch != est.batch:
        shape += f" (micro-batch {est.micro_batch})"
    return title(est, shape)


def summary(est: StepEstimate) -> list[str]:
    """What the step trained on and what it keeps for the whole step: the loss, the model states."""
    lines = []
    if est.step:
        lines.append(f"step: {est.step}")
    if est.loss:
        lines.append(f"loss: {est.loss}")
    experts = experts_line(est.peak)
    if experts:  # a mixture of experts: the routed experts' share of the model states at the peak
        lines.append(f"mixture of experts at the peak: {experts}")
    if est.model_states and est.options is not None and not est.options.inference:
        per_rank = " per rank" if est.options.zero else ""
        lines.append(f"model states{per_rank} (parameters + gradients + optimizer state): "
                     f"{format_bytes(est.model_states)}")
    if getattr(est, "host", 0):
        pinned = f", {format_bytes(est.pinned)} of it pinned" if getattr(est, "pinned", 0) else ""
        lines.append(f"on the host{' per rank' if est.options is not None and est.options.zero else ''} (offloaded, "
                     f"not in the peak): {format_bytes(est.host)}{pinned}")
    if est.host_pinned:
        lines.append(f"activations on the host (not in the peak): {format_bytes(est.host_pinned)} pinned")
    return lines


def compute_line(est: StepEstimate) -> str:
    fwd, bwd = flops_text(est.flops["forward"]), flops_text(est.flops["backward"])
    return f"compute per optimizer step: {flops_text(est.total_flops)} (forward {fwd}, backward {bwd})"


def searched(est: StepEstimate) -> list[str]:
    """The searches' answers; a partial estimate's are upper bounds (each trial's figure a lower bound)."""
    lines = []
    most = "at most " if est.partial else ""
    why = " (partial: each trial stopped where this estimate did)" if est.partial else ""
    if est.max_batch is not None:
        lines.append(f"largest batch that fits: {most}{est.max_batch}{why}")
    if est.max_seq is not None:
        lines.append(f"longest sequence that fits: {most}{est.max_seq}{why}")
    return lines


def estimate_text(est: StepEstimate) -> str:
    lines = summary(est)
    if est.top_modules:
        lines.append(top_modules_line(est))
    if est.flops:
        lines.append(compute_line(est))
    return report_text(est, heading(est), lines + searched(est))


def estimate_html(est: StepEstimate) -> str:
    notes = [f"<div>{html.escape(line)}</div>" for line in summary(est)]
    if est.top_modules:
        notes.append(f"<div>{top_modules_line(est, code=True)}</div>")
    if est.flops:
        notes.append(f"<div>{html.escape(compute_line(est))}</div>")
    notes += [f"<div><b>{html.escape(line)}</b></div>" for line in searched(est)]
    return report_html(est, heading(est), notes)
