"""``quantize=`` and ``lora=`` applied to the fake model: the linear layers quantized first (quantize.py), then
adapters put on the quantized layers (lora.py)."""

from __future__ import annotations

from typing import Any

from torch import nn

from .lora import add_adapters
from .quantize import quantize_model


def adapt(model: nn.Module, opts: Any, mode: Any) -> tuple[nn.Module, list[str]]:
    """The model (a new one if it was a linear layer itself) and the notes saying what was done."""
    notes = []
    if opts.quantize:
        model, note = quantize_model(model, opts.quantize, mode)
        notes.append(note)
    if opts.lora:
        model, note = add_adapters(model, opts.lora, mode)
        notes.append(note)
    return model, notes


__all__ = ["adapt"]
