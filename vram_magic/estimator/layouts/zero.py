"""Per-rank memory under data parallelism: replicated (one GPU, or DDP), ZeRO-1/2/3 and FSDP (full sharding is
ZeRO-3) across ``world`` ranks, with the optimizer's state on the host or not.

The step is traced once, unsharded; each rank then holds ``1/world`` of what the stage shards, and the
collectives add their buffers:

* ZeRO-1 shards optimizer state (and the optimizer's temporaries, which are per shard).
* ZeRO-2 also shards gradients; a reduce-scatter needs the unsharded gradients of one unit at a time.
* ZeRO-3 / FSDP also shards parameters; each unit's parameters are all-gathered for its forward and again
  for its backward. The all-gather output and the unsharded parameters coexist while they are copied out,
  so the buffer is twice the largest unit; the reduce-scatter needs that unit's unsharded gradients.

A *unit* is what FSDP wraps: the estimate takes the blocks of the longest ``ModuleList``/``Sequential``
of like layers (the same ones activation checkpointing wraps); parameters outside them (embeddings, the
head) form the root unit, which FSDP2 keeps unsharded from forward to backward.

With ``offload`` the optimizer's state and its step live on the host: none of it is on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..options import Options, optimizer_name, short_dtype
from ..tracing.traced import FakeRun


@dataclass(frozen=True)
class ZeroLayout:
    """What one of ``world`` data-parallel ranks holds: ``stage`` 0 (replicated) to 3 (parameters sharded too)."""

    stage: int
    world: int
    largest_unit: int  # bytes of the largest unit's parameters (in the step's dtype)
    root: int  # bytes of the parameters outside the units
    offload: bool = False

    @classmethod
    def of(cls, opts: Options, trace: FakeRun) -> ZeroLayout:
        units = trace.unit_param_bytes
        largest = max(units) if units else trace.param_bytes
        root = max(trace.param_bytes - sum(units), 0) if units else 0
        return cls(opts.zero or 0, opts.world if opts.zero else 1, largest, root, opts.offload)

    def divides(self, category: str, label: str) -> bool:
        if not self.stage:
            return False
        if category == "optimizer_state" or (category == "other" and label == "optimizer temporaries"):
            return True
        if category == "gradients":
            return self.stage >= 2
        if category == "parameters":
            return self.stage >= 3
        return False

    def rank_sizes(self, trace: FakeRun, opts: Options) -> tuple[dict[int, int], int]:
        """Each storage's bytes on one rank of the device (Adam's ``step`` counters on the host with CUDA unless the
        optimizer is fused or capturable; the sharded share under ZeRO; optimizer state offloaded to the host), and
        the optimizer state's bytes before sharding and offload."""
        sizes = dict(trace.sizes)
        if opts.device == "cuda" and not trace.fused:
            for s in trace.host_scalars:
                sizes[s] = 0
        state_bytes = sum(sizes[s] for s, (cat, _) in trace.owner.items() if cat == "optimizer_state" and s in sizes)
        if self.stage or self.offload:
            for s, (cat, label) in trace.owner.items():
                if self.offload and (cat == "optimizer_state" or label == "optimizer temporaries"):
                    sizes[s] = 0
                elif self.divides(cat, label):
                    sizes[s] = -(-sizes[s] // self.world)
        return sizes, state_bytes

    def host_bytes(self, trace: FakeRun, opts: Options) -> tuple[int, int]:
        """``(host, pinned)``: with ``offload`` on a GPU, the optimizer's state (the rank's share under ZeRO) on the
        host, pageable."""
        if not self.offload or opts.device != "cuda" or opts.inference:
            return 0, 0
        from ...core.events import alive_after

        alive = alive_after(trace.initial, trace.events, trace.marks.get("step_end", len(trace.events)))
        state = sum(trace.sizes.get(s, 0) for s in alive if trace.owner.get(s, ("",))[0] == "optimizer_state")
        return (-(-state // self.world) if self.stage else state), 0

    def buffers(self, training: bool) -> dict[str, int]:
        """Collective buffers alive while the step's forward and backward run (modelled, per rank)."""
        out: dict[str, int] = {}
        unit = self.largest_unit
        if self.stage >= 3:
            out["all-gather buffers (unsharded unit ×2)"] = 2 * unit
            out["root unit kept unsharded"] = self.root - self.root // self.world
        if training and self.stage >= 2:
            out["reduce-scatter input (a unit's gradients)"] = unit
        return out

    def window(self, trace: FakeRun) -> tuple[int, int]:
        """The events during which the buffers are alive: FSDP/ZeRO gather and reduce during the forward and backward
        of a step; none is alive in the update."""
        return trace.marks.get("step_start", 0), trace.marks.get("backward_end", len(trace.events))

    def model_states(self, trace: FakeRun, opts: Options, state_bytes: int) -> int:
        """Bytes of parameters, gradients and optimizer state one rank holds for the whole step (the ZeRO paper's
        *model states*), whatever is alive at the peak."""
        if opts.inference:
            return trace.param_bytes
        world = self.world
        params = -(-trace.param_bytes // world) if self.stage >= 3 else trace.param_bytes
        grads = -(-trace.grad_bytes // world) if self.stage >= 2 else trace.grad_bytes
        state = 0 if self.offload else (-(-state_bytes // world) if self.stage >= 1 else state_bytes)
        return params + grads + state

    def notes(self, opts: Options) -> list[str]:
        return [self.master_note(opts)] if opts.master_weights else []

    def master_note(self, opts: Options) -> str:
        half = short_dtype(opts.dtype)
        text = (f"mixed precision with fp32 master weights: {half} weights and gradients in the model, an fp32 copy of "
                f"the weights and the {optimizer_name(opts.optimizer)} state in the optimizer (with Adam 2 + 2 + 12 "
                "bytes per parameter, the ZeRO paper's scheme); gradients are cast to fp32 for the update")
        if self.stage:
            what = {1: "the optimizer's fp32 copy and state",
                    2: "the optimizer's fp32 copy and state and the gradients",
                    3: "the optimizer's fp32 copy and state, the gradients and the weights"}[self.stage]
            text += f"; ZeRO-{self.stage} shards {what} across {self.world} ranks"
        return text
