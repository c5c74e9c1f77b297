"""``estimate(model, input_ids, generate=N)``: the peak of ``model.generate(input_ids, max_new_tokens=N,
min_new_tokens=N)`` on fake tensors.

``generate()`` cannot run on fake tensors to its end (its stopping checks read values), so its loop is
modelled (``loop.py``): generate() itself prepares everything as it would (the cache object it
chooses, ``logits_to_keep``, the encoder outputs, beams), the prefill runs as it runs it, then the first
decoding steps, then the last one with the cache at its longest (prompt + N − 2 tokens going in, one more
coming out). A hand-written decoder that takes and returns a tuple cache is run through the same kind of
loop (``manual.py``). The cache's tensors are the estimate's ``kv_cache`` category.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import Any

import torch

from ...engine.hooks.kv_cache import KV_CACHE
from ...engine.scan.experts import expert_parameters, marked
from ...engine.scan.registry import LiveStorages
from ..device.autocast import cuda_autocast
from ..fake.convert import from_specs, resize, size_of, tensors_in
from ..fake.frameworks import fake_run, not_tracing
from ..fake.lora import adapt_linear_layers
from ..fake.quantize import count_parameters, parameter_labels
from ..fake.request import Request
from ..options import Options, short_dtype
from ..torch_private import FakeTensorMode
from ..tracing.errors import EstimateError
from ..tracing.routing import routing_for
from ..tracing.traced import FakeRun
from ..tracing.tracer import FAKE_PROBLEMS, FORWARD
from .facts import GenerateSpec
from .loop import DecodePlan, decoding
from .recorder import LoopRecorder
from .variants import no_streams

#: the category the cache's tensors are counted in
KV = KV_CACHE
GROWTH = ("other", "KV-cache growth: a layer's new copy while the old one is alive (torch.cat, beam reordering)")
MARK = "\x00kv"  # first-pass labels: which cache storage is alive at the peak


def cache_implementations() -> tuple[str, ...]:
    """The ``cache_implementation`` names the installed transformers accepts for ``generate()``."""
    try:
        from transformers.generation.configuration_utils import ALL_CACHE_IMPLEMENTATIONS
    except ImportError:
        return ()
    return tuple(ALL_CACHE_IMPLEMENTATIONS)


def make_spec(new_tokens: Any, cache_implementation: Any = None, num_beams: Any = 1,
              do_sample: bool = False) -> GenerateSpec:
    """Check what ``generate=``, ``cache_implementation=`` and ``num_beams=`` ask; ``ValueError`` naming what is
    accepted."""
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
        raise ValueError(f"generate must be the number of new tokens, a whole number ≥ 1 (generate=256), not "
                         f"{new_tokens!r}")
    if isinstance(num_beams, bool) or not isinstance(num_beams, int) or num_beams < 1:
        raise ValueError(f"num_beams must be a whole number ≥ 1 (1 is greedy decoding), not {num_beams!r}")
    if cache_implementation is not None:
        known = cache_implementations()
        if not isinstance(cache_implementation, str) or cache_implementation not in known:
            listed = ", ".join(known) if known else "none (transformers is not installed)"
            raise ValueError(f"unknown cache implementation {cache_implementation!r}; the installed transformers "
                             f"knows: {listed} (or None for the model's default)")
    return GenerateSpec(new_tokens, cache_implementation, num_beams, bool(do_sample))


def model_kind(model: Any) -> str:
    """``"transformers"`` (a model whose ``generate()`` is transformers'), ``"hand-written"`` (a forward that
    takes a cache argument), else ``ValueError`` saying what is needed."""
    from .manual import cache_argument

    name = type(model).__name__
    config = getattr(model, "config", None)
    can = getattr(model, "can_generate", None)
    if callable(can):  # a transformers model: its own generate() or none
        try:
            able = bool(can()) and hasattr(model, "generate")
        except Exception:
            able = False
        if able:
            return "transformers"
        if config is not None and not getattr(config, "is_decoder", False) and not getattr(
                config, "is_encoder_decoder", False):
            raise ValueError(f"{name} is an encoder-only model: it cannot generate (transformers' can_generate() is "
                             "False). generate= needs a causal language model (…ForCausalLM, …LMHeadModel), an "
                             "encoder-decoder (…ForConditionalGeneration), or a decoder whose forward takes and "
                             "returns a cache (past_key_values)")
        raise ValueError(f"{name} cannot generate (transformers' can_generate() is False): generate= needs a model "
                         "with a language-modelling head")
    if cache_argument(model) is not None:
        return "hand-written"
    raise ValueError(f"{name} has no generate() and its forward takes no cache: generate= needs a transformers model "
                     "that can generate, or a decoder whose forward(input_ids, past_key_values=...) (or past=, "
                     "layer_past=, cache=, kv_cache=) returns the logits and the new cache, as (logits, cache) or an "
                     "object with .logits and .past_key_values")


def trace_generate(request: Request, opts: Options, spec: GenerateSpec, *, cuda: Any = None
                   ) -> tuple[FakeRun, dict[str, Any]]:
    """The fake run of one ``generate()`` call; the trace and what the loop learnt (cache slots, phases)."""
    t0 = time.perf_counter()
    with fake_run() as mode:
        return _trace(request, opts, spec, mode, t0, cuda)


def _fake_model(request: Request, opts: Options, mode: FakeTensorMode) -> tuple[Any, list[str]]:
    model, _compiled = request.fake_model(mode, opts.dtype)
    model, notes = adapt_linear_layers(model, opts, mode)
    model.eval()
    return model, notes


def _inputs(request: Request, opts: Options, mode: FakeTensorMode) -> tuple[Any, int, int]:
    specs = request.input_specs(mode)
    batch, seq = size_of(specs, 0), size_of(specs, 1)
    if batch is None or seq is None:
        raise ValueError("generate= needs token ids of shape (batch, prompt length): a tensor, or a dict with "
                         "input_ids (and attention_mask)")
    if opts.batch is not None:
        specs, batch = resize(specs, 0, batch, opts.batch), opts.batch
    if opts.seq is not None:
        specs, seq = resize(specs, 1, seq, opts.seq), opts.seq
    with mode:
        inputs = from_specs(specs, opts.dtype if opts.amp is None else None)
    return inputs, batch, seq


def _trace(request: Request, opts: Options, spec: GenerateSpec, mode: FakeTensorMode, t0: float,
           cuda: Any) -> tuple[FakeRun, dict[str, Any]]:
    from .cuda import GenerateTracer

    model, notes = _fake_model(request, opts, mode)
    kind = model_kind(model)
    if spec.last_logits_only:
        _last_position_logits(model, notes)
    inputs, batch, seq = _inputs(request, opts, mode)
    registry = LiveStorages()
    owner: dict[int, tuple[str, str]] = {}

    experts = {id(p) for p in expert_parameters(model)}  # the MoE experts' weights, shown apart (scan/experts.py)

    def claim(t: Any, cat: tuple[str, str]) -> int | None:
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return None
        if id(t) in experts:
            cat = (cat[0], marked(cat[1]))
        entry = registry.add(t.untyped_storage())
        owner.setdefault(entry.serial, cat)
        return entry.serial

    params = list(model.parameters())
    for p, label in parameter_labels(model):
        claim(p, ("parameters", label))
    for p in params:
        claim(p, ("parameters", "parameters"))
    for b in model.buffers():
        claim(b, ("other", "buffers"))
    for t in tensors_in(inputs):
        claim(t, ("other", "inputs"))
    names = {id(m): (name or type(m).__name__) for name, m in model.named_modules()}
    tracer = GenerateTracer(registry, names, cuda)
    tracer.routing = routing_for(model, names, opts.moe_imbalance)  # MoE routing (tracing/routing.py)
    learnt = LoopRecorder(tracer, registry, spec)
    plan = DecodePlan(spec.new_tokens, on_event=learnt.event, cuda=cuda is not None)
    learnt.plan = plan
    autocast = cuda_autocast(opts.device, opts.amp)  # amp= for CUDA: CUDA's op lists (estimator/device/autocast.py)
    amp = autocast.region(opts.amp) if autocast is not None else \
        torch.autocast("cpu", dtype=opts.amp) if opts.amp is not None else _null()
    problem = None
    try:
        with autocast or _null(), mode, tracer, not_tracing(), torch.inference_mode(), amp:
            tracer.stage = FORWARD
            if kind == "transformers":
                result = _hf_generate(model, inputs, spec, plan)
            else:
                from .manual import manual_generate

                result = manual_generate(model, inputs, spec, plan, learnt)
            learnt.final(result)
            del result
    except FAKE_PROBLEMS as err:
        where = tracer.problem or (str(err), tracer.module() or "(top level)", type(err).__name__)
        problem = (f"{where[0]} in module {where[1]!r} needs real tensor values ({where[2]}), which fake tensors do "
                   "not have; the estimate covers what ran before it")
    except (EstimateError, ValueError, TypeError):
        raise
    except Exception as err:
        op = tracer.failed_in
        at = f" at {op[0]} on ({op[2]}) in module {op[1]!r}" if op else ""
        raise EstimateError(f"generate() on fake tensors raised {type(err).__name__}{at}: "
                            f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}") from err
    if autocast is not None:
        notes.append(autocast.note())
    if tracer.routing is not None:
        notes.extend(tracer.routing.notes())
    trace = _step_trace(tracer, owner, learnt, model, params, batch, seq, notes, problem, t0)
    facts = learnt.summary(kind, batch, seq, plan, model)
    facts["kernels"] = dict(tracer.kernels)
    return trace, facts


def _last_position_logits(model: Any, notes: list[str]) -> None:
    """What-if: the output head computes the last position's logits only (what ``logits_to_keep=1`` does)."""
    from ..fake.quantize import output_head

    head = output_head(model)
    if head is None:
        raise ValueError("the model's output head (its get_output_embeddings(), or a last linear layer as wide as "
                         "the vocabulary) was not found: logits_to_keep cannot be modelled")

    def last(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        return (x[:, -1:, :], *args[1:]) if isinstance(x, torch.Tensor) and x.dim() == 3 else args

    head.register_forward_pre_hook(last)
    notes.append("what-if: the output head computes the last position's logits only (logits_to_keep=1)")


def _hf_generate(model: Any, inputs: Any, spec: GenerateSpec, plan: DecodePlan) -> Any:
    kwargs: dict[str, Any] = dict(max_new_tokens=spec.new_tokens, min_new_tokens=spec.new_tokens,
                                  do_sample=spec.do_sample, num_beams=spec.num_beams, custom_generate=decoding(plan))
    if spec.do_sample:
        kwargs.update(top_k=0, top_p=1.0, temperature=1.0)
    if spec.cache_implementation == "quantized":  # optimum-quanto's layout, modelled (variants.py)
        from .variants import quantized_cache

        kwargs["cache"] = quantized_cache(model.config, spec.cache_bits)
    elif spec.cache_implementation is not None:
        kwargs["cache_implementation"] = spec.cache_implementation
    if isinstance(inputs, Mapping):
        args, named = (), dict(inputs)
    elif isinstance(inputs, (tuple, list)):
        args, named = tuple(inputs), {}
    else:
        args, named = (inputs,), {}
    _stand_in_values(model, args[0] if args else named.get("input_ids"))
    offloaded = str(spec.cache_implementation or "").startswith("offloaded")
    # an offloading cache makes its prefetch stream when it is built: a stand-in, so no GPU is touched
    with no_streams() if offloaded else contextlib.nullcontext():
        return model.generate(*args, **named, **kwargs)


def _special_tokens(model: Any) -> set[int]:
    found: set[int] = set()
    for config in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        for name in ("pad_token_id", "eos_token_id", "bos_token_id", "decoder_start_token_id"):
            value = getattr(config, name, None)
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(v, int):
                    found.add(v)
    return found


def _stand_in_values(model: Any, ids: Any) -> None:
    """Token ids whose values are not known (a random expression evaluated on fake tensors): generate() reads
    them (a pad token in the prompt makes a padding mask; negative ids; right padding), so they get stand-in
    values: one ordinary token everywhere, none of the model's special tokens — an unpadded prompt."""
    from ..fake.known_values import LIMIT, attach, value_of
    from ..torch_private import disable_current_modes as _disable_current_modes

    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or value_of(ids) is not None:
        return
    if ids.numel() > LIMIT:
        return
    special = _special_tokens(model)
    token = next(t for t in range(len(special) + 1) if t not in special)
    with _disable_current_modes():
        attach(ids, torch.full(tuple(ids.shape), token, dtype=ids.dtype))


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _step_trace(tracer: Any, owner: dict[int, tuple[str, str]], learnt: LoopRecorder, model: Any, params: list[Any],
                batch: int, seq: int, notes: list[str], problem: str | None, t0: float) -> FakeRun:
    sizes = dict(tracer.counts.initial)
    sizes.update(tracer.counts.late)
    module: dict[int, str] = {}
    made_at: dict[int, int] = {}
    for i, ev in enumerate(tracer.counts.events):
        if ev > 0:
            made_at.setdefault(ev, i)
    marks = learnt.marks
    prefill = marks.get("prefill_start", 0)
    decode = marks.get("decode_start", len(tracer.counts.events))
    for serial, record in tracer.counts.allocs.items():
        sizes[serial] = record[0]
        _stage, mod, _r = tracer.made.get(serial, (0, "", False))
        module[serial] = mod
        if serial in owner:
            continue
        if serial in learnt.slot:
            owner[serial] = (KV, f"{MARK}{serial}")
        elif serial in learnt.special:
            owner[serial] = learnt.special[serial]
        else:
            at = made_at.get(serial, 0)
            phase = "set-up (generate() before its loop)" if at < prefill else (
                "prefill" if at < decode else "decoding step")
            owner[serial] = ("activations", f"{phase} activations") if mod else (
                "other", "generate(): token ids, positions, masks" if at < prefill else
                "generate() loop: token ids, positions, masks")
    for serial in tracer.counts.late:
        owner.setdefault(serial, ("other", "temporaries"))
    param_bytes = sum(sizes.get(s, 0) for s, c in owner.items() if c[0] == "parameters")
    trace = FakeRun(
        sizes=sizes, owner=owner, module=module, events=tracer.counts.events,
        initial=tuple(tracer.counts.initial) + tuple(tracer.counts.late),
        marks={"forward_end": marks.get("decode_start", len(tracer.counts.events)), "step_start": 0, **marks},
        flops={"forward": 0, "backward": 0, "optimizer": 0}, convs=tracer.convs, copies=tracer.copies,
        rnns=tracer.rnns, gemms=tracer.gemms, host_scalars=set(), problem=problem, uses_matmul=tracer.matmul,
        batch=batch, seq=seq, micro_batch=batch, param_count=count_parameters(model), param_bytes=param_bytes,
        wall=time.perf_counter() - t0, notes=notes, answered=tracer.answered, ops=tracer.ops,
        op_marks=dict(learnt.op_rows))
    return trace


def describe(spec: GenerateSpec, opts: Options, facts: dict[str, Any]) -> str:
    parts = [f"generate {spec.new_tokens} token{'s' if spec.new_tokens != 1 else ''}",
             f"beam search × {spec.num_beams}" if spec.num_beams > 1 else ("sampling" if spec.do_sample else "greedy"),
             f"prompt {facts['seq']}", facts["cache"] or "no cache"]
    if spec.cache_implementation == "quantized":
        parts[-1] += f" (int{spec.cache_bits})"
    if spec.last_logits_only:
        parts.append("logits_to_keep=1")
    if opts.dtype is not None:
        parts.append(short_dtype(opts.dtype))
    if opts.quantize:
        parts.append(f"{opts.quantize} weights")
    if opts.amp is not None:
        parts.append(f"AMP {short_dtype(opts.amp)}")
    return ", ".join(parts)


__all__ = ["GROWTH", "KV", "MARK", "cache_implementations", "describe", "make_spec", "model_kind",
           "trace_generate"]
