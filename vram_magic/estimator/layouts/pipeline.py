"""Pipeline parallelism as ``torch.distributed.pipelining`` runs it, traced per rank.

The model's children (an ``nn.Sequential``) are split into stages, at the user's split points or evenly by blocks
(the longest run of like layers; what comes before the blocks joins the first stage, what comes after the last).
Each rank's step is traced on its own stages' modules, as a ``PipelineStage`` and its schedule run them on one rank:

* one receive buffer per micro-batch, allocated once and kept, for the activations of the stage before (every stage
  but the first; a leaf that requires grad) and for the gradients of the stage after (every stage but the last);
* the first stage's micro-batches are views of the batch (``tensor_split``); the last stage computes the loss of
  each micro-batch and keeps its outputs for the merged output (their concatenation, which ``step()`` returns);
* the forwards and backwards in the schedule's order (:func:`actions`): ``ScheduleGPipe`` every forward before any
  backward; ``Schedule1F1B`` ``min(m, p − i)`` warm-up forwards on stage i, then one backward and one forward;
  ``ScheduleInterleaved1F1B`` the order PyTorch computes for the rank (its own function, read from the installed
  release); a stage keeps a micro-batch's output and inputs from its forward to its backward;
* a send needs no memory of its own, but its work holds the tensor it sent: GPipe's lists of sends, and the
  interleaved runtime's, hold every sent output and input gradient until the step's end; 1F1B holds the last send
  fired in the warm-up (micro-batch ``w − 2``) until the step's end, the send ops of the latest forward until the
  next forward, and those of the latest backward (its input's gradient, which PyTorch takes off the receive buffer:
  ``stage_backward`` sets ``val.grad = None``) until the next backward;
* the gradients are divided by the number of micro-batches in place (``scale_grads``);
* the last stage's schedule keeps each micro-batch's loss to the step's end, and through its graph the stage's inputs.

That is the runtime of torch 2.6–2.13. The runtime of torch 2.15 (:func:`buffers_per_use`: its ``_recv_buffers``)
makes each receive buffer just before its receive and lets go of it once the stage is done with it; a stage lets go of
a sent output once the send is waited on (GPipe: after the last forward; 1F1B: after the next forward, or before the
next backward), and its backward starts from the output's gradient edge, so an output autograd does not save is freed
then. Its interleaved schedule runs the communication PyTorch lowers into the rank's actions (receives ahead of their
forward or backward, the wait on each send): the estimate follows that list (:data:`COMMS`).
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from ...engine.hooks.pipeline import MERGED, outputs_role, received_role
from ..parallel_options import SCHEDULES
from ..tracing.tracer import BACKWARD, FORWARD, LOSS
from .tensor import is_dtensor

#: PyTorch's class for each schedule
SCHEDULE_CLASSES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe", "interleaved": "ScheduleInterleaved1F1B",
                    "interleaved-zb": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
                    "dualpipev": "ScheduleDualPipeV"}
#: the schedules with two stages a rank, and how they lay them: "loop" (rank, rank + p) or "v" (rank, 2p − 1 − rank)
TWO_A_RANK = {"interleaved": "loop", "interleaved-zb": "loop", "zbv": "v", "dualpipev": "v"}
#: the zero-bubble schedules, replayed from PyTorch's lowered action list (schedule_runtime.py)
RUNTIME = frozenset({"interleaved-zb", "zbv", "dualpipev"})


@dataclass(frozen=True)
class Split:
    """Which of the model's children each stage runs: ``stages[s]`` is a range of child indices."""

    stages: tuple[range, ...]
    names: tuple[str, ...]  # the children's names (a real model's: its layers')
    plan: Any = None  # a real model's stages (stages.StagePlan): each stage is cut from the model (stages.py)

    def describe(self, stage: int) -> str:
        if self.plan is not None:
            return self.plan.describe(stage)
        r = self.stages[stage]
        first, last = self.names[r.start], self.names[r.stop - 1]
        return f"stage {stage}: {first}" if r.start == r.stop - 1 else f"stage {stage}: {first}–{last}"


