"""A step of a tensor- or pipeline-parallel job, estimated per rank: one trace per role (every tensor-parallel rank
of a stage holds the same shapes; each pipeline rank its own stages), each replayed for the target device with
ZeRO over the data-parallel ranks, the most loaded rank as the headline.

Ranks are numbered as torchtitan's mesh ``(dp, pp, tp)`` numbers them: rank ``r`` is tensor-parallel rank
``r % tp`` of pipeline rank ``(r // tp) % pp`` in data-parallel group ``r // (tp × pp)``."""

from __future__ import annotations

from typing import Any

from ..options import Options
from ..replay import from_trace
from ..result import ParallelEstimate, RankEstimate, fits_of
from .low_bit_optimizers import paged_note, paged_share


def pipeline_rank(rank: int, opts: Options) -> int:
    return (rank // opts.tp) % opts.pp


def pipeline_stages(opts: Options, pp_rank: int) -> tuple[int, ...]:
    """The pipeline stages rank ``pp_rank`` holds (none without a pipeline)."""
    if opts.pp == 1:
        return ()
    from ..layouts.pipeline import TWO_A_RANK, stages_of

    n = opts.pp * (2 if opts.schedule in TWO_A_RANK else 1)
    return tuple(stages_of(pp_rank, opts.pp, n, opts.schedule))


def role_name(opts: Options, pp_rank: int, stages: tuple[int, ...]) -> str:
    parts = []
    if opts.pp > 1:
        what = ", ".join(str(s) for s in stages)
        parts.append(f"pipeline stage{'s' if len(stages) > 1 else ''} {what}")
    if opts.tp > 1:
        parts.append(f"a tensor-parallel shard of {opts.tp}")
    if opts.dp > 1:
        parts.append(f"one of {opts.dp} data-parallel replicas" + (f" (ZeRO-{opts.zero})" if opts.zero else ""))
    return ", ".join(parts)


def evaluate_ranks(workload: Any, opts: Options) -> ParallelEstimate:
    """The estimate of every rank of the job ``opts`` describe (``workload``: a step's, which traces and keeps the
    traces)."""
    roles: list[RankEstimate] = []
    replays = []
    for pp_rank in range(opts.pp):
        o = opts.with_(pp_rank=pp_rank)
        trace = workload.trace(o)
        r = from_trace(trace, o, workload.target)
        stages = pipeline_stages(opts, pp_rank)
        ranks = tuple(k for k in range(opts.world) if pipeline_rank(k, opts) == pp_rank)
        roles.append(RankEstimate(
            ranks=ranks, role=role_name(opts, pp_rank, stages), stages=stages, peak=r.peak,
            after_forward=r.after_forward, needed=r.needed, reserved=r.reserved, capacity=r.capacity,
            fits=fits_of(r.fits, trace.problem is not None), model_states=r.model_states, modelled=r.modelled))
        replays.append((trace, r))
    top = max(range(len(roles)), key=lambda i: (roles[i].needed, -i))
    trace, r = replays[top]
    gpu = workload.target.gpu
    problems = [t.problem for t, _ in replays if t.problem is not None]
    fits = None if r.capacity is None else False if any(x.fits is False for x in roles) else \
        fits_of(True, bool(problems))
    notes = list(r.notes)
    if opts.pp > 1:
        notes.append(f"the headline is rank {roles[top].ranks[0]}'s ({roles[top].role}), the most loaded; each "
                     "rank's peak is in est.ranks[r]")
    paged = paged_share(trace.paged, opts)
    if paged:
        notes.append(paged_note(paged))
    return ParallelEstimate(
        model=workload.request.name, description=opts.describe(), device=opts.device, peak=r.peak,
        after_forward=r.after_forward, top_modules=r.top_modules, flops=dict(trace.flops), batch=trace.batch,
        seq=trace.seq, micro_batch=trace.micro_batch, parameters=sum_parameters(replays),
        gpu=gpu.name if gpu is not None else None, capacity=r.capacity, reserved=r.reserved, context=r.context,
        needed=r.needed, fits=fits, partial=bool(problems), problem=trace.problem or next(iter(problems), None),
        modelled=r.modelled, notes=tuple(notes), wall_time=sum(t.wall for t, _ in replays), loss=trace.loss,
        model_states=r.model_states, paged=paged, step=trace.step, options=opts, rerun=workload,
        ranks=tuple(roles[pipeline_rank(k, opts)] for k in range(opts.world)), roles=tuple(roles),
        most_loaded=roles[top].ranks[0], tp=opts.tp, pp=opts.pp, dp=opts.dp,
        micro_batches=(opts.micro_batches or opts.pp) if opts.pp > 1 else None,
        schedule=opts.schedule if opts.pp > 1 else "")


def sum_parameters(replays: list[Any]) -> int:
    """The model's parameters: a stage's count of its own, summed over the stages (a tensor-parallel trace counts
    the whole parameters)."""
    return sum(t.param_count for t, _ in replays)


__all__ = ["evaluate_ranks", "pipeline_rank", "pipeline_stages", "role_name"]
