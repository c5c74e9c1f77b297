"""What a tracker hears of the model and the optimizer while it measures: module forwards and optimizer steps.

:class:`StepHooks` is one of the parts :class:`~vram_magic.engine.tracker.mode.Tracker` is made of. Its hooks (PyTorch's
global module forward hooks and optimizer step hooks, installed by the tracker as it enters) keep the stack of
modules whose forward runs and the optimizer step's depth, which give each allocation its phase and module; the
site that every allocation takes while it is fixed (sites.py: a module of PyTorch's own, PyTorch's own optimizer
step); and the roles an optimizer step reveals (its parameters, their gradients, its state), remembered even for
storages freed before the end of the block.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ..phases import Phase
from ..tensors import is_wrapper, storage_parts
from ..torch_private import current_autograd_node as _current_node
from .frames import is_user_code, user_site
from .sites import plain_forward

_grad_enabled = torch.is_grad_enabled
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
CELL, FORWARD, BACKWARD, OPTIMIZER, INFERENCE = Phase.CELL, Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER, \
    Phase.INFERENCE


class StepHooks:
    """Module forwards and optimizer steps, as the tracker hears of them (see the module's docstring)."""

    # the parts of the tracker this one reads (counts.py, engine/hooks/generation.py, engine/hooks/collectives.py,
    # mode.py)
    record_sites: bool
    roles: dict[int, Any]
    observer: Any
    _lookup: Any
    _stage: int
    ddp_open: int | None
    ddp_types: tuple[type, ...]
    root_forward: Any
    ddp_module_entered: Any
    close_ddp: Any

    def hooks_init(self) -> None:
        self._optimizer_depth = 0
        self._modules: list[int] = []  # ids of the modules whose forward is running, innermost last
        self._site: tuple[Any, ...] | None = None  # the site of every allocation while it is set (sites.py)
        self._sites: list[tuple[Any, ...] | None] = []  # what it was as each running module's forward began

    def install_hooks(self) -> list[Any]:
        """PyTorch's global optimizer-step and module-forward hooks, to this tracker: their handles."""
        import torch.nn.modules.module as mod
        import torch.optim.optimizer as opt

        return [
            opt.register_optimizer_step_pre_hook(self._opt_pre),
            opt.register_optimizer_step_post_hook(self._opt_post),
            mod.register_module_forward_pre_hook(self._mod_pre),
            mod.register_module_forward_hook(self._mod_post, always_call=True),
        ]

    def _opt_pre(self, optimizer: Any, *_: Any) -> None:
        self._optimizer_depth += 1
        if self.record_sites and self._optimizer_depth == 1 and not _user_step(optimizer):
            # PyTorch's own step: every allocation it makes has the site of the line that called it
            self._site = user_site(sys._getframe(1))
        # The parameters and the gradients the step reads: remembered as such even if they are freed before the
        # end of the block (zero_grad; a rank's function that returns before its measurement ends).
        for group in optimizer.param_groups:
            params = group.get("params", ())
            self._note_roles(params, "parameters", optimizer)
            self._note_roles([g for g in (p.grad for p in params) if g is not None], "gradients", optimizer)

    def _opt_post(self, optimizer: Any, *_: Any) -> None:
        self._optimizer_depth = max(self._optimizer_depth - 1, 0)
        if not self._optimizer_depth:
            self._site = None
        state = [v for s in optimizer.state.values() if isinstance(s, dict) for v in s.values()
                 if isinstance(v, torch.Tensor)]
        self._note_roles(state, "optimizer_state", optimizer)

    def _note_roles(self, tensors: Any, category: str, owner: Any) -> None:
        """:meth:`_note_role` of each tensor, plain tensors inline (an optimizer step over many parameters)."""
        lookup, roles, label = self._lookup, self.roles, (category, id(owner))
        for t in tensors:
            cls = type(t)
            if cls is not _Tensor and cls is not _Parameter:
                self._note_role(t, category, owner)
                continue
            try:
                entry = lookup(id(t.untyped_storage()))
            except (RuntimeError, NotImplementedError):
                continue
            if entry is not None:
                roles[entry.serial] = label

    def _note_role(self, t: torch.Tensor, category: str, owner: Any) -> None:
        cls = type(t)
        if cls is not _Tensor and cls is not _Parameter and is_wrapper(t):  # a DTensor's shard, a quantized tensor
            for storage, kind in storage_parts(t) or ():
                entry = self._lookup(id(storage))
                if entry is not None:
                    self.roles[entry.serial] = (category, f"{kind} {category.replace('_', ' ')}")
            return
        try:
            entry = self._lookup(id(t.untyped_storage()))
        except (RuntimeError, NotImplementedError):
            return
        if entry is not None:
            self.roles[entry.serial] = (category, id(owner))

    def _mod_pre(self, module: Any, *_: Any) -> None:
        if not self._modules:
            self.root_forward()
        self._modules.append(id(module))
        if self.record_sites:  # one site for all a module of PyTorch's makes (sites.py)
            site = self._site
            self._sites.append(site)
            if site is None:
                if plain_forward(module):
                    self._site = user_site(sys._getframe(1))
            elif not plain_forward(module):
                self._site = None
        if self.ddp_open is not None or (self.ddp_types and type(module) in self.ddp_types):
            self.ddp_module_entered(module)
        if self.observer is not None:
            self.observer.module_entered(module)

    def _mod_post(self, module: Any, *_: Any) -> None:
        if self._modules:
            self._modules.pop()
        if self._sites:
            self._site = self._sites.pop()
        if self.ddp_open is not None:
            self.close_ddp()
        if self.observer is not None:
            self.observer.module_exited(module)

    def phase(self) -> int:
        if self._stage:
            return self._stage
        if self._optimizer_depth:
            return OPTIMIZER
        if _current_node() is not None:
            return BACKWARD
        if self._modules:
            return FORWARD if _grad_enabled() else INFERENCE
        return CELL


_user_steps: dict[type, bool] = {}


def _user_step(optimizer: Any) -> bool:
    """The optimizer's ``step`` is code of the user's (a class written in the notebook), whose own lines are
    worth naming."""
    cls = type(optimizer)
    hit = _user_steps.get(cls)
    if hit is None:
        step = getattr(cls, "step", None)
        code = getattr(getattr(step, "__wrapped__", step), "__code__", None)
        hit = _user_steps[cls] = code is not None and is_user_code(code)
    return hit


__all__ = ["StepHooks"]
