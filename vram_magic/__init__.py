"""vram_magic: see what fills GPU memory, cell by cell, and predict it before you run.

Importing this package has no side effects: IPython, ipywidgets and matplotlib are imported only when
needed, and CUDA is not touched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .breakdown import CATEGORIES, Breakdown
from .device_stats import DeviceStats
from .report import Advice, CellReport, OomInfo
from .units import format_bytes, parse_size

if TYPE_CHECKING:
    from collections.abc import Callable

    from .engine.cell.measurement import Measurement
    from .estimator import GPU, CudaModel, Estimate

__version__ = "0.1.0"

__all__ = [
    "CATEGORIES",
    "Advice",
    "Breakdown",
    "CellReport",
    "DeviceStats",
    "OomInfo",
    "estimate",
    "plan",
    "format_bytes",
    "gather",
    "load_ipython_extension",
    "measure",
    "parse_size",
    "unload_ipython_extension",
]


def measure(device: Any = None, **kwargs: Any) -> Measurement:
    """``with vram_magic.measure() as m: ...`` — see :func:`vram_magic.engine.cell.measurement.measure`."""
    import sys

    from .engine.cell.measurement import measure as _measure
    from .engine.namespace import FrameNamespace

    if kwargs.get("namespace") is None:
        kwargs["namespace"] = FrameNamespace(sys._getframe(1))
    return _measure(device, **kwargs)


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
    # the estimator (and torch) are imported on the first call, not with the package; its estimate() has this
    # signature and docstring (tests/test_estimate.py holds the two together)
    options = dict(locals())
    from .estimator import estimate as run

    return run(**options)


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
    # the planner (and torch) are imported on the first call; its plan() has this signature and docstring
    options = dict(locals())
    from .estimator import plan as run

    return run(**options)


def gather(*args: Any, **kwargs: Any) -> Any:
    """Every rank's report of a distributed job, on rank 0 (``None`` elsewhere); see :func:`vram_magic.ranks.gather`."""
    from .ranks.gather import gather as _gather

    return _gather(*args, **kwargs)


def load_ipython_extension(ipython: Any) -> None:
    from .magics import load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    from .magics import unload

    unload(ipython)
