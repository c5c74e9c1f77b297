"""The model-parallel options of an estimate (tensor, pipeline and context parallelism, the pipeline's schedule
and the user's ``parallelize_plan``), checked once with messages that say what is accepted (a leaf)."""

from __future__ import annotations

from typing import Any

#: the pipeline schedules (``torch.distributed.pipelining``'s ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B,
#: and the zero-bubble ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV)
SCHEDULES = ("1f1b", "gpipe", "interleaved", "interleaved-zb", "zbv", "dualpipev")


def parse_parallel(tp: Any, pp: Any, micro_batches: Any, schedule: Any, plan: Any, world: int, zero: Any,
                   inference: bool, accumulate: int, cp: Any = 1) -> dict[str, Any]:
    """The model-parallel options checked (``ValueError``/``TypeError`` naming what is accepted), with ``world``
    (``tp × pp × cp`` when it was left at 1)."""
    for name, n, what in (("tp", tp, "tensor-parallel ranks"), ("cp", cp, "context-parallel ranks")):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be a whole number ≥ 1 (the {what}), not {n!r}")
    split_points: tuple[str, ...] = ()
    if isinstance(pp, (list, tuple)):
        if not pp or not all(isinstance(p, str) for p in pp):
            raise TypeError("pp takes the number of stages, or a list of the modules where the stages after the "
                            "first begin (e.g. pp=['4', '8'] for three stages)")
        split_points, pp = tuple(pp), len(pp) + 1
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pp must be a whole number ≥ 1 (the pipeline stages) or a list of split points, not {pp!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, not {schedule!r}")
    if micro_batches is not None and (isinstance(micro_batches, bool) or not isinstance(micro_batches, int)
                                      or micro_batches < 1):
        raise ValueError(f"micro_batches must be a whole number ≥ 1, not {micro_batches!r}")
    if micro_batches is not None and pp == 1:
        raise ValueError("micro_batches is the pipeline's (pp ≥ 2); for gradient accumulation give accumulate=K")
    if plan is not None and tp == 1:
        raise ValueError("parallelize_plan applies with tp ≥ 2 (the tensor-parallel ranks)")
    if plan is not None:
        plan = parse_plan(plan)
    if pp > 1 and inference:
        raise ValueError("pp estimates a training step (a pipeline's forwards and backwards); drop inference=True")
    if pp > 1 and accumulate > 1:
        raise ValueError("with pp the batch is split into micro_batches; give micro_batches=K instead of accumulate")
    ranks = tp * pp * cp
    if ranks > 1:
        if world == 1:
            world = ranks
        if world % ranks:
            what, cps = (f" × cp={cp}", "cp × ") if cp > 1 else ("", "")
            raise ValueError(f"tp × pp × {cps}dp must equal world: tp={tp} × pp={pp}{what} = {ranks} does not divide "
                             f"world={world}; give world as a multiple of {ranks} (dp = world / {ranks})")
        ranks = tp * pp  # ZeRO and FSDP shard over dp × cp, as torchtitan's FSDP mesh does
        if zero is not None and world // ranks < 2:
            raise ValueError(f"zero shards over the data-parallel ranks, dp = world / (tp × pp) = {world // ranks}: "
                             f"give world={2 * ranks} or more with zero")
    return {"tp": tp, "pp": pp, "split_points": split_points, "micro_batches": micro_batches if pp > 1 else None,
            "schedule": schedule, "parallelize_plan": plan, "world": world, "cp": cp}


def parse_plan(plan: Any) -> tuple[tuple[str, Any], ...]:
    """The user's ``parallelize_plan`` as ``((module name or pattern, style), ...)``; ``TypeError`` for anything
    but a dict of PyTorch's parallel styles."""
    if not isinstance(plan, dict) or not plan:
        raise TypeError("parallelize_plan must be a dict from module names to parallel styles, as "
                        "parallelize_module takes it, e.g. {'0': ColwiseParallel(), '2': RowwiseParallel()}, not "
                        f"{type(plan).__name__}")
    from torch.distributed.tensor.parallel import ParallelStyle

    for name, style in plan.items():
        if not isinstance(name, str) or not isinstance(style, ParallelStyle):
            raise TypeError(f"parallelize_plan: {name!r} → {type(style).__name__}: each entry must be a module name "
                            "(or a pattern such as 'layers.*.mlp') and a style (ColwiseParallel, RowwiseParallel, "
                            "SequenceParallel, PrepareModuleInput, ...)")
    return tuple(plan.items())
