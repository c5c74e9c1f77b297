"""``generate()`` as a workload: one fake ``generate()`` run (``trace.py``) per configuration that changes it, each
estimate a replay of that run for the target with the cache as the ``kv_cache`` category, the facts of generation
(cache per token, the two phases: ``facts.py``) and on CUDA what the allocator reserves for a cache that grows one
token at a time (``cuda.py``); its candidate changes (``candidates.py``) and its FLOPs per sequence."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..device import Target
from ..device.sdpa import DEFAULT_CAPABILITY, kernel_note
from ..fake.request import Request
from ..followups.search import fitted_max
from ..followups.whatif import what_if
from ..options import Options
from ..replay import Replayed, from_trace
from ..result import Candidate, GenerateEstimate, Strategy
from ..tracing.errors import EstimateError
from ..tracing.kept import KeptTraces
from ..tracing.traced import FakeRun
from .candidates import candidates, stranded_note
from .cuda import loop_allocation
from .facts import generation_facts, loop_note, spec_of
from .trace import GROWTH, KV, MARK, describe, trace_generate

#: fake generate() runs a workload keeps
KEPT_TRACES = 32


def capability(opts: Options, target: Target) -> tuple[int, int] | None:
    """The compute capability whose kernels the loop runs: the named GPU's, else an A100's; ``None`` off CUDA."""
    if opts.device != "cuda":
        return None
    gpu = target.gpu
    if gpu is not None and gpu.capability is not None:
        return gpu.capability
    return DEFAULT_CAPABILITY


class GenerateWorkload:
    """What makes an estimate of ``generate()`` with any options: the request (the model's source, held weakly when
    it is a module; the prompt as shapes), the target and the runs made so far. Kept beside an estimate's numbers
    (``Estimate.rerun``) for the what-if table and the prompt and batch searches."""

    def __init__(self, request: Request, target: Target) -> None:
        self.request, self.target = request, target
        self._traces: KeptTraces[tuple[FakeRun, dict[str, Any]]] = KeptTraces(KEPT_TRACES)

    @property
    def traced(self) -> int:
        """Fake runs made (the rest of the estimates were replays)."""
        return self._traces.made

    def trace(self, opts: Options) -> tuple[FakeRun, dict[str, Any]]:
        """The fake ``generate()`` run for ``opts`` and what its loop learnt, made once per configuration that
        changes it."""
        cap = capability(opts, self.target)
        return self._traces.get((opts.trace_key(), cap), lambda: self._make(opts, cap))

    def _make(self, opts: Options, cap: tuple[int, int] | None) -> tuple[FakeRun, dict[str, Any]]:
        made = trace_generate(self.request, opts, spec_of(opts), cuda=cap)
        if made[0].problem:  # the loop never ran: a partial figure would mislead
            raise EstimateError(f"generate() could not be run on fake tensors: {made[0].problem}")
        return made

    def evaluate(self, opts: Options) -> GenerateEstimate:
        """One fake ``generate()`` run, evaluated for the target."""
        spec, target = spec_of(opts), self.target
        cap = capability(opts, target)
        traced, facts = self.trace(opts)
        trace = replace(traced, owner=dict(traced.owner))  # the cache's labels are this replay's own
        _label_cache(trace, facts, from_trace(trace, opts, target))
        r = from_trace(trace, opts, target)
        gen = generation_facts(trace, facts, spec)
        notes = list(r.notes)
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
            r, gen, replayed = loop_allocation(r, gen, trace, facts, spec, target)
            if replayed:
                notes.append(replayed)
            if spec.cache_implementation in ("static", "offloaded_static"):
                notes.append("on CUDA, generate() compiles the decoding step for a static cache (torch.compile "
                             "'reduce-overhead': CUDA graphs with their own memory pool), not modelled")
        gpu = target.gpu
        return GenerateEstimate(
            model=self.request.name, description=describe(spec, opts, facts), device=opts.device,
            peak=r.peak, after_forward=r.after_forward, top_modules=r.top_modules,
            flops={"prefill": gen.flops_prefill, "decode": gen.flops_decode * max(gen.new_tokens - 1, 0)},
            batch=trace.batch, seq=trace.seq, parameters=trace.param_count,
            gpu=gpu.name if gpu is not None else None, capacity=r.capacity, reserved=r.reserved, context=r.context,
            needed=r.needed, fits=r.fits, partial=False, problem=None, modelled=r.modelled, notes=tuple(notes),
            wall_time=trace.wall, generation=gen, options=opts, rerun=self)

    def candidates(self, est: Any) -> list[Candidate]:
        assert est.options is not None
        return candidates(est.options, spec_of(est.options), est.generation)

    def compute_per_sample(self, est: Any) -> float:
        return est.total_flops / max(est.batch or 1, 1)

    def remark(self, est: Any) -> str:
        """What of a row's need is free space the caching allocator cannot give back, when it is a tenth of it or
        more."""
        return stranded_note(est.generation)

    def what_if(self, est: Any) -> list[Strategy]:
        return what_if(self, est)

    def largest(self, est: Any, key: str, progress: Any = None) -> int:
        """The longest prompt (``key="seq"``) or the largest batch (``"batch"``) whose generate() fits, with the
        estimate's beams and new tokens."""
        gen = est.generation
        if key == "seq":
            quadratic = any(kernel == "math" for kernel, _ in gen.sdpa) or gen.kind != "transformers" or not gen.sdpa
            return fitted_max(est, "seq", gen.prompt, quadratic=quadratic, progress=progress)[0]
        return fitted_max(est, "batch", gen.batch, quadratic=False, progress=progress)[0]

    #: where :meth:`largest` of the sequence goes in the estimate (the prompt), and the order the searches run in
    SEQ_FIELD = "max_prompt"
    SEARCH_ORDER = ("seq", "batch")


def _label_cache(trace: FakeRun, facts: dict[str, Any], first: Replayed) -> None:
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
