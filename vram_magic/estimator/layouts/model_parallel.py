"""One rank of a tensor- or pipeline-parallel job, replayed: its trace is already the rank's own (the shards, the
stages, the collectives' outputs, the receive buffers: ``rank_trace.py``), so what is left is ZeRO/FSDP over the
data-parallel ranks (``dp = world / (tp × pp × cp)``; :class:`.zero.ZeroLayout` with ``dp × cp`` ranks, as torchtitan's
FSDP mesh shards over the context-parallel ranks too) and the device: gloo's
staging buffers are the CPU's (a CUDA estimate gives them no bytes, NCCL has no staging copy)."""

from __future__ import annotations

from dataclasses import dataclass

from ...engine.hooks.collectives import GLOO_STAGING
from ..options import Options
from ..tracing.traced import FakeRun
from .zero import ZeroLayout

_GLOO = frozenset(GLOO_STAGING.values())


@dataclass(frozen=True)
class ModelParallelLayout:
    """ZeRO over the data-parallel ranks of a rank whose trace holds its tensor- and pipeline-parallel share."""

    data: ZeroLayout

    @classmethod
    def of(cls, opts: Options, trace: FakeRun) -> ModelParallelLayout:
        return cls(ZeroLayout.of(opts.with_(world=opts.dp * opts.cp), trace))

    def rank_sizes(self, trace: FakeRun, opts: Options) -> tuple[dict[int, int], int]:
        sizes, state = self.data.rank_sizes(trace, opts.with_(world=opts.dp * opts.cp))
        if opts.device == "cuda":
            for s, role in trace.owner.items():
                if role in _GLOO:
                    sizes[s] = 0
        return sizes, state

    def buffers(self, training: bool) -> dict[str, int]:
        return self.data.buffers(training)

    def window(self, trace: FakeRun) -> tuple[int, int]:
        return self.data.window(trace)

    def model_states(self, trace: FakeRun, opts: Options, state_bytes: int) -> int:
        return self.data.model_states(trace, opts.with_(world=opts.dp * opts.cp), state_bytes)

    def notes(self, opts: Options) -> list[str]:
        notes = self.data.notes(opts)
        if opts.zero:
            notes.append(f"ZeRO-{opts.zero} over the {opts.dp} data-parallel ranks (world {opts.world} = tp {opts.tp} "
                         f"× pp {opts.pp} × dp {opts.dp})")
        return notes


__all__ = ["ModelParallelLayout"]
