"""The planner's time model beside published GPU measurements: each configuration's setup as its source states it,
built as a transformers model from a config (nothing real is allocated: the estimator traces it on fake tensors),
estimated with the same options (``vram_magic.estimate``) and timed by the planner's own functions
(``timing/step_time.step_time(micro_ops(trace, rates), options, trace, network)``, the numbers a plan's rows carry).
Nothing here ran on a GPU: the published figure is the measurement. Run::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/plan_published.py [--markdown] [--only tt-h100,bert]

Prints, per configuration: the published throughput and the predicted one with their ratio (predicted ÷ published:
above 1 the model is too optimistic), the memory where the source states it (torchtitan prints the most any rank
reserved; the transformers guide prints NVML's "used", which includes the CUDA context it measured, 1,343 MB), where
the predicted time goes, and — to find which assumption a gap comes from — the throughput with the collectives
overlapped with compute (the planner assumes no overlap).

Selective activation checkpointing at op level (torchtitan's ``selective op`` AC) is not one of the planner's
choices. It is bracketed by two traces, no checkpointing and every block checkpointed, and mapped onto the second:
torchtitan's policy (``torchtitan/models/llama3/infra/parallelize.py``, ``_custom_policy``) saves the outputs of the
matmuls, attention and the reductions, except every second matmul, and recomputes the rest; so the mapped step is
the checkpointed step's time with its recompute replaced by the recompute of its pointwise ops and half its matmuls
(attention not recomputed). Its memory lies between the two traces'.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

import vram_magic
from vram_magic.estimator.device.gpus import GPU, find_gpu
from vram_magic.estimator.timing.cost import StepTime, time_ops
from vram_magic.estimator.timing.rates import gpu_rates
from vram_magic.estimator.timing.step_time import micro_ops, network_for, step_time
from vram_magic.estimator.tracing.oplog import ATTENTION, MATMUL, OpLog

GiB = 1024**3
MB = 1024**2  # nvidia-smi's and NVML's "MB" are MiB


# --- the models, from their configs --------------------------------------------------------------------------------
def llama3_8b() -> torch.nn.Module:
    """Llama 3 8B's shape (torchtitan's ``llama3_8b``: dim 4096, 32 layers, 32 heads, 8 KV heads, FFN 14336, vocab
    128256, rope θ 500000), as transformers' LlamaForCausalLM."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False))


def mpt_7b_shape() -> torch.nn.Module:
    """MPT-7B's shape (d_model 4096, 32 layers, 32 heads, expansion 4, vocab 50368, seq 2048, no dropout) as a GPT-2
    model: transformers' MPT runs eager attention with ALiBi (L × L scores in memory), where llm-foundry runs flash
    attention; GPT-2's learned positions and biases add 0.15 % parameters (6.659 B, MPT's count 6.649 B), the same
    matmuls. MPT's exact GELU (GPT-2's own ``gelu_new`` is a tanh formula whose ``pow`` CUDA's autocast runs in
    fp32, a chain of fp32 activations MPT does not have)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_embd=4096, n_layer=32, n_head=32, vocab_size=50368, n_positions=2048,
                                      activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def bert_large() -> torch.nn.Module:
    """bert-large-uncased for sequence classification (1024 wide, 24 layers, 16 heads, FFN 4096, vocab 30522), eager
    attention as transformers ran it then (no SDPA in BERT before 4.41)."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                        vocab_size=30522, max_position_embeddings=512, num_labels=2)
    config._attn_implementation = "eager"
    return BertForSequenceClassification(config)


def tokens(batch: int, seq: int, vocab: int) -> Callable[[], dict[str, torch.Tensor]]:
    return lambda: {"input_ids": torch.randint(0, vocab, (batch, seq)), "labels": torch.randint(0, vocab, (batch, seq))}


def classified(batch: int, seq: int) -> Callable[[], dict[str, torch.Tensor]]:
    return lambda: {"input_ids": torch.randint(100, 30000, (batch, seq)),
                    "labels": torch.zeros(batch, dtype=torch.long)}


