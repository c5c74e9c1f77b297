"""A transformer layer's activations per tensor-parallel rank, estimated, beside Megatron-LM's formula.

Megatron's "Reducing Activation Recomputation in Large Transformer Models" (Korthikanti et al., 2022, eq. 2-4)
counts the bytes one GPT layer keeps for backward in 16-bit training: ``sbh(34 + 5as/h)`` on one GPU,
``sbh(10 + 24/t + 5as/(ht))`` with tensor parallelism over t, and ``sbh/t · (34 + 5as/h)`` with sequence
parallelism too (s sequence, b micro-batch, h hidden, a heads). The estimate here is a transformers Llama's (the
suite's Llama of ``parallel_runs``: hidden 256, 4 heads, SwiGLU width 512; bf16 weights, batch 4 × 128), per layer:
the activations alive at the end of the forward of a 4-layer model less those of a 2-layer one, halved. Run::

    .venv/bin/python benchmarks/parallel_formula.py [--seq 128] [--batch 4] [--tp 2]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: tests.support

from tests.support import parallel_runs as pr  # noqa: E402


def megatron(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False) -> float:
    """Bytes one layer keeps for backward by Megatron's formula (16-bit activations, no recomputation)."""
    if t == 1:
        return s * b * h * (34 + 5 * a * s / h)
    if sequence_parallel:
        return s * b * h / t * (34 + 5 * a * s / h)
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def layer_activations(layers: int, seq: int, batch: int, tp: int, sequence_parallel: bool) -> int:
    """The activations a rank holds at the end of the forward (bytes), for a Llama of ``layers`` layers."""
    import torch
    import transformers

    import vram_magic

    transformers.logging.set_verbosity_error()
    config = {**pr.LLAMA, "num_hidden_layers": layers, "max_position_embeddings": max(seq, 256),
              "num_key_value_heads": pr.LLAMA["num_attention_heads"]}
    inputs = {"input_ids": torch.randint(0, config["vocab_size"], (batch, seq)),
              "position_ids": torch.arange(seq).unsqueeze(0)}
    kwargs: dict = {}
    if tp > 1:
        top, layer = pr.llama_plan(sequence_parallel)
        plan = dict(top)
        for i in range(layers):
            plan.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
        kwargs = {"tp": tp, "parallelize_plan": plan}
    est = vram_magic.estimate(lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)), inputs,
                              device="cpu", dtype=torch.bfloat16, loss_fn=lambda out: out.logits.float().sum(),
                              **kwargs)
    return int(est.after_forward["activations"])


def main(argv: list[str]) -> int:
    def option(name: str, default: int) -> int:
        return int(argv[argv.index(name) + 1]) if name in argv else default

    seq, batch, tp = option("--seq", pr.LLAMA_SEQ), option("--batch", pr.LLAMA_BATCH), option("--tp", 2)
    h, a = pr.LLAMA["hidden_size"], pr.LLAMA["num_attention_heads"]
    print(f"Llama: hidden {h}, {a} heads, SwiGLU {pr.LLAMA['intermediate_size']}, bf16; batch {batch} x {seq}; "
          "bytes per layer at the end of the forward, per rank")
    print(f"{'layout':<26}{'estimate':>12}{'Megatron':>12}{'ratio':>8}")
    for name, t, sp in (("one GPU", 1, False), (f"tp={tp}", tp, False), (f"tp={tp} + sequence parallel", tp, True)):
        per_layer = (layer_activations(4, seq, batch, t, sp) - layer_activations(2, seq, batch, t, sp)) // 2
        formula = megatron(seq, batch, h, a, t, sp)
        print(f"{name:<26}{per_layer:>12,}{formula:>12,.0f}{per_layer / formula:>8.2f}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main(sys.argv[1:]))
