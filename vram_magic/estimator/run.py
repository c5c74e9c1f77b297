"""An estimate's way through the estimator: the options checked once, the target made, the workload that traces the
model (a step or ``generate()``) evaluated, then the follow-ups asked for (the what-if table, the searches). The body
of :func:`vram_magic.estimate`, whose signature and documentation live in the package's ``__init__``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .device import Target, make_target
from .device.cuda_model import with_allocator
from .fake.request import Request
from .options import check_training_options, make_options
from .result import Estimate


def run_estimate(model: Any, inputs: Any, *, optimizer: Any, loss_fn: Any, dtype: Any, device: str, steps: int,
                 inference: bool, amp: Any, master_weights: Any, checkpointing: Any, accumulate: int, zero: Any,
                 fsdp: bool, world: int, offload: Any, quantize: Any, lora: Any, gpu: Any, budget: Any, cuda: Any,
                 param_dtype: Any, reduce_dtype: Any, float8: bool,
                 alloc_conf: Any, batch: Any, name: Any, what_if: bool, max_batch: bool, max_seq: bool,
                 progress: Callable[[str], None] | None, generate: Any, cache_implementation: Any, num_beams: int,
                 tp: int, pp: Any, micro_batches: Any, schedule: str, parallelize_plan: Any, step: Any = None,
                 keep_output: Any = None, optimizer_in_backward: bool = False, offload_activations: bool = False,
                 loss_chunks: Any = None, cp: int = 1, moe_imbalance: Any = 1.0) -> Estimate:
    """:func:`vram_magic.estimate`, its arguments as it takes them."""
    recipe = dict(step=step, keep_output=keep_output, optimizer_in_backward=optimizer_in_backward,
                  offload_activations=offload_activations, loss_chunks=loss_chunks)
    if step is not None and loss_fn is not None:
        raise ValueError("step= computes its own loss: drop loss_fn (or drop step= to have the built-in step train on "
                         "loss_fn)")
    if generate is not None or cache_implementation is not None or num_beams != 1:
        opts = generate_options(generate, cache_implementation, num_beams, dict(
            dtype=dtype, amp=amp, device=device, quantize=quantize, moe_imbalance=moe_imbalance), dict(
            checkpointing=checkpointing, accumulate=accumulate, zero=zero, fsdp=fsdp, world=world, offload=offload,
            param_dtype=param_dtype, reduce_dtype=reduce_dtype, float8=float8,
            lora=lora, master_weights=master_weights, loss_fn=loss_fn, tp=tp, pp=pp, micro_batches=micro_batches,
            parallelize_plan=parallelize_plan, cp=cp, **recipe))
    else:
        opts = make_options(optimizer=optimizer, inference=inference, dtype=dtype, amp=amp,
                            master_weights=master_weights, checkpointing=checkpointing, accumulate=accumulate,
                            zero=zero, fsdp=fsdp, world=world, offload=offload, device=device, steps=steps,
                            param_dtype=param_dtype, reduce_dtype=reduce_dtype, float8=float8,
                            quantize=quantize, lora=lora, tp=tp, pp=pp, micro_batches=micro_batches,
                            schedule=schedule, parallelize_plan=parallelize_plan, cp=cp, moe_imbalance=moe_imbalance,
                            **recipe)
    if batch is not None:
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be a whole number ≥ 1 (the inputs' new dimension 0), not {batch!r}")
        opts = opts.with_(batch=batch)
    target = make_target(gpu, budget, with_allocator(cuda, alloc_conf))
    if (max_batch or max_seq) and target.capacity is None:
        raise ValueError("max_batch/max_seq need a capacity: give gpu='A100-80GB' (or another known GPU) or "
                         "budget='24GiB'")
    from .fake.convert import check_inputs

    check_inputs(inputs)
    est = workload_for(model, inputs, loss_fn, opts, target, name).evaluate(opts)
    est = follow_ups(est, what_if=what_if, max_batch=max_batch, max_seq=max_seq, progress=progress)
    settings = target.cuda.allocator
    if opts.generate is not None and opts.device == "cuda" and settings.expandable_segments:
        # the decoding loop's replay keeps the default rules
        est = replace(est, notes=(*est.notes, settings.note("not modelled for generate()'s decoding loop: its "
                                                            "replay used the default rules, not those")))
    return est


def generate_options(generate: Any, cache_implementation: Any, num_beams: int, kept: dict[str, Any],
                     training: dict[str, Any]) -> Any:
    """The options of a ``generate()`` estimate (``kept``: those it takes; ``training``: the training options,
    which must be at their defaults)."""
    if generate is None:
        raise ValueError("cache_implementation and num_beams apply to generate=N (the number of new tokens)")
    check_training_options(training)
    from .generate.trace import make_spec

    spec = make_spec(generate, cache_implementation, num_beams)
    return make_options(inference=True, **kept).with_(
        generate=spec.new_tokens, cache_implementation=spec.cache_implementation, num_beams=spec.num_beams)


def workload_for(model: Any, inputs: Any, loss_fn: Any, opts: Any, target: Target, name: str | None = None) -> Any:
    """The workload that estimates ``model`` on ``inputs`` with options like ``opts``: ``generate()`` or a step."""
    if opts.generate is not None:
        from .fake.frameworks import without_init
        from .generate.workload import GenerateWorkload

        return GenerateWorkload(Request(without_init(model), inputs, name=name), target)
    from .step.workload import StepWorkload

    return StepWorkload(Request(model, inputs, loss_fn, name=name), target)


def follow_ups(est: Estimate, *, what_if: bool = False, max_batch: bool = False, max_seq: bool = False,
               progress: Callable[[str], None] | None = None) -> Estimate:
    """An estimate with the follow-ups asked for: the largest batch, the longest sequence (a step's) or prompt
    (``generate()``'s), the what-if table — each made by the estimate's workload with other options."""
    if not (what_if or max_batch or max_seq):
        return est
    workload = est.rerunnable()
    asked = {"batch": max_batch, "seq": max_seq}
    for key in workload.SEARCH_ORDER:
        if asked[key]:
            field = "max_batch" if key == "batch" else workload.SEQ_FIELD
            est = replace(est, **{field: workload.largest(est, key, progress)})
    if what_if:
        est = replace(est, strategies=tuple(workload.what_if(est)))
    return est


def find_max_batch(est: Estimate, *, dim: int = 0, progress: Callable[[str], None] | None = None) -> int:
    """The largest batch (``dim=0``) or sequence length (``dim=1``; a prompt for ``generate()``) whose estimate fits
    its capacity."""
    return est.rerunnable().largest(est, "batch" if dim == 0 else "seq", progress)
