"""Muon as recipes train with it: ``torch.optim.Muon`` (PyTorch 2.9 on) takes 2-D parameters only (its constructor
raises for any other), so recipes (Keller Jordan's, Moonlight's, torchtitan's) pair it with AdamW for the rest. The
name ``"muon"``, the ``Muon`` class and a ``Muon`` object all mean that here: Muon for every 2-D parameter (embeddings
and the output head included, as ``torch.optim.Muon`` accepts them), AdamW for the biases, norms and any other
parameter. Both are PyTorch's own and run as they are on fake tensors, so their state (Muon's momentum buffer,
``n × b`` bytes a 2-D parameter of n elements and b bytes each; AdamW's two moments and step counter) and their
temporaries (Newton–Schulz in bf16: ``8K + 4m²`` bytes at most for an fp32 M × N weight with K = MN, m = min(M, N))
are traced, not modelled (checked against torch 2.13's ``torch/optim/_muon.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: what an estimate of Muon says it assumed
MUON_NOTE = ("optimizer: torch.optim.Muon for the 2-D parameters and AdamW for the others (biases, norms), as Muon "
             "recipes pair them: Muon keeps one momentum buffer a matrix, AdamW two moments")


def muon_available() -> bool:
    return hasattr(torch.optim, "Muon")


def is_muon(spec: Any) -> bool:
    """Whether an optimizer spec (a name, a class, an object or what was kept of one) is Muon."""
    if isinstance(spec, str):
        return spec == "muon"
    cls = getattr(spec, "cls", None) if not isinstance(spec, type) else spec
    cls = cls if isinstance(cls, type) else type(spec)
    return cls.__name__ == "Muon" and str(cls.__module__).startswith("torch.optim")


class MuonWithAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` over the 2-D parameters and ``torch.optim.AdamW`` over the others, as one optimizer: one
    ``state`` (shared by both), their parameter groups, a step that steps both."""

    def __init__(self, params: list[torch.nn.Parameter], muon_kwargs: dict[str, Any], adamw_kwargs: dict[str, Any],
                 prepare: Callable[[torch.optim.Optimizer], None]) -> None:
        if not muon_available():
            raise ValueError(f"Muon needs torch.optim.Muon (PyTorch 2.9 or later; this is {torch.__version__})")
        super().__init__(params, {"lr": muon_kwargs.get("lr", 1e-3)})
        matrices = [p for p in params if p.ndim == 2]
        others = [p for p in params if p.ndim != 2]
        self.parts: list[torch.optim.Optimizer] = []
        if matrices:
            self.parts.append(torch.optim.Muon(matrices, **muon_kwargs))
        if others:
            self.parts.append(torch.optim.AdamW(others, **adamw_kwargs))
        for part in self.parts:
            part.state = self.state
            prepare(part)
        self.param_groups = [g for part in self.parts for g in part.param_groups]

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for part in self.parts:
            part.step()


def muon_settings(spec: Any) -> dict[str, Any]:
    """Muon's keyword arguments from an object's hyper-parameters (``defaults``), or none for a name or a class."""
    defaults = getattr(spec, "defaults", None)
    if not isinstance(defaults, dict):
        return {}
    keys = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn")
    return {k: defaults[k] for k in keys if k in defaults}


__all__ = ["MUON_NOTE", "MuonWithAdamW", "is_muon", "muon_available", "muon_settings"]
