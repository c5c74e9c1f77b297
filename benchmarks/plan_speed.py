"""How long a plan takes: (a) a small model's, for a GPU and for this CPU (target ≤ 5 s each), and (b) a
Llama-3-8B-shaped full fine-tune on 8 × A100-80GB, global batch 64 × 4,096 tokens, scoring ≥ 100 combinations
(target ≤ 60 s). The models are builders (transformers models made from configs), so the estimator traces them on
fake tensors: nothing of the 8B model is allocated. Run::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/plan_speed.py [--only small,8b] [--top 10]

Prints each plan's wall time, the combinations it scored, how many of them were estimated exactly, the fake runs it
made (``Plan.traced``) and the rows that fit. On a shared machine the wall time counts other processes' turns on
the cores: the process's CPU time (``time.process_time``) is printed beside it. Both include the first trace of a
model (building it on the meta device; transformers' imports, its model classes' modules too, are paid before, as a
notebook that builds the model has) and, for the CPU plan, this machine's profile (measured once per process, about
0.5 s). The CPU plan runs first: it pays the estimator's own first imports (TorchDynamo's, which fake tensors load,
about 0.35 s), so the T4 plan after it does not.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

import vram_magic


def small_gpt2() -> torch.nn.Module:
    """A small GPT-2 (4 layers of width 256, 4 heads, vocabulary 8,000, context 256)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8000, n_positions=256))


def llama3_8b() -> torch.nn.Module:
    """Llama 3 8B's published shape (its config.json: 32 layers of width 4,096, 32 heads over 8 key/value heads, FFN
    14,336, vocabulary 128,256, rope θ 500,000, untied embeddings)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False))


def lm_batch(batch: int, seq: int, vocab: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (batch, seq))
    return {"input_ids": ids, "labels": ids}


def timed(title: str, target: str, **kwargs: Any) -> tuple[float, Any]:
    t0, c0 = time.perf_counter(), time.process_time()
    plan = vram_magic.plan(**kwargs)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    exact = sum(s.exact for s in plan.scored)
    best = plan.best
    print(f"{title}: {seconds:.1f} s wall, {cpu:.1f} s of this process's CPU (target ≤ {target}); "
          f"{len(plan.scored)} combinations scored ({plan.bounded} more bounded untraced), {exact} estimated exactly, "
          f"{plan.traced} fake runs, "
          f"{len(plan.rows)} rows that fit", flush=True)
    for note in plan.notes:
        print(f"  note: {note}", flush=True)
    if best is not None:
        print(f"  fastest: {best.name}: {best.step_time * 1e3:,.1f} ms a step, {best.throughput:,.0f} {plan.unit}, "
              f"needs {best.needed / 2**30:.2f} GiB of {plan.capacity / 2**30:.1f} GiB", flush=True)
    return seconds, plan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="small,8b", help="small, 8b or both (comma-separated)")
    ap.add_argument("--top", type=int, default=10, help="rows each plan shows (each an exact estimate)")
    args = ap.parse_args(argv)
    which = {w.strip() for w in args.only.split(",")}
    # transformers' imports, several seconds, are not the planner's: its GPT-2 and Llama modules load on first use
    import transformers.models.gpt2.modeling_gpt2  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)", flush=True)
    if "small" in which:
        timed("small GPT-2 (4 x 256), batch 8 x 256, this CPU, budget 1 GiB", "5 s", model=small_gpt2,
              inputs=lm_batch(8, 256, 8000), device="cpu", budget="1GiB", top=args.top)
        timed("small GPT-2 (4 x 256), batch 8 x 256, one T4", "5 s", model=small_gpt2,
              inputs=lm_batch(8, 256, 8000), gpu="T4", top=args.top)
    if "8b" in which:
        seconds, plan = timed("Llama-3-8B full fine-tune, 8 x A100-80GB, global batch 64 x 4096", "60 s",
                              model=llama3_8b, inputs=lm_batch(8, 4096, 128256), gpu="A100-80GB", gpus=8,
                              global_batch=64, top=args.top)
        print(f"  ≥ 100 combinations: {'yes' if len(plan.scored) >= 100 else 'NO'} ({len(plan.scored)}); "
              f"≤ 60 s of wall time: {'yes' if seconds <= 60 else 'NO'}", flush=True)
        for i, r in enumerate(plan.rows[:5]):
            print(f"  {i}. {r.name}: {r.step_time:.2f} s a step, {r.throughput:,.0f} tokens/s, "
                  f"{r.needed / 2**30:.1f} GiB", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
