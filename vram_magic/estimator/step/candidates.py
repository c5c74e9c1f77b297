"""The what-if table: each strategy alone and in useful combinations, its peak, the saving against the
baseline, and its price in compute — FLOPs counted on the same fake trace (checkpointing's recomputed
forward shows up as extra FLOPs; accumulation and smaller batches as extra sequential steps)."""

from __future__ import annotations

from typing import Any

import torch

from ..options import Options, optimizer_name
from ..result import Estimate, Strategy, strategies_frame
from ..tracing.quantize import NotApplicable
from .trace import EstimateError


def candidates(opts: Options, batch: int | None) -> list[tuple[str, dict[str, Any], float, str]]:
    """``(name, option changes, sequential-steps factor, note)`` worth trying from ``opts``."""
    out: list[tuple[str, dict[str, Any], float, str]] = []
    low = opts.dtype in (torch.bfloat16, torch.float16)
    if not low:
        out.append(("bf16 weights", {"dtype": torch.bfloat16}, 1, "same FLOPs, tensor cores; bf16 master weights"))
    if opts.amp is None and not low:
        out.append(("AMP bf16", {"amp": torch.bfloat16}, 1, "same FLOPs in bf16; fp32 weights kept"))
    if opts.inference:
        if batch and batch >= 2:
            out.append(("half batch", {"batch": batch // 2}, 2, "two forward passes per batch"))
        out.extend(_quantized(opts))
        return out
    if not opts.checkpointing:
        out.append(("activation checkpointing", {"checkpointing": True}, 1, "recomputes each block's forward"))
    if batch and batch >= 2 and opts.accumulate == 1:
        for k in (2, 4):
            if batch >= k:
                out.append((f"accumulate {k} micro-batches", {"accumulate": k}, k, f"{k} sequential micro-steps"))
    if batch and batch >= 2:
        out.append(("half batch", {"batch": batch // 2}, 2, "changes the optimisation (smaller batch)"))
    name = optimizer_name(opts.optimizer)
    if name in ("adam", "adamw", "Adam", "AdamW"):
        out.append(("SGD with momentum", {"optimizer": "sgd-momentum"}, 1, "one state tensor instead of two"))
        out.append(("Adafactor", {"optimizer": "adafactor"}, 1, "factored second moments"))
    if not opts.offload:
        out.append(("optimizer state offloaded", {"offload": True}, 1, "step on the host; PCIe traffic each step"))
    if not opts.zero:
        world = opts.world if opts.world > 1 else 8
        out.append((f"ZeRO-2 × {world} GPUs", {"zero": 2, "world": world}, 1, "per rank; reduce-scatter traffic"))
        out.append((f"FSDP (ZeRO-3) × {world} GPUs", {"zero": 3, "world": world}, 1,
                    "per rank; all-gathers each forward/backward"))
    out.extend(_quantized(opts))
    if not opts.checkpointing and opts.amp is None and not low:
        out.append(("AMP bf16 + checkpointing", {"amp": torch.bfloat16, "checkpointing": True}, 1, ""))
        if batch and batch >= 4:
            out.append(("bf16 + checkpointing + accumulate 4",
                        {"dtype": torch.bfloat16, "checkpointing": True, "accumulate": 4}, 4, ""))
    return out


def _quantized(opts: Options) -> list[tuple[str, dict[str, Any], float, str]]:
    """Quantized weights and adapters (quantize.py, lora.py): for inference int8 and nf4 weights; for training
    LoRA adapters on the frozen model, and QLoRA (adapters on an nf4 base)."""
    out: list[tuple[str, dict[str, Any], float, str]] = []
    if opts.inference:
        if not opts.quantize:
            out.append(("int8 weights", {"quantize": "int8"}, 1, "linear layers in int8; each dequantized for its "
                        "matmul"))
            out.append(("nf4 weights", {"quantize": "nf4"}, 1, "linear layers in 4 bits (bitsandbytes NF4)"))
        return out
    if not opts.lora:
        out.append(("LoRA r=16", {"lora": 16}, 1, "rank-16 adapters train, the model is frozen: another "
                    "fine-tuning method"))
        if not opts.quantize:
            out.append(("QLoRA: nf4 + LoRA r=16", {"quantize": "nf4", "lora": 16}, 1, "adapters on a 4-bit "
                        "frozen base; each matmul dequantizes its weight"))
    elif not opts.quantize:
        out.append((f"QLoRA: nf4 base + LoRA r={opts.lora}", {"quantize": "nf4"}, 1, "the frozen base in 4 bits; "
                    "each matmul dequantizes its weight"))
    elif opts.quantize == "nf4":
        out.append(("nf4 with double quantization", {"quantize": "nf4-dq"}, 1, "block constants in 8 bits "
                    "(QLoRA's recipe)"))
    return out


def what_if(base: Estimate) -> list[Strategy]:
    """Each candidate of :func:`candidates` estimated again by the estimate's re-run handle, after the baseline."""
    rerun = base.rerunnable()
    opts = base.options
    assert opts is not None
    per_sample = base.total_flops / max(base.batch or 1, 1)
    rows = [Strategy("baseline: " + opts.describe(), base.peak.total, base.needed, 0, 1.0, 1.0, base.fits)]
    for name, changes, steps, note in candidates(opts, base.batch):
        try:
            est = rerun.evaluate(opts.with_(**changes))
        except NotApplicable:  # quantize/LoRA rows on a model without linear layers
            continue
        except (EstimateError, ValueError, TypeError) as err:
            rows.append(Strategy(name, 0, 0, 0, float("nan"), steps, None, f"could not run: {err}"))
            continue
        compute = (est.total_flops / max(est.batch or 1, 1)) / per_sample if per_sample else 1.0
        rows.append(Strategy(name, est.peak.total, est.needed, est.needed - base.needed, compute, steps, est.fits,
                             note))
    return rows


__all__ = ["candidates", "strategies_frame", "what_if"]
