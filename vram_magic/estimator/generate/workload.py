"""From the fake ``generate()`` run to an :class:`~vram_magic.estimator.result.Estimate`: the peak split by
category with the cache as ``kv_cache``, the facts of generation (cache per token, the two phases), and on
CUDA what the allocator reserves for a cache that grows one token at a time."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ...units import format_bytes
from ..options import Options
from ..replay import Target, from_trace
from ..result import Estimate, Strategy
from ..tracing.errors import EstimateError
from ..tracing.request import Request
from ..tracing.traced import Trace
from .cuda import DEFAULT_CAPABILITY, LoopReplay, kernel_note, unrolled_reserved
from .facts import GenerateSpec, Generation, spec_of
from .trace import GROWTH, KV, MARK, describe, make_spec, trace_generate

#: training options that mean nothing for generate() (their defaults)
_TRAINING = {"checkpointing": False, "accumulate": 1, "zero": None, "fsdp": False, "world": 1, "offload": False,
             "lora": None, "master_weights": None, "loss_fn": None}


def check_training_options(given: dict[str, Any]) -> None:
    wrong = [k for k, default in _TRAINING.items() if k in given and given[k] != default]
    if wrong:
        raise ValueError(f"{', '.join(wrong)} appl{'y' if len(wrong) > 1 else 'ies'} to training; generate= estimates "
                         "inference (drop them, or estimate a training step without generate=)")


def capability(opts: Options, target: Target) -> tuple[int, int] | None:
    if opts.device != "cuda":
        return None
    gpu = target.gpu
    if gpu is not None and gpu.capability is not None:
        return gpu.capability
    return DEFAULT_CAPABILITY


def evaluate_generate(request: Request, opts: Options, spec: GenerateSpec, target: Target, *,
                      model_name: str = "") -> Estimate:
    """One fake ``generate()`` run, evaluated for ``target``."""
    cap = capability(opts, target)
    trace, facts = trace_generate(request, opts, spec, cuda=cap)
    if trace.problem:  # the loop never ran: a partial figure would mislead
        raise EstimateError(f"generate() could not be run on fake tensors: {trace.problem}")
    name = model_name or request.source.name
    first = from_trace(trace, opts, target, model_name=name)
    _label_cache(trace, facts, first)
    est = from_trace(trace, opts, target, model_name=name)
    gen = _generation(trace, facts, spec)
    notes = [n for n in est.notes]
    notes.insert(0, loop_note(facts, spec))
    limit, length = facts.get("max_positions"), facts["seq"] + spec.new_tokens
    if limit and length > limit and not facts["is_encoder_decoder"]:
        notes.append(f"prompt + new tokens = {length} is beyond the model's {limit} positions "
                     "(max_position_embeddings): learned position embeddings cannot index it, rotary ones leave "
                     "their training range; the memory is estimated all the same")
    if cap is not None:
        note = kernel_note(dict(facts.get("kernels", {})), cap, target.gpu is not None)
        if note:
            notes.append(note)
        est, gen, replayed = _allocator_replay(est, gen, trace, facts, spec, opts, target)
        if replayed:
            notes.append(replayed)
        if spec.cache_implementation in ("static", "offloaded_static"):
            notes.append("on CUDA, generate() compiles the decoding step for a static cache (torch.compile "
                         "'reduce-overhead': CUDA graphs with their own memory pool), not modelled")
    return replace(est, description=describe(spec, opts, facts), notes=tuple(notes), generation=gen,
                   flops={}, top_modules=est.top_modules)


def _label_cache(trace: Trace, facts: dict[str, Any], first: Estimate) -> None:
    """The cache's storages named for good: at the peak, of a slot (``layers[3].keys``) holding two storages
    (``torch.cat``'s new copy made, the old one not yet freed; a beam reorder's copy) the newer is the growth
    transient, the rest is the cache as it stands."""
    alive = [int(label[len(MARK):]) for _c, label, _n in first.peak.detail if label.startswith(MARK)]
    slot = facts["slot"]
    by_slot: dict[str, list[int]] = {}
    for s in alive:
        by_slot.setdefault(slot.get(s, ""), []).append(s)
    growth = {s for serials in by_slot.values() if len(serials) > 1 for s in sorted(serials)[1:]}
    for s, path in slot.items():
        if s in growth:
            trace.owner[s] = GROWTH
        elif trace.owner.get(s, ("", ""))[1].startswith(MARK):
            what = "cross-attention cache" if path.startswith("cross_attention_cache") else "KV cache"
            trace.owner[s] = (KV, what)


def _phase_peaks(trace: Trace) -> tuple[int, int, int]:
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


def _generation(trace: Trace, facts: dict[str, Any], spec: GenerateSpec) -> Generation:
    pre, dec, step = _phase_peaks(trace)
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


def _allocator_replay(est: Estimate, gen: Generation, trace: Trace, facts: dict[str, Any], spec: GenerateSpec,
                      opts: Options, target: Target) -> tuple[Estimate, Generation, str]:
    """The estimate and its facts with what the caching allocator's replay of the whole loop says, and its note
    (``""``: the steps do not line up, nothing replayed)."""
    replay = _reserved(trace, facts, spec, opts, target)
    if replay is None:
        return est, gen, ""
    reserved = max(est.reserved, replay.peak_reserved)
    growth = max(replay.reserved - replay.allocated, 0)
    pinned = replay.peak_pinned
    stranded = max(pinned - replay.in_use, 0)
    why = stranded_reason(replay.stranded, trace, pinned)
    gen = replace(gen, reserved_growth=growth, in_use=replay.in_use, stranded=stranded, stranded_by=why)
    needed = max(pinned, est.peak.total) + est.context
    est = replace(est, reserved=reserved, needed=needed, fits=None if est.capacity is None else needed <= est.capacity)
    note = (f"the caching allocator replayed over all {spec.new_tokens - 1} decoding steps (the cache asks for one "
            f"token more per layer each step): with room to spare it reserves up to {format_bytes(reserved)}, "
            f"{format_bytes(growth)} above allocated when the loop ends; a GPU needs the {format_bytes(pinned)} of "
            "segments holding live blocks at their peak (the allocator frees its cached segments when cudaMalloc "
            f"fails) + the CUDA context: {format_bytes(replay.in_use)} in use then and {format_bytes(stranded)} free "
            "inside those segments (a free block is split for a smaller request when no smaller one is large enough, "
            "and a segment goes back to the device only when nothing in it is in use)")
    if why:
        note += f"; {why}"
    return est, gen, note


def stranded_reason(stranded: Any, trace: Trace, needed: int) -> str:
    """Words for the largest segment whose free space counts in what a GPU needs, when it holds a tenth of it or
    more: what it was made for and what keeps it (``""`` otherwise)."""
    if not stranded or stranded[0].free * 10 < needed:
        return ""
    top = stranded[0]
    holder, size = top.holders[0] if top.holders else (None, 0)
    return (f"{format_bytes(top.free)} of it in a {format_bytes(top.segment)} segment made for "
            f"{_tag_name(top.made_for, trace)}, which {_tag_name(holder, trace)} ({format_bytes(size)}) keeps "
            "from being given back")


def _tag_name(tag: Any, trace: Trace) -> str:
    """What a block of the allocator's replay holds, in words (its module and label; its decoding step)."""
    if tag == "workspace":
        return "the cuBLAS workspace"
    serial, step = tag if isinstance(tag, tuple) else (tag, None)
    label = trace.owner.get(serial, ("", "a tensor"))[1] if isinstance(serial, int) else "a tensor"
    module = trace.module.get(serial, "") if isinstance(serial, int) else ""
    text = f"{module}'s {label}" if module else label
    return text if step is None else f"{text} (decoding step {step})"


