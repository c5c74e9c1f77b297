"""Per-rank memory under ZeRO-1/2/3 and FSDP (full sharding is ZeRO-3) across ``world`` ranks.

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
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sharding:
    stage: int
    world: int
    largest_unit: int  # bytes of the largest unit's parameters (in the step's dtype)
    root: int  # bytes of the parameters outside the units

    def divides(self, category: str, label: str) -> bool:
        if category == "optimizer_state" or (category == "other" and label == "optimizer temporaries"):
            return True
        if category == "gradients":
            return self.stage >= 2
        if category == "parameters":
            return self.stage >= 3
        return False

    def buffers(self, training: bool) -> dict[str, int]:
        """Collective buffers alive at the peak (modelled, per rank)."""
        out: dict[str, int] = {}
        unit = self.largest_unit
        if self.stage >= 3:
            out["all-gather buffers (unsharded unit ×2)"] = 2 * unit
            out["root unit kept unsharded"] = self.root - self.root // self.world
        if training and self.stage >= 2:
            out["reduce-scatter input (a unit's gradients)"] = unit
        return out


def sharding_for(stage: int | None, world: int, unit_bytes: list[int], param_bytes: int) -> Sharding | None:
    if not stage:
        return None
    largest = max(unit_bytes) if unit_bytes else param_bytes
    root = max(param_bytes - sum(unit_bytes), 0) if unit_bytes else 0
    return Sharding(stage, world, largest, root)
