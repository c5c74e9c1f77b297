"""Where the measured code is now, as every allocation reads it: the phase of a step and the module running.

The step hooks (``step_hooks.py``: module forwards, optimizer steps) and ``generate()``'s stages
(``engine/hooks/generation.py``) write it; the counts (``counts.py``) read it for every new storage, inline, on the
hot path. One small object that all three hold, so that none of them reaches into another's state.
"""

from __future__ import annotations

from typing import Any

import torch

from ..phases import Phase
from ..torch_private import current_autograd_node as _current_node

_grad_enabled = torch.is_grad_enabled
CELL, FORWARD, BACKWARD, OPTIMIZER, INFERENCE = Phase.CELL, Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER, \
    Phase.INFERENCE
LOSS = Phase.LOSS


class Now:
    """``stage``: a stage that overrides the usual rules (``generate()``'s prefill and decode steps, a cache's
    update; 0 when none); ``optimizer_depth``: optimizer steps running; ``modules``: the ids of the modules whose
    forward runs, innermost last; ``site``: the site every allocation takes while it is set (``sites.py``), and
    ``sites`` what it was as each running module's forward began; ``loss``: a forward with grad returned and neither a
    backward nor an optimizer step has run since, so code outside any module computes the loss (a chunked loss, a
    loss function called on the output): its memory is the loss's, an activation, not the cell's own."""

    __slots__ = ("loss", "modules", "optimizer_depth", "site", "sites", "stage")

    def __init__(self) -> None:
        self.stage = 0
        self.optimizer_depth = 0
        self.modules: list[int] = []
        self.site: tuple[Any, ...] | None = None
        self.sites: list[tuple[Any, ...] | None] = []
        self.loss = False

    def phase(self) -> int:
        """The phase of memory made now (the counts inline this for every new storage: keep the two alike)."""
        if self.stage:
            return self.stage
        if self.optimizer_depth:
            return OPTIMIZER
        if _current_node() is not None:
            self.loss = False
            return BACKWARD
        if self.modules:
            return FORWARD if _grad_enabled() else INFERENCE
        if self.loss and _grad_enabled():
            return LOSS
        return CELL

    def module(self) -> int:
        """The id of the innermost module whose forward runs (0 outside any)."""
        modules = self.modules
        return modules[-1] if modules else 0


__all__ = ["Now"]
