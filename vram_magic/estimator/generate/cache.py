"""A cache described by what it costs: its class, its layers by type, the bytes one more token adds, and the
bytes that do not grow (sliding windows, cross-attention)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch


def _per_token(layer: Any) -> int:
    """Bytes one token takes in a layer: ``batch × heads × head_dim × element size``, keys and values."""
    n = 0
    for name in ("keys", "values"):
        t = getattr(layer, name, None)
        if isinstance(t, torch.Tensor) and t.dim() == 4:
            b, h, _, d = t.shape
            n += int(b) * int(h) * int(d) * t.element_size()
    return n


def _stored(layer: Any) -> int:
    seen: dict[int, int] = {}
    for name in ("keys", "values"):
        t = getattr(layer, name, None)
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[id(st)] = int(st.nbytes())
    return sum(seen.values())


def describe_cache(cache: Any) -> tuple[str, str, int, int]:
    """``(class, layers, bytes per token, fixed bytes)`` of a transformers cache object."""
    inner = getattr(cache, "self_attention_cache", None)
    cross = getattr(cache, "cross_attention_cache", None)
    own = inner if inner is not None else cache
    name = type(own).__name__
    if getattr(own, "offloading", False):
        name += " (offloaded)"
    if inner is not None:
        name = f"{type(cache).__name__}({name}, cross-attention {type(cross).__name__})"
    layers = list(getattr(own, "layers", []) or [])
    kinds = Counter(type(layer).__name__ for layer in layers)
    summary = " + ".join(f"{n} × {k}" for k, n in kinds.items())
    per_token = fixed = 0
    for layer in layers:
        if getattr(layer, "is_sliding", False):
            fixed += _stored(layer)
        else:
            per_token += _per_token(layer)
    for layer in list(getattr(cross, "layers", []) or []) if cross is not None else []:
        fixed += _stored(layer)
    return name, summary, per_token, fixed


__all__ = ["describe_cache"]
