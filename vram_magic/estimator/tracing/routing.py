"""Mixture-of-experts routing on fake tensors: the model's own routing code runs, and where the sizes of its tensors
depend on which tokens the router sends where, they are answered from a stated assignment.

A router picks each token's ``k`` experts with ``topk`` over the experts' scores; fake tensors have no scores, so its
choice is not known. Whether that matters depends on how the experts run:

* transformers' default ``grouped_mm`` experts (``grouped_mm_experts_forward`` in
  ``transformers/integrations/moe.py``) sort the ``tokens × k`` (token, expert) pairs by expert and run every expert
  on its slice of one batch: every shape is ``tokens × k`` rows whatever the routing, and the estimate is exact for
  any router;
* the ``eager`` experts (``config._experts_implementation = "eager"``, or ``experts_implementation="eager"`` to
  ``from_pretrained``) and older code (a ``ModuleList`` of experts) loop over the experts hit (``nonzero``) and gather
  each one's tokens (``torch.where`` on the one-hot routing mask): each expert's tensors are as many rows as the
  tokens routed to it, which only the router's values decide.

So the routing indices ``topk`` (a top-1 router's ``argmax``) returns inside an MoE block
(:func:`vram_magic.engine.scan.experts.experts_of`) get values: a balanced assignment (:func:`assignment`), each
expert ``tokens × k / experts`` tokens, and with ``moe_imbalance=F`` the worst case where the busiest expert takes
``F`` times its share (at most every token) and the others share what is left, so the routed total stays
``tokens × k``. The model's code then runs on those values
(``fake/known_values.py``: the one-hot mask, ``nonzero``, ``where``), and the estimate says that it assumed them.
"""

from __future__ import annotations

from typing import Any

import torch

from ...core.units import format_count
from ...engine.scan.experts import experts_of, num_experts
from ..fake.known_values import ATTR, ROUTED, ROUTED_DROPPED, ROUTED_LIMIT, routed
from ..torch_private import disable_current_modes

TOPK = torch.ops.aten.topk.default
ARGMAX = torch.ops.aten.argmax.default  # a top-1 router (Switch Transformers)
#: the ops a router chooses its experts with
CHOOSERS = frozenset({TOPK, ARGMAX})
#: how far up the module stack a router's ``topk`` may be from its MoE block (the block, or its router child)
DEPTH = 3


