"""The routed experts of mixture-of-experts blocks, found by the model's structure: what ``%%vram`` and the estimator
show apart from the dense parameters ("of which experts").

An experts module is a module held under the name ``experts`` that holds several experts: transformers 5 keeps them as
3-D parameters of one module (``gate_up_proj`` and ``down_proj`` of shape ``(num_experts, …)``: Mixtral, Qwen2/3-MoE,
OLMoE, gpt-oss, DeepSeek-V3, …; ``transformers/integrations/moe.py``), older and other code as a ``ModuleList`` or
``ModuleDict`` of expert MLPs (Switch Transformers, NLLB-MoE), DBRX as 2-D weights viewed per expert with a
``num_experts`` count. Every parameter under it is an expert's (gpt-oss's 2-D biases too). Shared experts
(``shared_expert``, ``shared_experts``: every token runs them) and the router are dense, and stay out. The module
holding the experts is the MoE block: its forward routes the tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ...core.breakdown import EXPERTS

NAME = "experts"


def is_experts(name: str, module: Any) -> bool:
    """Whether ``module``, found at path ``name``, holds a block's routed experts."""
    if name.rpartition(".")[2] != NAME or not isinstance(module, nn.Module):
        return False
    if isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
        kids = list(module.values()) if isinstance(module, nn.ModuleDict) else list(module)
        return len(kids) >= 2 and len({type(k) for k in kids}) == 1
    count = getattr(module, "num_experts", None)
    if isinstance(count, int) and not isinstance(count, bool) and count >= 2:
        return True
    return any(isinstance(p, torch.Tensor) and p.dim() >= 3 and p.shape[0] >= 2
               for p in module._parameters.values())


def num_experts(module: nn.Module) -> int:
    """How many experts an experts module holds."""
    if isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
        return len(module)
    count = getattr(module, "num_experts", None)
    if isinstance(count, int) and not isinstance(count, bool) and count >= 2:
        return count
    return max(int(p.shape[0]) for p in module._parameters.values() if p is not None and p.dim() >= 3)


def experts_of(model: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module, nn.Module]]:
    """``(path, experts module, its MoE block)`` of every experts module of ``model`` (none inside another)."""
    inside = ""
    parents: dict[str, nn.Module] = {}
    for name, module in model.named_modules(prefix=prefix):
        if inside and (name == inside[:-1] or name.startswith(inside)):
            continue
        inside = ""
        parents[name] = module
        if name.endswith(NAME) and is_experts(name, module):
            inside = name + "."
            parent = parents.get(name.rpartition(".")[0], model)
            yield name, module, parent


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of the routed experts of ``model`` (each once)."""
    seen: dict[int, nn.Parameter] = {}
    for _, module, _ in experts_of(model):
        for p in module.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())


def marked(label: str) -> str:
    """A detail label marked as the experts' (``Breakdown.experts`` sums the rows so marked)."""
    return label if label.endswith(EXPERTS) else label + EXPERTS


__all__ = ["NAME", "experts_of", "expert_parameters", "is_experts", "marked", "num_experts"]