#: torchtitan's H100s: "96 GB HBM2e, 2.4 TB/s, 500 W" (the SXM5 entry's peaks, which torchtitan's MFU uses too)
H100_96 = replace(find_gpu("H100-80GB"), name="H100 96GB HBM2e", memory=96 * 10**9, bandwidth=2400e9, aliases=())


# --- the published configurations ----------------------------------------------------------------------------------
@dataclass
class Published:
    key: str
    title: str
    setup: str  # what the source states, and how it was mapped
    source: str
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[], Any]
    options: dict[str, Any]  # estimate()'s keyword arguments
    gpu: GPU
    gpus: int
    figure: float  # published throughput per GPU (tokens/s) or of the run (samples/s)
    unit: str
    per_step: int  # tokens (per GPU) or samples in one optimizer step
    memory: float | None = None  # published memory, bytes
    memory_kind: str = ""  # "reserved" (the allocator's most reserved) or "nvml" (nvidia-smi's used)
    context: float = 0.0  # CUDA context measured in the source, bytes (NVML figures include it)
    interconnect: Any = None
    sac: bool = False  # selective (op-level) checkpointing: bracketed and mapped (module docstring)
    extra: dict[str, Any] = field(default_factory=dict)


CONFIGS = (
    Published("tt-h100", "torchtitan Llama 3 8B, 8 × H100, FSDP2, local batch 2 × 8192, selective op AC",
              "FSDP 8, bf16 params / fp32 reduce (MixedPrecisionPolicy), AdamW, seq 8192, local batch 2 (global 16), "
              "selective AC 'op', no compile, no Float8; 8 × H100 96 GB HBM2e 2.4 TB/s 500 W, NVLink. Mapped: fp32 "
              "weights under bf16 autocast with FSDP (amp='bf16', zero=3, world=8) on the H100 entry with 96 GB and "
              "2.4 TB/s",
              "pytorch/torchtitan docs/performance.md @d4c86e37 (table 1): 5,762 tokens/s per GPU, 82.4 GiB",
              llama3_8b, tokens(2, 8192, 128256), dict(amp="bf16", zero=3, world=8), H100_96, 8,
              5762, "tokens/s/GPU", 2 * 8192, memory=82.4 * GiB, memory_kind="reserved", sac=True),
    Published("tt-a100", "torchtitan Llama 3 8B, 64 × A100-80GB, FSDP2, local batch 1 × 8192, selective op AC",
              "FSDP 64, bf16 mixed precision, AdamW, seq 8192, local batch 1 (global 64), selective AC 'op', C4; the "
              "network between the 8 hosts is not stated: taken as one 200 Gb/s InfiniBand link per GPU (a DGX A100's "
              "eight HDR adapters). Mapped as above on the A100-80GB entry",
              "pytorch/torchtitan docs/performance.md @04133643: 2,973 tokens/s per GPU, MFU 58.2 %",
              llama3_8b, tokens(1, 8192, 128256), dict(amp="bf16", zero=3, world=64), find_gpu("A100-80GB"), 64,
              2973, "tokens/s/GPU", 8192, interconnect="infiniband-200g", sac=True),
    Published("mpt-a100", "llm-foundry MPT-7B, 8 × A100-80GB, FULL_SHARD, micro-batch 6 × 2, seq 2048, bf16 AMP",
              "FSDP FULL_SHARD, amp_bf16, flash attention, no AC, seq 2048, micro-batch 6 × accumulation 2 (global "
              "96), 1600 Gb/s RoCE between hosts (one host here). Mapped: the GPT-2-shaped 7B (mpt_7b_shape) with "
              "amp='bf16', zero=3, world=8, accumulate=2",
              "mosaicml/llm-foundry scripts/train/benchmarking/README.md @061f2c7c: 4,641 tokens/s per GPU, "
              "MFU 64.23 %",
              mpt_7b_shape, tokens(12, 2048, 50368), dict(amp="bf16", zero=3, world=8, accumulate=2),
              find_gpu("A100-80GB"), 8, 4641, "tokens/s/GPU", 12 * 2048),
    Published("mpt-h100", "llm-foundry MPT-7B, 8 × H100-80GB, FULL_SHARD, micro-batch 6 × 1, seq 2048, bf16 AMP",
              "as above, micro-batch 6, no accumulation (global 48), H100-80GB (SXM5)",
              "mosaicml/llm-foundry scripts/train/benchmarking/README.md @061f2c7c: 10,643 tokens/s per GPU, "
              "MFU 46.44 %",
              mpt_7b_shape, tokens(6, 2048, 50368), dict(amp="bf16", zero=3, world=8), find_gpu("H100-80GB"), 8,
              10643, "tokens/s/GPU", 6 * 2048),
    Published("bert-b4", "transformers bert-large, 1 × V100-16GB, batch 4, fp32",
              "HF Trainer defaults (its AdamW), 512 sequences of 512 tokens, 1 epoch, V100-SXM2-16GB, driver 460.91, "
              "CUDA 11.2; memory is NVML's used, with the 1,343 MB the source measured for the CUDA context",
              "huggingface/transformers docs model_memory_anatomy.md / perf_train_gpu_one: 8.86 samples/s, 14,949 MB",
              bert_large, classified(4, 512), {}, find_gpu("V100-16GB"), 1, 8.86, "samples/s", 4,
              memory=14949 * MB, memory_kind="nvml", context=1343 * MB),
    Published("bert-acc", "transformers bert-large, 1 × V100-16GB, batch 1 × 4 accumulated, fp32",
              "as above, per_device_train_batch_size=1, gradient_accumulation_steps=4",
              "transformers docs perf_train_gpu_one: 7.75 samples/s, 8,681 MB",
              bert_large, classified(4, 512), dict(accumulate=4), find_gpu("V100-16GB"), 1, 7.75, "samples/s", 4,
              memory=8681 * MB, memory_kind="nvml", context=1343 * MB),
    Published("bert-fp16", "transformers bert-large, 1 × V100-16GB, batch 4, fp16 AMP",
              "as above, batch 4, fp16=True (autocast fp16 with loss scaling; a V100 has no bf16)",
              "transformers docs perf_train_gpu_one: 18.64 samples/s, 13,939 MB",
              bert_large, classified(4, 512), dict(amp="fp16"), find_gpu("V100-16GB"), 1, 18.64, "samples/s", 4,
              memory=13939 * MB, memory_kind="nvml", context=1343 * MB),
)


