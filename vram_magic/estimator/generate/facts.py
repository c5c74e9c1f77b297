"""What an estimate of text generation knows beyond a step's peak: the cache per token, the two phases, how
the loop was modelled. Plain numbers (bytes), no tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..options import Options
    from ..tracing.traced import FakeRun


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


def spec_of(opts: Options) -> GenerateSpec:
    """What ``opts`` ask ``generate()`` to do."""
    if opts.generate is None:
        raise ValueError("these options are not of generate(): estimate with generate=N")
    return GenerateSpec(opts.generate, opts.cache_implementation, opts.num_beams, opts.do_sample, opts.cache_bits,
                        opts.last_logits_only)


def phase_peaks(trace: FakeRun) -> tuple[int, int, int]:
    """Traced bytes (CPU sizes) at the prefill's peak and at the decoding steps' (the jump left out), and the step
    the highest of them falls in (0: the prefill and what the loop does with its logits)."""
    sizes, marks = trace.sizes, trace.marks
    current = sum(sizes[s] for s in trace.initial)
    decode = marks.get("decode_start", len(trace.events))
    j0, j1 = marks.get("jump_start", -1), marks.get("jump_end", -1)
    pre, dec, best, at = current, 0, current, 0
    for i, ev in enumerate(trace.events, 1):
        current += sizes[ev] if ev > 0 else -sizes[-ev]
        if i <= decode:
            pre = max(pre, current)
        elif not j0 < i <= j1:
            dec = max(dec, current)
        if current > best and not j0 < i <= j1:
            best, at = current, i
    starts = sorted((v, int(k[4:])) for k, v in marks.items() if k.startswith("step") and k[4:].isdigit())
    step = max((n for v, n in starts if v < at), default=0)
    return pre, dec, step


def generation_facts(trace: FakeRun, facts: dict[str, Any], spec: GenerateSpec) -> Generation:
    pre, dec, step = phase_peaks(trace)
    rows = facts["batch"] * spec.num_beams
    per_token = facts["per_token"]
    fp, fd = facts["flops"]
    return Generation(
        new_tokens=spec.new_tokens, prompt=facts["seq"], batch=facts["batch"], beams=spec.num_beams,
        kind=facts["kind"], cache=facts["cache"], cache_implementation=spec.cache_implementation,
        do_sample=spec.do_sample, cache_bits=spec.cache_bits, last_logits_only=spec.last_logits_only,
        layers=facts["layers"], kv_cache=facts["kv_final"], kv_per_token=per_token,
        kv_per_token_per_sequence=per_token // rows if rows else per_token, kv_fixed=facts["fixed"],
        prefill_peak=pre, decode_peak=dec, peak_step=step, logits_to_keep=facts["logits_to_keep"],
        steps_run=facts["steps"],
        jumped=facts["jumped"], encoder_length=facts["encoder_length"], flops_prefill=fp, flops_decode=fd,
        sdpa=tuple(sorted(dict(facts.get("kernels", {})).items())))


def loop_note(facts: dict[str, Any], spec: GenerateSpec) -> str:
    steps = facts["steps"]
    ran = ", ".join(str(s) for s in steps)
    if facts["kind"] == "transformers":
        how = ("generate() cannot run on fake tensors to its end (its stopping checks read values): it ran as "
               "the installed transformers runs it up to its decoding loop (its cache choice, "
               + ("logits_to_keep=1, " if facts["logits_to_keep"] else "all logits (its forward has no "
                  "logits_to_keep), ")
               + ("the encoder once, " if facts["is_encoder_decoder"] else "")
               + "the prefill), and the loop was modelled step for step")
    else:
        how = ("a hand-written decoder: the greedy loop logits[:, -1].argmax(), one token per step, its cache "
               "passed back, was run on fake tensors")
    if facts["jumped"]:
        how += (f"; steps {ran} of {spec.new_tokens - 1} ran, the {facts['jumped']} between them alike but "
                "for one token more in the cache each, so the cache was advanced to the last step's length (prompt "
                "+ new − 2 tokens going in) and the last step ran at it")
    else:
        how += f"; every step ran ({len(steps)} forwards)"
    return how


__all__ = ["GenerateSpec", "Generation", "generation_facts", "loop_note", "phase_peaks", "spec_of"]
