"""``step=fn``: one training step as the user writes it, ``fn(model, batch, optimizer)``, traced exactly as written —
every hook, context manager, custom autograd function and loss of it runs on the fake model, ``steps`` times (the first
makes the optimizer's state, as the built-in step's does).

Nothing here decides where the step is: each op's stage is read as ``%%vram`` reads a measured cell's
(``engine/tracker/now.py``): an optimizer step (also one inside backward), backward (checkpointing's recompute there
too), a module's forward, the loss (code outside modules after a forward with grad), the rest of the step. So an
estimate of ``fn`` names its memory as a measurement of ``fn`` would, and the gradients and the optimizer state are the
tensors the optimizers step on and keep (PyTorch's global optimizer hooks: any optimizer, one per parameter included).

``optimizer``: what ``optimizer=`` makes — the optimizer of a name, class or object on the trainable parameters, or,
for a callable ``model -> anything``, what it returns, called once on the fake model before the first step (so it can
make one optimizer per parameter and hook them, or a scheduler, or a tuple of both).
"""

from __future__ import annotations

import contextlib
import linecache
from typing import Any

import torch

from ....engine.torch_private import never_compiled
from ....engine.tracker.frames import is_user_code
from ...fake.known_values import value_of
from ...options import OptimizerChoice
from ...tracing.errors import failure_message
from ...tracing.tracer import BACKWARD, OPTIMIZER, SETUP, StepTracer
from ..first_step import claim_state

_ITEM = torch.ops.aten._local_scalar_dense.default
_UNSET = object()


class UserStepTracer(StepTracer):
    """The step tracer of a user's step: each op's stage read from where the code is (the tracker's own rules), the
    events where backward began and ended noted, and value reads outside the model (a step that logs
    ``loss.item()``) answered with a stand-in value, counted in ``guessed``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.first_backward: int | None = None
        self.last_backward = 0
        self.guessed = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.compiling:
            now = self.now
            stage = self.stage = now.phase()
            if stage == BACKWARD:
                events = len(self.counts.events)
                if self.first_backward is None:
                    self.first_backward = events
                self.last_backward = events
            elif func is _ITEM and not now.modules and stage != OPTIMIZER and value_of(args[0]) is None:
                self.guessed += 1
                return self.item_value
        return super().__torch_dispatch__(func, types, args, kwargs)


never_compiled(UserStepTracer.__torch_dispatch__)


def makes_argument(spec: Any) -> bool:
    """Whether ``optimizer=`` is a callable that makes the step's optimizer argument (not a name, class or object)."""
    return callable(spec) and not isinstance(spec, (str, type, OptimizerChoice, torch.optim.Optimizer))


class UserStep:
    """The user's step ``fn`` in one fake run: what it receives as its optimizer (made once) and how it ran."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.argument: Any = _UNSET
        self.name = getattr(fn, "__name__", type(fn).__name__)

    def run(self, step: Any, last: bool) -> None:
        """One call of ``fn`` under the fake step ``step`` (``trace._FakeStep``): the gradients and state the
        optimizers meet claimed as such, the gradients left at the end too, the marks of the last step set."""
        tracer = step.tracer
        if self.argument is _UNSET:
            tracer.stage = SETUP
            self.argument = step.opts.optimizer(step.model) if makes_argument(step.opts.optimizer) else step.optimizer
        tracer.first_backward = None
        with _claiming(step), step.levers.saving():
            self.fn(step.runner, step.inputs, self.argument)
        for p in step.trainable:
            step.claim(p.grad, ("gradients", "gradients"))
        tracer.stage = SETUP
        if last:
            end = len(tracer.counts.events)
            step.marks["forward_end"] = tracer.first_backward if tracer.first_backward is not None else end
            step.marks["backward_end"] = tracer.last_backward or end
            step.marks["step_end"] = end

    def failure(self, err: Exception, tracer: Any, model: Any, specs: Any) -> str:
        """What went wrong and where: the op, module and stage (``tracing/errors.py``) and the line of the step."""
        text = failure_message(err, tracer, model, specs).replace("the model raised", f"your step {self.name}() raised",
                                                                  1)
        line = step_line(err, self.fn)
        return f"{text} — at {line}" if line else text

    def notes(self, tracer: Any) -> list[str]:
        out: list[str] = []
        if getattr(tracer, "guessed", 0):
            out.append(f"your step read {tracer.guessed} value(s) outside the model (loss.item(), a logged metric): "
                       "fake tensors have none, each was answered with 1.0 (memory does not depend on it unless the "
                       "step branches on it)")
        return out


@contextlib.contextmanager
def _claiming(step: Any) -> Any:
    """While the step runs: the gradients an optimizer is about to step on claimed as gradients (one freed inside
    backward by an optimizer in backward included), its state claimed as optimizer state after each step."""
    import torch.optim.optimizer as opt

    def before(optimizer: Any, *_: Any) -> None:
        for group in optimizer.param_groups:
            for p in group.get("params", ()):
                step.claim(p.grad, ("gradients", "gradients"))

    def after(optimizer: Any, *_: Any) -> None:
        claim_state(optimizer, step.claim, step.host_scalars)

    handles = [opt.register_optimizer_step_pre_hook(before), opt.register_optimizer_step_post_hook(after)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def step_line(err: BaseException, fn: Any) -> str:
    """``line N of name (file): `code```: the innermost frame of ``fn`` in the error's traceback, else the innermost
    frame of the user's code ("" where there is none)."""
    call = type(fn).__dict__.get("__call__")  # a callable object's step: its __call__'s code
    code = getattr(fn, "__code__", None) or getattr(call, "__code__", None)
    mine = user = None
    tb = err.__traceback__
    while tb is not None:
        frame_code = tb.tb_frame.f_code
        if frame_code is code:
            mine = tb
        elif is_user_code(frame_code):
            user = tb
        tb = tb.tb_next
    hit = mine or user
    if hit is None:
        return ""
    f = hit.tb_frame.f_code
    source = linecache.getline(f.co_filename, hit.tb_lineno).strip()
    return f"line {hit.tb_lineno} of {f.co_name} ({f.co_filename})" + (f": `{source}`" if source else "")


__all__ = ["UserStep", "UserStepTracer", "makes_argument", "step_line"]
