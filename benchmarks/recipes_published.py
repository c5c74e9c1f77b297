"""The recipes' levers beside published GPU memory figures: each setup as its source states it, built as a transformers
model from its config (nothing real is allocated: the estimator traces it on fake tensors, modelling CUDA), estimated
with the options that name the same levers, and set beside the published figure with their ratio (estimate ÷
published: above 1 the estimate says more than the GPU held). Nothing here ran on a GPU: the published figure is the
measurement. Run::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/recipes_published.py [--markdown] [--only tt-8b-full,vit]

Which of the estimate's figures is compared says what the source measured: torchtune's and torchtitan's logs read
PyTorch's allocator (``peak_memory_active`` / ``_alloc`` / ``_reserved``; torchtitan prints the most reserved), which
counts neither the CUDA context nor bitsandbytes' paged state (CUDA managed memory); the estimate's allocated peak
(``est.peak``) and reserved memory (``est.reserved``) are the same two kinds of figure. Where a source does not say
which it printed, both are shown. Each case's ``gap`` says what the difference comes from, as far as it is known.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

import vram_magic
from vram_magic.estimator.device.gpus import find_gpu

GiB = 1024**3
GB = 10**9


# --- the models, from their published configs ----------------------------------------------------------------------
def llama3_1_8b() -> torch.nn.Module:
    """Llama 3.1 8B (torchtune's ``llama3_1_8b``, torchtitan's ``llama3_8b``): dim 4096, 32 layers, 32 heads over 8 KV
    heads, FFN 14336, vocabulary 128256, untied output head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=False))


def llama3_2_3b() -> torch.nn.Module:
    """Llama 3.2 3B (torchtune's ``llama3_2_3b``): dim 3072, 28 layers, 24 heads over 8 KV heads, FFN 8192, vocabulary
    128256, the output head tied to the embedding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
        num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=True))


def vit_l_16() -> torch.nn.Module:
    """ViT-L/16 at 224 × 224 for 1,000 classes (torchvision's ``vit_l_16``: 24 layers, hidden 1024, 16 heads, MLP
    4096), as transformers' ViTForImageClassification (torchvision cannot be imported beside the CPU torch here)."""
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(
        hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096, image_size=224,
        patch_size=16, num_labels=1000, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def tokens(batch: int, seq: int, vocab: int = 128256) -> Callable[[], dict[str, torch.Tensor]]:
    def make() -> dict[str, torch.Tensor]:
        ids = torch.randint(0, vocab, (batch, seq))
        return {"input_ids": ids, "labels": ids}

    return make


def image() -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.rand(1, 3, 224, 224)}


def logits_sum(out: Any) -> torch.Tensor:  # the tutorial's loss: model(fake_image).sum()
    return out.logits.sum()


#: torchtitan's H100s: "96 GB HBM2e, 2.4 TB/s, 500 W" (the SXM5 entry otherwise)
H100_96 = replace(find_gpu("H100-80GB"), name="H100 96GB HBM2e", memory=96 * 10**9, bandwidth=2400e9, aliases=())

#: torchtune's single-device recipes: bf16 weights, the loss a chunk of the sequence at a time, the output freed
TUNE = {"dtype": "bf16", "loss_chunks": 8, "keep_output": False}


@dataclass(frozen=True)
class Case:
    key: str
    source: str  # where the figure is published, with the commit or version read
    setup: str  # the setup as the source states it
    published: float  # bytes
    unit: str  # "GiB" or "GB" as the source writes it
    kind: str  # what the source measured: "active" (allocated), "reserved", "not stated", "state"
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[], Any]
    options: dict[str, Any]
    gap: str  # what the difference comes from, as far as it is known
    measure: str = "peak"  # "peak" (est.peak), "reserved" (est.reserved) or "state ratio"
    after: str = ""  # the case this one adds a lever to: what the lever saves, published and estimated


