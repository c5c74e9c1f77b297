"""What an autograd graph holds: the tensors its nodes saved for backward, and the leaves it reaches."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

_saved_attrs: dict[type, tuple[str, ...]] = {}


def _saved_names(node: Any) -> tuple[str, ...]:
    names = _saved_attrs.get(type(node))
    if names is None:
        names = tuple(a for a in dir(node) if a.startswith("_saved_"))
        try:
            custom = hasattr(node, "saved_tensors")  # custom autograd.Function
        except RuntimeError:  # a custom Function's node after backward has freed what it saved
            custom = True
        if custom:
            names += ("saved_tensors",)
        _saved_attrs[type(node)] = names
    return names


def saved_tensors(root: Any, limit: int = 200_000) -> Iterable[tuple[torch.Tensor, bool]]:
    """``(tensor, is_leaf)``: tensors the autograd graph under ``root`` has saved for backward and not yet
    freed, and the leaves (parameters) its ``AccumulateGrad`` nodes hold."""
    stack = [root]
    seen: set[int] = set()
    while stack and len(seen) < limit:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for attr in _saved_names(node):
            try:
                value = getattr(node, attr)
            except Exception:  # freed by a backward, or not a tensor slot
                continue
            if isinstance(value, torch.Tensor):
                yield value, False
            elif isinstance(value, (tuple, list)):
                for v in value:
                    if isinstance(v, torch.Tensor):
                        yield v, False
        try:
            leaf = getattr(node, "variable", None)
            nexts = getattr(node, "next_functions", ())
        except Exception:
            continue
        if isinstance(leaf, torch.Tensor):
            yield leaf, True
        for nxt, _ in nexts:
            if nxt is not None and id(nxt) not in seen:
                stack.append(nxt)


__all__ = ["saved_tensors"]
