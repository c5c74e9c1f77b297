"""How one rank's share of a traced step is computed: each layout says which of the traced storages a rank holds and
at what size, the buffers its collectives add and when they are alive, and the model states it keeps. Data parallelism
(replicated, ZeRO, FSDP; ``zero.py``) is the first layout; FSDP2 with its mixed-precision or offload policy is
traced as one rank (``fsdp.py``); a tensor- or pipeline-parallel rank is traced as that rank
(``tensor.py``, ``pipeline.py`` with ``stages.py`` cutting a real model's stages and ``schedule_runtime.py`` running
the zero-bubble schedules, ``rank_trace.py``) and replayed with ZeRO over its data-parallel group
(``model_parallel.py``); context parallelism adds its ring attention's buffers (``context.py``)."""

from __future__ import annotations

from typing import Protocol

from ..options import Options
from ..tracing.traced import FakeRun


class Layout(Protocol):
    """One rank's view of a traced step."""

    def rank_sizes(self, trace: FakeRun, opts: Options) -> tuple[dict[int, int], int]:
        """Each storage's bytes on the rank, and the optimizer state's bytes before sharding and offload."""
        ...

    def buffers(self, training: bool) -> dict[str, int]:
        """The collectives' buffers (modelled), by what they are."""
        ...

    def window(self, trace: FakeRun) -> tuple[int, int]:
        """The events during which the buffers are alive."""
        ...

    def model_states(self, trace: FakeRun, opts: Options, state_bytes: int) -> int:
        """Parameters, gradients and optimizer state the rank keeps for the whole step."""
        ...

    def notes(self, opts: Options) -> list[str]:
        """What the layout did, in words."""
        ...


def layout_for(opts: Options, trace: FakeRun) -> Layout:
    """The layout ``opts`` ask for."""
    if opts.cp > 1 and trace.context is not None:  # the ring attention's buffers on top (context.py)
        from .context import ContextLayout

        return ContextLayout(layout_for(opts.with_(cp=1), trace), trace.context)
    if opts.parallel:  # the trace is one rank's of a tensor- or pipeline-parallel job (rank_trace.py)
        from .model_parallel import ModelParallelLayout

        return ModelParallelLayout.of(opts, trace)
    if opts.fsdp_traced:  # the trace is one FSDP2 rank's (fsdp.py)
        from .fsdp import FsdpLayout

        return FsdpLayout.of(opts, trace)
    from .zero import ZeroLayout

    return ZeroLayout.of(opts, trace)
