"""Context parallelism (``cp=C``, vram_magic/estimator/layouts/context.py): each rank traced on its shard of the
sequence, the ring attention's K/V exchange buffers added as PyTorch's ring attention allocates them (bytes worked
out here by hand), ZeRO over dp × cp, the option on the command line and in the magic, and models or layouts it
cannot shard refused saying what to give instead. Not checked on real ranks: torch 2.13 runs no causal ring attention
on the CPU with gloo (docs/parallel.md)."""

from __future__ import annotations

import pytest
import torch

import vram_magic
from tests.support import skip_module_without_transformers_5

skip_module_without_transformers_5()

BF16 = 2
CONFIG = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 256}
IDS = torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(0))
BATCH = {"input_ids": IDS, "labels": IDS}


def llama(**extra):
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG, **extra))


def ring_bytes(cp: int, backward: bool) -> int:
    """One attention call's ring buffers on one rank, bf16: the local K and V made contiguous, their concatenation,
    the all-gathered K/V of the cp ranks; in backward also the fp32 gradients of K and V sent on (a concatenation and
    the buffer received) and the fp32 accumulators of dq, dk, dv."""
    s, d = IDS.shape[1] // cp, 64 // 4
    q = 4 * 4 * s * d * BF16  # batch × heads × tokens × head dim
    kv = 4 * 2 * s * d * BF16  # 2 KV heads
    forward = (cp + 2) * 2 * kv
    return forward + 2 * 2 * kv * 2 + q * 2 + 2 * kv * 2 if backward else forward


def test_a_rank_runs_its_shard_and_the_ring_buffers_by_hand() -> None:
    cp = vram_magic.estimate(llama, BATCH, device="cuda", dtype="bf16", cp=2)
    label = "context-parallel ring buffers (K/V and their gradients, 2 ranks) (modelled)"
    assert ring_bytes(2, backward=True) == 393_216
    assert cp.peak.details("other")[label] == ring_bytes(2, backward=True)
    # the same step on half the sequence, without the ring: what the rank traced
    half = {k: v[:, :64] for k, v in BATCH.items()}
    shard = vram_magic.estimate(llama, half, device="cuda", dtype="bf16")
    assert cp.peak.total - shard.peak.total == ring_bytes(2, backward=True)
    assert cp.peak["activations"] == shard.peak["activations"]
    assert "CP 2" in cp.description and "not checked on real ranks" in " ".join(cp.notes)
    assert cp.seq == 128  # the estimate speaks of the whole sequence


def test_inference_holds_the_forward_exchange_only() -> None:
    est = vram_magic.estimate(llama, IDS, device="cuda", dtype="bf16", cp=4, inference=True)
    assert est.peak.details("other")["context-parallel ring buffers (K/V of 4 ranks) (modelled)"] == \
        ring_bytes(4, backward=False) == 6 * 2 * 4 * 2 * 32 * 16 * BF16


def test_zero_shards_over_the_data_and_context_parallel_ranks() -> None:
    plain = vram_magic.estimate(llama, BATCH, device="cuda", dtype="bf16", cp=2)
    zero = vram_magic.estimate(llama, BATCH, device="cuda", dtype="bf16", cp=2, zero=1, world=2)
    # half the AdamW state on each of the dp × cp = 2 ranks (the CUDA allocator's 512-byte blocks round each shard)
    assert zero.peak["optimizer_state"] == pytest.approx(plain.peak["optimizer_state"] / 2, rel=0.02)
    assert "ZeRO-1" in zero.description


def test_context_and_pipeline_parallelism_together() -> None:
    est = vram_magic.estimate(llama, BATCH, device="cuda", dtype="bf16", cp=2, pp=2, world=4)
    assert len(est.ranks) == 4 and [r.stages for r in est.roles] == [(0,), (1,)]
    # a pipeline's micro-batch (2 of 4 rows) meets the ring: half a batch's buffers
    assert est.ranks[0].peak.details("other")[
        "context-parallel ring buffers (K/V and their gradients, 2 ranks) (modelled)"] == ring_bytes(2, True) // 2


@pytest.mark.parametrize(("model", "inputs", "kwargs", "message"), [
    (llama, BATCH, dict(device="cpu"), "estimate cp with device='cuda'"),
    (lambda: llama(attn_implementation="eager"), BATCH, {}, "attention is 'eager', which it cannot shard"),
    (lambda: llama(sliding_window=16), BATCH, {}, "has a sliding window"),
    (lambda: torch.nn.Sequential(torch.nn.Linear(128, 128)), torch.randn(4, 128, 128), {},
     "Sequential has none: estimate it with cp=1"),
    (llama, {k: v[:, :30] for k, v in BATCH.items()}, {}, "its length 30 is not a multiple of 4"),
    (llama, BATCH, dict(pp=2, world=6), "tp × pp × cp × dp must equal world: tp=1 × pp=2 × cp=2 = 4"),
    (llama, IDS, dict(generate=4), "cp applies to training"),
])
def test_what_cannot_be_sharded_is_refused(model, inputs, kwargs: dict, message: str) -> None:
    kwargs = {"device": "cuda", **kwargs}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        vram_magic.estimate(model, inputs, cp=2, **kwargs)


def test_the_command_line_and_the_magic_take_cp(shell) -> None:
    import argparse

    from vram_magic.estimator.cli.arguments import OPTIONS, parallel_options

    parser = argparse.ArgumentParser()
    for flags, kwargs in OPTIONS:
        parser.add_argument(*flags, **kwargs)
    args = parser.parse_args(["m", "--cp", "2", "--pp", "model.layers.1", "--schedule", "zbv"])
    assert parallel_options(args, {}) == {"cp": 2, "pp": ["model.layers.1"], "schedule": "zbv"}
    shell.user_ns.update(model=llama(), batch=BATCH)
    shell.run_line_magic("vram_estimate", "model --input batch --dtype bf16 --cp 2 -q -o est")
    assert "CP 2" in shell.user_ns["est"].description