def split(model: nn.Module, stages: int, split_points: tuple[str, ...] = (), units_of: Any = None) -> Split:
    """The stages of ``model`` (``units_of(model)``: its blocks); ``ValueError`` for a model that is no
    ``nn.Sequential``, transformers decoder or torchtitan model, unknown split points, or more stages than blocks."""
    if not isinstance(model, nn.Sequential):
        from .stages import model_parts, plan_stages

        parts = model_parts(model)
        if parts is None:
            raise ValueError(f"pipeline parallelism splits an nn.Sequential into stages (its children run one after "
                             f"the other, as torch.distributed.pipelining's manual stages do), or cuts a transformers "
                             f"decoder laid out as Llama's or a torchtitan model into stages; {type(model).__name__} "
                             "is neither: pass the model as nn.Sequential(embedding, *blocks, head), or estimate it "
                             "with pp=1")
        plan = plan_stages(model, parts, stages, split_points)
        return Split(tuple(range(ls[0], ls[-1] + 1) for ls in plan.layers),
                     tuple(parts.layer_name(i) for i in range(parts.n_layers)), plan)
    names = tuple(n for n, _ in model.named_children())
    children = list(model.children())
    if split_points:
        at = []
        for point in split_points:
            head = point.split(".")[0]
            if head not in names:
                raise ValueError(f"split point {point!r} is no child of the model (its children: "
                                 f"{', '.join(names[:6])}{'…' if len(names) > 6 else ''})")
            at.append(names.index(head))
        at = sorted(set(at))
        if at[0] == 0:
            raise ValueError(f"split point {names[0]!r} is the model's first child: a stage begins at each split "
                             "point, and the first stage at the first child")
        bounds = [0, *at, len(children)]
        return Split(tuple(range(a, b) for a, b in zip(bounds, bounds[1:])), names)
    units = {id(u) for u in (units_of(model) if units_of is not None else children)}
    blocks = [i for i, c in enumerate(children) if id(c) in units]
    if len(blocks) < stages:
        raise ValueError(f"pp={stages} needs at least {stages} blocks to split; {type(model).__name__} has "
                         f"{len(blocks)} ({', '.join(names[i] for i in blocks[:4])}…)" if blocks else
                         f"pp={stages}: the model has no blocks to split")
    per, extra = divmod(len(blocks), stages)
    starts, at = [], 0
    for s in range(stages):
        starts.append(blocks[at])
        at += per + (1 if s < extra else 0)
    starts[0] = 0  # what comes before the blocks joins the first stage
    bounds = [*starts, len(children)]
    return Split(tuple(range(a, b) for a, b in zip(bounds, bounds[1:])), names)


def stages_of(rank: int, ranks: int, n_stages: int, schedule: str = "1f1b") -> list[int]:
    """The stages rank ``rank`` holds: one, or under a looped schedule ``rank``, ``rank + p``, …, or under a V-shaped
    one ``rank`` and ``2p − 1 − rank``."""
    if TWO_A_RANK.get(schedule) == "v":
        return [rank, n_stages - 1 - rank]
    return list(range(rank, n_stages, ranks))


def receive_claims(stages: Any) -> list[tuple[torch.Tensor, tuple[str, str]]]:
    """The receive buffers of a rank's ``stages`` (activations in, gradients back), with their roles: alive from the
    first step on."""
    out = []
    for s in stages:
        out += [(t, received_role(s.index, "activations")) for t in s.received]
        out += [(t, received_role(s.index, "gradients")) for t in s.grads_in]
    return out


