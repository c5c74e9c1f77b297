"""The pipeline schedules PyTorch runs from an action list (``_PipelineScheduleRuntime``): the zero-bubble ones
(``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``), which split a stage's backward
into the gradients of its inputs (I) and, later, of its weights (W), replayed on one rank's fake stages as torch 2.13's
runtime runs them.

The rank's actions are PyTorch's own: the schedule built on stand-in stages, its ``pipeline_order_with_comms`` read
(``torch_private.runtime_schedule_order``: the compute actions with the sends and receives it lowers into them, a
DualPipeV ``OVERLAP_F_B`` as its forward and backward). Each is replayed as ``_PipelineScheduleRuntime`` and
``PipelineStage`` run it, with PyTorch's own backward functions (``stage_backward``, ``stage_backward_input``,
``stage_backward_weight``), so what the split backward keeps between I and W (the intermediates' gradients, the graph
it retains) is what a rank keeps:

* a receive fills the stage's receive buffer of that micro-batch, made once in the first step and kept;
* a send's work holds what it sent (a forward's output, a backward's input gradients) until the step's end, where
  every send is waited on;
* two stages of the V on one rank (the middle of the V: ``ZBV``, ``DualPipeV``) pass tensors without a send: the
  forward's output, detached, becomes the next stage's receive buffer for that micro-batch, and the input gradients of
  a backward the previous stage's gradient buffer (``set_local_fwd_input``, ``set_local_bwd_input``), where they stay
  until replaced in the next step;
* I keeps the stage's inputs, its output (detached), the gradient it received and the parameter groups with their
  intermediates' gradients until W; the first stage's I computes nothing and its W runs the whole backward; the
  input gradients stay on the receive buffer (``.grad``) until the next step;
* ``REDUCE_GRAD`` divides the stage's gradients by the micro-batches, in place.

Torch 2.15's runtime makes receive buffers per use and lets go of sent outputs sooner (pipeline.py): not modelled
for these schedules; the estimate refuses them there."""

from __future__ import annotations

from typing import Any

import torch

from ...engine.hooks.pipeline import MERGED, outputs_role
from ..tracing.tracer import BACKWARD, FORWARD, LOSS
from .pipeline import SCHEDULE_CLASSES, StageOnRank, receive_claims