def _reserved(trace: Trace, facts: dict[str, Any], spec: GenerateSpec, opts: Options,
              target: Target) -> LoopReplay | None:
    marks = trace.marks
    last = spec.new_tokens - 1
    keys = ("bookkeeping_before_jump", "jump_start", "jump_end", f"step{last}", "forward_done", "loop_end")
    if not all(k in marks for k in keys):
        return None
    workspace = target.cuda.workspace(target.gpu)[0] if trace.uses_matmul else 0
    bounds = tuple(marks[k] for k in keys)
    first = max(s for s in facts["steps"] if s < last) + 1
    cached = facts["cached"]
    return unrolled_reserved(trace.initial, trace.events, trace.sizes, bounds, last, first, cached,  # type: ignore[arg-type]
                             slot=facts["slot"], replaced=facts["replaced"], token_bytes=facts["token_bytes"],
                             persistent=(workspace,))


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


@dataclass(frozen=True, eq=False)
class GenerateRerun:
    """What makes an estimate of ``generate()`` again with other options or another spec: the request (the model's
    source, held weakly when it is a module; the prompt as shapes), the target and the spec. Kept beside an
    estimate's numbers (``Estimate.rerun``) for the what-if table and the prompt and batch searches."""

    request: Request
    target: Target
    spec: GenerateSpec

    def evaluate(self, opts: Options, **spec_changes: Any) -> Estimate:
        rerun = replace(self, spec=replace(self.spec, **spec_changes)) if spec_changes else self
        return replace(evaluate_generate(self.request, opts, rerun.spec, self.target), rerun=rerun)

    def what_if(self, est: Estimate) -> list[Strategy]:
        from .candidates import generate_what_if

        return generate_what_if(est)


