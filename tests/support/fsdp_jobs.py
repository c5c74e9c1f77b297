"""FSDP2 as large runs configure it, on real gloo ranks (tests/support/parallel_runs.py's ``fsdp-*`` cases): a
transformers ``LlamaForCausalLM`` built from a config, ``fully_shard`` on each decoder layer and on the root with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=…)`` and, for ``-offload``, ``CPUOffloadPolicy`` (unpinned:
pinning needs an accelerator), for ``-float8`` with torchao's float8 linears (``convert_to_float8_training`` before
``fully_shard``, the output head left out), trained by AdamW on the model's own loss; and the estimate of the same
rank.

The model is small and parameter-heavy (4 layers, hidden 256, intermediate 1024, vocab 2048) at 2 × 32 tokens, so
that a rank's peak falls in the backward with every FSDP2 buffer alive at once: the all-gathered parameters of two
units, the flat all-gather buffers, the unsharded bf16 gradients, the fp32 reduce-scatter input kept for its
collective, and the sharded gradients so far.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

LLAMA = {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 2048, "max_position_embeddings": 256}
BATCH, SEQ = 2, 32
#: case → (reduce_dtype, CPUOffloadPolicy, torchao's float8 linears)
VARIANTS = {"fsdp-llama-bf16": (torch.float32, False, False),
            "fsdp-llama-bf16-reduce-bf16": (torch.bfloat16, False, False),
            "fsdp-llama-bf16-offload": (torch.float32, True, False),
            "fsdp-llama-bf16-float8": (torch.float32, False, True)}


def llama() -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))


def inputs(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, LLAMA["vocab_size"], (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def job(name: str, world: int, rank: int) -> tuple[dict[str, Any], Callable[[], None]]:
    """The rank's model, optimizer and batch, and one training step."""
    import gc

    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    gc.collect()  # an earlier case's FSDP modules hold reference cycles: gone before this case is measured
    reduce_dtype, offloaded, float8 = VARIANTS[name]
    torch.manual_seed(0)
    model = llama()
    if float8:  # before fully_shard, as torchtitan converts: every linear but the output head
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn != "lm_head")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    offload = CPUOffloadPolicy(pin_memory=False) if offloaded else OffloadPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mp_policy=mp, offload_policy=offload)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = inputs()

    def step() -> None:
        out = model(**batch)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return {"model": model, "opt": opt, "batch": batch}, step


def estimate(name: str, world: int, **extra: Any) -> Any:
    """``vram_magic.estimate`` of one rank of the job (every rank holds the same: the shapes divide evenly)."""
    import vram_magic

    reduce_dtype, offloaded, float8 = VARIANTS[name]
    return vram_magic.estimate(llama, inputs, device="cpu", zero=3, world=world, param_dtype="bf16",
                               reduce_dtype="bf16" if reduce_dtype is torch.bfloat16 else "fp32",
                               offload="params" if offloaded else False, float8=float8, **extra)


__all__ = ["BATCH", "LLAMA", "SEQ", "VARIANTS", "estimate", "inputs", "job", "llama"]
