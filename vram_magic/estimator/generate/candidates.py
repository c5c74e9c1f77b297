"""The what-if table of text generation: each change alone, its peak, what it saves against the baseline, and
what it costs — compute per sequence counted on the same fake run, sequential ``generate()`` calls, and in
words the speed and quality it trades."""

from __future__ import annotations

import math
from typing import Any

import torch

from ...units import format_bytes
from ..options import Options
from ..result import Estimate, Strategy
from ..tracing.errors import EstimateError
from ..tracing.quantize import NotApplicable
from .facts import GenerateSpec, Generation, spec_of

Candidate = tuple[str, dict[str, Any], dict[str, Any], float, str]


def _weights(opts: Options) -> list[Candidate]:
    out: list[Candidate] = []
    if opts.dtype not in (torch.bfloat16, torch.float16):
        out.append(("bf16 weights", {"dtype": torch.bfloat16}, {}, 1, "half the weight and cache bytes; as fast or "
                    "faster (tensor cores); bf16 rounding"))
        out.append(("fp16 weights", {"dtype": torch.float16}, {}, 1, "as bf16; fp16 may overflow in some models"))
    if not opts.quantize:
        out.append(("int8 weights", {"quantize": "int8"}, {}, 1, "linear layers in 8 bits (bitsandbytes): each "
                    "matmul dequantizes its weight, slower decoding; near-lossless"))
        out.append(("nf4 weights", {"quantize": "nf4"}, {}, 1, "linear layers in 4 bits (bitsandbytes NF4): slower "
                    "matmuls, a small quality loss"))
    return out


def _caches(opts: Options, spec: GenerateSpec, gen: Generation) -> list[Candidate]:
    out: list[Candidate] = []
    impl = spec.cache_implementation
    if gen.kind != "transformers":
        return out
    if impl in (None, "dynamic"):
        out.append(("static cache", {}, {"cache_implementation": "static"}, 1, "preallocated to prompt + new tokens "
                    "from the start; lets generate() compile the decoding step on CUDA (faster)"))
    elif impl in ("static", "offloaded_static"):
        out.append(("dynamic cache", {}, {"cache_implementation": None}, 1, "grows a token at a time; no compiled "
                    "decoding step"))
    if "Sliding" not in gen.layers and gen.encoder_length is None:
        fewer = ((4, "a small quality loss"), (2, "a larger quality loss"))
        for bits, loss in fewer if impl != "quantized" else [b for b in fewer if b[0] < spec.cache_bits]:
            out.append((f"quantized cache (int{bits})", {}, {"cache_implementation": "quantized", "cache_bits": bits},
                        1, f"KIVI-style {bits}-bit keys and values, the last 128 tokens in full precision; each step "
                        f"dequantizes a whole layer (slower decoding); {loss}"))
    if opts.device == "cuda" and impl not in ("offloaded", "offloaded_static"):
        out.append(("offloaded cache", {}, {"cache_implementation": "offloaded"}, 1, "layers on the host, one "
                    "prefetched at a time: PCIe traffic every step, slower decoding"))
    return out


def candidates(opts: Options, spec: GenerateSpec, gen: Generation) -> list[Candidate]:
    """``(name, option changes, spec changes, sequential calls, note)`` worth trying."""
    out = _weights(opts) + _caches(opts, spec, gen)
    if gen.prompt >= 2:
        out.append(("half the prompt", {"seq": gen.prompt // 2}, {}, 1, "less context: the model sees half the "
                    "prompt"))
    if gen.batch >= 2:
        out.append(("half the batch", {"batch": gen.batch // 2}, {}, 2, "two generate() calls: twice the time"))
    if spec.num_beams > 1:
        out.append(("greedy decoding (1 beam)", {}, {"num_beams": 1}, 1, f"{spec.num_beams}× fewer sequences "
                    "decoded; other outputs than beam search"))
    if not gen.logits_to_keep and not spec.last_logits_only:
        out.append(("logits_to_keep=1", {}, {"last_logits_only": True}, 1, "the prefill computes the last position's "
                    "logits only (what generate() passes where the forward accepts it): no cost"))
    return out


def generate_what_if(base: Estimate) -> list[Strategy]:
    """Each candidate estimated again by the estimate's re-run handle (``generate_estimate.GenerateRerun``), after
    the baseline."""
    if base.generation is None:
        raise ValueError("this estimate cannot be re-run for what-ifs (make it with vram_magic.estimate(..., "
                         "generate=N))")
    rerun: Any = base.rerunnable()
    opts, gen, spec = base.options, base.generation, spec_of(base)
    assert opts is not None
    per_seq = gen.total_flops / max(gen.batch, 1)
    rows = [Strategy("baseline: " + base.description, base.peak.total, base.needed, 0, 1.0, 1.0, base.fits,
                     stranded_note(gen).lstrip("; "))]
    for name, opt_changes, spec_changes, steps, note in candidates(opts, spec, gen):
        try:
            est = rerun.evaluate(opts.with_(**opt_changes), **spec_changes)
        except NotApplicable:
            continue
        except (EstimateError, ValueError, TypeError) as err:
            rows.append(Strategy(name, 0, 0, 0, math.nan, steps, None, f"could not run: {err}"))
            continue
        g = est.generation
        compute = (g.total_flops / max(g.batch, 1)) / per_seq if per_seq and g is not None else 1.0
        rows.append(Strategy(name, est.peak.total, est.needed, est.needed - base.needed, compute, steps, est.fits,
                             note + stranded_note(g)))
    return rows


def stranded_note(gen: Generation | None) -> str:
    """What of a row's need is free space the caching allocator cannot give back, when it is a tenth of it or more
    (a freed block split for a smaller tensor): a row can need gigabytes more than its neighbour for it."""
    if gen is None or not gen.stranded_by or not gen.stranded:
        return ""
    return f"; needs {format_bytes(gen.stranded)} free inside segments in use: {gen.stranded_by}"


__all__ = ["candidates", "generate_what_if", "stranded_note"]
