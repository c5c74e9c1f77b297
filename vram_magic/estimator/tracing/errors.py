"""What went wrong in a fake run, said once and clearly: :class:`EstimateError`, and the message naming the op,
the module, the shapes the op saw and the stage (with a word about the inputs only when they are the likely
cause)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from torch import nn

from ...engine.tracker.oom_frames import ShownAtUsersLine
from ..fake.convert import TensorSpec, is_named_tuple, takes_one
from .tracer import BACKWARD, FORWARD, LOSS, OPTIMIZER, SETUP, ZERO_GRAD


class EstimateError(ShownAtUsersLine, RuntimeError):
    """The model could not run on fake tensors for a reason in the model or its inputs (not a fake-tensor
    limitation): a shape mismatch, a missing argument, an exception in user code. In IPython its traceback ends at
    the user's line (the ``estimate()`` call, or the model's code that failed), the estimator's frames left out."""


STAGE_WORDS = {FORWARD: "the forward pass", LOSS: "the loss", BACKWARD: "the backward pass",
               OPTIMIZER: "the optimizer step", ZERO_GRAD: "zero_grad", SETUP: "the step"}


def failure_message(err: Exception, tracer: Any, model: nn.Module, specs: Any) -> str:
    """What went wrong, where (op, module, the shapes the op saw, the stage of ``tracer``, a ``StepTracer``) and,
    only when the inputs are the likely cause, a word about them."""
    message = str(err).strip().splitlines()[0] if str(err).strip() else ""
    if tracer.failed_in is None:
        where = tracer.module() or "(top level)"
        stage = STAGE_WORDS.get(tracer.stage, "the step")
        text = f"the model raised {type(err).__name__} in module {where!r} during {stage}: {message}"
        if isinstance(err, TypeError) and tracer.stage == FORWARD and not tracer.modstack:
            bad = call_mismatch(model, specs)
            if bad:
                text += f" — the inputs do not match the model's forward(): {bad}"
        return text
    op, where, shapes = tracer.failed_in
    stage = tracer.failed_stage
    during = STAGE_WORDS.get(stage, "the step")
    if stage == BACKWARD and where != "(top level)":
        during = "the recomputed forward of activation checkpointing (in the backward pass)"
    text = (f"the model raised {type(err).__name__} in module {where!r} at {op} on ({shapes}) during {during}: "
            f"{message}")
    if tracer.failed_on_input and stage in (FORWARD, LOSS):
        text += (" — the op received one of the inputs directly: check their shapes and dtypes "
                 f"({describe_specs(specs)})")
    return text


def describe_specs(specs: Any) -> str:
    """The inputs as people read them: ``(4, 64) int64, mask=(4, 64) bool``."""

    def one(s: Any) -> str:
        return f"{tuple(s.shape)} {str(s.dtype).replace('torch.', '')}" if isinstance(s, TensorSpec) else repr(s)

    if isinstance(specs, Mapping):
        return ", ".join(f"{k}={one(v)}" for k, v in specs.items())
    if isinstance(specs, (tuple, list)):
        return ", ".join(one(v) for v in specs)
    return one(specs)


def call_mismatch(model: nn.Module, specs: Any) -> str:
    """Why the inputs cannot bind to ``model.forward``'s signature (``""`` when they can or it has none)."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return ""
    try:
        if isinstance(specs, Mapping):
            sig.bind(**specs)
        elif isinstance(specs, (tuple, list)) and not (is_named_tuple(specs) and takes_one(model, specs)):
            sig.bind(*specs)
        else:
            sig.bind(specs)
    except TypeError as bad:
        return f"{bad} (forward{sig})"
    return ""


__all__ = ["STAGE_WORDS", "EstimateError", "call_mismatch", "describe_specs", "failure_message"]
