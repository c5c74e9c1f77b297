"""What a tracker hears of the model and the optimizer while it measures: module forwards and optimizer steps.

:class:`StepHooks` is one of the parts :class:`~vram_magic.engine.tracker.mode.Tracker` is made of. Its hooks (PyTorch's
global module forward hooks and optimizer step hooks, installed by the tracker as it enters) keep where the measured
code is (``now.py``: the modules whose forward runs, the optimizer step's depth), which gives each allocation its
phase and module; the site that every allocation takes while it is fixed (``sites.py``: a module of PyTorch's own,
PyTorch's own optimizer step); and the roles an optimizer step reveals (its parameters, their gradients, its state),
remembered in the counts' ``roles`` even for storages freed before the end of the block.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ...core.breakdown import EXPERTS
from ..tensors import is_wrapper, storage_parts
from ..torch_private import current_autograd_node as _current_node
from .frames import is_user_code, user_site
from .now import Now
from .sites import plain_forward

_Tensor = torch.Tensor
_grad_enabled = torch.is_grad_enabled
_Parameter = torch.nn.Parameter


class StepHooks:
    """Module forwards and optimizer steps, as the tracker hears of them (see the module's docstring). ``roles``:
    the counts' map of serial -> role, written here; ``lookup``: the registry's entry of a storage id;
    ``on_root_forward``: called as a forward with no module's forward around it begins (``generate()``'s stages);
    ``ddp``: told of modules entered and left while DistributedDataParallel's own forward may run (the
    collectives)."""

    def __init__(self, now: Now, roles: dict[int, Any], lookup: Any, *, record_sites: bool, observer: Any,
                 on_root_forward: Any, ddp: Any) -> None:
        self.now, self.roles, self.lookup, self.ddp = now, roles, lookup, ddp
        self.record_sites, self.observer, self.on_root_forward = record_sites, observer, on_root_forward
        # id() of the parameters of MoE blocks' routed experts (engine/scan/experts.py; the scan before the block
        # finds them): their gradients and state keep the mark in their roles
        self.experts: set[int] = set()

    def install(self) -> list[Any]:
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
        now = self.now
        now.optimizer_depth += 1
        now.loss = False
        if self.record_sites and now.optimizer_depth == 1 and not _user_step(optimizer):
            # PyTorch's own step: every allocation it makes has the site of the line that called it
            now.site = user_site(sys._getframe(1))
        # The parameters and the gradients the step reads: remembered as such even if they are freed before the
        # end of the block (zero_grad; a rank's function that returns before its measurement ends).
        experts = self.experts
        for group in optimizer.param_groups:
            params = group.get("params", ())
            if experts:
                routed = [p for p in params if id(p) in experts]
                if routed:
                    params = [p for p in params if id(p) not in experts]
                    self._note_roles(routed, "parameters", optimizer, True)
                    self._note_roles([g for g in (p.grad for p in routed) if g is not None], "gradients", optimizer,
                                     True)
            self._note_roles(params, "parameters", optimizer)
            self._note_roles([g for g in (p.grad for p in params) if g is not None], "gradients", optimizer)

    def _opt_post(self, optimizer: Any, *_: Any) -> None:
        now = self.now
        now.optimizer_depth = max(now.optimizer_depth - 1, 0)
        if not now.optimizer_depth:
            now.site = None
        experts = self.experts
        state = [v for p, s in optimizer.state.items() if isinstance(s, dict) and not (experts and id(p) in experts)
                 for v in s.values() if isinstance(v, torch.Tensor)]
        self._note_roles(state, "optimizer_state", optimizer)
        if experts:
            routed = [v for p, s in optimizer.state.items() if isinstance(s, dict) and id(p) in experts
                      for v in s.values() if isinstance(v, torch.Tensor)]
            self._note_roles(routed, "optimizer_state", optimizer, True)

    def _note_roles(self, tensors: Any, category: str, owner: Any, experts: bool = False) -> None:
        """:meth:`_note_role` of each tensor, plain tensors inline (an optimizer step over many parameters);
        ``experts``: they are the routed experts' (the role's label is then ``(id(owner), EXPERTS)``)."""
        lookup, roles = self.lookup, self.roles
        label = (category, (id(owner), EXPERTS) if experts else id(owner))
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
                entry = self.lookup(id(storage))
                if entry is not None:
                    self.roles[entry.serial] = (category, f"{kind} {category.replace('_', ' ')}")
            return
        try:
            entry = self.lookup(id(t.untyped_storage()))
        except (RuntimeError, NotImplementedError):
            return
        if entry is not None:
            self.roles[entry.serial] = (category, id(owner))

    def _mod_pre(self, module: Any, *_: Any) -> None:
        now = self.now
        if not now.modules:
            self.on_root_forward()
        now.modules.append(id(module))
        if self.record_sites:  # one site for all a module of PyTorch's makes (sites.py)
            site = now.site
            now.sites.append(site)
            if site is None:
                if plain_forward(module):
                    now.site = user_site(sys._getframe(1))
            elif not plain_forward(module):
                now.site = None
        ddp = self.ddp
        if ddp.ddp_open is not None or (ddp.ddp_types and type(module) in ddp.ddp_types):
            ddp.ddp_module_entered(module)
        if self.observer is not None:
            self.observer.module_entered(module)

    def _mod_post(self, module: Any, *_: Any) -> None:
        now = self.now
        if now.modules:
            now.modules.pop()
            if not now.modules and _grad_enabled() and _current_node() is None:  # a root forward with grad returned
                now.loss = True
        if now.sites:
            now.site = now.sites.pop()
        if self.ddp.ddp_open is not None:
            self.ddp.close_ddp()
        if self.observer is not None:
            self.observer.module_exited(module)


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
