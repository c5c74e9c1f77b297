"""Context parallelism (``cp=C``) as PyTorch's ``context_parallel`` runs it and torchtitan uses it: the sequence of
the inputs (and labels) is sharded over C ranks, each holding ``S / C`` tokens in two chunks (the round-robin load
balancing of a causal mask: ``S`` a multiple of 2C), and ``scaled_dot_product_attention`` becomes ring attention:
each rank's queries meet every rank's keys and values, which travel around the ring
(torch/distributed/tensor/experimental/_context_parallel/_attention.py, torch 2.13).

Each rank is traced on its own shard (the inputs' dimension 1 divided by C): its activations are the shard's,
and what autograd saves of a ring attention is what the fused kernel saves of the local q, k, v (the merged output and
log-sum-exp), as at that length. What the ring adds is modelled, per attention call, as PyTorch allocates it:

* forward (``_templated_ring_attention``, rotation by all-gather, PyTorch's default): the local K and V made
  contiguous, their concatenation, and the all-gathered K/V of all C ranks: ``(C + 2) · 2 · kv``;
* backward (``_templated_ring_attention_backward``): the same K/V exchange, the gradients of K and V sent around the
  ring by all-to-all in fp32 (``convert_to_f32``: a concatenation and the buffer received) and the fp32 accumulators
  of dq, dk, dv: ``(C + 2) · 2 · kv + 2 · 2 · kv₃₂ + q₃₂ + 2 · kv₃₂``;

with ``kv`` the bytes of one rank's K (or V) as the attention gets them (``micro-batch × KV heads × S / C × head
dim``) and ``q`` its queries', ``·₃₂`` in fp32. One call's largest is counted alive through the step's forward and
backward (an attention call holds it, one after the other): the estimate's figure is an upper bound by at most that
much where the peak falls between two attention calls.

Not checked on real ranks: torch 2.13 on the CPU with gloo cannot run causal ring attention (no sharding strategy
for the CPU's flash kernel; with the math kernel the causal mask meets a ``DTensor``), so the figures are modelled
from PyTorch's source and checked by hand (tests/estimator/parallel/test_context.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..options import Options
from ..tracing.traced import FakeRun


@dataclass(frozen=True)
class RingShapes:
    """One rank's attention, as the ring sees it: bytes of its queries and of its K (or V) per call."""

    cp: int
    layers: int
    q: int
    kv: int
    itemsize: int

    def forward(self) -> int:
        return (self.cp + 2) * 2 * self.kv

    def backward(self) -> int:
        f32 = 4 / self.itemsize
        return int((self.cp + 2) * 2 * self.kv + 4 * self.kv * f32 + self.q * f32 + 2 * self.kv * f32)

    def buffers(self, training: bool) -> dict[str, int]:
        if training and self.backward() > self.forward():
            return {f"context-parallel ring buffers (K/V and their gradients, {self.cp} ranks)": self.backward()}
        return {f"context-parallel ring buffers (K/V of {self.cp} ranks)": self.forward()}


def shard_length(seq: int | None, cp: int) -> int:
    """The tokens a rank holds; ``ValueError`` where the sequence does not split into 2 × cp chunks."""
    if seq is None or seq % (2 * cp):
        raise ValueError(f"context parallelism shards the sequence (the inputs' dimension 1) into 2 × cp = {2 * cp} "
                         f"chunks for the causal load balancing; its length {seq} is not a multiple of {2 * cp}: give "
                         "a sequence length that is, or another cp")
    return seq // cp


def ring_shapes(model: Any, opts: Options, micro_batch: int | None, seq_shard: int) -> RingShapes:
    """The ring's shapes for a transformers decoder with scaled-dot-product attention; ``ValueError`` for a model
    whose attention context parallelism cannot shard, or a device it does not run on."""
    if opts.device != "cuda":
        raise ValueError("context parallelism's ring attention runs CUDA's attention kernels (flash, memory-efficient, "
                         "cuDNN); torch 2.13 has no sharding for the CPU's: estimate cp with device='cuda'")
    config = getattr(model, "config", None)
    if config is None:  # a pipeline rank's stages (a list of cut copies of the model): their config
        config = next((getattr(m, "config", None) for m in model.modules() if getattr(m, "config", None) is not None),
                      None)
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int) or not isinstance(getattr(config, "num_hidden_layers", None), int):
        raise ValueError(f"context parallelism shards the attention of a decoder it knows (a transformers model with "
                         f"num_attention_heads and num_hidden_layers in its config); {type(model).__name__} has none: "
                         "estimate it with cp=1")
    implementation = getattr(config, "_attn_implementation", None) or "sdpa"
    if implementation not in ("sdpa", "flash_attention_2", "flash_attention_3"):
        raise ValueError(f"context parallelism turns scaled_dot_product_attention into ring attention; "
                         f"{type(model).__name__}'s attention is {implementation!r}, which it cannot shard: build the "
                         "model with attn_implementation='sdpa', or estimate it with cp=1")
    if getattr(config, "sliding_window", None) is not None or getattr(config, "use_bidirectional_attention", False):
        raise ValueError("context parallelism's ring attention is causal over the whole sequence; this model's "
                         "attention has a sliding window (or is bidirectional), which it cannot shard: estimate it "
                         "with cp=1")
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    dtype = opts.amp or opts.dtype or next(iter(model.parameters())).dtype
    itemsize = dtype.itemsize
    tokens = (micro_batch or 1) * seq_shard * head_dim * itemsize
    return RingShapes(opts.cp, config.num_hidden_layers, heads * tokens, kv_heads * tokens, itemsize)


@dataclass(frozen=True)
class ContextLayout:
    """A layout (data parallelism, or a tensor- or pipeline-parallel rank's) with the ring's buffers added."""

    base: Any
    ring: RingShapes

    def rank_sizes(self, trace: FakeRun, opts: Options) -> tuple[dict[int, int], int]:
        return self.base.rank_sizes(trace, opts)

    def buffers(self, training: bool) -> dict[str, int]:
        return {**self.base.buffers(training), **self.ring.buffers(training)}

    def window(self, trace: FakeRun) -> tuple[int, int]:
        return trace.marks.get("step_start", 0), trace.marks.get("backward_end", len(trace.events))

    def model_states(self, trace: FakeRun, opts: Options, state_bytes: int) -> int:
        return self.base.model_states(trace, opts, state_bytes)

    def notes(self, opts: Options) -> list[str]:
        return [*self.base.notes(opts), f"context parallelism over {opts.cp} ranks: each runs 1/{opts.cp} of the "
                "sequence; the ring attention's buffers are modelled from PyTorch's source (K/V exchanged by "
                "all-gather, their gradients by all-to-all in fp32), one attention call's at a time; not checked on "
                "real ranks (torch 2.13 runs no causal ring attention on CPU/gloo)"]


__all__ = ["ContextLayout", "RingShapes", "ring_shapes", "shard_length"]
