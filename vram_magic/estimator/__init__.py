"""Predict a training or inference step's memory without a GPU: the user's model runs on fake tensors
(shapes, no memory) under the same live-storage tracker as ``%%vram``, and what a CUDA device adds is
modelled on top. See :func:`estimate`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .core import Target, evaluate, make_target, search_max
from .cuda_model import CudaModel
from .gpus import GPU, GPUS, find_gpu
from .options import make_options
from .result import Estimate, Strategy
from .run import EstimateError, Request


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
    what_if: bool = False,
    max_batch: bool = False,
    max_seq: bool = False,
    progress: Callable[[str], None] | None = None,
) -> Estimate:
    """Estimate the memory of a training (or inference) step of ``model`` on ``inputs``.

    ``model``: an ``nn.Module`` (never moved, modified or copied onto real memory) or a zero-argument
    callable that builds one (called under fake mode, so any size works). ``inputs``: a tensor, a tuple or
    dict of tensors, or a zero-argument callable returning them; dimension 0 is the batch.
    ``optimizer``: ``sgd``, ``sgd-momentum``, ``adam``, ``adamw``, ``adagrad``, ``rmsprop``, ``adafactor``,
    an optimizer class, or an optimizer object (its class and hyper-parameters are reused).
    ``dtype``: weights and inputs in bf16/fp16/fp32; ``amp``: autocast to bf16/fp16. ``master_weights="fp32"``
    (with ``dtype="bf16"`` or ``"fp16"``): the optimizer keeps an fp32 copy of the weights and updates it (mixed
    precision as DeepSpeed and Megatron train: 2 + 2 + 12 bytes per parameter with Adam).
    ``loss_fn(output)``: the loss; by default the output's ``loss`` (a Hugging Face model given ``labels``), else
    the sum of the output — the estimate's ``loss`` says which.
    ``accumulate=K`` splits the batch into K micro-batches. ``zero=1|2|3`` or ``fsdp=True`` with ``world=N``
    give per-rank memory; ``offload`` keeps optimizer state and its step on the host.
    ``quantize="int8"|"int4"|"nf4"|"nf4-dq"``: the linear layers' weights (not the output head) in that format,
    counted from its layout and frozen; ``lora=R``: rank-R adapters on the linear layers, everything else frozen
    (``quantize="nf4", lora=16`` is QLoRA). A model already quantized (torch.ao, torchao, bitsandbytes) or made
    with PEFT is estimated as it is.
    ``device="cuda"`` models a GPU (default), ``"cpu"`` a CPU run. ``gpu`` (a name from :data:`GPUS`) or
    ``budget`` (``"24GiB"``) sets the capacity for the fit verdict. ``what_if`` adds the strategy table;
    ``max_batch`` (``max_seq``) searches the largest batch (sequence length, dimension 1
    of the inputs) that fits (needs ``gpu`` or ``budget``); ``progress`` receives a line per trial.
    """
    opts = make_options(optimizer=optimizer, inference=inference, dtype=dtype, amp=amp, master_weights=master_weights,
                        checkpointing=checkpointing, accumulate=accumulate, zero=zero, fsdp=fsdp, world=world,
                        offload=offload, device=device, steps=steps, quantize=quantize, lora=lora)
    target = make_target(gpu, budget, cuda)
    if (max_batch or max_seq) and target.capacity is None:
        raise ValueError("max_batch/max_seq need a capacity: give gpu='A100-80GB' (or another known GPU) or "
                         "budget='24GiB'")
    from .fake import check_inputs

    check_inputs(inputs)
    request = Request(model, inputs, loss_fn)
    est = evaluate(request, opts, target)
    est = _with(est, rerun=(request, target))
    if max_batch:
        est = _with(est, max_batch=find_max_batch(est, progress=progress))
    if max_seq:
        est = _with(est, max_seq=find_max_batch(est, dim=1, progress=progress))
    if what_if:
        from .strategies import what_if as _what_if

        est = _with(est, strategies=tuple(_what_if(est)))
    return est


def find_max_batch(est: Estimate, *, dim: int = 0, progress: Callable[[str], None] | None = None) -> int:
    """The largest batch (``dim=0``) or sequence length (``dim=1``) whose step fits the estimate's
    capacity, by doubling and bisection on fake runs."""
    if est.rerun is None or est.options is None:
        raise ValueError("this estimate cannot be re-run (it was not made by vram_magic.estimate)")
    request, target = est.rerun
    if target.capacity is None:
        raise ValueError("a capacity is needed: estimate with gpu='…' or budget='…'")
    start = est.batch if dim == 0 else est.seq
    if start is None:
        raise ValueError(f"the inputs have no dimension {dim} to grow")
    key = "batch" if dim == 0 else "seq"

    def fits(n: int) -> bool:
        opts = est.options.with_(**{key: n})  # type: ignore[union-attr]
        try:
            e = evaluate(request, opts, target)
        except EstimateError:
            return False
        return bool(e.fits)

    best, _ = search_max(fits, start, progress=progress)
    return best


def _with(est: Estimate, **changes: Any) -> Estimate:
    from dataclasses import replace

    return replace(est, **changes)

__all__ = ["GPU", "GPUS", "CudaModel", "Estimate", "EstimateError", "Strategy", "Target", "estimate",
           "find_gpu", "find_max_batch", "make_target", "search_max"]
