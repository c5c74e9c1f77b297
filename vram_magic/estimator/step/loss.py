"""The loss a fake step trains on: the given ``loss_fn``, else the output's own ``loss`` (a Hugging Face model
given ``labels``), else a stand-in (the sum of the output's floating tensors) that the estimate names, with
what to do instead."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..tracing.errors import EstimateError


def default_loss(output: Any) -> torch.Tensor:
    return stand_in_loss(output)[0]


def stand_in_loss(output: Any) -> tuple[torch.Tensor, str]:
    """The loss a step trains on when no ``loss_fn`` is given, and what it was: the output's own ``loss``
    (a Hugging Face model given ``labels``), else the sum of the output (of its floating tensors)."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss, "the model's own loss (output.loss)"
    if isinstance(output, torch.Tensor):
        return output.sum(), "output.sum()"
    parts: list[torch.Tensor] = []
    names: list[str] = []
    items = list(output.items()) if isinstance(output, Mapping) else list(enumerate(output)) if isinstance(
        output, (tuple, list)) else []
    for k, v in items:
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.requires_grad:
            parts.append(v.sum())
            names.append(f"output.{k}" if isinstance(k, str) and k.isidentifier() else f"output[{k!r}]")
    if not parts:
        raise EstimateError(f"cannot make a loss from the model's output ({type(output).__name__}); pass loss_fn, "
                            "e.g. loss_fn=lambda out: out.logits.sum()")
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total, " + ".join(f"{n}.sum()" for n in names)


def describe_loss(used: str, model: nn.Module, specs: Any) -> str:
    """What the estimate says of the loss it trained on (``used``: from :func:`stand_in_loss`, or the given one),
    with a hint when it was a stand-in."""
    if not used or used.startswith("the model's own") or used.startswith("loss_fn"):
        return used or "none (the step stopped before the loss)"
    hint = 'pass loss_fn=... (%vram_estimate: --loss "lambda out: ...")'
    try:
        takes_labels = "labels" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        takes_labels = False
    if takes_labels and not (isinstance(specs, Mapping) and "labels" in specs):
        hint = "put labels in the inputs to train on the model's own loss, or " + hint
    return f"stand-in {used}: the model computed no loss; {hint}"


__all__ = ["default_loss", "describe_loss", "stand_in_loss"]