def _cases() -> list[Case]:
    tt = "pytorch/torchtune README.md (@30b8519e, Sep 2024; configs read at that commit)"
    tt32 = "pytorch/torchtune README.md 'Optimization flags' (@bd2a0fc7)"
    full8b = dict(TUNE, optimizer="paged_adamw8bit", optimizer_in_backward=True, checkpointing=True)
    lora8b = dict(TUNE, lora=8, checkpointing=True)
    cases = [
        Case("tt-8b-full-4090", tt, "Llama 3.1 8B full fine-tune, 1 × RTX 4090, batch 2 × 2048 (packed), compile on; "
             "8B_full_single_device: bf16, PagedAdamW8bit, optimizer in backward, activation checkpointing, "
             "CEWithChunkedOutputLoss (8 chunks)", 18.9 * GiB, "GiB", "not stated", llama3_1_8b, tokens(2, 2048),
             dict(full8b, gpu="RTX-4090"),
             "which figure the README prints (active, allocated or reserved) is not said; compile is on there, the "
             "estimate is eager; CEWithChunkedOutputLoss has the model make every chunk's bf16 logits (1.0 GiB here, "
             "alive until the loss ends) where loss_chunks models LinearCrossEntropyLoss (one chunk's at a time): "
             "that difference goes the other way"),
        Case("tt-8b-full-a6000", tt, "the same model and batch on 1 × RTX A6000 (48 GB); the README states no other "
             "setting: estimated with the same config", 37.4 * GiB, "GiB", "not stated", llama3_1_8b,
             tokens(2, 2048), dict(full8b, gpu="RTX-A6000"),
             "the README does not say which levers the A6000 run turned off; with the config's levers the step needs "
             "what the 4090 row needs, so the run used fewer of them (the 'no checkpointing' row below)"),
        Case("tt-8b-full-a6000-noac", tt, "the A6000 row with activation checkpointing off (a guess at its setup)",
             37.4 * GiB, "GiB", "not stated", llama3_1_8b, tokens(2, 2048),
             dict(full8b, checkpointing=False, gpu="RTX-A6000"), "a guess: the setup is not published"),
        Case("tt-8b-lora-4090", tt, "Llama 3.1 8B LoRA, 1 × RTX 4090, batch 2 × 2048, compile on; "
             "8B_lora_single_device: rank 8 on q and v, bf16, AdamW, activation checkpointing, chunked loss",
             16.2 * GiB, "GiB", "not stated", llama3_1_8b, tokens(2, 2048), dict(lora8b, gpu="RTX-4090"),
             "lora=8 puts adapters on every linear layer (q and v only in the config): a few MiB more; which figure "
             "the README prints is not said"),
        Case("tt-8b-qlora-4090", tt, "Llama 3.1 8B QLoRA, 1 × RTX 4090, batch 2 × 2048, compile on; "
             "8B_qlora_single_device: NF4 base, rank 8 on q, k, v, output and the MLP, AdamW, activation "
             "checkpointing, chunked loss", 7.4 * GiB, "GiB", "not stated", llama3_1_8b, tokens(2, 2048),
             dict(lora8b, quantize="nf4", gpu="RTX-4090"),
             "the estimate keeps the adapters, their gradients and AdamW's state in fp32 on a quantized base "
             "(PEFT's rule; torchtune keeps them bf16); torchtune's NF4 tensors (torchao) against bitsandbytes' "
             "layout; the output head and embeddings stay bf16 in both"),
        *_torchtune_3b(tt32),
        Case("vit-plain", "pytorch/tutorials intermediate_source/optimizer_step_in_backward_tutorial.py (@2a488705)",
             "ViT-L/16, batch 1 × 3 × 224 × 224, fp32, torch.optim.Adam (foreach on CUDA), loss = output.sum(); "
             "'~6GB of peak memory' in the optimizer step (read from the memory snapshot)", 6 * GB, "GB",
             "allocated", vit_l_16, image,
             dict(optimizer="adam", loss_fn=logits_sum, keep_output=False, gpu="A100-80GB"),
             "the tutorial's '~6GB' is read by eye from its snapshot ('~1.2GB of parameters' is 304 M × 4 B = 1.22 GB: "
             "decimal GB); transformers' ViT against torchvision's (the same parameters and matmuls)"),
        Case("vit-in-backward", "the same tutorial", "the same with one Adam(foreach=False) per parameter stepped in "
             "a post-accumulate-grad hook: 'now ~4GB'", 4 * GB, "GB", "allocated", vit_l_16, image,
             dict(optimizer="adam", optimizer_in_backward=True, loss_fn=logits_sum, keep_output=False,
                  gpu="A100-80GB"),
             "read by eye, as above: the tutorial explains ~3.6 GB of model states plus ~0.4 GB of activations",
             after="vit-plain"),
        Case("bnb-8bit-state", "bitsandbytes docs (v0.50.1, '8-bit optimizers'): '75% less GPU memory' for the "
             "optimizer", "8-bit AdamW's state against 32-bit AdamW's, Llama 3.1 8B with fp32 weights", 0.75, "",
             "state", llama3_1_8b, tokens(1, 512), dict(optimizer="adamw8bit", gpu="A100-80GB"),
             "the estimate's state: uint8 moments and an fp32 scale per block of 256 (2 + 8/256 bytes a weight, "
             "against 8); tensors under 4,096 elements stay 32-bit (the norms)", measure="state ratio"),
        Case("titan-fsdp", "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, table 1 (@b5bcd76c)",
             "Llama 3.1 8B, FSDP over 8 × H100 96 GB, local batch 2 × 8192, bf16 parameters with fp32 reduction, "
             "AdamW, selective activation checkpointing ('op'), no compile; the most any rank reserved",
             82.4 * GiB, "GiB", "reserved", llama3_1_8b, tokens(2, 8192),
             dict(zero=3, world=8, param_dtype="bf16", checkpointing="ops", gpu=H100_96),
             "FSDP2's streams (its all-gathers and reduce-scatters on streams of their own, which the caching "
             "allocator pools apart) are not modelled; the 'op' policy as torchtitan writes it", measure="reserved"),
        Case("titan-float8", "the same table", "+ torch.compile + Float8 (the table's third row; its second, compile "
             "alone, is 77.0 GiB)", 76.8 * GiB, "GiB", "reserved", llama3_1_8b, tokens(2, 8192),
             dict(zero=3, world=8, param_dtype="bf16", checkpointing="ops", float8=True, gpu=H100_96),
             "compile is not modelled: eager float8 adds the casts' high-precision temporaries (the published "
             "float8 row is 0.2 GiB below compile alone)", measure="reserved"),
    ]
    return cases