def check_micro_batches(schedule: str, m: int, ranks: int, n_stages: int, batch: int | None) -> None:
    """``ValueError`` where PyTorch's schedule would refuse ``m`` micro-batches, or the batch does not split."""
    if schedule == "1f1b" and m < ranks:
        raise ValueError(f"Schedule1F1B needs at least as many micro-batches as stages: micro_batches={m} < pp={ranks}")
    if schedule == "interleaved":
        rounds = max(1, m // ranks)
        if m % rounds:
            raise ValueError(f"ScheduleInterleaved1F1B needs micro_batches a multiple of its rounds ({rounds}): "
                             f"{m} is not")
    if batch is not None and batch % m:
        raise ValueError(f"the batch ({batch}) does not split into {m} equal micro-batches")


def actions(schedule: str, rank: int, ranks: int, m: int, n_stages: int) -> list[tuple[str, int, int]]:
    """``(kind, stage, micro-batch)`` in the order rank ``rank`` runs them (``kind``: "F" or "B")."""
    if schedule == "gpipe":
        return [("F", rank, j) for j in range(m)] + [("B", rank, j) for j in range(m)]
    if schedule == "1f1b":
        warmup = min(m, ranks - rank)
        out = [("F", rank, j) for j in range(warmup)]
        f, b = warmup, 0
        while b < m:
            out.append(("B", rank, b))
            b += 1
            if f < m:
                out.append(("F", rank, f))
                f += 1
        return out
    return interleaved_actions(rank, ranks, m, n_stages)


def interleaved_actions(rank: int, ranks: int, m: int, n_stages: int) -> list[tuple[str, int, int]]:
    """The rank's forwards and backwards under ``ScheduleInterleaved1F1B``, as PyTorch computes them
    (``_calculate_single_rank_operations``, called on the numbers it reads from its stages; torch 2.13, 2.15). Where
    the runtime makes receive buffers per use (:func:`buffers_per_use`) its receives, the sends of input gradients and
    the waits on sends come in too, where the runtime lowers them (:data:`COMMS`)."""
    from ..torch_private import interleaved_rank_ops, interleaved_rank_ops_with_comms

    rounds = max(1, m // ranks)
    numbers = SimpleNamespace(n_local_stages=n_stages // ranks, pp_group_size=ranks, _n_microbatches=m,
                              number_of_rounds=rounds, microbatches_per_round=m // rounds)
    lowered = buffers_per_use()
    try:
        ops = interleaved_rank_ops_with_comms(numbers, rank) if lowered else interleaved_rank_ops(numbers, rank)
    except (AttributeError, TypeError) as err:
        raise ValueError(f"the interleaved schedule's order could not be read from this PyTorch "
                         f"({torch.__version__}): {err}; estimate it with schedule='1f1b'") from err
    out = []
    for op in ops:
        if op is None:
            continue
        kind = str(getattr(op.computation_type, "value", op.computation_type))
        if kind in ("F", "B") or (lowered and kind in COMMS):
            out.append((kind, int(op.stage_index), int(op.microbatch_index)))
    return out


#: the lowered communication actions a rank's memory follows: a receive makes its buffer, a stage keeps a sent
#: output until the wait on its send, the sent input gradient is held until the wait on its send
COMMS = frozenset({"RECV_F", "RECV_B", "WAIT_SEND_F", "SEND_B", "WAIT_SEND_B"})


@dataclass
class StageOnRank:
    """One stage as its rank holds it: its module, its receive buffers, what is kept between its actions."""

    index: int
    module: nn.Module
    first: bool
    last: bool
    received: list[torch.Tensor]  # activations from the stage before, one per micro-batch (kept buffers)
    grads_in: list[torch.Tensor]  # gradients from the stage after, one per micro-batch (kept buffers)
    input_like: tuple[torch.Size, torch.dtype]  # what a receive of activations allocates
    output_like: tuple[torch.Size, torch.dtype]  # and of gradients

    def receive(self, what: str, claim: Any) -> torch.Tensor:
        """A receive buffer made for one receive (the runtime of ``_recv_buffers``), claimed as its role
        (``what``: "activations" or "gradients")."""
        t = _buffer(self.input_like, True) if what == "activations" else _buffer(self.output_like, False)
        claim(t, received_role(self.index, what))
        return t


def _buffer(like: tuple[torch.Size, torch.dtype], requires_grad: bool) -> torch.Tensor:
    shape, dtype = like
    return torch.empty(shape, dtype=dtype).requires_grad_(requires_grad)


@functools.lru_cache(maxsize=1)
def buffers_per_use() -> bool:
    """Whether the installed ``torch.distributed.pipelining`` makes each receive buffer just before its receive and
    lets go of it once the stage has used it, and lets go of a stage's sent output once its send is waited on
    (backward then starts from the output's gradient edge): the runtime of its ``_recv_buffers`` module (2.15).
    Before it (2.6–2.13) one buffer per micro-batch is made in the first step and kept, and sent outputs are kept
    until their backward."""
    return importlib.util.find_spec("torch.distributed.pipelining._recv_buffers") is not None


def make_stages(model: nn.Module, cut: Split, mine: list[int], micro: torch.Tensor, m: int,
                has_backward: bool, seq_shards: int = 1) -> list[StageOnRank]:
    """The rank's stages with their receive buffers, shaped by running the stages before on one fake micro-batch
    (no grad): what ``PipelineStage`` infers in its first step. A real model's stages are cut from it
    (``stages.build_stage``, over the fake copy's own modules) and pass ``(micro-batch, seq / seq_shards, hidden)``
    between them (``seq_shards``: sequence parallelism's shards), shapes known without running them (an MoE's
    routing, say, cannot run outside the traced step)."""
    n = len(cut.stages)
    likes: dict[int, tuple[Any, Any]] = {}  # (input, output) per stage: (shape, dtype)
    if cut.plan is not None:
        from .stages import build_stage, hidden_like

        modules = {s: build_stage(model, cut.plan, s, copy_weights=False) for s in mine}
        for module in modules.values():
            module.seq_shards = seq_shards
        width, dtype = hidden_like(model, cut.plan.parts)
        hidden = (torch.Size((micro.shape[0], micro.shape[1] // seq_shards, width)), dtype)
        likes = {s: ((micro.shape, micro.dtype) if s == 0 else hidden, hidden) for s in mine}
    else:
        children = list(model.children())
        modules = {s: nn.Sequential(*[children[i] for i in cut.stages[s]]) for s in mine}
        with torch.no_grad():
            x = micro
            for s, r in enumerate(cut.stages):
                y = x
                for i in r:
                    y = children[i](y)
                likes[s] = ((x.shape, x.dtype), (y.shape, y.dtype))
                x = y
    out = []
    kept = not buffers_per_use()
    for s in mine:
        input_like, output_like = likes[s]
        received = [] if s == 0 or not kept else [_buffer(input_like, has_backward) for _ in range(m)]
        grads_in = [] if s == n - 1 or not has_backward or not kept else [_buffer(output_like, False)
                                                                          for _ in range(m)]
        out.append(StageOnRank(s, modules[s], s == 0, s == n - 1, received, grads_in, input_like, output_like))
    return out


class PipelineRank:
    """The forwards and backwards of one rank's stages in its schedule's order, on fake tensors under the step
    tracer (the step's optimizer, ``zero_grad`` and marks are the step's own)."""

    def __init__(self, stages: list[StageOnRank], order: list[tuple[str, int, int]], m: int, schedule: str,
                 ranks: int) -> None:
        self.stages = {s.index: s for s in stages}
        self.order, self.m, self.schedule, self.ranks = order, m, schedule, ranks
        self.per_use = buffers_per_use()
        self.kept: list[Any] = []  # what outlives the step: the last stage's outputs, the sent-back gradients
        self.loss_of: Any = None  # (output, micro-batch) → loss; None: the step's loss_fn or stand-in of the output

    def claims(self) -> list[tuple[torch.Tensor, tuple[str, str]]]:
        """The receive buffers, alive from the first step on."""
        return receive_claims(self.stages.values())

    def run(self, step: Any, batch: Any, last: bool) -> None:
        """One step's forwards and backwards (``batch``: the first stage's input, split into micro-batches)."""
        tracer, claim = step.tracer, step.claim
        loss_fn = step.request.loss_fn or _stated(step)
        loss_of = self.loss_of or (lambda output, j: loss_fn(output))
        micro = torch.tensor_split(batch, self.m) if batch is not None else [None] * self.m
        cache: dict[tuple[int, int], tuple[Any, Any]] = {}
        losses: dict[tuple[int, int], Any] = {}
        outputs: dict[int, list[Any]] = {s: [] for s in self.stages}
        held: list[Any] = []  # sent outputs whose works the schedule keeps until the step's end
        warm_send: Any = None
        latest_send: Any = None
        bwd_send: Any = None
        self.kept = []
        forwards = sum(1 for kind, _, _ in self.order if kind == "F")
        done = 0
        sent: list[tuple[int, int]] = []  # forwards whose sends are not yet waited on (buffers made per use)
        lowered = any(kind in COMMS for kind, _, _ in self.order)  # the runtime's receives and waits are listed
        received: dict[tuple[str, int, int], Any] = {}  # buffers received ahead of their forward or backward
        sends: dict[tuple[int, int], Any] = {}  # input gradients sent back, until the wait on their send
        for kind, s, j in self.order:
            stage = self.stages[s]
            if kind in COMMS:
                if kind == "RECV_F":
                    received[("F", s, j)] = stage.receive("activations", claim)
                elif kind == "RECV_B":
                    received[("B", s, j)] = stage.receive("gradients", claim)
                elif kind == "WAIT_SEND_F" and (s, j) in cache:
                    _release_sent(cache, [(s, j)])
                elif kind == "WAIT_SEND_B":
                    sends.pop((s, j), None)
                continue
            if self.per_use and sent and kind == "B":
                _release_sent(cache, sent)  # every send is waited on before a backward
            if kind == "F":
                tracer.stage = FORWARD
                if stage.first:
                    inp = micro[j]
                elif self.per_use:
                    inp = received.pop(("F", s, j), None)
                    if inp is None:
                        inp = stage.receive("activations", claim)
                else:
                    inp = stage.received[j]
                out = stage.module(inp)
                cache[(s, j)] = (out, inp)
                if stage.last:
                    outputs[s].append(out)
                    claim(out, outputs_role(s))
                    tracer.stage = LOSS
                    losses[(s, j)] = loss_of(out, j)
                elif lowered:
                    pass  # kept until the wait on its send
                elif self.per_use:
                    if self.schedule == "1f1b":
                        _release_sent(cache, sent)  # 1F1B waits on the send before once this forward is done
                    sent.append((s, j))
                elif self.schedule == "1f1b":
                    if j < min(self.m, self.ranks - s) - 1:  # fired in the warm-up
                        warm_send = out
                    latest_send = out
                else:
                    held.append(out)
                done += 1
                if done == forwards and last:
                    step.marks["forward_end"] = len(tracer.counts.events)
                del out, inp
            else:
                tracer.stage = BACKWARD
                out, inp = cache.pop((s, j))
                if stage.last:  # the schedule keeps each loss (and through its graph the stage's inputs) to the end
                    torch.autograd.backward(losses[(s, j)])
                elif self.per_use:
                    grad_out = received.pop(("B", s, j), None)
                    if grad_out is None:
                        grad_out = stage.receive("gradients", claim)
                    torch.autograd.backward(out, grad_tensors=grad_out)
                    del grad_out
                else:
                    torch.autograd.backward(out, grad_tensors=stage.grads_in[j])
                if not stage.first:  # the input's gradient, sent back: PyTorch takes it off the buffer
                    grad, inp.grad = inp.grad, None
                    if lowered:
                        sends[(s, j)] = grad
                    elif self.schedule == "1f1b":
                        bwd_send = grad  # the send ops of the latest backward, until the next one's
                    else:
                        held.append(grad)
                    del grad
                for p in stage.module.parameters():
                    claim(p.grad, ("gradients", "gradients"))
                if stage.last and not stage.first:
                    _detach(out)
                del out, inp
        for outs in outputs.values():
            if outs:
                merged = torch.cat(outs)  # what step() returns; the caller lets go of it
                claim(merged, MERGED)
                del merged
                self.kept.extend(outs)
        with torch.no_grad():
            for stage in self.stages.values():
                for p in stage.module.parameters():
                    if p.grad is not None:
                        p.grad.div_(self.m)
        del held, warm_send, latest_send, bwd_send, outputs, cache, losses, sends, received


def _release_sent(cache: dict[tuple[int, int], tuple[Any, Any]], sent: list[tuple[int, int]]) -> None:
    """The stage lets go of the outputs whose sends completed (``release_fwd_send_outputs``): its backward starts
    from each output's gradient edge, so an output that autograd does not save is freed here. A ``DTensor``
    output is kept, as PyTorch keeps any output that is not a plain tensor."""
    from torch.autograd.graph import get_gradient_edge

    for key in sent:
        out, inp = cache[key]
        if isinstance(out, torch.Tensor) and not is_dtensor(out) and out.requires_grad:
            cache[key] = (get_gradient_edge(out), inp)
        del out, inp
    sent.clear()


def _detach(out: torch.Tensor) -> None:
    """The last stage's output let go of its graph (``backward_one_chunk``; PyTorch leaves a view as it is)."""
    try:
        out.detach_()
    except RuntimeError:  # a view
        pass


def _stated(step: Any) -> Any:
    """The stand-in loss a step uses when none is given, noting which it was."""
    from ..step.loss import stand_in_loss

    def loss(output: Any) -> torch.Tensor:
        value, step.loss_used = stand_in_loss(output)
        return value

    return loss


__all__ = ["RUNTIME", "SCHEDULES", "SCHEDULE_CLASSES", "TWO_A_RANK", "PipelineRank", "Split", "StageOnRank", "actions",
           "check_micro_batches", "interleaved_actions", "make_stages", "split", "stages_of"]