def estimate_generate(model: Any, inputs: Any, opts: Options, target: Target, *, new_tokens: Any,
                      cache_implementation: Any = None, num_beams: Any = 1, what_if: bool = False,
                      max_seq: bool = False, max_batch: bool = False,
                      progress: Callable[[str], None] | None = None) -> Estimate:
    """:func:`vram_magic.estimate` with ``generate=``; see its documentation."""
    spec = make_spec(new_tokens, cache_implementation, num_beams)
    if (max_seq or max_batch) and target.capacity is None:
        raise ValueError("max_seq/max_batch need a capacity: give gpu='A100-80GB' (or another known GPU) or "
                         "budget='24GiB'")
    from ..tracing.fake import check_inputs

    check_inputs(inputs)
    est = GenerateRerun(Request(without_init(model), inputs), target, spec).evaluate(opts.with_(inference=True))
    return generate_follow_ups(est, what_if=what_if, max_seq=max_seq, max_batch=max_batch, progress=progress)


def generate_follow_ups(est: Estimate, *, what_if: bool = False, max_seq: bool = False, max_batch: bool = False,
                        progress: Callable[[str], None] | None = None) -> Estimate:
    """An estimate of ``generate()`` with the follow-ups asked for: the longest prompt and the largest batch that
    fit, the what-if table (each made by re-running the estimate)."""
    if max_seq or max_batch:
        from ..explore.generate_search import with_search

        est = with_search(est, max_seq=max_seq, max_batch=max_batch, progress=progress)
    if what_if:
        est = replace(est, strategies=tuple(est.rerunnable().what_if(est)))
    return est


def without_init(model: Any) -> Any:
    """A model builder run with transformers' weight initialization off (``no_init_weights``: fake weights have
    no values to initialize, and an 8B model's initialization is most of its build time); anything else as
    it is. transformers 5's ``no_init_weights`` stubs out ``PreTrainedModel.init_weights``, which ``post_init``
    calls to initialize *and tie* the weights: the tying is put back, so tied embeddings stay one tensor (what the
    builder does after construction, untying included, stands)."""
    from torch import nn

    if isinstance(model, nn.Module) or not callable(model):
        return model
    try:
        from transformers import PreTrainedModel
        from transformers.initialization import no_init_weights
    except ImportError:
        try:
            from transformers import PreTrainedModel
            from transformers.modeling_utils import no_init_weights  # type: ignore[no-redef]
        except ImportError:
            return model
    import functools

    @functools.wraps(model)
    def build() -> Any:
        original = PreTrainedModel.init_weights
        with no_init_weights():
            stub = PreTrainedModel.init_weights
            if stub is not original:  # transformers 5: init_weights stubbed out, its tie_weights with it
                PreTrainedModel.init_weights = _tie_only  # type: ignore[method-assign]
            try:
                return model()
            finally:
                PreTrainedModel.init_weights = stub  # type: ignore[method-assign]

    return build


def _tie_only(self: Any) -> None:
    """``PreTrainedModel.init_weights`` (transformers 5.x) less the initialization: the tying, by the mapping
    ``post_init`` has just computed."""
    import inspect

    if "recompute_mapping" in inspect.signature(self.tie_weights).parameters:
        self.tie_weights(recompute_mapping=False)
    else:
        self.tie_weights()


__all__ = ["GenerateRerun", "check_training_options", "estimate_generate", "evaluate_generate", "generate_follow_ups",
           "loop_note", "spec_of", "stranded_reason"]
