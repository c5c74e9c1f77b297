"""Predict a training or inference step's memory, or a ``generate()`` call's, without a GPU: the user's model runs on
fake tensors (shapes, no memory) under the same live-storage tracker as ``%%vram``, and what a CUDA device adds is
modelled on top. See :func:`estimate`.

The estimator's house: ``tracing/`` runs a model on fake tensors; a workload (``step/``, ``generate/``) traces once per
configuration that changes the trace and ``replay.py`` turns a trace into one rank's peak for a target (``target/``)
and a layout (``layouts/``); ``explore/`` holds the what-if table and the searches; ``render/`` the reports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .options import check_training_options, make_options
from .result import Estimate, GenerateEstimate, ParallelEstimate, RankEstimate, StepEstimate, Strategy
from .target import Target, make_target
from .target.cuda import CudaModel, with_allocator
from .target.gpus import GPU, GPUS, find_gpu
from .tracing.errors import EstimateError
from .tracing.request import Request


def estimate(
    model: Any,
    inputs: Any,
    *,
    optimizer: Any = "adamw",
    loss_fn: Callable[[Any], Any] | None = None,
    dtype: Any = None,
    device: str = "cuda",
    steps: int = 2,
    inference: bool = False,
    amp: Any = None,
    master_weights: Any = None,
    checkpointing: bool = False,
    accumulate: int = 1,
    zero: int | None = None,
    fsdp: bool = False,
    world: int = 1,
    offload: bool = False,
    quantize: str | None = None,
    lora: int | None = None,
    gpu: str | GPU | None = None,
    budget: int | str | None = None,
    cuda: CudaModel | None = None,
    alloc_conf: str | None = None,
    batch: int | None = None,
    name: str | None = None,
    what_if: bool = False,
    max_batch: bool = False,
    max_seq: bool = False,
    progress: Callable[[str], None] | None = None,
    generate: int | None = None,
    cache_implementation: str | None = None,
    num_beams: int = 1,
    tp: int = 1,
    pp: int | list[str] = 1,
    micro_batches: int | None = None,
    schedule: str = "1f1b",
    parallelize_plan: dict[str, Any] | None = None,
) -> Estimate:
    """Estimate the memory of a training (or inference) step of ``model`` on ``inputs``.

    ``model``: an ``nn.Module`` (never moved, modified or copied onto real memory) or a zero-argument
    callable that builds one (called under fake mode, so any size works). ``inputs``: a tensor, a tuple or
    dict of tensors, or a zero-argument callable returning them; dimension 0 is the batch.
    ``inference=True``: one forward pass under ``inference_mode`` instead of a training step; ``steps``: the
    training steps run (the first makes the optimizer's state; the peak is the last one's).
    ``optimizer``: ``sgd``, ``sgd-momentum``, ``adam``, ``adamw``, ``adagrad``, ``rmsprop``, ``adafactor``,
    an optimizer class, or an optimizer object (its class and hyper-parameters are reused).
    ``dtype``: weights and inputs in bf16/fp16/fp32; ``amp``: autocast to bf16/fp16. ``master_weights="fp32"``
    (with ``dtype="bf16"`` or ``"fp16"``): the optimizer keeps an fp32 copy of the weights and updates it (mixed
    precision as DeepSpeed and Megatron train: 2 + 2 + 12 bytes per parameter with Adam).
    ``loss_fn(output)``: the loss; by default the output's ``loss`` (a Hugging Face model given ``labels``), else
    the sum of the output — the estimate's ``loss`` says which.
    ``checkpointing``: activation checkpointing (the model's own ``gradient_checkpointing_enable`` when it has
    one, else of each block). ``accumulate=K`` splits the batch into K micro-batches. ``zero=1|2|3`` or
    ``fsdp=True`` with ``world=N`` give per-rank memory; ``offload`` keeps optimizer state and its step on the host.
    ``quantize="int8"|"int4"|"nf4"|"nf4-dq"``: the linear layers' weights (not the output head) in that format,
    counted from its layout and frozen; ``lora=R``: rank-R adapters on the linear layers, everything else frozen
    (``quantize="nf4", lora=16`` is QLoRA). A model already quantized (torch.ao, torchao, bitsandbytes) or made
    with PEFT is estimated as it is.
    ``device="cuda"`` models a GPU (default), ``"cpu"`` a CPU run. ``gpu`` (a name from :data:`GPUS`) or
    ``budget`` (``"24GiB"``) sets the capacity for the fit verdict; ``cuda``: a :class:`CudaModel` with other
    constants for what CUDA adds (its context, the cuBLAS and cuDNN workspaces). ``alloc_conf``: the caching
    allocator's settings in ``PYTORCH_CUDA_ALLOC_CONF``'s syntax (``"expandable_segments:True"``,
    ``"max_split_size_mb:512"``, ``"roundup_power2_divisions:4"``; default: that variable's value here), modelled
    in the block sizes and reserved memory and named in the notes. ``what_if`` adds the strategy table;
    ``max_batch`` (``max_seq``) searches the largest batch (sequence length, dimension 1
    of the inputs) that fits (needs ``gpu`` or ``budget``); ``progress`` receives a line per trial. ``batch=B``
    resizes the inputs' dimension 0 to ``B`` first (``--batch`` on the command line); ``name``: what the report
    calls the model (default: its class, or the builder's name).

    ``generate=N``: the peak of ``model.generate(inputs, max_new_tokens=N, min_new_tokens=N)`` instead of a step
    (``inputs``: token ids, or a dict with ``input_ids`` and ``attention_mask``), with ``cache_implementation``
    (a name the installed transformers knows: ``"static"``, ``"offloaded"``, ...) and ``num_beams``; the KV
    cache is the ``kv_cache`` category, ``estimate.generation`` holds its bytes per token. With it, ``max_seq``
    finds the longest prompt (``estimate.max_prompt``) and ``max_batch`` the largest batch that fit with N new
    tokens.
    A decoder without transformers whose forward takes and returns a cache (``past_key_values``) works too.

    ``tp=T``: tensor parallelism over T ranks, as ``parallelize_module`` does it with ``parallelize_plan`` (a dict
    of ``ColwiseParallel`` / ``RowwiseParallel`` / ``SequenceParallel`` styles, as PyTorch takes it; default:
    torchtitan's plan for a transformers decoder laid out as Llama's). ``pp=P``: pipeline parallelism over P stages
    of an ``nn.Sequential`` (split evenly by blocks, or ``pp=["4", "8"]``: the children where stages begin), with
    ``micro_batches`` (default P) and ``schedule`` (``"1f1b"``, ``"gpipe"``, ``"interleaved"``: two stages a
    rank). ``world`` is then tp × pp × dp and ``zero``/``fsdp`` shard over the dp ranks. The estimate is the most
    loaded rank's; ``estimate.ranks[r]`` is rank r's, and ``fits`` asks whether every rank fits.
    """
    if generate is not None or cache_implementation is not None or num_beams != 1:
        opts = generate_options(generate, cache_implementation, num_beams, dict(
            dtype=dtype, amp=amp, device=device, quantize=quantize), dict(
            checkpointing=checkpointing, accumulate=accumulate, zero=zero, fsdp=fsdp, world=world, offload=offload,
            lora=lora, master_weights=master_weights, loss_fn=loss_fn, tp=tp, pp=pp, micro_batches=micro_batches,
            parallelize_plan=parallelize_plan))
    else:
        opts = make_options(optimizer=optimizer, inference=inference, dtype=dtype, amp=amp,
                            master_weights=master_weights, checkpointing=checkpointing, accumulate=accumulate,
                            zero=zero, fsdp=fsdp, world=world, offload=offload, device=device, steps=steps,
                            quantize=quantize, lora=lora, tp=tp, pp=pp, micro_batches=micro_batches,
                            schedule=schedule, parallelize_plan=parallelize_plan)
    if batch is not None:
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be a whole number ≥ 1 (the inputs' new dimension 0), not {batch!r}")
        opts = opts.with_(batch=batch)
    target = make_target(gpu, budget, with_allocator(cuda, alloc_conf))
    if (max_batch or max_seq) and target.capacity is None:
        raise ValueError("max_batch/max_seq need a capacity: give gpu='A100-80GB' (or another known GPU) or "
                         "budget='24GiB'")
    from .tracing.fake import check_inputs

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
        from .generate.workload import GenerateWorkload
        from .tracing.frameworks import without_init

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


def plan(model: Any, inputs: Any, *, gpu: Any = None, gpus: int = 1, global_batch: int | None = None,
         device: str = "cuda", allow: Any = (), interconnect: Any = None, generate: int | None = None,
         top: int | None = 10, optimizer: Any = "adamw", loss_fn: Callable[[Any], Any] | None = None, dtype: Any = None,
         budget: Any = None, name: str | None = None, progress: Callable[[str], None] | None = None) -> Any:
    """The fastest ways to make a training step of ``model`` on ``inputs`` fit ``gpus`` GPUs like ``gpu``, ranked by
    predicted step time (a :class:`~vram_magic.estimator.plans.Plan`).

    It searches micro-batch × accumulation at the same ``global_batch`` (default: the inputs' batch, split over the
    GPUs), activation checkpointing (none, every block, every second block), ZeRO-1/2/3 or FSDP over the GPUs and the
    optimizer's state on the host, and mixed precision (marked as changing the numerics); ``allow`` adds ``"lora"``
    (and with ``"quantize"`` QLoRA), ``"optimizer"`` (SGD with momentum, Adafactor) and ``"batch"`` (half the global
    batch). ``interconnect``: how the GPUs talk (``"nvlink"``, ``"pcie"``, ``"infiniband-400g"``, ``"ethernet-100g"``,
    or bytes/s per GPU; default: the GPU's own link within a host, needed beyond 8 GPUs). ``top``: rows shown.
    ``device="cpu"`` plans a CPU run, timed with this machine's measured profile. Each row's ``options`` are
    :func:`estimate`'s keyword arguments that give its memory; ``plan.calibrate(report)`` scales every time by a
    measured step.

    ``generate=N``: plan ``model.generate(inputs, max_new_tokens=N)`` instead: the weights' dtype (int8 and nf4 too
    with ``allow="quantize"``), the cache (default, static, int4-quantized, offloaded on CUDA) and the largest batch
    that fits, ranked by tokens/s.
    """
    from .explore.plan import plan as run

    return run(model, inputs, gpu=gpu, gpus=gpus, global_batch=global_batch, device=device, allow=allow,
               interconnect=interconnect, generate=generate, top=top, optimizer=optimizer, loss_fn=loss_fn,
               dtype=dtype, budget=budget, name=name, progress=progress)


def find_max_batch(est: Estimate, *, dim: int = 0, progress: Callable[[str], None] | None = None) -> int:
    """The largest batch (``dim=0``) or sequence length (``dim=1``; a prompt for ``generate()``) whose estimate fits
    its capacity."""
    return est.rerunnable().largest(est, "batch" if dim == 0 else "seq", progress)


__all__ = ["GPU", "GPUS", "CudaModel", "Estimate", "EstimateError", "GenerateEstimate", "ParallelEstimate",
           "RankEstimate", "StepEstimate", "Strategy",
           "Target", "estimate", "find_gpu", "find_max_batch", "follow_ups", "make_target", "plan"]
