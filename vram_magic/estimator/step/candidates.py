"""The changes worth trying from a step's options, one what-if row each: each strategy alone and in useful
combinations (the table itself: ``estimator/followups/whatif.py``)."""

from __future__ import annotations

import torch

from ..options import Options, optimizer_name
from ..result import Candidate


def candidates(opts: Options, batch: int | None) -> list[Candidate]:
    """The changes worth trying from ``opts`` (the inputs' batch being ``batch``)."""
    out: list[Candidate] = []
    low = opts.dtype in (torch.bfloat16, torch.float16)
    if not low:
        out.append(Candidate("bf16 weights", {"dtype": torch.bfloat16},
                             1, "same FLOPs, tensor cores; bf16 master weights"))
    if opts.amp is None and not low:
        out.append(Candidate("AMP bf16", {"amp": torch.bfloat16}, 1, "same FLOPs in bf16; fp32 weights kept"))
    if opts.inference:
        if batch and batch >= 2:
            out.append(Candidate("half batch", {"batch": batch // 2}, 2, "two forward passes per batch"))
        out.extend(_quantized(opts))
        return out
    if not opts.checkpointing:
        out.append(Candidate("activation checkpointing", {"checkpointing": True}, 1, "recomputes each block's forward"))
    if batch and batch >= 2 and opts.accumulate == 1:
        for k in (2, 4):
            if batch >= k:
                out.append(Candidate(f"accumulate {k} micro-batches", {"accumulate": k},
                                     k, f"{k} sequential micro-steps"))
    if batch and batch >= 2:
        out.append(Candidate("half batch", {"batch": batch // 2}, 2, "changes the optimisation (smaller batch)"))
    name = optimizer_name(opts.optimizer)
    if name in ("adam", "adamw", "Adam", "AdamW"):
        out.append(Candidate("SGD with momentum", {"optimizer": "sgd-momentum"}, 1, "one state tensor instead of two"))
        out.append(Candidate("Adafactor", {"optimizer": "adafactor"}, 1, "factored second moments"))
        if opts.device == "cuda":
            out.append(Candidate("8-bit AdamW (bitsandbytes)", {"optimizer": "adamw8bit"}, 1,
                                 "AdamW's moments in 8 bits, block-wise; needs bitsandbytes on CUDA"))
    if not opts.offload:
        out.append(Candidate("optimizer state offloaded", {"offload": True},
                             1, "step on the host; PCIe traffic each step"))
    if not opts.zero:
        world = opts.world if opts.world > 1 else 8
        out.append(Candidate(f"ZeRO-2 × {world} GPUs", {"zero": 2, "world": world},
                             1, "per rank; reduce-scatter traffic"))
        out.append(Candidate(f"FSDP (ZeRO-3) × {world} GPUs", {"zero": 3, "world": world}, 1,
                    "per rank; all-gathers each forward/backward"))
    out.extend(_quantized(opts))
    if opts.step is None and not opts.optimizer_in_backward and opts.accumulate == 1 and not opts.master_weights \
            and not opts.parallel:
        out.append(Candidate("optimizer in backward", {"optimizer_in_backward": True}, 1, "each parameter steps as its "
                             "gradient is accumulated: no accumulation, no global-norm clipping"))
    if not opts.checkpointing and opts.amp is None and not low:
        out.append(Candidate("AMP bf16 + checkpointing", {"amp": torch.bfloat16, "checkpointing": True}, 1, ""))
        if batch and batch >= 4:
            out.append(Candidate("bf16 + checkpointing + accumulate 4",
                        {"dtype": torch.bfloat16, "checkpointing": True, "accumulate": 4}, 4, ""))
    if opts.step is not None or opts.optimizer_in_backward:  # the user's step settles its autocast and accumulation;
        # an optimizer in backward takes none
        banned = {"amp", "accumulate"} if opts.step is not None else {"accumulate"}
        out = [c for c in out if not banned & set(c.changes)]
    return out


def _quantized(opts: Options) -> list[Candidate]:
    """Quantized weights and adapters (estimator/fake/quantize.py, estimator/fake/lora.py): for inference int8 and nf4
    weights; for training
    LoRA adapters on the frozen model, and QLoRA (adapters on an nf4 base)."""
    out: list[Candidate] = []
    if opts.inference:
        if not opts.quantize:
            out.append(Candidate("int8 weights", {"quantize": "int8"},
                                 1, "linear layers in int8; each dequantized for its "
                        "matmul"))
            out.append(Candidate("nf4 weights", {"quantize": "nf4"}, 1, "linear layers in 4 bits (bitsandbytes NF4)"))
        return out
    if not opts.lora:
        out.append(Candidate("LoRA r=16", {"lora": 16}, 1, "rank-16 adapters train, the model is frozen: another "
                    "fine-tuning method"))
        if not opts.quantize:
            out.append(Candidate("QLoRA: nf4 + LoRA r=16", {"quantize": "nf4", "lora": 16}, 1, "adapters on a 4-bit "
                        "frozen base; each matmul dequantizes its weight"))
    elif not opts.quantize:
        out.append(Candidate(f"QLoRA: nf4 base + LoRA r={opts.lora}", {"quantize": "nf4"},
                             1, "the frozen base in 4 bits; "
                    "each matmul dequantizes its weight"))
    elif opts.quantize == "nf4":
        out.append(Candidate("nf4 with double quantization", {"quantize": "nf4-dq"}, 1, "block constants in 8 bits "
                    "(QLoRA's recipe)"))
    return out
