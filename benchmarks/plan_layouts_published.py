"""Published multi-GPU runs beside the layout planner's prediction for the layout they ran (issue 32): the memory of
that layout on one rank, estimated exactly on the whole model (what ``estimate(**row.options)`` gives), and its step
time with the planner's overlap per collective (``timing/overlap.py``): FSDP's prefetched all-gathers and
reduce-scatters hidden behind the blocks' compute, DDP's and HSDP's buckets behind the backward, tensor- and
pipeline-parallel communication exposed. Each run is the combination the source states, scored by
``LayoutPlanner.exact`` (no search); the sources are in ``/work/shared/research/planning.md``. Run::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/plan_layouts_published.py [--only tt-a100,fms-13b]

Prints, per run: tokens/s per GPU published and predicted and their ratio (above 1: too optimistic), the memory
predicted (and published where stated), and each collective's seconds and the part of it left exposed.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from vram_magic.estimator.device import make_target
from vram_magic.estimator.device.gpus import find_gpu
from vram_magic.estimator.fake.frameworks import fake_run
from vram_magic.estimator.fake.request import Request
from vram_magic.estimator.options import make_options
from vram_magic.estimator.planning.choices import Choice
from vram_magic.estimator.planning.depth import survey
from vram_magic.estimator.planning.layout_planner import LayoutPlanner
from vram_magic.estimator.timing.step_time import network_for

#: torchtitan's H100s: "96 GB HBM2e, 2.4 TB/s, 500 W" (benchmarks/plan_published.py's entry)
H100_96 = replace(find_gpu("H100-80GB"), name="H100 96GB HBM2e", memory=96 * 10**9, bandwidth=2400e9, aliases=())


def llama(layers: int, hidden: int, ffn: int, heads: int, kv: int, vocab: int) -> Any:
    def build() -> torch.nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                                            num_hidden_layers=layers, num_attention_heads=heads,
                                            num_key_value_heads=kv, tie_word_embeddings=False))

    build.__name__ = f"llama_{layers}x{hidden}"
    return build


LLAMA3_8B = llama(32, 4096, 14336, 32, 8, 128256)
LLAMA2_7B = llama(32, 4096, 11008, 32, 32, 32000)
LLAMA2_13B = llama(40, 5120, 13824, 40, 40, 32000)
BF16 = torch.bfloat16


@dataclass(frozen=True)
class Run:
    key: str
    what: str
    source: str
    build: Any
    seq: int
    vocab: int
    gpu: Any
    gpus: int
    interconnect: Any
    choice: dict[str, Any]  # Choice's fields
    published: float  # tokens/s per GPU
    memory: str = "not stated"


RUNS = [
    Run("tt-a100", "torchtitan Llama 3 8B, 64 × A100-80GB, FSDP2 (bf16 params, fp32 reduce), 1 × 8192, op SAC",
        "pytorch/torchtitan docs/performance.md @04133643: 2,973 tokens/s per GPU (network not stated: 200 Gb/s IB "
        "per GPU assumed)", LLAMA3_8B, 8192, 128256, "A100-80GB", 64, "infiniband-200g",
        dict(micro=1, accumulate=1, checkpointing="ops", zero=3, param_dtype=BF16), 2973),
    Run("tt-h100", "torchtitan Llama 3 8B, 8 × H100 96 GB, FSDP2 (bf16 params, fp32 reduce), 2 × 8192, op SAC",
        "pytorch/torchtitan docs/performance.md @d4c86e37 (table 1): 5,762 tokens/s per GPU, 82.4 GiB reserved",
        LLAMA3_8B, 8192, 128256, H100_96, 8, None,
        dict(micro=2, accumulate=1, checkpointing="ops", zero=3, param_dtype=BF16), 5762, "82.4 GiB"),
    Run("fms-7b", "fms-fsdp Llama 2 7B, 128 × A100-80GB, HSDP (8 a host × 16), 2 × 4096, no AC, bf16",
        "foundation-model-stack/fms-fsdp README @3b1ce15f: 4,550 tokens/s per GPU (with torch.compile, not "
        "modelled; 400 Gb/s)", LLAMA2_7B, 4096, 32000, "A100-80GB", 128, "infiniband-400g",
        dict(micro=2, accumulate=1, checkpointing=False, zero=3, param_dtype=BF16, replicas=16), 4550),
    Run("fms-13b", "fms-fsdp Llama 2 13B, 128 × A100-80GB, HSDP (8 a host × 16), 1 × 4096, no AC, bf16",
        "foundation-model-stack/fms-fsdp README @0d319983, scripts/13b.sh @2fdced76: 1,700 tokens/s per GPU (network "
        "not stated: 400 Gb/s assumed)", LLAMA2_13B, 4096, 32000, "A100-80GB", 128, "infiniband-400g",
        dict(micro=1, accumulate=1, checkpointing=False, zero=3, param_dtype=BF16, replicas=16), 1700),
]


def predict(run: Run) -> None:
    t0, c0 = time.perf_counter(), time.process_time()
    target = make_target(run.gpu)
    gpu = target.gpu
    base = make_options(device="cuda")
    ids = torch.randint(0, run.vocab, (1, run.seq))
    request = Request(run.build, {"input_ids": ids, "labels": ids}, None, name=run.key)
    with fake_run() as mode:
        found = survey(request, mode, base.dtype)
    net = network_for(gpu, run.gpus, run.interconnect)
    planner = LayoutPlanner(request, base, target, run.gpus, net, 8, found, run.seq, None)
    fields = dict(run.choice)
    micro, acc = fields.pop("micro"), fields.pop("accumulate")
    ck, zero = fields.pop("checkpointing"), fields.pop("zero")
    dp = run.gpus
    c = Choice(micro, acc, ck, zero, False, None, None, None, None, micro * acc * dp, **fields)
    est, t = planner.exact(c)
    tokens = micro * acc * run.seq / t.total if t.total > 0 else 0.0
    print(f"{run.key}: {run.what}\n   source: {run.source}\n   predicted {tokens:,.0f} tokens/s per GPU against "
          f"{run.published:,} published: {tokens / run.published:.2f}; memory {est.needed / 2**30:.1f} GiB "
          f"(published: {run.memory}); step {t.total:.2f} s = compute {t.compute:.2f} + memory {t.memory:.2f} + "
          f"recompute {t.recompute:.2f} + optimizer {t.optimizer:.2f} + exposed collectives {t.collectives:.2f}",
          flush=True)
    for col in planner.comms.get(c, ()):
        print(f"   {col.text()}", flush=True)
    for what, why in planner.failures.items():
        print(f"   failed: {what}: {why[:200]}")
    print(f"   ({time.perf_counter() - t0:.0f} s wall, {time.process_time() - c0:.0f} s CPU)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(r.key for r in RUNS))
    args = parser.parse_args()
    import transformers  # noqa: F401

    keys = args.only.split(",")
    for run in RUNS:
        if run.key in keys:
            predict(run)


if __name__ == "__main__":
    main()
