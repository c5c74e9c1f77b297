"""The changes worth trying from a ``generate()`` estimate's options, one what-if row each (the table itself:
``estimator/followups/whatif.py``): weights in another dtype or quantized, another cache, a shorter prompt, a smaller
batch,
greedy decoding — each with what it trades in speed and quality."""

from __future__ import annotations

import torch

from ...core.units import format_bytes
from ..options import Options
from ..result import Candidate
from .facts import GenerateSpec, Generation


def _weights(opts: Options) -> list[Candidate]:
    out: list[Candidate] = []
    if opts.dtype not in (torch.bfloat16, torch.float16):
        out.append(Candidate("bf16 weights", {"dtype": torch.bfloat16},
                             1, "half the weight and cache bytes; as fast or "
                    "faster (tensor cores); bf16 rounding"))
        out.append(Candidate("fp16 weights", {"dtype": torch.float16}, 1, "as bf16; fp16 may overflow in some models"))
    if not opts.quantize:
        out.append(Candidate("int8 weights", {"quantize": "int8"}, 1, "linear layers in 8 bits (bitsandbytes): each "
                    "matmul dequantizes its weight, slower decoding; near-lossless"))
        out.append(Candidate("nf4 weights", {"quantize": "nf4"},
                             1, "linear layers in 4 bits (bitsandbytes NF4): slower "
                    "matmuls, a small quality loss"))
    return out


def _caches(opts: Options, spec: GenerateSpec, gen: Generation) -> list[Candidate]:
    out: list[Candidate] = []
    impl = spec.cache_implementation
    if gen.kind != "transformers":
        return out
    if impl in (None, "dynamic"):
        out.append(Candidate("static cache", {"cache_implementation": "static"},
                             1, "preallocated to prompt + new tokens "
                    "from the start; lets generate() compile the decoding step on CUDA (faster)"))
    elif impl in ("static", "offloaded_static"):
        out.append(Candidate("dynamic cache", {"cache_implementation": None}, 1, "grows a token at a time; no compiled "
                    "decoding step"))
    if "Sliding" not in gen.layers and gen.encoder_length is None:
        fewer = ((4, "a small quality loss"), (2, "a larger quality loss"))
        for bits, loss in fewer if impl != "quantized" else [b for b in fewer if b[0] < spec.cache_bits]:
            out.append(Candidate(f"quantized cache (int{bits})",
                                 {"cache_implementation": "quantized", "cache_bits": bits},
                                 1, f"KIVI-style {bits}-bit keys and values, the last 128 tokens in full precision; "
                                 f"each step dequantizes a whole layer (slower decoding); {loss}"))
    if opts.device == "cuda" and impl not in ("offloaded", "offloaded_static"):
        out.append(Candidate("offloaded cache", {"cache_implementation": "offloaded"}, 1, "layers on the host, one "
                    "prefetched at a time: PCIe traffic every step, slower decoding"))
    return out


def candidates(opts: Options, spec: GenerateSpec, gen: Generation) -> list[Candidate]:
    """The changes worth trying from a generate() estimate's options."""
    out = _weights(opts) + _caches(opts, spec, gen)
    if gen.prompt >= 2:
        out.append(Candidate("half the prompt", {"seq": gen.prompt // 2}, 1, "less context: the model sees half the "
                    "prompt"))
    if gen.batch >= 2:
        out.append(Candidate("half the batch", {"batch": gen.batch // 2}, 2, "two generate() calls: twice the time"))
    if spec.num_beams > 1:
        out.append(Candidate("greedy decoding (1 beam)", {"num_beams": 1}, 1, f"{spec.num_beams}× fewer sequences "
                    "decoded; other outputs than beam search"))
    if not gen.logits_to_keep and not spec.last_logits_only:
        out.append(Candidate("logits_to_keep=1", {"last_logits_only": True},
                             1, "the prefill computes the last position's "
                    "logits only (what generate() passes where the forward accepts it): no cost"))
    return out


def stranded_note(gen: Generation | None) -> str:
    """What of a row's need is free space the caching allocator cannot give back, when it is a tenth of it or more
    (a freed block split for a smaller tensor): a row can need gigabytes more than its neighbour for it."""
    if gen is None or not gen.stranded_by or not gen.stranded:
        return ""
    return f"; needs {format_bytes(gen.stranded)} free inside segments in use: {gen.stranded_by}"


__all__ = ["candidates", "stranded_note"]