def assignment(tokens: int, k: int, experts: int, imbalance: float = 1.0) -> torch.Tensor:
    """``(tokens, k)`` expert indices, each token's ``k`` experts distinct: round-robin (token ``t``'s ``j``-th choice
    is ``(t·k + j) mod experts``: every expert ``tokens·k/experts`` tokens, ±1), or with ``imbalance > 1`` expert 0
    taking ``busiest(...)`` tokens and experts ``1 … experts−1`` sharing the remaining pairs round-robin."""
    with disable_current_modes():
        flat = torch.arange(tokens * k, dtype=torch.int64)
        n0 = busiest(tokens, k, experts, imbalance)
        if n0 <= -(-tokens * k // experts) or k >= experts:
            return (flat % experts).view(tokens, k)
        out = torch.empty(tokens, k, dtype=torch.int64)
        rest = torch.ones(tokens, k, dtype=torch.bool)
        rest[:n0, 0] = False
        out[rest] = torch.arange(int(rest.sum()), dtype=torch.int64) % (experts - 1) + 1
        out[:n0, 0] = 0
        return out


def busiest(tokens: int, k: int, experts: int, imbalance: float = 1.0) -> int:
    """The tokens the busiest expert takes: ``imbalance`` times the balanced share, at most every token."""
    if k >= experts:
        return tokens
    return min(tokens, max(round(imbalance * tokens * k / experts), -(-tokens * k // experts)))


def routing_for(model: torch.nn.Module, names: dict[int, str], imbalance: float = 1.0) -> Routing | None:
    """The routing of ``model``'s MoE blocks (``names``: id(module) → the name the tracer's module stack uses), or
    None for a model without any."""
    blocks = {names.get(id(block), ""): num_experts(experts) for _, experts, block in experts_of(model)}
    return Routing(blocks, imbalance) if blocks else None


class Routing:
    """The MoE blocks of one fake run (``blocks``: module name → number of experts) and the routing assumed in them;
    ``used``: a shape was answered from the assumed routing (the eager experts), else the routing changed nothing."""

    def __init__(self, blocks: dict[str, int], imbalance: float = 1.0) -> None:
        self.blocks, self.imbalance = blocks, imbalance
        self.assigned: set[str] = set()  # the blocks whose routing was assumed
        self.shapes: dict[tuple[int, int, int], None] = {}  # each (tokens, k, experts) routed, in order
        self.used = False
        self.too_big = False  # routing masks too large to compute on the host: the eager loop stopped (PARTIAL)
        self.dropped = ROUTED_DROPPED[0]  # the count of routed values dropped for their size, when the run began

    def block(self, modstack: list[str]) -> str | None:
        for name in reversed(modstack[-DEPTH:]):
            if name in self.blocks:
                return name
        return None

    def chose(self, func: Any, modstack: list[str], args: Any, kwargs: dict[str, Any], out: Any) -> None:
        """After ``topk`` (or a top-1 router's ``argmax``) ran on fake tensors: inside an MoE block and over its
        experts' scores, the indices it returns get the assumed routing as their values."""
        name = self.block(modstack)
        if name is None:
            return
        scores = args[0]
        if func is TOPK:
            if not isinstance(out, (tuple, list)) or len(out) != 2:
                return
            indices, k = out[1], int(args[1] if len(args) > 1 else kwargs["k"])
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        else:
            indices, k = out, 1
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if (args[2] if len(args) > 2 else kwargs.get("keepdim", False)) or not isinstance(indices, torch.Tensor):
                return
        experts = self.blocks[name]
        if dim not in (-1, scores.dim() - 1) or scores.shape[-1] != experts or not 0 < k <= experts:
            return
        if getattr(indices, ATTR, None) is not None:  # the router's scores were known: the real choice stands
            return
        tokens = indices.numel() // k
        value = assignment(tokens, k, experts, self.imbalance)
        with disable_current_modes():
            setattr(indices, ATTR, value.view(tuple(indices.shape)) if k > 1 or indices.dim() else value.view(()))
        setattr(indices, ROUTED, True)
        self.assigned.add(name)
        self.shapes[(tokens, k, experts)] = None

    def answered(self, args: Any, known: bool, modstack: list[str]) -> None:
        """After an op fake tensors cannot run (a value read, a shape that depends on values): whether the assumed
        routing answered it (``known``), or an MoE block's loop stopped without its values (masks too large to keep)."""
        if known and routed(args):
            self.used = True
        elif not known and ROUTED_DROPPED[0] > self.dropped and self.block(modstack) is not None:
            self.too_big = True

    def notes(self) -> list[str]:
        """What the estimate assumed of the routing, and whether it mattered."""
        if self.too_big:
            return ["MoE routing: the experts loop needs the values of the routing masks (tokens × top-k × experts "
                    f"elements), more than the {format_count(ROUTED_LIMIT)} kept on the host for them: the estimate "
                    "stopped there; transformers' default grouped_mm experts need none (their shapes do not depend "
                    "on the routing)"]
        if not self.assigned:
            return []
        blocks = f"{len(self.assigned)} MoE block{'s' if len(self.assigned) > 1 else ''}"
        factor = f"moe_imbalance={self.imbalance:g}"
        if not self.used:
            said = (f"MoE routing: in {blocks} no shape depended on which tokens the router sends to which expert "
                    "(each expert runs on its slice of one sorted batch, as transformers' grouped_mm experts do): "
                    "exact for any routing")
            return [said + (f"; {factor} changes nothing here" if self.imbalance != 1 else "")]
        parts = []
        for tokens, k, experts in self.shapes:
            part = f"{format_count(tokens)} tokens × top-{k} over {experts} experts, {tokens * k / experts:,.4g} each"
            top = busiest(tokens, k, experts, self.imbalance)
            if top > -(-tokens * k // experts):
                every = ", every token" if top == tokens else ""
                part += (f" (the busiest {format_count(top)}{every}, the other {experts - 1} sharing "
                         f"{format_count(tokens * k - top)})")
            parts.append(part)
        how = "balanced" if self.imbalance == 1 else \
            f"balanced but for the busiest expert ({factor}: {self.imbalance:g} × its share, the worst case)"
        return [f"MoE routing assumed {how} in {blocks}, whose experts run on the tokens routed to each (nonzero, "
                f"where: shapes only the router's values decide): {'; '.join(parts)}; the routed total stays tokens "
                "× top-k. A real router's split changes from step to step, and its busiest expert sets the peak: "
                "moe_imbalance=F estimates the busiest at F × its share"]


__all__ = ["ARGMAX", "CHOOSERS", "DEPTH", "TOPK", "Routing", "assignment", "busiest", "routing_for"]
