"""The optimizer a step would use, built on the fake parameters, as the target device would pick it.

On CUDA, PyTorch's optimizers default to the ``foreach`` implementation, whose temporaries are as large
as the parameters; on the CPU they default to the per-parameter loop. Estimating for CUDA therefore asks
for ``foreach=True`` explicitly, unless the user chose ``fused`` or ``foreach`` themselves.

bitsandbytes' and torchao's optimizers are not run: their state is made from the parameters' shapes
(``low_bit_optimizers.py``); Muon runs with AdamW for the parameters that are not matrices (``muon.py``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..options import OptimizerChoice
from .low_bit_optimizers import ModelledOptimizer, recipe_for
from .muon import MuonWithAdamW, is_muon, muon_settings

_BY_NAME: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 1e-3}),
    "sgd-momentum": (torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 1e-3}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-3}),
    "adagrad": (torch.optim.Adagrad, {"lr": 1e-2}),
    "rmsprop": (torch.optim.RMSprop, {"lr": 1e-2}),
    "adafactor": (torch.optim.Adafactor, {"lr": 1e-2}),
}


def make_optimizer(spec: Any, params: list[torch.nn.Parameter], device: str) -> torch.optim.Optimizer:
    """``spec``: a name from :data:`_BY_NAME`, an optimizer class, or an optimizer object (or the
    ``options.OptimizerChoice`` made of one) whose class and hyper-parameters are reused (never its state or
    parameters). bitsandbytes' and torchao's optimizers (by name, class or object) come back as a
    :class:`ModelledOptimizer` with the object's settings (bits, paging, block size); Muon as Muon with AdamW."""
    recipe = recipe_for(spec)
    if recipe is not None:
        return ModelledOptimizer(params, recipe, device)
    if is_muon(spec):
        adamw = {"lr": 1e-3, "foreach": device == "cuda"}
        return MuonWithAdamW(params, muon_settings(spec), adamw, _skip_graph_capture_check)
    if isinstance(spec, str):
        cls, kwargs = _BY_NAME[spec]
        kwargs = dict(kwargs)
    elif isinstance(spec, type):
        cls, kwargs = spec, {}
    else:
        cls = spec.cls if isinstance(spec, OptimizerChoice) else type(spec)
        kwargs = {k: v for k, v in spec.defaults.items() if _accepts(cls, k)}
    if device == "cuda" and _accepts(cls, "foreach") and kwargs.get("foreach") is None \
            and not kwargs.get("fused"):
        kwargs["foreach"] = True
    if device == "cpu" and kwargs.get("foreach") is None and _accepts(cls, "foreach"):
        kwargs["foreach"] = False
    try:
        optimizer = cls(params, **kwargs)
    except TypeError as err:
        raise TypeError(f"cannot build the optimizer {cls.__name__} on the model's parameters: {err}. Pass an "
                        "optimizer object instead, so its hyper-parameters are reused") from None
    _skip_graph_capture_check(optimizer)
    return optimizer


def _skip_graph_capture_check(optimizer: torch.optim.Optimizer) -> None:
    """No stream is being captured while fake tensors run; the check that each ``step()`` makes asks whether
    CUDA is there (``torch.cuda.is_available()`` on torch 2.5, the accelerator API later), which an estimate
    must not do. This optimizer is the estimator's own, so the check is switched off on it alone, under both
    the old name and the new."""
    for name in ("_cuda_graph_capture_health_check", "_accelerator_graph_capture_health_check"):
        if hasattr(optimizer, name):
            setattr(optimizer, name, _no_check)


def _no_check() -> None:
    return None


def _accepts(cls: type, name: str) -> bool:
    try:
        return name in inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return False


def is_fused(opt: torch.optim.Optimizer) -> bool:
    return any(g.get("fused") for g in opt.param_groups)
