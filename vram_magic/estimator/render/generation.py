"""Text and HTML of a ``generate()`` call's estimate: every estimate's report, with the cache per token, the two
phases and the searches' results (pure functions of the result)."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

from ...core.units import format_bytes
from ...render.text import experts_line
from .common import report_html, report_text, title, top_modules_line

if TYPE_CHECKING:
    from ..result import GenerateEstimate


def heading(est: GenerateEstimate) -> str:
    return title(est, f" · batch {est.batch}" if est.batch is not None else "")


def generation_lines(est: GenerateEstimate) -> list[str]:
    g = est.generation
    if g is None:
        return []
    rows = g.batch * g.beams
    who = f"{rows} sequence{'s' if rows != 1 else ''}" + (f" ({g.batch} × {g.beams} beams)" if g.beams > 1 else "")
    lines = [f"KV cache when the last token is made: {format_bytes(g.kv_cache)} ({g.layers or g.cache}); "
             f"{format_bytes(g.kv_per_token)} per token for {who}, {format_bytes(g.kv_per_token_per_sequence)} per "
             "token per sequence" + (f", {format_bytes(g.kv_fixed)} that does not grow (sliding windows, "
                                     "cross-attention)" if g.kv_fixed else "")]
    lines.append(f"peak in the {g.peak_phase}; traced peaks: prefill {format_bytes(g.prefill_peak)}, decoding "
                 f"{format_bytes(g.decode_peak)}")
    if g.reserved_growth:
        lines.append(f"the cache growing a token at a time leaves {format_bytes(g.reserved_growth)} reserved above "
                     "allocated by the end (caching allocator replayed over every step)")
    return lines


def searched(est: GenerateEstimate) -> list[str]:
    g = est.generation
    lines = []
    if est.max_prompt is not None:
        lines.append(f"longest prompt that fits with {g.new_tokens} new tokens: {est.max_prompt} tokens "
                     f"(batch {g.batch}; checked: {round(est.max_prompt * 1.1)} does not fit)")
    if est.max_batch is not None:
        lines.append(f"largest batch that fits with a {g.prompt}-token prompt and {g.new_tokens} new tokens: "
                     f"{est.max_batch}")
    return lines


def experts(est: GenerateEstimate) -> list[str]:
    """A mixture of experts' weights with the routed experts' share."""
    line = experts_line(est.peak)
    return [f"mixture of experts at the peak: {line}"] if line else []


def estimate_text(est: GenerateEstimate) -> str:
    lines = experts(est) + ([top_modules_line(est)] if est.top_modules else [])
    return report_text(est, heading(est), lines + generation_lines(est) + searched(est))


def estimate_html(est: GenerateEstimate) -> str:
    notes = [f"<div>{html.escape(line)}</div>" for line in experts(est)]
    notes += [f"<div>{top_modules_line(est, code=True)}</div>"] if est.top_modules else []
    notes += [f"<div>{html.escape(line)}</div>" for line in generation_lines(est)]
    notes += [f"<div><b>{html.escape(line)}</b></div>" for line in searched(est)]
    return report_html(est, heading(est), notes)