def _torchtune_3b(source: str) -> list[Case]:
    """torchtune's 'Optimization flags' table: Llama 3.2 3B, full_finetune_single_device, batch 2 × 4096, bf16, one
    A100, "Peak Memory Active"; each technique added to the row before (its unpacked baseline is left out: its
    sequences' lengths are the dataset's). The full fine-tune's optimizer is ``torch.optim.AdamW`` as the README's
    command names it (foreach on CUDA); the LoRA rows run the 3B LoRA configs (rank 64 on q, v, the attention's output
    and the MLP, ``AdamW(fused=True)``), without the optimizer in backward or 8-bit AdamW."""
    a100 = {"dtype": "bf16", "gpu": "A100-80GB"}
    chunked = dict(a100, loss_chunks=8, keep_output=False)
    ac = dict(chunked, checkpointing=True)
    inbwd = dict(ac, optimizer_in_backward=True)
    offload = dict(inbwd, offload_activations=True)
    fused = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], fused=True)  # its class and settings are read
    lora = dict(ac, offload_activations=True, lora=64, optimizer=fused)
    eager = "eager against compiled: compile fuses the blocks' pointwise ops (fewer saved tensors) and the loss"

    def row(key: str, setup: str, gib: float, options: dict[str, Any], gap: str, after: str = "") -> Case:
        return Case(key, source, setup, gib * GiB, "GiB", "active", llama3_2_3b, tokens(2, 4096), options, gap,
                    after=after)

    return [
        row("tt-3b-packed", "Llama 3.2 3B full fine-tune, 1 × A100, batch 2 × 4096 packed, bf16, AdamW, no "
            "checkpointing, the whole batch's logits", 60.0, a100,
            "the whole batch's logits, bf16 and their fp32 upcast (3.9 GiB), alive at once, as the model's own loss"),
        row("tt-3b-compile", "+ torch.compile (model and loss)", 51.0, a100,
            "torch.compile is not modelled: the estimate is the eager step's (the row above)", "tt-3b-packed"),
        row("tt-3b-chunked", "+ chunked cross-entropy (8 chunks)", 42.9, chunked, eager, "tt-3b-compile"),
        row("tt-3b-ac", "+ activation checkpointing", 24.9, ac,
            "the estimate's peak is the optimizer step with foreach AdamW's parameter-sized temporaries (6.0 GiB of "
            "'other'); the published figure is about the model states alone (24 GiB) plus 0.9 GiB, as if the update "
            "made none (the fused AdamW row below): not resolved", "tt-3b-chunked"),
        row("tt-3b-ac-fused", "the same with AdamW(fused=True) (a guess at why the published row has no foreach "
            "temporaries)", 24.9, dict(ac, optimizer=fused), "a guess: the README's command names torch.optim.AdamW"),
        row("tt-3b-inbwd", "+ optimizer step fused into backward", 23.1, inbwd,
            "its saving counts the foreach temporaries of the row before (against the fused row it saves 0.8 GiB); "
            + eager, "tt-3b-ac"),
        row("tt-3b-offload", "+ activation offloading", 21.8, offload,
            "torchtune's recipe offloads inside the model's forward only: the loss's saved tensors (the chunks' fp32 "
            "log-probabilities, 3.9 GiB here) stay on the GPU, where the lever (save_on_cpu around the forward and "
            "the loss) moves them too; OffloadActivations also keeps tensors under 1 KiB on the GPU", "tt-3b-inbwd"),
        row("tt-3b-8bit", "+ 8-bit AdamW", 17.6, dict(offload, optimizer="adamw8bit"),
            "which 8-bit AdamW is not said (bitsandbytes' or torchao's, paged or not): taken as bitsandbytes' "
            "AdamW8bit, not paged; the estimate saves its 2 bytes a weight of bf16 state (4 → 2)", "tt-3b-offload"),
        row("tt-3b-lora", "LoRA: packed, compile, chunked loss, checkpointing, offloading; rank 64, AdamW(fused=True), "
            "no optimizer in backward", 8.5, lora, "rank 64 on every linear layer (the config: q, v, the attention's "
            "output and the MLP; k left out): 2 % more adapter weights"),
        row("tt-3b-qlora", "QLoRA: the same on an NF4 base (the README's reproduction command)", 4.6,
            dict(lora, quantize="nf4"), "the estimate keeps the adapters, their gradients and AdamW's state in fp32 "
            "on a quantized base (PEFT's rule; torchtune keeps them bf16: 0.7 GiB here); torchtune's NF4 tensors "
            "(torchao) against bitsandbytes' layout; " + eager, "tt-3b-lora"),
    ]


