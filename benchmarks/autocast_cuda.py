"""What CUDA's autocast lists change in an ``amp=`` estimate for CUDA, by category, against the CPU's lists that the
fake run carried before (a transformers GPT-2 and a Llama, small configurations, AdamW, two steps).

    python benchmarks/autocast_cuda.py

Each row is one estimate made twice: with ``vram_magic.estimator.device.autocast`` (CUDA's op lists, the default)
and with the CPU's lists (its ``cuda_autocast`` hook switched off), with the categories whose bytes differ.
"""

from __future__ import annotations

import time

import torch

import vram_magic
import vram_magic.estimator.step.trace as step_trace

MiB = 2**20


def models() -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    gpt2 = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8192, n_positions=1024)
    llama = LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    return {"GPT-2 4 x 256": lambda: GPT2LMHeadModel(gpt2), "Llama 4 x 256 (GQA 8/2)": lambda: LlamaForCausalLM(llama)}


def main() -> None:
    print(f"torch {torch.__version__}; batch 4 x 512 tokens, labels = input_ids, AdamW")
    ids = torch.randint(0, 8192, (4, 512))
    cuda_lists = step_trace.cuda_autocast
    for name, build in models().items():
        for amp, gpu in (("bf16", "A100-80GB"), ("fp16", "T4")):
            got = {}
            for label, hook in (("CPU lists", lambda device, amp: None), ("CUDA lists", cuda_lists)):
                step_trace.cuda_autocast = hook
                t0 = time.perf_counter()
                try:
                    got[label] = (vram_magic.estimate(build, {"input_ids": ids, "labels": ids}, amp=amp, gpu=gpu),
                                  time.perf_counter() - t0)
                finally:
                    step_trace.cuda_autocast = cuda_lists
            before, after = got["CPU lists"][0], got["CUDA lists"][0]
            print(f"{name}, amp={amp}, {gpu}: {before.total / MiB:.1f} -> {after.total / MiB:.1f} MiB "
                  f"({got['CPU lists'][1]:.1f} s / {got['CUDA lists'][1]:.1f} s)")
            for what, x, y in (("peak", before.peak, after.peak), ("after the forward", before.after_forward,
                                                                   after.after_forward)):
                a = {f"{c}: {n}": v for c, n, v in x.detail}
                b = {f"{c}: {n}": v for c, n, v in y.detail}
                for key in sorted(set(a) | set(b)):
                    if a.get(key, 0) != b.get(key, 0):
                        print(f"    {what:17}  {key}: {a.get(key, 0) / MiB:.2f} -> {b.get(key, 0) / MiB:.2f} MiB")
            for note in after.notes:
                if note.startswith(("autocast modelled", "SDPA")):
                    print("    " + note)


if __name__ == "__main__":
    main()
