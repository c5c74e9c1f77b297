"""The routed experts' share of a fake run's parameters, gradients and optimizer state ("of which experts"): each is
claimed under its label with the experts' mark (``engine/scan/experts.py`` finds them, ``Breakdown.experts`` sums
them), as ``%%vram`` names them in a measured step."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ...engine.scan.experts import expert_parameters, marked


class ExpertLabels:
    """Which tensors of a fake run are the routed experts': their parameters (``params``), the fp32 master copies of
    them (``masters``: parameter → its master), the gradients on them and the optimizer's state of them, looked up
    where a claim is made. ``now``: a count that changes whenever tensors may have changed (the tracer's events), so
    the gradients and state are looked up once per batch of claims."""

    def __init__(self, params: list[nn.Parameter], masters: dict[int, nn.Parameter], optimizer: Any,
                 now: Callable[[], int]) -> None:
        self.params = params
        self.keys = [masters.get(id(p), p) for p in params]  # what the optimizer's state is kept under
        self.ids = {id(p) for p in params} | {id(k) for k in self.keys}
        self.optimizer, self.now = optimizer, now
        self._at: tuple[int, str] | None = None
        self._found: set[int] = set()

    @classmethod
    def of(cls, model: nn.Module, trainable: list[nn.Parameter], masters: list[nn.Parameter], optimizer: Any,
           now: Callable[[], int]) -> ExpertLabels | None:
        params = expert_parameters(model)
        if not params:
            return None
        return cls(params, {id(p): m for p, m in zip(trainable, masters)}, optimizer, now)

    def label(self, t: Any, cat: tuple[str, str]) -> tuple[str, str]:
        """``cat`` marked when ``t`` is one of the experts' parameters, gradients or optimizer state."""
        kind = cat[0]
        if kind == "parameters" or kind == "optimizer_state" and id(t) in self.ids:
            found = self.ids
        elif kind in ("gradients", "optimizer_state"):
            at = (self.now(), kind)
            if at != self._at:
                self._at, self._found = at, self._look(kind)
            found = self._found
        else:
            return cat
        return (kind, marked(cat[1])) if id(t) in found else cat

    def _look(self, kind: str) -> set[int]:
        if kind == "gradients":
            return {id(p.grad) for p in self.params if p.grad is not None}
        state = getattr(self.optimizer, "state", None)
        if not isinstance(state, Mapping):
            return set()
        return {id(v) for k in self.keys for v in (state.get(k) or {}).values() if isinstance(v, torch.Tensor)}


__all__ = ["ExpertLabels"]
