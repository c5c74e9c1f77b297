"""``optimizer_in_backward=True``: the optimizer steps inside backward, one parameter at a time.

PyTorch's recipe (the tutorial "How to save memory by fusing the optimizer step into the backward pass") and
torchtune's ``optimizer_in_bwd``: one optimizer per parameter, each made as ``optimizer=`` makes one but over that
parameter alone, and a ``register_post_accumulate_grad_hook`` on every parameter that steps its optimizer and frees
its gradient as soon as the gradient is accumulated. The step has no ``optimizer.step()`` after backward: gradients are
never all alive (at most those backward is still accumulating, and the one being stepped), the optimizer's state is
the same as one optimizer's, and each update's temporaries are one parameter's (a ``foreach`` update over one tensor).

It cannot take gradient accumulation (each micro-batch would step) or a clip of the global gradient norm (no moment
sees every gradient): ``options.parse_recipe`` refuses the first, the plan's rows say the second.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import torch

from ...tracing.tracer import BACKWARD, OPTIMIZER

NOTE = ("optimizer in backward: one {name} per parameter, each stepped by a post-accumulate-grad hook as its gradient "
        "is complete and the gradient freed at once (PyTorch's register_post_accumulate_grad_hook recipe, torchtune's "
        "optimizer_in_bwd); no optimizer.step() after backward, no gradient accumulation, no global-norm clipping")


class _States(MutableMapping):
    """Every parameter's state, read from and written to its own optimizer's (what the fake step's first-step and
    claiming code read of one optimizer)."""

    def __init__(self, optimizers: dict[Any, torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    def __getitem__(self, p: Any) -> Any:
        state = self.optimizers[p].state
        if p not in state:
            raise KeyError(p)
        return state[p]

    def __setitem__(self, p: Any, value: Any) -> None:
        self.optimizers[p].state[p] = value

    def __delitem__(self, p: Any) -> None:
        del self.optimizers[p].state[p]

    def __iter__(self) -> Iterator[Any]:
        for p, o in self.optimizers.items():
            if p in o.state:
                yield p

    def __len__(self) -> int:
        return sum(1 for _ in self)


class InBackward:
    """The per-parameter optimizers, as one optimizer to the fake step: ``state`` (every parameter's), ``param_groups``,
    ``step()`` (the parameters that hold a gradient: the first step's stand-in gradients), ``zero_grad()``. Each is
    stepped inside backward once :meth:`install` has hooked the parameters."""

    def __init__(self, spec: Any, params: list[torch.nn.Parameter], device: str,
                 make: Callable[[Any, list[torch.nn.Parameter], str], torch.optim.Optimizer]) -> None:
        self.optimizers = {p: make(spec, [p], device) for p in params}
        self.state = _States(self.optimizers)
        self.param_groups = [g for o in self.optimizers.values() for g in o.param_groups]
        self.name = type(next(iter(self.optimizers.values()))).__name__ if params else "optimizer"
        self.handles: list[Any] = []

    def install(self, tracer: Any, claim: Callable[..., int | None], after: Callable[[Any], None]) -> None:
        """Each parameter's hook: its gradient claimed as a gradient, its optimizer stepped (the tracer in the optimizer
        stage meanwhile), ``after(optimizer)`` (its state claimed), the gradient freed."""

        def hook(p: torch.Tensor) -> None:
            optimizer = self.optimizers[p]
            claim(p.grad, ("gradients", "gradients"))
            stage, tracer.stage = tracer.stage, OPTIMIZER
            try:
                optimizer.step()
                after(optimizer)
                optimizer.zero_grad(set_to_none=True)
            finally:
                tracer.stage = stage if stage != OPTIMIZER else BACKWARD

        for p in self.optimizers:
            self.handles.append(p.register_post_accumulate_grad_hook(hook))
            if hasattr(self.optimizers[p], "ops"):  # a modelled library optimizer: its update's row in the op log
                self.optimizers[p].ops = tracer.ops

    def step(self) -> None:
        for p, optimizer in self.optimizers.items():
            if p.grad is not None:
                optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=set_to_none)

    def note(self) -> str:
        return NOTE.format(name=self.name)


__all__ = ["NOTE", "InBackward"]