# --- predicting -----------------------------------------------------------------------------------------------------
@dataclass
class Predicted:
    label: str
    time: StepTime
    memory: float  # bytes, in the published figure's kind
    fits: bool | None
    ops: int = 0  # ops in one optimizer step


def _kinds(trace: Any) -> tuple[OpLog, OpLog]:
    """The last step's recomputed ops as two logs: matmuls, and every other op but attention."""
    matmuls, others = OpLog(), OpLog()
    for stage, kind, dtype, again, flops, nbytes in trace.ops.rows(trace.ops_start):
        if again and kind != ATTENTION:
            (matmuls if kind == MATMUL else others).add(stage, kind, dtype, True, flops, nbytes)
    return matmuls, others


def op_level_sac(t: StepTime, trace: Any, rates: Any, accumulate: int) -> StepTime:
    """``t`` (every block checkpointed) with torchtitan's op-level policy's recompute in place of the whole forward's:
    the pointwise ops and every second matmul."""
    matmuls, others = _kinds(trace)
    n = max(trace.micro_steps, 1)
    again = (time_ops(others, rates).recompute + 0.5 * time_ops(matmuls, rates).recompute) / n * accumulate
    return replace(t, recompute=again)


def predict(c: Published) -> list[Predicted]:
    net = network_for(c.gpu, c.gpus, c.interconnect)
    rates = gpu_rates(c.gpu)
    out = []
    for ckpt in ((False, True) if c.sac else (False,)):
        est = vram_magic.estimate(c.build, c.inputs, gpu=c.gpu, checkpointing=ckpt, **c.options)
        trace = est.rerun.trace(est.options)
        ops = micro_ops(trace, rates)
        t = step_time(ops, est.options, trace, net)
        per_step = round(ops.ops / max(trace.micro_steps, 1) * est.options.accumulate)
        memory = (est.reserved or est.needed) + c.context if c.memory_kind == "nvml" else (est.reserved or est.needed)
        label = ("every block checkpointed" if ckpt else "no checkpointing") if c.sac else "as stated"
        out.append(Predicted(label, t, memory, est.fits, per_step))
        if ckpt:
            out.append(Predicted("op-level SAC, mapped", op_level_sac(t, trace, rates, est.options.accumulate),
                                 float("nan"), None, per_step))
    return out


