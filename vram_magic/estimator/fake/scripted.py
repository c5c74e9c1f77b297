"""TorchScript modules (``torch.jit.script``, ``torch.jit.trace``) in the fake copy of a model.

A deep copy of a ScriptModule is made in C++: it would copy the real weights and ignore the memo that swaps
them for fake tensors. Instead each scripted module is replicated as DataParallel replicates it (a shallow copy
of the C++ object: same compiled code, its own attribute slots), and the replica's parameters and buffers are
set to fake tensors. The user's module keeps its slots, weights and gradients; the replica runs its compiled
code in the TorchScript interpreter on fake tensors, as the real module runs it.

The compiled code and its executor are shared with the user's module (they belong to the module's type). The
profiling executor runs the code as written on its first call and an optimized graph (with TorchScript's own
autodiff, which saves other tensors) from then on, so the step runs three times to reach that state; a module
whose first call was without gradients keeps running as written, in the estimate as for real. The estimate's
runs count as calls of the module: the first training step a user runs afterwards is already optimized.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..torch_private import construct_script_module


def is_scripted(module: Any) -> bool:
    return isinstance(module, torch.jit.ScriptModule)


def has_scripted(model: nn.Module) -> bool:
    return any(is_scripted(m) for m in model.modules())


def replicate_scripted(model: nn.Module, memo: dict[int, Any], fake: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Put a fake replica of every outermost scripted module of ``model`` (the model itself, when scripted) into
    ``memo``, the deep copy's memo; ``fake(t)`` gives the fake twin of a parameter or buffer (tied weights stay
    tied through ``memo``). ``ValueError`` for a module that cannot be replicated."""
    for name, m in model.named_modules():
        if is_scripted(m) and id(m) not in memo:
            _check(m, name)
            memo[id(m)] = _replica(m, name, memo, fake)


def _replica(m: Any, name: str, memo: dict[int, Any], fake: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    try:
        copy = construct_script_module(m._c._replicate_for_data_parallel(), lambda _: None)
    except (AttributeError, RuntimeError) as err:  # a PyTorch without DataParallel's replication of script modules
        raise ValueError(f"{_where(m, name)} is a TorchScript module, which this PyTorch cannot copy onto fake "
                         f"tensors ({type(err).__name__}: {err}); estimate the Python module it was scripted or "
                         "traced from, or measure it with %%vram / vram_magic.measure()") from None
    memo[id(m)] = copy
    for child_name, child in list(m._modules.items()):
        if child is None:
            continue
        sub = memo.get(id(child))
        if sub is None:
            sub = _replica(child, f"{name}.{child_name}" if name else child_name, memo, fake)
        copy._modules[child_name] = sub
    for table in ("_parameters", "_buffers"):
        source, target = getattr(m, table), getattr(copy, table)
        for key, t in list(source.items()):
            if isinstance(t, torch.Tensor):
                twin = memo.get(id(t))
                if twin is None:
                    twin = memo[id(t)] = fake(t)
                target[key] = twin
    return copy


def _check(m: Any, name: str) -> None:
    """A frozen module (``torch.jit.freeze``) holds its weights as constants of its graph, not as attributes:
    a copy would run on the real weights and count none of them."""
    if any(True for _ in m.parameters()) or any(True for _ in m.buffers()):
        return
    try:
        _, constants = m.code_with_constants
        frozen = any(isinstance(v, torch.Tensor) and v.numel() > 1 for v in constants.const_mapping.values())
    except (AttributeError, RuntimeError):
        frozen = False
    if frozen:
        raise ValueError(f"{_where(m, name)} is a frozen TorchScript module (torch.jit.freeze): its weights are "
                         "constants of its graph, which fake tensors cannot stand in for; estimate the module "
                         "before torch.jit.freeze (or before scripting it), or measure it with %%vram / "
                         "vram_magic.measure()")


def _where(m: Any, name: str) -> str:
    return f"module {name or '(the model)'!r} ({getattr(m, 'original_name', type(m).__name__)})"
