"""A plan of the user's own step (``plan(model, inputs, step=fn)``): what it may search — only what the step leaves to
the planner, the sharding over the GPUs and the optimizer's state on the host — and what conflicts with a step traced
as written (``planner.py`` runs the search)."""

from __future__ import annotations

from typing import Any

from ..options import Options
from .choices import Choice, searched_batches, searched_layouts


def step_choices(base: Options, global_batch: int, gpus: int, allow: frozenset[str]) -> list[Choice]:
    """The combinations a plan of the user's own step (``step=fn``) scores: only what the step leaves to the planner —
    how the model states are sharded over the GPUs (ZeRO-1/2/3, FSDP) and the optimizer's state on the host, at the
    whole batch a rank (half of it with ``allow="batch"``). Checkpointing, precision, accumulation and the recipes'
    levers are the step's: a plan never rewrites it."""
    return [Choice(g // gpus, 1, False, zero, off, None, base.lora, base.quantize, None, g)
            for g in searched_batches(global_batch, gpus, allow) for zero, off in searched_layouts(base, gpus)]


#: what ``allow=`` may name with ``step=``: the rest would rewrite the user's step or model
STEP_ALLOWED = frozenset({"batch"})


def check_step(step: Any, allowed: frozenset[str], generate: Any, loss_fn: Any, fixed: dict[str, Any]) -> None:
    """``ValueError`` where ``step=`` comes with what conflicts with a step traced as written."""
    if not callable(step):
        raise TypeError(f"step must be a function fn(model, batch, optimizer) that runs one training step, not "
                        f"{type(step).__name__}")
    conflicts = [f"allow={','.join(sorted(allowed - STEP_ALLOWED))!r}"] if allowed - STEP_ALLOWED else []
    conflicts += ["generate="] if generate is not None else []
    conflicts += ["loss_fn="] if loss_fn is not None else []
    conflicts += [f"{k}=" for k in fixed]
    if conflicts:
        raise ValueError(f"step= plans your step as you wrote it, which {', '.join(conflicts)} would rewrite or "
                         "replace (the recipes' levers, LoRA, another optimizer, tensor or pipeline parallelism, a "
                         "generate() call, another loss): write them into the step, or drop step= to plan the "
                         "built-in step; with step= the plan searches the sharding over the GPUs, the optimizer's "
                         "state on the host and (allow='batch') half the global batch")


def step_name(fn: Any) -> str:
    """What a plan calls the user's step: its function's name."""
    return getattr(fn, "__name__", type(fn).__name__)
