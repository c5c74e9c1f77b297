"""What a GPU needs for generate() (``est.needed`` on CUDA), split as the caching allocator's replay splits it: the
live blocks when the segments holding them peak, the free space stranded inside those segments, and the segment
holding most of it. Rows a what-if table would show side by side (the dynamic cache, the quantized cache in
int4 and int2) on a long prompt run by the math kernel (a T4), where they can differ by a block of attention
scores (docs/inference.md, "What a GPU needs").

    .venv/bin/python benchmarks/generate_needed.py           # a 4-layer Llama of width 1,024, prompt 8,192
    .venv/bin/python benchmarks/generate_needed.py --8b      # the Llama-3-8B shape, prompt 7,936 (minutes)
    .venv/bin/python benchmarks/generate_needed.py --alloc-conf max_split_size_mb:512   # blocks over 512 MiB kept whole
"""

from __future__ import annotations

import argparse
import time

import torch

import vram_magic
from vram_magic.core.units import format_bytes


def rows(config, prompt: int, new: int, alloc_conf: str | None = None) -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    ids = torch.randint(0, config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    est = vram_magic.estimate(lambda: transformers.LlamaForCausalLM(config), ids, generate=new, dtype="fp16",
                              gpu="T4", alloc_conf=alloc_conf)
    made = [("dynamic cache", est)] + [
        (f"quantized cache (int{bits})", est.rerunnable().evaluate(est.options, cache_implementation="quantized",
                                                                   cache_bits=bits)) for bits in (4, 2)]
    print(f"{config.num_hidden_layers} layers, width {config.hidden_size}, prompt {prompt}, {new} new, fp16, T4"
          f"{'' if alloc_conf is None else ', ' + alloc_conf} ({time.perf_counter() - t0:.1f} s)")
    print(f"   {'row':24} {'peak':>10} {'needed':>10} {'in use':>10} {'stranded':>10}  segment holding most of it")
    for name, e in made:
        g = e.generation
        print(f"   {name:24} {format_bytes(e.peak.total):>10} {format_bytes(e.needed):>10} "
              f"{format_bytes(g.in_use):>10} {format_bytes(g.stranded):>10}  {g.stranded_by or '-'}")


def main() -> None:
    import transformers

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--8b", dest="big", action="store_true", help="the Llama-3-8B shape instead (slow)")
    p.add_argument("--alloc-conf", help="PYTORCH_CUDA_ALLOC_CONF's settings for the estimate")
    args = p.parse_args()
    if args.big:
        config = transformers.LlamaConfig(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336,
                                          num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                          max_position_embeddings=8192, rope_theta=500000.0)
        rows(config, 7936, 256, args.alloc_conf)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=1024, intermediate_size=3584,
                                          num_attention_heads=8, num_key_value_heads=2, vocab_size=32000,
                                          max_position_embeddings=16384)
        rows(config, 8192, 8, args.alloc_conf)


if __name__ == "__main__":
    main()
