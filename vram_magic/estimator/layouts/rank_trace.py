"""What a traced step does differently on one rank of a tensor- or pipeline-parallel job (the step's fake run,
``step/trace.py``, calls these hooks): the model parallelized with its plan and cut to the rank's stages, the
rank's inputs and receive buffers, the tracer that lets ``DTensor`` run its shards, the pipeline's schedule in
place of the plain forward and backward, and the collectives' outputs named."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from ..options import Options
from . import pipeline, tensor


class RankTrace:
    """The hooks for one rank (``opts.pp_rank``; every tensor-parallel rank holds the same shapes, so rank 0 of the
    tensor-parallel group stands for all)."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.notes: list[str] = []
        self.pipeline: pipeline.PipelineRank | None = None
        self.full_names: dict[int, str] = {}
        self._unregister: Any = None

    @property
    def micro_batches(self) -> int:
        return self.opts.micro_batches or self.opts.pp

    # --- the model and its inputs -----------------------------------------------------------------------------
    def build(self, step: Any, model: nn.Module, units_of: Any) -> nn.Module:
        """``model`` (the fake copy) parallelized and cut to the rank's stages; ``step.inputs`` made the rank's.
        ``units_of(model)``: its blocks (what checkpointing and FSDP wrap)."""
        opts = self.opts
        self.full_names = {id(m): (name or type(m).__name__) for name, m in model.named_modules()}
        if opts.tp > 1:
            plan, notes = tensor.resolve(model, opts.parallelize_plan, opts.tp)
            self.notes += notes
            if tensor.needs_positions(opts.parallelize_plan is not None, model):
                step.inputs = _with_positions(step.inputs, step.mode)
            name, unregister = tensor.fake_group(opts.tp)
            self._unregister = weakref.finalize(self, unregister)  # at the trace's end, or if it fails
            tensor.shard(model, plan, opts.tp, step.mode, name)
        if opts.pp == 1:
            return model
        interleaved = opts.schedule == "interleaved"
        if interleaved and opts.split_points:
            raise ValueError("the interleaved schedule splits the blocks evenly into two stages a rank; give pp as a "
                             "number with it")
        ranks = opts.pp
        cut = pipeline.split(model, ranks * (2 if interleaved else 1), opts.split_points, units_of)
        n = len(cut.stages)
        m = self.micro_batches
        pipeline.check_micro_batches(opts.schedule, m, ranks, n, step.batch)
        mine = pipeline.stages_of(opts.pp_rank, ranks, n)
        batch = step.inputs if isinstance(step.inputs, torch.Tensor) else None
        if batch is None:
            raise ValueError("pipeline parallelism takes the first stage's input as one tensor (a batch of rows)")
        with step.mode:
            first = torch.tensor_split(batch, m)[0]
            stages = pipeline.make_stages(model, cut, mine, first, m, has_backward=True)
        order = pipeline.actions(opts.schedule, opts.pp_rank, ranks, m, n)
        self.pipeline = pipeline.PipelineRank(stages, order, m, opts.schedule, ranks)
        self.first_stage_input = 0 in mine
        if not self.first_stage_input:
            step.inputs = ()  # the batch is the first stage's
        step.micro_batch = (step.batch // m) if step.batch else step.micro_batch
        self.notes.append(", ".join(cut.describe(s) for s in mine) + f" ({n} stages, {m} micro-batches, "
                          f"{pipeline.SCHEDULE_CLASSES[opts.schedule]})")
        return stages[0].module if len(stages) == 1 else nn.ModuleList(s.module for s in stages)

    def prepare(self, step: Any) -> None:
        """After the step claimed the model and inputs: the receive buffers, and the modules named as in the whole
        model."""
        step.names.update(self.full_names)
        if self.pipeline is not None:
            for t, role in self.pipeline.claims():
                step.claim(t, role)

    def tracer(self, registry: Any, names: dict[int, str]) -> Any:
        from ..tracing.tracer import StepTracer

        if self.opts.tp > 1:
            return tensor.TensorParallelTracer(registry, names)
        return StepTracer(registry, names)

    # --- the step -------------------------------------------------------------------------------------------------
    def forward_backward(self, step: Any, last: bool) -> bool:
        """The pipeline's forwards and backwards in the schedule's order (``True``), or nothing (``False``: the
        step's own)."""
        if self.pipeline is None:
            return False
        self.pipeline.run(step, step.inputs if self.first_stage_input else None, last)
        return True

    def local(self, t: Any) -> Any:
        return tensor.local(t)

    def local_bytes(self, p: Any) -> int:
        return tensor.local_bytes(p)

    def finish(self, tracer: Any, owner: dict[int, tuple[str, str]]) -> None:
        """The collectives' outputs and gloo's buffers named (over what the stage that made them says)."""
        roles = getattr(tracer, "collective_roles", None)
        if roles is not None:
            owner.update(roles())
        if self._unregister is not None:
            self._unregister()


def _with_positions(inputs: Any, mode: Any) -> Any:
    """A decoder's keyword inputs with ``position_ids`` (``0 … seq − 1``) when they have none."""
    if not isinstance(inputs, dict) or "position_ids" in inputs or "input_ids" not in inputs:
        return inputs
    seq = inputs["input_ids"].shape[1]
    with mode:
        return {**inputs, "position_ids": torch.arange(seq).unsqueeze(0)}


def rank_trace(opts: Options) -> RankTrace | None:
    """The hooks ``opts`` need (``None`` for a step on one rank, or data parallelism alone)."""
    return RankTrace(opts) if opts.parallel else None


__all__ = ["RankTrace", "rank_trace"]
