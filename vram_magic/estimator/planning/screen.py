"""The screen of a layout search: a combination's memory per rank and its step time, from two shallow traces of its
trace class instead of a fake run of its own.

A trace class (checkpointing, precision, the tensor-parallel degree; FSDP2's world) is traced at one micro-batch of
one sample, on the model cut to ``d`` and ``d + 1`` blocks (``depth.py``). What one more block adds is every block's
(:class:`Fit`): the memory by category at the peak and at the end of the forward (replays of the two traces for each
ZeRO stage and sharding degree: milliseconds), the ops' times, the bytes the collectives move. A combination is then
scored at its own depth (a pipeline stage's blocks), micro-batch (the activations and the ops scaled), context
parallelism (the sequence's share, the ring's buffers) and mesh (``timing/overlap.py``). All of it is interpolated
and the plan says so (``Scored.exact``); the rows shown are estimated exactly (``estimate(**row.options)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..options import Options
from ..timing.cost import forward_backward
from ..timing.overlap import RankWork
from ..timing.step_time import micro_ops

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "other")


@dataclass(frozen=True)
class Fit:
    """A figure at ``blocks`` blocks: ``base + per_block × blocks``."""

    base: float
    per_block: float

    @classmethod
    def of(cls, low: float, high: float, d_low: int, d_high: int) -> Fit:
        per = (high - low) / (d_high - d_low)
        return cls(low - per * d_low, per)

    def at(self, blocks: float) -> float:
        return self.base + self.per_block * blocks

    def mixed(self, other: Fit, weight: float) -> Fit:
        """``(1 − weight) × self + weight × other``."""
        return Fit(self.base + (other.base - self.base) * weight,
                   self.per_block + (other.per_block - self.per_block) * weight)


@dataclass(frozen=True)
class Memory:
    """One rank's bytes by category at the peak and at the end of the forward, as fits in the blocks, and what the
    device needs beyond the peak's bytes (the caching allocator's, the CUDA context)."""

    peak: dict[str, Fit]
    forward: dict[str, Fit]
    overhead: float

    def mixed(self, other: Memory, weight: float) -> Memory:
        return Memory({k: v.mixed(other.peak[k], weight) for k, v in self.peak.items()},
                      {k: v.mixed(other.forward[k], weight) for k, v in self.forward.items()},
                      self.overhead + (other.overhead - self.overhead) * weight)


@dataclass(frozen=True)
class Work:
    """One micro-batch of one sample's work on a rank, as fits in the blocks (``RankWork``'s fields)."""

    forward: Fit
    backward: Fit
    compute: Fit
    memory: Fit
    recompute: Fit
    optimizer: Fit
    gather: Fit
    reduce: Fit
    tp: dict[str, Fit] = field(default_factory=dict)
    tp_count: Fit = Fit(0.0, 0.0)

    def mixed(self, other: Work, weight: float) -> Work:
        mix = {n: getattr(self, n).mixed(getattr(other, n), weight) for n in
               ("forward", "backward", "compute", "memory", "recompute", "optimizer", "gather", "reduce", "tp_count")}
        return Work(**mix, tp={k: v.mixed(other.tp.get(k, v), weight) for k, v in self.tp.items()})


def breakdown_fits(low: Any, high: Any, d_low: int, d_high: int) -> dict[str, Fit]:
    """Each category's fit; one that shrinks with a block more (the peak moved to another moment of the step, e.g.
    from the loss's logits to the backward) is held at the larger of the two instead of extrapolated down: the
    screen must not promise a fit the exact estimate then refuses (each refusal is a whole-model trace)."""
    out = {}
    for c in CATEGORIES:
        a, b = float(low[c]), float(high[c])
        out[c] = Fit.of(a, b, d_low, d_high) if b >= a else Fit(a, 0.0)
    return out


def memory_fit(low: Any, high: Any, d_low: int, d_high: int) -> Memory:
    """The fits of two estimates of one configuration at ``d_low`` and ``d_high`` blocks."""
    return Memory(breakdown_fits(low.peak, high.peak, d_low, d_high),
                  breakdown_fits(low.after_forward, high.after_forward, d_low, d_high),
                  float(high.needed - high.peak.total))


def trace_work(trace: Any, opts: Options, rates: Any) -> RankWork:
    """What one micro-batch of the traced rank does (and its update): its forward and backward seconds, their parts,
    its blocks and the bytes its collectives move (the data-parallel ones in their dtypes, FSDP2's as it gathers and
    reduces them; the tensor-parallel ones as the trace made them)."""
    from ..layouts.tensor import collective_volumes
    from ..timing.cost import fsdp_traffic

    ops = micro_ops(trace, rates)
    n = max(trace.micro_steps, 1)
    if opts.pp > 1:  # a pipeline rank's trace runs all of the step's micro-batches
        n = opts.micro_batches or opts.pp
        ops = replace(ops, compute=ops.compute / n, memory=ops.memory / n, recompute=ops.recompute / n)
    fwd, bwd = forward_backward(trace.ops, rates, trace.ops_start)
    if opts.fsdp_traced:
        traffic = fsdp_traffic(opts, trace)
        gather, reduce = traffic.gather, traffic.reduce
    else:
        gather, reduce = float(trace.param_bytes), float(trace.grad_bytes)
    volumes, count = collective_volumes(trace) if opts.tp > 1 else ({}, 0)
    units = trace.unit_param_bytes
    root = max(float(trace.param_bytes - sum(units)), 0.0) if units else 0.0
    return RankWork(forward=fwd / n, backward=bwd / n, compute=ops.compute, memory=ops.memory,
                    recompute=ops.recompute, optimizer=ops.optimizer, blocks=len(units), gather=gather,
                    reduce=reduce, root=root, tp={k: v / n for k, v in volumes.items()}, tp_count=round(count / n))


def work_fit(low: RankWork, high: RankWork, d_low: int, d_high: int) -> Work:
    def f(name: str) -> Fit:
        return Fit.of(getattr(low, name), getattr(high, name), d_low, d_high)

    return Work(f("forward"), f("backward"), f("compute"), f("memory"), f("recompute"), f("optimizer"),
                f("gather"), f("reduce"),
                {k: Fit.of(low.tp.get(k, 0.0), v, d_low, d_high) for k, v in high.tp.items()},
                Fit.of(low.tp_count, high.tp_count, d_low, d_high))


@dataclass(frozen=True)
class Stage:
    """A rank's part of the model: its blocks, whether it holds the embedding and the head, the micro-batches whose
    activations it holds at once."""

    blocks: float
    first: bool
    last: bool
    in_flight: float


def stages(blocks: int, pp: int, micro_batches: int, schedule: str) -> list[Stage]:
    """The first and the last stage of a pipeline (the most loaded in memory and in time), or the whole model.
    1F1B and ZB-V keep ``min(m, p)`` micro-batches' activations on the first stage (ZB-V: the same peak as 1F1B, Qi et
    al. 2024), the interleaved schedule ``(1 + (p − 1)/(p v))`` times that with ``v`` = 2 stages a rank (Korthikanti et
    al. 2022); the last stage holds one."""
    if pp == 1:
        return [Stage(blocks, True, True, 1.0)]
    per = blocks / pp
    held = float(min(micro_batches, pp))
    if schedule == "interleaved":
        held *= 1 + (pp - 1) / (pp * 2)
    elif schedule == "gpipe":
        held = float(micro_batches)
    return [Stage(per, True, False, held), Stage(per, False, True, 1.0)]


def stage_bytes(mem: Memory, stage: Stage, scale: float, ends: tuple[float, float], param_per_block: float,
                held_grads: float, extra: float) -> float:
    """What one stage's rank needs: each phase's states at its blocks (less the embedding's or the head's, ``ends``
    in parameter bytes, where the stage holds neither: each category's bytes per parameter byte as the blocks have
    them), its activations scaled (``scale``: micro-batch × sequence share) and held ``in_flight`` times over, the
    rest as the anchor had it; the gradients a step of several micro-batches keeps through the next forward
    (``held_grads``); the larger phase, plus ``extra`` (buffers the anchor lacked) and the allocator's overhead."""
    first, last = ends
    best = 0.0
    for phase in (mem.peak, mem.forward):
        total = extra + (held_grads if phase is mem.forward else 0.0)
        for cat in ("parameters", "gradients", "optimizer_state"):
            value = phase[cat].at(stage.blocks)
            ratio = phase[cat].per_block / param_per_block if param_per_block > 0 else 0.0
            if not stage.first:
                value -= first * ratio
            if not stage.last:
                value -= last * ratio
            total += max(value, 0.0)
        acts = phase["activations"]
        total += max(acts.per_block, 0.0) * stage.blocks * stage.in_flight * scale
        if stage.last:
            total += max(acts.base, 0.0) * scale
        total += max(phase["other"].at(stage.blocks), 0.0)
        best = max(best, total)
    return best + mem.overhead


def scaled_work(w: Work, stage: Stage, scale: float) -> RankWork:
    """A stage's work in one micro-batch ``scale`` times the anchor's (its update as traced: it does not depend on the
    micro-batch)."""
    b = stage.blocks
    base = 1.0 if stage.last else 0.0
    per = lambda f: max(f.per_block * b + f.base * base, 0.0) * scale  # noqa: E731
    return RankWork(forward=per(w.forward), backward=per(w.backward), compute=per(w.compute), memory=per(w.memory),
                    recompute=per(w.recompute), optimizer=max(w.optimizer.at(b), 0.0),
                    blocks=max(int(round(b)), 1), gather=max(w.gather.at(b), 0.0), reduce=max(w.reduce.at(b), 0.0),
                    root=max(w.gather.base, 0.0), tp={k: max(v.at(b), 0.0) * scale for k, v in w.tp.items()},
                    tp_count=max(int(round(w.tp_count.at(b))), 0))


__all__ = ["CATEGORIES", "Fit", "Memory", "Stage", "Work", "breakdown_fits", "memory_fit", "scaled_work",
           "stage_bytes", "stages", "trace_work", "work_fit"]
