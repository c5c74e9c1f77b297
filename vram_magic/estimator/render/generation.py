"""The lines an estimate of ``generate()`` adds to the report: the cache per token, the two phases, the search
results (text; the HTML wraps the same lines)."""

from __future__ import annotations

import html

from ...units import format_bytes
from ..result import Estimate


def generation_lines(est: Estimate) -> list[str]:
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
    if est.max_seq is not None:
        lines.append(f"longest prompt that fits with {g.new_tokens} new tokens: {est.max_seq} tokens "
                     f"(batch {g.batch}; checked: {round(est.max_seq * 1.1)} does not fit)")
    if est.max_batch is not None:
        lines.append(f"largest batch that fits with a {g.prompt}-token prompt and {g.new_tokens} new tokens: "
                     f"{est.max_batch}")
    return lines


def generation_html(est: Estimate) -> str:
    lines = generation_lines(est)
    if not lines:
        return ""
    bold = {i for i, line in enumerate(lines) if line.startswith(("longest prompt", "largest batch"))}
    return "".join(f"<div>{'<b>' if i in bold else ''}{html.escape(line)}{'</b>' if i in bold else ''}</div>"
                   for i, line in enumerate(lines))


__all__ = ["generation_html", "generation_lines"]
