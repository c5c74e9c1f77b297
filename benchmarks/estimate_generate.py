"""Text generation estimates at scale, on this machine (no GPU), beside the published calculators. Run::

    .venv/bin/python benchmarks/estimate_generate.py            # 1 and 2 (about a minute)
    .venv/bin/python benchmarks/estimate_generate.py --table    # 3 as well (7B/8B/70B × T4, L4, A100, H100)
    .venv/bin/python benchmarks/estimate_generate.py --cases    # 4: the tiny CPU cases against real generate()

1. A Llama-3-8B-shaped config (32 layers, hidden 4096, 32 heads, 8 kv heads, head dim 128, intermediate 14336,
   vocabulary 128256), bf16, a 4,096-token prompt, 256 new tokens, modelled for CUDA: the time and the
   process's peak RSS, the KV cache against the bytes by hand (128 KiB per token) and the parameters
   against Llama-3-8B's 8,030,261,248.
2. The longest prompt for that model that fits an A100-80GB with 256 new tokens (``max_seq``): the search's
   runs, their time, and that the answer fits and 1.1× it does not.
3. 7B (Llama-2 shape, MHA), 8B (Llama-3 shape, GQA) and 70B (Llama-3 shape, nf4 weights) on T4, L4, A100-80GB
   and H100: the longest prompt (batch 1) and the largest batch (2,048-token prompts) with 256 new tokens, by
   vram_magic and by the formulas of accelerate's ``estimate-memory``, gpu_poor and vLLM's KV budget
   (see the functions below for each one's formula and where it comes from).
4. The CPU cases of ``tests/support/generate_zoo.py`` against the profiler on real ``generate()`` runs.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import sys
import time
import warnings
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: tests.support

import vram_magic  # noqa: E402
from vram_magic.core.units import format_bytes  # noqa: E402
from vram_magic.estimator.device.gpus import find_gpu  # noqa: E402

GiB, MiB = 1024**3, 1024**2
NEW = 256
LLAMA3_8B_PARAMS = 8_030_261_248


def _t():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


SHAPES: dict[str, dict[str, Any]] = {
    "7B": dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
               num_key_value_heads=32, head_dim=128, vocab_size=32000, max_position_embeddings=4096),
    "8B": dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
               rope_theta=500000.0),
    "70B": dict(num_hidden_layers=80, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                rope_theta=500000.0),
}


def builder(shape: str) -> Any:
    t = _t()
    config = t.LlamaConfig(**SHAPES[shape])
    cls = t.LlamaForCausalLM

    def build() -> Any:
        return cls(config)

    build.__name__ = f"llama_{shape}"
    return build


def prompt(batch: int, length: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(0))


def part1() -> Any:
    build = builder("8B")
    t0 = time.perf_counter()
    est = vram_magic.estimate(build, prompt(1, 4096, 128256), generate=NEW, dtype="bf16", device="cuda",
                              gpu="A100-80GB")
    wall = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    g = est.generation
    kv_hand = 2 * 32 * 8 * 128 * 2 * (4096 + NEW - 1)  # keys and values × layers × kv heads × head dim × bf16
    print("1. Llama-3-8B shape, bf16, prompt 4096, 256 new tokens, device=cuda (A100-80GB)")
    print(f"   estimate {wall:.1f} s, peak RSS {format_bytes(rss)}; load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} CPUs")
    print(f"   KV cache per token {format_bytes(g.kv_per_token)} (by hand 128 KiB); at the end "
          f"{g.kv_cache:,} B, by hand {kv_hand:,} B ({100 * (g.kv_cache - kv_hand) / kv_hand:+.2f} %)")
    print(f"   parameters {est.parameters:,}, Llama-3-8B {LLAMA3_8B_PARAMS:,} "
          f"({100 * (est.parameters - LLAMA3_8B_PARAMS) / LLAMA3_8B_PARAMS:+.2f} %)")
    print(f"   peak {format_bytes(est.peak.total)} ({g.peak_phase}); needs {format_bytes(est.needed)}; "
          f"{est.verdict()}")
    for line in est.notes[:1]:
        print(f"   note: {line}")
    return est


def part2() -> None:
    build = builder("8B")
    trials: list[str] = []
    t0 = time.perf_counter()
    est = vram_magic.estimate(build, prompt(1, 4096, 128256), generate=NEW, dtype="bf16", device="cuda",
                              gpu="A100-80GB", max_seq=True, progress=trials.append)
    wall = time.perf_counter() - t0
    print(f"2. longest prompt for the 8B on an A100-80GB with {NEW} new tokens: {est.max_seq:,} tokens "
          f"({wall:.0f} s, {len(trials) + 1} fake runs)")
    for line in trials:
        print(f"   {line}")
    fits = [t for t in trials if t.startswith(f"prompt {est.max_seq}:")]
    above = [t for t in trials if t.split(":")[0].startswith("prompt ") and "does not fit" in t
             and int(t.split()[1].rstrip(":")) <= math.ceil(est.max_seq * 1.1)]
    print(f"   self-consistent: fits at {est.max_seq} ({'yes' if fits and 'does not' not in fits[0] else 'no'}), "
          f"not at ≤ 1.1× ({'yes' if above else 'no'})")


# --- the published formulas --------------------------------------------------------------------------------------
def params_of(shape: str) -> int:
    s = SHAPES[shape]
    h, layers, inter, vocab = s["hidden_size"], s["num_hidden_layers"], s["intermediate_size"], s["vocab_size"]
    kv = s["num_key_value_heads"] * s["head_dim"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h
    return vocab * h * 2 + layers * per_layer + h


def weight_bytes(shape: str, quant: str | None) -> float:
    """What the weights take: 2 bytes per parameter (bf16/fp16), 0.5 for nf4 (+ its block constants, 1/64)."""
    n = params_of(shape)
    return n * 2 if quant is None else n * (0.5 + 4 / 64)


def accelerate(shape: str, quant: str | None, capacity: int) -> str:
    """accelerate ``estimate-memory`` (src/accelerate/commands/estimate.py): the weights only, no KV cache and no
    activations; its docs add "up to an additional 20%" for inference. It gives no prompt or batch limit."""
    w = weight_bytes(shape, quant)
    return "weights fit: any prompt" if 1.2 * w <= capacity else "weights do not fit"


def gpu_poor(shape: str, quant: str | None, capacity: int) -> int:
    """gpu_poor (RahulSChand/gpu_poor, src/App.js, inference 'inf'): KV MiB = 2·ctx·2·2·hidden·layers / 2^20
    (hidden_size, so GQA is ignored), activations MiB = (ctx·hidden·5·2 + ctx²·heads·2) / 2^20, weights from
    vocab·h·2 + layers·(4h² + 3·inter·h) parameters × 2 bytes (÷4 for 4-bit, + 6 %), a flat 650 MiB; batch 1.
    Returns the longest context (prompt + new) whose total fits."""
    s = SHAPES[shape]
    h, layers, inter, vocab, heads = (s["hidden_size"], s["num_hidden_layers"], s["intermediate_size"],
                                      s["vocab_size"], s["num_attention_heads"])
    model_mib = (vocab * h * 2 + layers * 4 * h * h + layers * 3 * inter * h) * 2 / MiB
    if quant == "nf4":
        model_mib = model_mib / 4 * 1.06

    def total(ctx: int) -> float:
        return 8 * ctx * h * layers / MiB + (ctx * h * 10 + ctx * ctx * heads * 2) / MiB + model_mib + 650

    lo, hi = 0, 1 << 22
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if total(mid) <= capacity / MiB else (lo, mid)
    return lo


def vllm(shape: str, quant: str | None, capacity: int, prompt_len: int) -> tuple[int, int]:
    """vLLM's KV budget (vllm/v1/worker/gpu_worker.py, vllm/v1/core/kv_cache_utils.py): available = 0.92 × total −
    (weights + profiled peak activation + non-torch memory); tokens = blocks of 16 × (2·kv_heads·head_dim·2 bytes
    × layers) each. The activation and non-torch terms are measured by vLLM on the GPU: the published Llama-3.1-8B
    figures on an H100 (4.76 GiB, 0.13 GiB) stand in for every model here. Returns (longest prompt for one
    request with ``NEW`` new tokens, most concurrent requests of ``prompt_len`` + ``NEW`` tokens)."""
    s = SHAPES[shape]
    per_token = 2 * s["num_key_value_heads"] * s["head_dim"] * 2 * s["num_hidden_layers"]
    available = 0.92 * capacity - (weight_bytes(shape, quant) + 4.76 * GiB + 0.13 * GiB)
    if available <= 0:
        return 0, 0
    blocks = int(available // (16 * per_token))
    return max(blocks * 16 - NEW, 0), blocks // math.ceil((prompt_len + NEW) / 16)


GRID = [("7B", None, ("T4", "L4", "A100-80GB", "H100-80GB")), ("8B", None, ("T4", "L4", "A100-80GB", "H100-80GB")),
        ("70B", "nf4", ("A100-80GB",))]
BATCH_PROMPT = 2048


def ours(shape: str, quant: str | None, gpu: str) -> tuple[str, str]:
    dtype = "fp16" if find_gpu(gpu).capability < (8, 0) else "bf16"  # no bf16 before Ampere
    vocab = SHAPES[shape]["vocab_size"]
    build = builder(shape)
    try:
        seq = vram_magic.estimate(build, prompt(1, 4096, vocab), generate=NEW, dtype=dtype, quantize=quant,
                                  device="cuda", gpu=gpu, max_seq=True)
        longest = f"{seq.max_seq:,}" if seq.max_seq else "0 (weights do not fit)"
    except Exception as err:  # a model that cannot fit at all
        longest = f"— ({type(err).__name__})"
    batch = vram_magic.estimate(build, prompt(1, BATCH_PROMPT, vocab), generate=NEW, dtype=dtype, quantize=quant,
                                device="cuda", gpu=gpu, max_batch=True)
    return longest, f"{batch.max_batch:,}" if batch.max_batch else "0"


def part3() -> None:
    print(f"3. longest prompt (batch 1) and largest batch ({BATCH_PROMPT}-token prompts), {NEW} new tokens")
    head = (f"   {'model':<10}{'GPU':<11}{'vram_magic prompt':>18}{'batch':>7}   {'gpu_poor prompt':>16}"
            f"{'vLLM prompt':>13}{'batch':>7}   accelerate")
    print(head)
    for shape, quant, gpus in GRID:
        for gpu in gpus:
            cap = find_gpu(gpu).memory
            t0 = time.perf_counter()
            longest, batch = ours(shape, quant, gpu)
            gp = gpu_poor(shape, quant, cap)
            v_prompt, v_batch = vllm(shape, quant, cap, BATCH_PROMPT)
            name = shape + (f" {quant}" if quant else "")
            print(f"   {name:<10}{gpu:<11}{longest:>18}{batch:>7}   {max(gp - NEW, 0):>16,}{v_prompt:>13,}"
                  f"{v_batch:>7}   {accelerate(shape, quant, cap)}   ({time.perf_counter() - t0:.0f} s)", flush=True)


def part4() -> None:
    from tests.support.generate_zoo import CASES, estimate_case, real_generate

    print("4. tiny models on the CPU: estimate vs the profiler's peak of the real generate()")
    print(f"   {'case':<52}{'real':>12}{'estimate':>12}{'error':>9}{'above base':>12}{'KV real':>11}{'KV est':>11}")
    for name, case in CASES.items():
        est, real = estimate_case(case), real_generate(case)
        err = 100 * (est.peak.total - real.peak) / real.peak
        above = 100 * ((est.peak.total - real.base) - (real.peak - real.base)) / (real.peak - real.base)
        print(f"   {name:<52}{real.peak:>12,}{est.peak.total:>12,}{err:>+8.2f}%{above:>+11.2f}%"
              f"{real.kv_cache:>11,}{est.generation.kv_cache:>11,}", flush=True)
    from tests.support.generate_zoo import TupleGPT, real_tuple_generate

    torch.manual_seed(0)
    model = TupleGPT().eval()
    est = vram_magic.estimate(model, prompt(2, 64, 2000), generate=16, device="cpu")
    real = real_tuple_generate(2, 64, 16)
    err = 100 * (est.peak.total - real.peak) / real.peak
    above = 100 * ((est.peak.total - real.base) - (real.peak - real.base)) / (real.peak - real.base)
    print(f"   {'hand-written decoder, tuple cache (2 × 64 + 16)':<52}{real.peak:>12,}{est.peak.total:>12,}"
          f"{err:>+8.2f}%{above:>+11.2f}%{real.kv_cache:>11,}{est.generation.kv_cache:>11,}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table", action="store_true", help="also part 3 (minutes)")
    p.add_argument("--cases", action="store_true", help="also part 4 (real generate() runs on the CPU)")
    p.add_argument("--only", choices=("1", "2", "3", "4"), help="run one part only")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    _t()
    import transformers.modeling_utils  # noqa: F401  (imported once, as a notebook has)

    parts = [args.only] if args.only else ["1", "2"] + (["3"] if args.table else []) + (["4"] if args.cases else [])
    for part in parts:
        {"1": part1, "2": part2, "3": part3, "4": part4}[part]()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
