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
        self.added_positions = False  # position_ids added to the inputs for tensor parallelism (not the user's)

    @property
    def micro_batches(self) -> int:
        return self.opts.micro_batches or self.opts.pp

    # --- the model and its inputs -----------------------------------------------------------------------------
    def build(self, step: Any, model: nn.Module, units_of: Any) -> nn.Module:
        """``model`` (the fake copy) parallelized and cut to the rank's stages; ``step.inputs`` made the rank's.
        ``units_of(model)``: its blocks (what checkpointing and FSDP wrap)."""
        opts = self.opts
        self.full_names = {id(m): (name or type(m).__name__) for name, m in model.named_modules()}
        self.seq_shards = 1
        if opts.tp > 1:
            plan, notes = tensor.resolve(model, opts.parallelize_plan, opts.tp)
            self.seq_shards = opts.tp if tensor.shards_sequence(plan) else 1
            self.notes += notes
            if tensor.needs_positions(opts.parallelize_plan is not None, model):
                self.added_positions = not (isinstance(step.inputs, dict) and "position_ids" in step.inputs)
                step.inputs = _with_positions(step.inputs, step.mode, known=opts.pp == 1)
            name, unregister = tensor.fake_group(opts.tp)
            self._unregister = weakref.finalize(self, unregister)  # at the trace's end, or if it fails
            tensor.shard(model, plan, opts.tp, step.mode, name)
        if opts.pp == 1:
            return model
        return self._cut(step, model, units_of)

    def _cut(self, step: Any, model: nn.Module, units_of: Any) -> nn.Module:
        """The rank's stages of ``model``, their schedule and loss; ``step.inputs`` made what the rank holds."""
        opts, ranks = self.opts, self.opts.pp
        cls = pipeline.SCHEDULE_CLASSES[opts.schedule]
        two = opts.schedule in pipeline.TWO_A_RANK
        if two and opts.split_points:
            raise ValueError(f"{cls} runs two stages a rank, split evenly from the layers; give pp as a number with "
                             "it")
        cut = pipeline.split(model, ranks * (2 if two else 1), opts.split_points, units_of)
        n = len(cut.stages)
        m = self.micro_batches
        pipeline.check_micro_batches(opts.schedule, m, ranks, n, step.batch)
        if opts.schedule in pipeline.RUNTIME:
            from .schedule_runtime import RuntimeRank, runtime_actions

            order = runtime_actions(opts.schedule, opts.pp_rank, ranks, m, n)
            if pipeline.buffers_per_use():  # (after what PyTorch itself refuses of the layout)
                raise ValueError(f"{cls} is modelled as torch 2.13's pipelining runs it; this PyTorch "
                                 f"({torch.__version__}) makes receive buffers per use, which is not modelled for "
                                 "it: estimate schedule='1f1b', 'gpipe' or 'interleaved'")
        else:
            order = pipeline.actions(opts.schedule, opts.pp_rank, ranks, m, n)
        mine = pipeline.stages_of(opts.pp_rank, ranks, n, opts.schedule)
        batch, labels = self._stage_inputs(step.inputs, cut)
        with step.mode:
            first = torch.tensor_split(batch, m)[0]
            stages = pipeline.make_stages(model, cut, mine, first, m, has_backward=True,
                                          seq_shards=self.seq_shards if cut.plan is not None else 1)
        if opts.schedule in pipeline.RUNTIME:
            self.pipeline = RuntimeRank(stages, order, m)
        else:
            self.pipeline = pipeline.PipelineRank(stages, order, m, opts.schedule, ranks)
        self.pipeline.loss_of = stage_loss(step, model, cut, labels, m)
        self.first_stage_input = 0 in mine
        self.batch = batch
        held = ([batch] if 0 in mine else []) + ([labels] if n - 1 in mine and labels is not None else [])
        step.inputs = tuple(held)  # the batch is the first stage's, the labels the last stage's
        step.micro_batch = (step.batch // m) if step.batch else step.micro_batch
        self.notes.append(", ".join(cut.describe(s) for s in mine) + f" ({n} stages, {m} micro-batches, {cls})")
        if cut.plan is not None and (0 in mine or n - 1 in mine) and model_ties_head(model, cut):
            self.notes.append("the output head is tied to the embedding: the first stage's embedding and the last "
                              "stage's head each hold a copy of the weight (as torchtitan's deep copies do, also on "
                              "one rank); the all-reduce of their gradients that keeps them tied is not modelled")
        return stages[0].module if len(stages) == 1 else nn.ModuleList(s.module for s in stages)

    def _stage_inputs(self, inputs: Any, cut: pipeline.Split) -> tuple[torch.Tensor, Any]:
        """(the first stage's input, the labels or None) from the step's inputs."""
        if isinstance(inputs, torch.Tensor):
            return inputs, None
        if cut.plan is not None and isinstance(inputs, dict) and isinstance(inputs.get("input_ids"), torch.Tensor):
            other = sorted(set(inputs) - {"input_ids", "labels", "attention_mask", "position_ids"})
            if other:
                raise ValueError(f"pipeline stages take input_ids (and labels for the last stage's loss); "
                                 f"{', '.join(other)} cannot be passed between stages: drop them")
            dropped = [k for k in ("attention_mask", "position_ids") if k in inputs
                       and not (k == "position_ids" and self.added_positions)]
            if dropped:
                self.notes.append(f"{' and '.join(dropped)} not given to the stages: they make causal masks and "
                                  "positions 0 … seq − 1, as torchtitan's stages do")
            return inputs["input_ids"], inputs.get("labels")
        what = "one tensor (a batch of rows)" if cut.plan is None else "input_ids, or a dict of input_ids and labels"
        raise ValueError(f"pipeline parallelism takes the first stage's input as {what}")

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
        self.pipeline.run(step, self.batch if self.first_stage_input else None, last)
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


def _with_positions(inputs: Any, mode: Any, known: bool = True) -> Any:
    """A decoder's keyword inputs with ``position_ids`` (``0 … seq − 1``) when they have none; token ids given as one
    tensor become ``input_ids`` beside them (the model is called with them as keywords, as ``model(ids)`` binds them):
    the rotary embedding's cos and sin then follow the whole sequence's positions, not the sequence shard a
    sequence-parallel rank sees. ``known``: the positions carry their values (``fake/known_values.py``), as the
    positions a decoder makes from ``arange`` do — transformers reads them to tell packed sequences apart, and
    positions it cannot read make it build an explicit causal mask over the sequence shard a sequence-parallel rank
    sees, which its attention over the whole sequence cannot take (under checkpointing, or with labels). A pipeline's
    stages (tensor × pipeline parallelism) take them unknown: their masks are what real gloo ranks hold
    (``tests/estimator/parallel/test_real_ranks.py``)."""
    if isinstance(inputs, torch.Tensor) and inputs.dim() == 2 and not inputs.is_floating_point():
        inputs = {"input_ids": inputs}
    if not isinstance(inputs, dict) or "position_ids" in inputs or "input_ids" not in inputs:
        return inputs
    seq = inputs["input_ids"].shape[1]
    with mode:
        positions = torch.arange(seq).unsqueeze(0)
    if known:
        from ..fake.known_values import attach

        attach(positions, torch.arange(seq).unsqueeze(0))
    return {**inputs, "position_ids": positions}


def stage_loss(step: Any, model: nn.Module, cut: pipeline.Split, labels: Any, m: int) -> Any:
    """The last stage's loss of micro-batch j, ``(output, j) → loss``: the given ``loss_fn`` (a transformers decoder's
    logits handed over as its output, ``output.logits``), else with labels the model's own loss on the micro-batch's
    labels (transformers' ``loss_function``; a torchtitan model's cross-entropy), else the stand-in sum."""
    given = step.request.loss_fn
    kind = cut.plan.parts.kind if cut.plan is not None else None

    def as_output(out: Any) -> Any:
        if kind != "transformers":
            return out
        from transformers.modeling_outputs import CausalLMOutput

        return CausalLMOutput(logits=out)

    if given is not None:
        return lambda out, j: given(as_output(out))
    if labels is not None and kind is not None:
        per = torch.tensor_split(labels, m)
        if kind == "transformers":
            fn, vocab = model.loss_function, model.config.vocab_size
            step.loss_used = "the model's own loss (its loss_function on each micro-batch's labels)"
            return lambda out, j: fn(logits=out, labels=per[j], vocab_size=vocab)
        step.loss_used = "cross-entropy on each micro-batch's labels (torchtitan's loss)"
        return lambda out, j: torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), per[j].flatten(0, 1))
    from ..step.loss import stand_in_loss

    def stated(out: Any, j: int) -> torch.Tensor:
        value, step.loss_used = stand_in_loss(as_output(out))
        return value

    return stated


def model_ties_head(model: nn.Module, cut: pipeline.Split) -> bool:
    """Whether the model's output head shares its weight with the embedding (Gemma's tied embeddings)."""
    p = cut.plan.parts
    embed = model.get_submodule(p.embed).weight
    return any(w is embed for w in model.get_submodule(p.head).parameters())


def rank_trace(opts: Options) -> RankTrace | None:
    """The hooks ``opts`` need (``None`` for a step on one rank, or data parallelism modelled after the trace)."""
    if opts.fsdp_traced:  # one FSDP2 rank, fully_shard run on the fake copy (fsdp.py)
        from .fsdp import FsdpRank

        return FsdpRank(opts)  # type: ignore[return-value]
    return RankTrace(opts) if opts.parallel else None


__all__ = ["RankTrace", "model_ties_head", "rank_trace", "stage_loss"]