def runtime_actions(schedule: str, rank: int, ranks: int, m: int, n_stages: int) -> list[tuple[str, int, int]]:
    """The rank's actions as PyTorch lowers them; ``ValueError`` for micro-batches PyTorch refuses."""
    from ..torch_private import runtime_schedule_order

    cls = SCHEDULE_CLASSES[schedule]
    try:
        order = runtime_schedule_order(cls, ranks, n_stages // ranks, m, rank)
    except (ValueError, RuntimeError, AssertionError) as err:
        raise ValueError(f"{cls} refuses micro_batches={m} on {ranks} ranks: {err}") from err
    if any(j >= m for _, _, j in order):
        raise ValueError(f"{cls} with micro_batches={m} on {ranks} ranks runs micro-batches beyond {m - 1}: give "
                         f"micro_batches ≥ {max(j for _, _, j in order) + 1}")
    return order


class RuntimeRank:
    """One rank's stages under a runtime schedule, on fake tensors under the step tracer."""

    def __init__(self, stages: list[StageOnRank], order: list[tuple[str, int, int]], m: int) -> None:
        self.stages = {s.index: s for s in stages}
        self.order, self.m = order, m
        self.kept: list[Any] = []  # the last stage's outputs, until the next step
        self.loss_of: Any = None  # (output, micro-batch) → loss; set by the rank's trace

    def claims(self) -> list[tuple[torch.Tensor, tuple[str, str]]]:
        """The receive buffers, alive from the first step on."""
        return receive_claims(self.stages.values())

    def run(self, step: Any, batch: Any, last: bool) -> None:
        """One step's actions (``batch``: the first stage's input)."""
        from ..torch_private import pipeline_backward

        bw = pipeline_backward()
        tracer, claim = step.tracer, step.claim
        micro = torch.tensor_split(batch, self.m) if batch is not None else [None] * self.m
        self.kept = []
        for stage in self.stages.values():
            _clear_grads(stage.received)  # clear_runtime_states
        fwd: dict[tuple[int, int], tuple[Any, Any]] = {}  # (stage, micro-batch) → (output, input): fwd_cache
        bwd: dict[tuple[int, int], Any] = {}  # the input gradients to send: bwd_cache
        state: dict[tuple[int, int], tuple[Any, ...]] = {}  # from I to W: backward_state
        losses: dict[tuple[int, int], Any] = {}
        outputs: dict[int, list[Any]] = {s: [] for s in self.stages}
        sends: list[Any] = []  # what the send works hold until the step's end
        forwards = sum(1 for kind, _, _ in self.order if kind == "F")
        done = 0
        for kind, s, j in self.order:
            stage = self.stages.get(s)
            if kind == "F":
                tracer.stage = FORWARD
                inp = micro[j] if stage.first else stage.received[j].requires_grad_(True)
                out = stage.module(inp)
                fwd[(s, j)] = (out, inp)
                if stage.last:
                    outputs[s].append(out)
                    claim(out, outputs_role(s))
                    tracer.stage = LOSS
                    losses[(s, j)] = self.loss_of(out, j)
                if s + 1 in self.stages:  # the V's turn on this rank: set_local_fwd_input
                    self.stages[s + 1].received[j] = out.detach()
                done += 1
                if done == forwards and last:
                    step.marks["forward_end"] = len(tracer.counts.events)
                del out, inp
            elif kind == "SEND_F":
                sends.append(fwd[(s, j)][0])
            elif kind == "SEND_B":
                sends.append(bwd.pop((s, j)))
            elif kind in ("B", "I", "W"):
                tracer.stage = BACKWARD
                self._backward(bw, kind, stage, j, fwd, bwd, state, losses)
                for p in stage.module.parameters():
                    claim(p.grad, ("gradients", "gradients"))
            elif kind == "REDUCE_GRAD":
                with torch.no_grad():
                    for p in stage.module.parameters():
                        if p.grad is not None:
                            p.grad.div_(self.m)
        del sends, fwd, bwd, state, losses  # every send waited on, the losses handed over, before the merged output
        for outs in outputs.values():
            if outs:
                merged = torch.cat(outs)  # what step() returns; the caller lets go of it
                claim(merged, MERGED)
                del merged
                self.kept.extend(outs)
        del outputs

    def _backward(self, bw: Any, kind: str, stage: StageOnRank, j: int, fwd: dict, bwd: dict, state: dict,
                  losses: dict) -> None:
        """B, I or W of micro-batch ``j``, as ``backward_one_chunk`` / ``backward_weight_one_chunk`` run them."""
        s = stage.index
        if kind == "W":
            inputs, groups, output, grads = state.pop((s, j))
            if s != 0:
                bw.stage_backward_weight(stage.module.parameters(), groups)
            else:  # the first stage's I computed nothing: its W is the whole backward
                bw.stage_backward(output, grads, inputs)
            return
        out, inp = fwd.pop((s, j))
        output = losses[(s, j)] if stage.last else (out,)
        grads = None if stage.last else (stage.grads_in[j],)
        if kind == "B":
            made = bw.stage_backward(output, grads, [inp])
        elif stage.first:
            made, state[(s, j)] = (), ([inp], None, output, grads)
        else:
            made, groups = bw.stage_backward_input(output if isinstance(output, tuple) else (output,), grads, [inp],
                                                   stage.module.parameters())
            state[(s, j)] = ([inp], groups, output, grads)
        if not stage.first:
            bwd[(s, j)] = made[:1]
        if stage.last and not stage.first:
            try:
                out.detach_()  # kept for the merged output only (PyTorch leaves a view as it is)
            except RuntimeError:
                pass
        if s - 1 in self.stages:  # the V's turn: set_local_bwd_input
            self.stages[s - 1].grads_in[j] = bwd.pop((s, j))[0]
        del out, inp, output, grads, made


def _clear_grads(buffers: list[Any]) -> None:
    """Each buffer's gradient let go of (in a function of its own: a loop's name would keep the last buffer alive)."""
    for t in buffers:
        t.grad = None


__all__ = ["RuntimeRank", "runtime_actions"]