def estimate_case(c: Case) -> tuple[float, Any, float]:
    """``(the estimate's figure to compare, the estimate, seconds)``."""
    t0 = time.perf_counter()
    est = vram_magic.estimate(c.build, c.inputs, **c.options)
    if c.measure == "state ratio":
        plain = vram_magic.estimate(c.build, c.inputs, **dict(c.options, optimizer="adamw"))
        figure = 1 - est.peak["optimizer_state"] / plain.peak["optimizer_state"]
    else:
        figure = float(est.reserved if c.measure == "reserved" else est.peak.total)
    return figure, est, time.perf_counter() - t0


def shown(x: float, c: Case) -> str:
    if c.measure == "state ratio":
        return f"{100 * x:.1f} % less"
    return f"{x / (GB if c.unit == 'GB' else GiB):.1f} {c.unit or 'GiB'}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="comma-separated case keys (prefixes)")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown as well")
    args = p.parse_args()
    keys = [k for k in args.only.split(",") if k]
    cases = [c for c in _cases() if not keys or any(c.key.startswith(k) for k in keys)]
    done: dict[str, tuple[Case, float]] = {}
    rows = []
    for c in cases:
        figure, est, seconds = estimate_case(c)
        done[c.key] = (c, figure)
        ratio = figure / c.published
        also = f"reserved {shown(est.reserved, c)}" if c.measure == "peak" else ""
        saves = ""
        if c.after in done:
            before, was = done[c.after]
            saves = (f"saves {shown(was - figure, c)} (published {shown(before.published - c.published, c)})")
        rows.append((c, figure, ratio, also, saves))
        print(f"{c.key}: {c.setup}\n  published {shown(c.published, c)} ({c.kind}; {c.source})\n"
              f"  estimated {shown(figure, c)}" + (f" ({also})" if also else "") + f", ratio {ratio:.2f}"
              + (f"; {saves}" if saves else "") + f"; {seconds:.0f} s\n  parts: "
              + ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in est.peak.items() if v)
              + (f"; paged {est.paged / GiB:.2f} GiB" if getattr(est, "paged", 0) else "")
              + (f"; PARTIAL: {est.problem}" if est.partial else "") + f"\n  gap: {c.gap}", flush=True)
    if args.markdown:
        print("\n| case | published | estimated | ÷ published | the lever saves, estimated (published) | also |")
        print("|---|---:|---:|---:|---|---|")
        for c, figure, ratio, also, saves in rows:
            print(f"| {c.key} | {shown(c.published, c)} ({c.kind}) | {shown(figure, c)} | {ratio:.2f} | "
                  f"{saves.removeprefix('saves ')} | {also} |")


if __name__ == "__main__":
    main()
