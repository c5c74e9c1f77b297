"""What an estimate of text generation knows beyond a step's peak: the cache per token, the two phases, how
the loop was modelled. Plain numbers (bytes), no tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..result import Estimate


@dataclass(frozen=True)
class GenerateSpec:
    """What ``generate()`` is asked to do: ``new_tokens`` tokens (``max_new_tokens = min_new_tokens``), the
    cache implementation (``None``: the model's default), beams, greedy or sampled."""

    new_tokens: int
    cache_implementation: str | None = None
    num_beams: int = 1
    do_sample: bool = False
    cache_bits: int = 4  # a quantized cache's bits (2 or 4)
    last_logits_only: bool = False  # what-if: the output head computes the last position only


@dataclass(frozen=True)
class Generation:
    """Facts of an estimate of ``generate()``.

    ``kv_cache``: bytes of the cache when the last token is produced (prompt + new − 1 tokens per
    sequence); ``kv_per_token``: what one more token adds to it for the whole batch (its full-attention
    layers; sliding-window layers stop growing at their window), ``kv_per_token_per_sequence`` per sequence
    (batch × beams rows); ``kv_fixed``: the part that does not grow (sliding windows once full, a static
    cache's preallocation beyond use, cross-attention caches)."""

    new_tokens: int
    prompt: int
    batch: int
    beams: int
    kind: str  # "transformers" (generate() run up to its loop) or "hand-written" (a decoder with a tuple cache)
    cache: str  # the cache's class
    layers: str  # its layers, by type: "4 × DynamicLayer"
    kv_cache: int
    kv_per_token: int
    kv_per_token_per_sequence: int
    kv_fixed: int = 0
    prefill_peak: int = 0  # traced bytes (CPU sizes) at the prefill's peak
    decode_peak: int = 0  # ... and at the decoding steps' (the highest of the steps run)
    peak_step: int = 0  # the step the peak falls in (0: the prefill and what the loop does with its logits)
    logits_to_keep: bool | None = None  # generate() passed logits_to_keep=1 (None: not a transformers model)
    steps_run: tuple[int, ...] = ()
    jumped: int = 0  # decoding steps skipped by advancing the cache (the steps between are alike)
    encoder_length: int | None = None
    reserved_growth: int | None = None  # CUDA: reserved above allocated at the end of the loop (allocator replay)
    # CUDA, the segments holding live blocks at their peak (what a GPU needs): the live blocks then, the free space
    # inside those segments, and the segment holding most of it in words when it is a tenth of the need or more
    in_use: int | None = None
    stranded: int | None = None
    stranded_by: str = ""
    sdpa: tuple[tuple[str, int], ...] = ()  # CUDA: SDPA kernels modelled, with their counts
    flops_prefill: int = 0
    flops_decode: int = 0  # one decoding step at the longest cache
    cache_implementation: str | None = None  # as asked (None: the model's default)
    do_sample: bool = False
    cache_bits: int = 4  # a quantized cache's bits, as asked
    last_logits_only: bool = False  # what-if: the output head was made to compute the last position only

    @property
    def rows(self) -> int:
        return self.batch * self.beams

    @property
    def peak_phase(self) -> str:
        return "prefill" if self.peak_step == 0 else f"decoding step {self.peak_step}"

    @property
    def total_flops(self) -> int:
        return self.flops_prefill + self.flops_decode * max(self.new_tokens - 1, 0)


def spec_of(est: Estimate) -> GenerateSpec:
    """The spec an estimate of ``generate()`` was made with, read from its ``generation`` facts."""
    gen = est.generation
    if gen is None:
        raise ValueError("this estimate is not of generate(): estimate with generate=N")
    return GenerateSpec(gen.new_tokens, gen.cache_implementation, gen.beams, gen.do_sample, gen.cache_bits,
                        gen.last_logits_only)


__all__ = ["GenerateSpec", "Generation", "spec_of"]
