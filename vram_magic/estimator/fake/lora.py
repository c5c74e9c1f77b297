"""LoRA adapters on fake tensors, and what ``quantize=`` and ``lora=`` do to a fake model's linear layers.

``estimate(..., lora=R)`` trains rank-R adapters on every linear layer but the
output head, with the rest of the model frozen — what PEFT's ``LoraConfig(r=R, target_modules="all-linear")``
builds. :class:`LoraLinear` runs PEFT's forward op for op (so its temporaries are the same): the base layer,
a defensive clone of its output when the base is 4-bit (as PEFT's bitsandbytes layer does), the input cast to
the adapters' dtype, ``lora_B(lora_A(x)) * scaling`` added to the result. Adapters take the base layer's dtype
when it is a floating one and fp32 on a quantized base (PEFT's rule), so only they have gradients and
optimizer state.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...core.units import format_count
from ..options import parse_lora
from .quantize import NotApplicable, QuantLinear, features, linear_layers, quantize_model, replace_layers


class LoraLinear(nn.Module):
    """A frozen base layer with a rank-``r`` adapter, as PEFT's LoRA ``Linear`` computes it."""

    def __init__(self, base: nn.Module, r: int, alpha: float | None = None) -> None:
        super().__init__()
        self.base_layer = base
        self.in_features, self.out_features = features(base)  # type: ignore[misc]
        weight = getattr(base, "weight", None)
        floating = not isinstance(base, QuantLinear) and weight is not None and weight.is_floating_point()
        dtype = weight.dtype if floating else torch.float32
        self.lora_A = nn.Linear(self.in_features, r, bias=False, dtype=dtype)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, dtype=dtype)
        self.scaling = (alpha if alpha is not None else 2 * r) / r
        self.clone = isinstance(base, QuantLinear) and base.bits == 4  # PEFT's 4-bit layer clones the result
        self.r = r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        if self.clone:
            result = result.clone()
        expected = result.dtype
        x = x.to(self.lora_A.weight.dtype)
        output = self.lora_B(self.lora_A(x)) * self.scaling
        if self.clone:
            output = output.to(expected)
        result = result + output
        return result if self.clone else result.to(expected)

    def extra_repr(self) -> str:
        return f"r={self.r}"


def add_adapters(model: nn.Module, r: int, mode: Any) -> tuple[nn.Module, str]:
    """Freeze the fake model and put rank-``r`` adapters on its linear layers (not the head): the model (a new
    one if it was a linear layer itself) and what was done."""
    layers = linear_layers(model)
    if not layers:
        raise NotApplicable("lora: the model has no linear layers to put adapters on (nn.Linear, or transformers' "
                            "Conv1D)")
    for p in model.parameters():
        p.requires_grad_(False)
    made: list[LoraLinear] = []

    def adapted(layer: nn.Module) -> LoraLinear:
        made.append(LoraLinear(layer, r))
        return made[-1]

    with mode:
        model = replace_layers(model, layers, adapted)
    count = sum(r * (a.in_features + a.out_features) for a in made)
    dtypes = {str(a.lora_A.weight.dtype).replace("torch.", "") for a in made}
    return model, (f"LoRA: rank-{r} adapters on {len(layers)} linear layers (PEFT's all-linear, the output head "
            f"excluded), {format_count(count)} trainable parameters in {'/'.join(sorted(dtypes))}; every other weight "
            "frozen: gradients and optimizer state for the adapters only")


def adapt_linear_layers(model: nn.Module, opts: Any, mode: Any) -> tuple[nn.Module, list[str]]:
    """``quantize=`` and ``lora=`` applied to the fake model: its linear layers quantized first, then adapters put on
    the quantized layers; the model (a new one if it was a linear layer itself) and the notes saying what was done."""
    notes = []
    if opts.quantize:
        model, note = quantize_model(model, opts.quantize, mode)
        notes.append(note)
    if opts.lora:
        model, note = add_adapters(model, opts.lora, mode)
        notes.append(note)
    return model, notes


__all__ = ["LoraLinear", "adapt_linear_layers", "add_adapters", "parse_lora"]
