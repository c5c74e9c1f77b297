"""The recipes' levers switched on for one fake run, as the fake step (``step/trace.py``) meets them: the optimizer it
makes, the checkpointing context, the forward and loss, what autograd saves through, whether its first step runs for
real, and what the run leaves besides the trace (the pinned host memory, the bytes copied over PCIe, the step in
words)."""

from __future__ import annotations

import contextlib
from typing import Any

from ...options import Options
from ...tracing.tracer import FORWARD, LOSS, StepTracer
from ..optimizers import make_optimizer
from .chunked_loss import ChunkedLoss
from .convention import step_words
from .in_backward import InBackward
from .offload_activations import SavedOnHost
from .op_checkpointing import context_fn, describe
from .user_step import UserStep, UserStepTracer, makes_argument


def make_step_optimizer(opts: Options, params: list[Any]) -> Any:
    """The optimizer of the step: one per parameter with ``optimizer_in_backward``, none yet where ``optimizer=`` is a
    callable (the user's step gets what it makes: ``user_step.py``), else as ``optimizer=`` says."""
    if makes_argument(opts.optimizer):
        return None
    if opts.optimizer_in_backward:
        return InBackward(opts.optimizer, params, opts.device, make_optimizer)
    return make_optimizer(opts.optimizer, params, opts.device)


def checkpoint_context(opts: Options, modes: bool) -> Any:
    """``torch.utils.checkpoint``'s ``context_fn`` for ``checkpointing="ops"`` (or a policy); None for plain
    checkpointing."""
    return context_fn(opts.checkpoint_ops, modes) if opts.checkpoint_ops is not None else None


class Levers:
    """The levers of ``opts`` in one fake run."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.user = UserStep(opts.step) if opts.step is not None else None
        self.chunked: ChunkedLoss | None = None
        self.saved: SavedOnHost | None = None
        self.notes: list[str] = []

    @property
    def tracer_class(self) -> type:
        return UserStepTracer if self.user is not None else StepTracer

    @property
    def real_first_step(self) -> bool:
        """The first step runs as written (no stand-in gradients): the user's step, and an optimizer in backward (whose
        gradients are never all alive, as the stand-in's would be)."""
        return self.user is not None or self.opts.optimizer_in_backward

    def build(self, model: Any, inputs: Any) -> None:
        opts = self.opts
        if opts.loss_chunks > 1 and not opts.inference:
            self.chunked = ChunkedLoss.of(model, opts.loss_chunks, inputs)
            self.notes.append(self.chunked.describe())
        if opts.checkpoint_ops is not None and not opts.inference:
            self.notes.append(describe(opts.checkpoint_ops))

    def prepare(self, step: Any) -> None:
        """After the tracer is made: the hooks of an optimizer in backward, the ledger of activations on the host."""
        optimizer = step.optimizer
        if isinstance(optimizer, InBackward):
            from ..first_step import claim_state

            optimizer.install(step.tracer, step.claim, lambda o: claim_state(o, step.claim, step.host_scalars))
            self.notes.append(optimizer.note())
            first = next(iter(optimizer.optimizers.values()), None)
            if hasattr(first, "recipe"):  # bitsandbytes' or torchao's, modelled (low_bit_optimizers.py)
                from ..low_bit_optimizers import recipe_note

                self.notes.append(recipe_note(first.recipe, self.opts.device))
        if self.opts.offload_activations:
            self.saved = SavedOnHost(self.opts.device, step.claim)
            self.notes.append(self.saved.note())

    def saving(self) -> Any:
        """The context the forward runs in: autograd saving to the host with ``offload_activations``."""
        if self.saved is None:
            return contextlib.nullcontext()
        self.saved.new_step()
        return self.saved.hooks()

    def forward_loss(self, step: Any, loss_fn: Any) -> tuple[Any, Any]:
        """The built-in step's forward and loss: ``(output, loss)``."""
        tracer = step.tracer
        tracer.stage = FORWARD
        if self.chunked is not None:
            step.loss_used = f"the model's own labels, cross-entropy in {self.chunked.chunks} chunks (loss_chunks)"
            return self.chunked.forward_loss(step.inputs, lambda: setattr(tracer, "stage", LOSS))
        from ...fake.convert import call_model

        out = call_model(step.runner, step.inputs)
        tracer.stage = LOSS
        return out, loss_fn(out)

    def finish(self, step: Any) -> dict[str, Any]:
        """What the run leaves besides the trace (``FakeRun``'s fields) and its notes (added to ``step.notes``)."""
        if isinstance(step.optimizer, InBackward):  # the hooks hold the fake model: let it go with the run
            for handle in step.optimizer.handles:
                handle.remove()
        if self.user is not None:
            step.notes.extend(self.user.notes(step.tracer))
        step.notes.extend(self.notes + (self.chunked.notes if self.chunked is not None else []))
        saved = self.saved
        return {"host_pinned": saved.peak if saved is not None else 0,
                "offloaded": saved.down + saved.up if saved is not None and saved.cuda else 0,
                "step": step_words(self.opts, step.specs, step.loss_used, self.user, self.chunked)}


__all__ = ["Levers", "checkpoint_context", "make_step_optimizer"]
