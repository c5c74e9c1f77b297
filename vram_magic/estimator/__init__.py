"""Predict a training or inference step's memory, or a ``generate()`` call's, without a GPU: the user's model runs on
fake tensors (shapes, no memory) under the same live-storage tracker as ``%%vram``, and what a CUDA device adds is
modelled on top. See :func:`estimate`.

The estimator's house, in the order a request travels:

* ``options.py`` and ``parallel_options.py`` — what a user may ask, checked once;
  ``fake/`` — the model and inputs on fake tensors;
* ``tracing/`` — the fake run under the engine's tracker, and the plain numbers it leaves;
* the workloads ``step/`` and ``generate/`` — traced once per configuration that changes the trace;
* ``device/`` — the target (a GPU, a budget, what CUDA adds); ``layouts/`` — what one rank holds;
  ``replay.py`` — a trace replayed for one rank of the target: its peak by category;
* ``followups/`` — the what-if table and the searches; ``timing/`` — how long a step takes; ``plan/`` — the
  planner, ranking the combinations that fit by their time;
* ``result.py`` — the results, plain numbers; ``render/`` — their text and HTML; ``cli/`` — the command line;
  ``torch_private.py`` — PyTorch's private names the estimator uses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .device.cuda_model import CudaModel
    from .device.gpus import GPU
    from .result import Estimate

# What the estimator offers besides estimate() and plan(), each imported (with torch) when first asked for, so that
# importing the package, reading estimate()'s signature or its help imports nothing heavy
_LAZY = {
    "GPU": "device.gpus", "GPUS": "device.gpus", "find_gpu": "device.gpus", "CudaModel": "device.cuda_model",
    "Target": "device", "make_target": "device", "EstimateError": "tracing.errors",
    "Estimate": "result", "GenerateEstimate": "result", "ParallelEstimate": "result", "RankEstimate": "result",
    "StepEstimate": "result", "Strategy": "result", "find_max_batch": "run", "follow_ups": "run",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


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
    offload: bool | str = False,
    param_dtype: Any = None, reduce_dtype: Any = None, float8: bool = False,
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
    step: Callable[[Any, Any, Any], Any] | None = None,
    keep_output: bool | None = None,
    optimizer_in_backward: bool = False,
    offload_activations: bool = False,
    loss_chunks: int | None = None,
    cp: int = 1, moe_imbalance: float = 1.0,
) -> Estimate:
    """Estimate the memory of a training (or inference) step of ``model`` on ``inputs``.

    ``model``: an ``nn.Module`` (never moved, modified or copied onto real memory) or a zero-argument
    callable that builds one (called under fake mode, so any size works). ``inputs``: a tensor, a tuple or
    dict of tensors, or a zero-argument callable returning them; dimension 0 is the batch.
    ``inference=True``: one forward pass under ``inference_mode`` instead of a training step; ``steps``: the
    training steps run (the first makes the optimizer's state; the peak is the last one's).
    ``optimizer``: ``sgd``, ``sgd-momentum``, ``adam``, ``adamw``, ``adagrad``, ``rmsprop``, ``adafactor``, the
    recipes' ``adamw8bit``, ``adam8bit``, ``paged_adamw8bit``, ``paged_adamw`` (bitsandbytes), ``torchao_adamw8bit``,
    ``torchao_adamw4bit``, ``torchao_adamw_fp8`` (their state modelled from the parameters' shapes; paged state in
    CUDA managed memory is ``est.paged``, outside the peak) and ``muon`` (Muon for 2-D parameters, AdamW for the rest),
    an optimizer class, or an optimizer object (its class and hyper-parameters are reused, bitsandbytes' bits, paging
    and ``min_8bit_size`` and torchao's ``block_size`` included).
    ``dtype``: weights and inputs in bf16/fp16/fp32; ``amp``: autocast to bf16/fp16. ``master_weights="fp32"``
    (with ``dtype="bf16"`` or ``"fp16"``): the optimizer keeps an fp32 copy of the weights and updates it (mixed
    precision as DeepSpeed and Megatron train: 2 + 2 + 12 bytes per parameter with Adam).
    ``loss_fn(output)``: the loss; by default the output's ``loss`` (a Hugging Face model given ``labels``), else
    the sum of the output — the estimate's ``loss`` says which.
    ``checkpointing``: activation checkpointing (the model's own ``gradient_checkpointing_enable`` when it has
    one, else of each block; ``"ops"``: op-level, below). ``accumulate=K`` splits the batch into K micro-batches.
    ``zero=1|2|3`` or ``fsdp=True`` with ``world=N`` give per-rank memory; ``offload`` keeps optimizer state on the
    host, ``offload="params"`` parameters and gradients too (FSDP2's ``CPUOffloadPolicy``: ``est.host``, ``.pinned``);
    ``param_dtype="bf16"``, ``reduce_dtype="fp32"|"bf16"``: FSDP2's ``MixedPrecisionPolicy``; ``float8``: Float8Linear.
    ``quantize="int8"|"int4"|"nf4"|"nf4-dq"``: the linear layers' weights (not the output head) in that format,
    counted from its layout and frozen; ``lora=R``: rank-R adapters on the linear layers, everything else frozen
    (``quantize="nf4", lora=16`` is QLoRA). A model already quantized (torch.ao, torchao, bitsandbytes) or made
    with PEFT is estimated as it is.
    ``device="cuda"`` models a GPU (default), ``"cpu"`` a CPU run. ``gpu`` (a name from :data:`GPUS`) or
    ``budget`` (``"24GiB"``) sets the capacity for the fit verdict (a partial estimate's ``fits`` is never ``True``);
    ``cuda``: a :class:`CudaModel` with other constants for what CUDA adds (its context, the cuBLAS and cuDNN
    workspaces). ``alloc_conf``: the caching allocator's settings in ``PYTORCH_CUDA_ALLOC_CONF``'s syntax
    (``"expandable_segments:True"``, ``"max_split_size_mb:512"``, ``"roundup_power2_divisions:4"``; default: that
    variable's value here), modelled in the block sizes and reserved memory and named in the notes. ``what_if`` adds
    the strategy table; ``max_batch`` (``max_seq``) searches the largest batch (sequence length, dimension 1 of the
    inputs) that fits (needs ``gpu`` or ``budget``); ``progress`` receives a line per trial. ``batch=B`` resizes the
    inputs' dimension 0 to ``B`` first (``--batch`` on the command line); ``name``: what the report calls the model
    (default: its class, or the builder's name).

    ``generate=N``: the peak of ``model.generate(inputs, max_new_tokens=N, min_new_tokens=N)`` instead of a step
    (``inputs``: token ids, or a dict with ``input_ids`` and ``attention_mask``), with ``cache_implementation``
    (a name the installed transformers knows: ``"static"``, ``"offloaded"``, ...) and ``num_beams``; the KV
    cache is the ``kv_cache`` category, ``estimate.generation`` holds its bytes per token. With it, ``max_seq``
    finds the longest prompt (``estimate.max_prompt``) and ``max_batch`` the largest batch that fit with N new
    tokens; a decoder without transformers whose forward takes and returns a cache (``past_key_values``) works too.

    ``tp=T``: tensor parallelism over T ranks, as ``parallelize_module`` does it with ``parallelize_plan`` (a dict
    of ``ColwiseParallel`` / ``RowwiseParallel`` / ``SequenceParallel`` styles, as PyTorch takes it; default:
    torchtitan's plan for a transformers decoder laid out as Llama's). ``pp=P``: P stages of an ``nn.Sequential``, a
    Llama-like transformers decoder or a torchtitan model (cut as torchtitan's ``pipeline_llm`` does), or
    ``pp=["model.layers.8"]``: where stages begin; ``micro_batches`` (default P), ``schedule`` (docs/parallel.md).
    ``cp=C``: context parallelism (ring attention). ``world`` is tp × pp × cp × dp, ``zero``/``fsdp`` shard over
    dp × cp; ``estimate.ranks[r]`` is rank r's, the headline the most loaded; ``fits`` asks whether every rank fits.
    ``moe_imbalance=F``: MoE routing's worst case, the busiest expert F × its balanced share (docs/estimate.md).

    The recipes (``step/recipes/``): ``step=fn`` runs ``fn(model, batch, optimizer)``, one training step as you write
    it (forward, any loss, backward, the update or none), traced exactly as written, ``steps`` times; ``optimizer`` is
    what ``optimizer=`` makes: the optimizer of a name, class or object, or what a callable ``model -> anything``
    returns (called once, so it can register hooks: an optimizer in backward). ``keep_output``: the built-in step's
    convention, ``True`` (default: ``out = model(**batch); loss = out.loss; loss.backward()``, the output alive
    through backward) or ``False`` (``model(**batch).loss.backward()``, as Hugging Face's Trainer does: the logits, and
    a KV cache a model returns, are freed before backward); every estimate names the step it assumed.
    ``optimizer_in_backward=True``: one optimizer per parameter stepping as soon as its gradient is accumulated
    (``register_post_accumulate_grad_hook``; torchtune's ``optimizer_in_bwd``): gradients are never all alive.
    ``offload_activations=True``: tensors saved for backward go to the host (``save_on_cpu(pin_memory=True)``): the
    pinned host memory is ``estimate.host_pinned``, the transfers are in the time. ``loss_chunks=N``: a transformers
    causal LM's head and cross-entropy computed from the hidden states in N chunks (torchtune's
    ``LinearCrossEntropyLoss``). ``checkpointing="ops"``: op-level selective checkpointing of each block
    (torchtitan's policy: matmul and attention outputs saved, the rest recomputed), or a policy function
    ``policy(ctx, op, *args, **kwargs) -> CheckpointPolicy`` (or a list of ops to save).
    """
    options = dict(locals())
    from .run import run_estimate

    return run_estimate(**options)


def plan(model: Any, inputs: Any, *, gpu: Any = None, gpus: int = 1, global_batch: int | None = None,
         device: str = "cuda", allow: Any = (), interconnect: Any = None, generate: int | None = None,
         top: int | None = 10, optimizer: Any = "adamw", loss_fn: Callable[[Any], Any] | None = None, dtype: Any = None,
         budget: Any = None, name: str | None = None, progress: Callable[[str], None] | None = None,
         host_size: int = 8, tp: int | None = None, pp: int | None = None, cp: int | None = None,
         step: Callable[[Any, Any, Any], Any] | None = None) -> Any:
    """The fastest ways to make a training step of ``model`` on ``inputs`` fit ``gpus`` GPUs like ``gpu``, ranked by
    predicted step time (a :class:`~vram_magic.estimator.planning.result.Plan`).

    It searches micro-batch × accumulation at the same ``global_batch`` (default: the inputs' batch, split over the
    GPUs), activation checkpointing (none, every block, every second block), ZeRO-1/2/3 or FSDP over the GPUs and the
    optimizer's state on the host, and mixed precision (marked as changing the numerics); ``allow`` adds ``"lora"``
    (and with ``"quantize"`` QLoRA), ``"optimizer"`` (SGD with momentum, Adafactor, and on CUDA bitsandbytes' 8-bit
    AdamW) and ``"batch"`` (half the global batch). ``interconnect``: how the GPUs talk (``"nvlink"``, ``"pcie"``,
    ``"infiniband-400g"``, ``"ethernet-100g"``, or bytes/s per GPU; default: the GPU's own link within a host, needed
    beyond 8 GPUs). ``top``: rows shown. When nothing of that fits, the recipes' levers join the search (an optimizer
    in backward, the loss in chunks, op-level checkpointing, activations on the host on CUDA: ``planning/recipes.py``);
    ``allow="recipes"`` adds them always.
    ``device="cpu"`` plans a CPU run, timed with this machine's measured profile. Each row's ``options`` are
    :func:`estimate`'s keyword arguments that give its memory; ``plan.calibrate(report)`` scales every time by a
    measured step.

    Across GPUs (``gpus`` more than one host's ``host_size``, or ``allow="parallel"``, or a degree fixed with ``tp=``,
    ``pp=``, ``cp=``) it searches the whole product of layouts: tensor parallelism inside a host, context
    parallelism, pipelines (1F1B, interleaved, ZB-V) and data parallelism (DDP, ZeRO-1/2, FSDP, HSDP) across hosts,
    every micro-batch count, checkpointing (none, every block, every second block, op-level) and precision (bf16
    autocast, FSDP2's bf16 ``param_dtype``); each collective is timed over its link with the overlap the runtime gives
    it (``Plan.rows[i].collectives``). ``ValueError`` for a degree that cannot run (heads ``tp`` does not divide, more
    stages than blocks, attention ``cp`` cannot shard, a ``tp`` larger than a host, degrees that do not divide
    ``gpus``).

    ``generate=N``: plan ``model.generate(inputs, max_new_tokens=N)`` instead: the weights' dtype (int8 and nf4 too
    with ``allow="quantize"``), the cache (default, static, int4-quantized, offloaded on CUDA) and the largest batch
    that fits, ranked by tokens/s.

    ``step=fn``: plan your own step, ``fn(model, batch, optimizer)`` as :func:`estimate` takes it, traced and timed as
    written. Only what the step leaves to the planner is searched: ZeRO-1/2/3 or FSDP over the GPUs and the
    optimizer's state on the host (``allow="batch"``: half the global batch too); each row's memory is
    ``estimate(model, inputs, step=fn, **row.options)``. What would rewrite the step (checkpointing, precision,
    accumulation, the recipes' levers) is not offered, and ``step=`` with ``allow=`` naming anything else,
    ``generate=``, ``loss_fn=`` or ``tp=``/``pp=``/``cp=`` is a ``ValueError``. ``optimizer`` may then be a callable
    ``model -> what fn receives``.
    """
    from .planning.planner import plan as run

    return run(model, inputs, gpu=gpu, gpus=gpus, global_batch=global_batch, device=device, allow=allow,
               interconnect=interconnect, generate=generate, top=top, optimizer=optimizer, loss_fn=loss_fn,
               dtype=dtype, budget=budget, name=name, progress=progress, host_size=host_size, tp=tp, pp=pp, cp=cp,
               step=step)


__all__ = ["GPU", "GPUS", "CudaModel", "Estimate", "EstimateError", "GenerateEstimate", "ParallelEstimate",
           "RankEstimate", "StepEstimate", "Strategy", "Target", "estimate", "find_gpu", "find_max_batch", "follow_ups",
           "make_target", "plan"]
