"""The planner for ``generate()``: the weights' dtype (and, where ``allow`` names ``"quantize"``, int8 or nf4), the
cache (the model's default, a static one, a quantized one, offloaded to the host on CUDA) and the batch — which is
where generation's throughput comes from: each combination at the largest batch that fits, ranked by tokens/s.

Each combination is traced at the inputs' batch; the largest batch is first predicted from it (what a sequence adds:
its KV cache at the end and its share of the peak's activations), then estimated exactly there, and smaller by a
tenth while it does not fit (a few runs at most). The time of a call is its prefill plus its decoding steps
(``timing.generate_time``): decoding reads the weights and the cache every step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ..device import Target
from ..fake.quantize import NotApplicable
from ..fake.request import Request
from ..options import make_options, short_dtype
from ..timing.step_time import generate_time, rates_for
from ..tracing.errors import EstimateError
from .result import Plan, PlanRow, Scored

#: exact estimates per combination while shrinking the batch to fit, at most
MAX_SHRINKS = 2


def _combinations(dtype: Any, allow: frozenset[str], half: Any, device: str) -> list[dict[str, Any]]:
    weights: list[dict[str, Any]] = [{}]
    if dtype not in (torch.bfloat16, torch.float16):
        weights.append({"dtype": half})
    if "quantize" in allow:
        weights += [{"dtype": half, "quantize": "int8"}, {"dtype": half, "quantize": "nf4"}]
    caches: list[dict[str, Any]] = [{}, {"cache_implementation": "static"},
                                    {"cache_implementation": "quantized", "cache_bits": 4}]
    if device == "cuda":
        caches.append({"cache_implementation": "offloaded"})
    return [{**w, **c} for w in weights for c in caches]


def _name(changes: dict[str, Any]) -> tuple[str, ...]:
    out = []
    if "dtype" in changes:
        out.append(f"{short_dtype(changes['dtype'])} weights")
    if changes.get("quantize"):
        out.append(f"{changes['quantize']} weights")
    impl = changes.get("cache_implementation")
    if impl == "quantized":
        out.append(f"int{changes.get('cache_bits', 4)} cache")
    elif impl:
        out.append(f"{impl} cache")
    return tuple(out)


def _facts(changes: dict[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """``(numerics, code, trade-offs)`` of a combination."""
    numerics, code, trade = [], [], []
    if "dtype" in changes:
        name = short_dtype(changes["dtype"])
        numerics.append(f"{name} weights")
        code.append(f"model = model.to(torch.{'bfloat16' if name == 'bf16' else 'float16'})")
    if changes.get("quantize"):
        numerics.append(f"{changes['quantize']} weights (bitsandbytes)")
        bits = "load_in_8bit=True" if changes["quantize"] == "int8" else "load_in_4bit=True, bnb_4bit_quant_type='nf4'"
        code.append(f"BitsAndBytesConfig({bits})  # given to from_pretrained")
        trade.append("each matmul dequantizes its weight: slower decoding, a small quality loss")
    impl = changes.get("cache_implementation")
    if impl:
        code.append(f"model.generate(..., cache_implementation={impl!r})")
    if impl == "quantized":
        numerics.append(f"int{changes.get('cache_bits', 4)} keys and values")
        trade.append("each step dequantizes a whole layer of the cache (slower decoding)")
    if impl == "static":
        trade.append("preallocated to prompt + new tokens; lets generate() compile the decoding step on CUDA")
    if impl == "offloaded":
        trade.append("layers on the host, one prefetched at a time: PCIe traffic every step")
    return tuple(numerics), tuple(code), tuple(trade)


def plan_generate(model: Any, inputs: Any, *, new_tokens: int, target: Target, device: str, dtype: Any,
                  allow: frozenset[str], top: int, name: str | None,
                  progress: Callable[[str], None] | None) -> Plan:
    """:func:`vram_magic.plan` with ``generate=``."""
    from ..fake.convert import check_inputs
    from ..fake.frameworks import without_init
    from ..generate.trace import make_spec
    from ..generate.workload import GenerateWorkload

    t0 = time.perf_counter()
    make_spec(new_tokens)
    check_inputs(inputs)
    base = make_options(inference=True, dtype=dtype, device=device).with_(generate=new_tokens)
    request = Request(without_init(model), inputs, name=name)
    workload = GenerateWorkload(request, target)
    rates = rates_for(device, target.gpu)
    capacity = target.capacity
    assert capacity is not None
    half = torch.bfloat16 if target.gpu is None or target.gpu.has_bf16 else torch.float16
    rows, scored = [], []
    for changes in _combinations(base.dtype, allow, half, device):
        label = ", ".join(_name(changes)) or "as it is"
        if progress is not None:
            progress(f"estimating {label}")
        try:
            got = _largest(workload, base.with_(**changes), capacity, progress)
        except (NotApplicable, EstimateError, ValueError) as err:
            if progress is not None:
                progress(f"{label}: could not run ({err})")
            continue
        if got is None:
            continue
        est = got
        t = generate_time(workload.trace(est.options)[0], rates, new_tokens)
        tokens = est.generation.batch * new_tokens
        numerics, code, trade = _facts(changes)
        options = {"generate": new_tokens, "batch": est.generation.batch, "device": device,
                   **{k: (short_dtype(v) if k == "dtype" else v) for k, v in changes.items() if k != "cache_bits"}}
        if changes.get("cache_bits", 4) != 4:
            options["cache_bits"] = changes["cache_bits"]
        if target.gpu is not None:
            options["gpu"] = target.gpu.name
        elif target.budget is not None:
            options["budget"] = target.budget
        rows.append(PlanRow(name=f"batch {est.generation.batch}" + (f", {label}" if changes else ""), options=options,
                            changes=_name(changes), peak=est.peak, needed=est.needed, fits=est.fits,
                            step_time=t.total, throughput=tokens / t.total if t.total else 0.0, time=t.as_dict(),
                            micro_batch=est.generation.batch, accumulate=1, numerics=numerics, code=code,
                            tradeoffs=trade))
        scored.append(Scored(rows[-1].name, est.needed, t.total, bool(est.fits), True))
    fitting = sorted((r for r in rows if r.fits), key=lambda r: -r.throughput)
    notes: list[str] = []
    if not fitting:
        fitting = sorted(rows, key=lambda r: r.needed)
        notes.append("nothing fits, not even a batch of one: the rows are the combinations that come closest")
    gpu = target.gpu
    return Plan(model=request.name, device=device, gpu=gpu.name if gpu is not None else None, gpus=1,
                capacity=capacity, global_batch=fitting[0].micro_batch if fitting else 0, unit="tokens/s",
                rows=tuple(fitting[:top]), scored=tuple(scored),
                assumptions=(rates.assumptions, "a generate() call: the prefill, then each decoding step reading the "
                             "weights and the cache; step time is the whole call"),
                notes=tuple(notes), traced=workload.traced, wall_time=time.perf_counter() - t0)


def _largest(workload: Any, opts: Any, capacity: int, progress: Callable[[str], None] | None) -> Any:
    """The estimate at the largest batch that fits (``None`` when not even one sequence does): predicted from the
    estimate at the inputs' batch, then estimated exactly and shrunk by a tenth while it does not fit."""
    first = workload.evaluate(opts)
    g = first.generation
    rows = max(g.batch, 1)
    per_sequence = (g.kv_cache + first.peak["activations"]) / rows
    fixed = first.needed - per_sequence * rows
    batch = max(int((capacity - fixed) // per_sequence) if per_sequence > 0 else g.batch, 1)
    best = first if first.fits else None
    for _ in range(MAX_SHRINKS + 1):
        if batch == g.batch:
            est = first
        else:
            if progress is not None:
                progress(f"  batch {batch}")
            est = workload.evaluate(opts.with_(batch=batch))
        if est.fits:
            return est if best is None or est.generation.batch >= best.generation.batch else best
        if batch == 1:
            break
        batch = max(int(batch * 0.9), 1)
    return best
