"""The 13B Llama that large runs train with FSDP on A100-80GB, estimated three ways: fp32 weights under bf16 autocast
(``amp="bf16"``: FSDP gathering fp32 parameters, autocast caching their bf16 casts through the forward), bf16 weights
(``dtype="bf16"``) and FSDP2's ``MixedPrecisionPolicy`` (``param_dtype="bf16"``: fp32 shards, bf16 all-gathers, no
autocast cache), with and without activation checkpointing; then the published fms-fsdp run beside its estimate.

Nothing is allocated: the model is transformers' ``LlamaForCausalLM`` built from Llama 2 13B's config (hidden 5120, 40
layers, 40 heads, FFN 13824, vocab 32000) on fake tensors. Run::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fsdp_precision.py [--markdown]

The published run (foundation-model-stack/fms-fsdp README.md @0d319983, scripts/13b.sh @2fdced76, its training
config ``fms_fsdp.config.training`` @00f20d5e): Llama 2 13B on 128 A100s, HSDP (sharded within each 8-GPU host,
replicated across the 16 hosts), batch 1 × 4,096 tokens a GPU, no activation checkpointing, bf16 parameters and bf16
reduction, no compile: 1,700 tokens/s per GPU. It states no memory figure; that it trained says the step fits 80 GB.

Last, torchtitan's Llama 3 8B on 64 A100s (benchmarks/plan_published.py's ``tt-a100`` row, which maps it to fp32
weights under autocast) estimated as it ran, with FSDP2's policy: the all-gathers move bf16.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch

import vram_magic
from vram_magic import format_bytes
from vram_magic.estimator.device.gpus import find_gpu
from vram_magic.estimator.timing.rates import gpu_rates
from vram_magic.estimator.timing.step_time import micro_ops, network_for, step_time

GPU = find_gpu("A100-80GB")
PUBLISHED_TOKENS_PER_GPU = 1700


def llama2_13b() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=5120, intermediate_size=13824,
                                        num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
                                        max_position_embeddings=4096, tie_word_embeddings=False))


def tokens(batch: int, seq: int = 4096) -> Any:
    def made() -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 32000, (batch, seq))
        return {"input_ids": ids, "labels": ids.clone()}

    return made


def headline(markdown: bool) -> None:
    """64 × A100-80GB, 2 × 4,096 tokens a GPU."""
    rows = []
    for label, kw in (("fp32 weights, bf16 autocast", dict(amp="bf16")),
                      ("bf16 weights", dict(dtype="bf16")),
                      ("FSDP2 MixedPrecisionPolicy (bf16 / fp32 reduce)", dict(param_dtype="bf16")),
                      ("fp32 weights, bf16 autocast + checkpointing", dict(amp="bf16", checkpointing=True)),
                      ("FSDP2 MixedPrecisionPolicy + checkpointing", dict(param_dtype="bf16", checkpointing=True))):
        t0 = time.perf_counter()
        est = vram_magic.estimate(llama2_13b, tokens(2), gpu=GPU, zero=3, world=64, **kw)
        p = est.peak
        rows.append([label, format_bytes(est.needed), "yes" if est.fits else "no", format_bytes(p["parameters"]),
                     format_bytes(p["gradients"]), format_bytes(p["optimizer_state"]), format_bytes(p["activations"]),
                     format_bytes(p["other"]), f"{time.perf_counter() - t0:.0f} s"])
    _print(["13B, 64 × A100-80GB, 2 × 4,096 tokens", "needs", "fits", "params", "grads", "optim", "activ", "other",
            "estimate took"], rows, markdown)


def published(markdown: bool) -> None:
    """fms-fsdp's 13B row: memory, and the predicted throughput beside the published one."""
    est = vram_magic.estimate(llama2_13b, tokens(1), gpu=GPU, zero=3, world=8, param_dtype="bf16", reduce_dtype="bf16")
    trace = est.rerun.trace(est.options)
    t = step_time(micro_ops(trace, gpu_rates(GPU)), est.options, trace, network_for(GPU, 8))
    predicted = 4096 / t.total
    parts = ", ".join(f"{k} {100 * v / t.total:.0f} %" for k, v in t.as_dict().items() if v)
    _print(["fms-fsdp 13B (HSDP 8, 1 × 4,096, no AC, bf16/bf16)", "needs", "fits", "tokens/s/GPU predicted",
            "published", "predicted ÷ published", "where the time goes"],
           [["FSDP2 rank of 8 (the host's shard group)", format_bytes(est.needed), "yes" if est.fits else "no",
             f"{predicted:,.0f}", f"{PUBLISHED_TOKENS_PER_GPU:,}", f"{predicted / PUBLISHED_TOKENS_PER_GPU:.2f}",
             parts]], markdown)


def torchtitan_a100(markdown: bool) -> None:
    """torchtitan's Llama 3 8B on 64 A100s (plan_published.py's ``tt-a100``) as it ran, FSDP2's MixedPrecisionPolicy
    (bf16 parameters, fp32 reduction), beside the mapping to fp32 weights under bf16 autocast."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from plan_published import llama3_8b, op_level_sac

    net = network_for(GPU, 64, "infiniband-200g")
    rows = []
    for label, kw in (("fp32 weights, bf16 autocast (the mapping)", dict(amp="bf16")),
                      ("FSDP2 MixedPrecisionPolicy (bf16 / fp32 reduce)", dict(param_dtype="bf16"))):
        est = vram_magic.estimate(llama3_8b, tokens_of(1, 8192, 128256), gpu=GPU, zero=3, world=64,
                                  checkpointing=True, **kw)
        trace = est.rerun.trace(est.options)
        rates = gpu_rates(GPU)
        t = op_level_sac(step_time(micro_ops(trace, rates), est.options, trace, net), trace, rates, 1)
        rows.append([label, f"{8192 / t.total:,.0f}", "2,973", f"{8192 / t.total / 2973:.2f}",
                     f"{t.collectives:.2f} s", format_bytes(est.needed)])
    _print(["torchtitan Llama 3 8B, 64 × A100, 1 × 8192, op SAC mapped", "tokens/s/GPU", "published", "÷ published",
            "collectives a step", "needs (every block checkpointed)"], rows, markdown)


def tokens_of(batch: int, seq: int, vocab: int) -> Any:
    def made() -> dict[str, torch.Tensor]:
        ids = torch.randint(0, vocab, (batch, seq))
        return {"input_ids": ids, "labels": ids.clone()}

    return made


def _print(head: list[str], rows: list[list[str]], markdown: bool) -> None:
    if markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        for r in [head, *rows]:
            print("  ".join(f"{c:>14}" for c in r))
    print()


if __name__ == "__main__":
    md = "--markdown" in sys.argv
    headline(md)
    published(md)
    torchtitan_a100(md)