def overlapped(t: StepTime) -> float:
    """The step with the collectives hidden behind the device's work (what FSDP's prefetching aims at)."""
    device = t.compute + t.memory + t.recompute
    return max(device, t.collectives) + t.optimizer + t.transfers + t.bubble


def where(t: StepTime) -> str:
    parts = [(k, v) for k, v in t.as_dict().items() if v > 0.005 * t.total]
    return ", ".join(f"{k} {100 * v / t.total:.0f} %" for k, v in parts)


def _gib(x: float) -> str:
    return "—" if x != x else f"{x / GiB:.1f} GiB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown (for docs/plan.md)")
    ap.add_argument("--only", default="", help="comma-separated keys: " + ", ".join(c.key for c in CONFIGS))
    args = ap.parse_args(argv)
    keys = {k.strip() for k in args.only.split(",") if k.strip()}
    configs = [c for c in CONFIGS if not keys or c.key in keys]
    start = time.perf_counter()
    print(f"torch {torch.__version__}; {len(configs)} published configurations, traced on fake tensors", flush=True)
    table = []
    for c in configs:
        t0 = time.perf_counter()
        for p in predict(c):
            rate = c.per_step / p.time.total
            hidden = c.per_step / overlapped(p.time)
            table.append((c, p, rate, hidden))
        print(f"  {c.key}: {time.perf_counter() - t0:.0f} s", flush=True)
    if args.markdown:
        print("\n| configuration | published | predicted | ÷ published | collectives overlapped | memory published | "
              "memory predicted | where the predicted time goes |")
        print("|---|---|---|---|---|---|---|---|")
    for c, p, rate, hidden in table:
        mem_pub = f"{c.memory / GiB:.1f} GiB ({c.memory_kind})" if c.memory else "not stated"
        fits = "" if p.fits is None or p.fits else " (does not fit)"
        mem = (_gib(p.memory) + fits) if c.memory or p.memory == p.memory else "—"
        name = f"{c.title}: {p.label}"
        figs = (f"{c.figure:,.2f} {c.unit}" if c.figure < 100 else f"{c.figure:,.0f} {c.unit}",
                f"{rate:,.2f}" if rate < 100 else f"{rate:,.0f}", f"{rate / c.figure:.2f}",
                f"{hidden / c.figure:.2f}")
        if args.markdown:
            print(f"| {name} | {figs[0]} | {figs[1]} | {figs[2]} | {figs[3]} | {mem_pub} | {mem} | "
                  f"{where(p.time)}; {p.ops:,} ops |")
        else:
            print(f"\n{name}\n  published {figs[0]}, predicted {figs[1]} (×{figs[2]}; ×{figs[3]} with the "
                  f"collectives overlapped)\n  memory: published {mem_pub}, predicted {mem}\n  step "
                  f"{p.time.total:.3f} s: {where(p.time)}; {p.ops:,} ops a step")
    if not args.markdown:
        print("\nsetups and sources:")
        for c in configs:
            print(f"  {c.key}: {c.setup}\n    {c.source}")
    print(f"\n{time.perf_counter() - start:.0f} s in all", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
