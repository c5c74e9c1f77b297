"""How long a layout plan across hosts takes (issue 32's targets): a Llama-3-70B-shaped full fine-tune over 64 H100s
(8 hosts of 8, InfiniBand 400 Gb/s), global batch 512 sequences of 8,192 tokens, ``allow="parallel"``: ≥ 1,000
combinations scored in ≤ 60 s; a Llama-3.1-405B-shaped one over 512 H100s in ≤ 120 s. The models are builders
(transformers models made from configs), so nothing of them is allocated: the planner traces them on fake tensors,
the screen at one and two blocks (``planning/depth.py``), the rows shown on the whole model. Run::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/plan_scale.py [--only 70b,405b] [--top 3] [--verbose]

Prints each plan's wall time and the process's CPU time, the combinations scored (and how many of them were
estimated exactly), the fake runs made, and the rows.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

import vram_magic

SHAPES: dict[str, dict[str, Any]] = {
    # Llama 3 70B's config.json
    "70b": dict(num_hidden_layers=80, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                rope_theta=500000.0, tie_word_embeddings=False),
    # Llama 3.1 405B's config.json
    "405b": dict(num_hidden_layers=126, hidden_size=16384, intermediate_size=53248, num_attention_heads=128,
                 num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                 rope_theta=500000.0, tie_word_embeddings=False),
}
RUNS = {"70b": dict(gpus=64, global_batch=512, target=60.0), "405b": dict(gpus=512, global_batch=1024, target=120.0)}


def builder(shape: str) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape])

    def build() -> torch.nn.Module:
        return LlamaForCausalLM(config)

    build.__name__ = f"llama_{shape}"
    return build


def run(shape: str, top: int, seq: int, verbose: bool = False) -> Any:
    spec = RUNS[shape]
    ids = torch.randint(0, 128256, (1, seq))
    t0, c0 = time.perf_counter(), time.process_time()

    def progress(text: str) -> None:
        print(f"   [{time.perf_counter() - t0:6.1f} s wall, {time.process_time() - c0:6.1f} s CPU] {text[:160]}",
              flush=True)

    plan = vram_magic.plan(builder(shape), {"input_ids": ids, "labels": ids}, gpu="H100-80GB", gpus=spec["gpus"],
                           global_batch=spec["global_batch"], interconnect="infiniband-400g", allow="parallel",
                           top=top, progress=progress if verbose else None)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    exact = sum(s.exact for s in plan.scored)
    print(f"{shape} over {spec['gpus']} H100s, global batch {spec['global_batch']} × {seq} tokens: {wall:.1f} s wall, "
          f"{cpu:.1f} s CPU (target ≤ {spec['target']:.0f} s); {len(plan.scored)} combinations scored "
          f"({plan.bounded} more bounded untraced), {exact} estimated exactly, {plan.traced} fake runs, "
          f"{len(plan.rows)} rows", flush=True)
    for r in plan.rows:
        print(f"   {r.name}: {r.needed / 2**30:.1f} GiB, fits {r.fits}, {r.step_time:.2f} s a step, "
              f"{r.throughput:,.0f} tokens/s", flush=True)
    for note in plan.notes:
        print(f"   note: {note[:300]}", flush=True)
    return plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="70b,405b")
    parser.add_argument("--top", type=int, default=3)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--verbose", action="store_true", help="print the plan's progress")
    args = parser.parse_args()
    import transformers  # noqa: F401  (its import is not the planner's time)

    for shape in args.only.split(","):
        run(shape, args.top, args.seq, args.verbose)


if __name__ == "__main__":
    main()
