"""The first step of a fake run: it only has to leave the optimizer's state behind.

The first fake run of a workload runs it: stand-in gradients and a real ``optimizer.step()``. What that step left
(each parameter's state: tensors' shapes, strides and dtypes, and plain values) is kept by what decides it — the
optimizer, the device, master weights, and the shapes and dtypes of the tensors it updates — and every later fake run
of the same workload with the same key makes that state directly, one ``empty_strided`` per state tensor, instead of
a whole update (a third of a small model's ops in each fake run). Nothing after the first step can tell the two apart:
the state's storages are allocated under the tracer as the step allocates them, and the step's own temporaries, and
its stand-in gradients, were freed before the second step, whose peak is the steady state's (the second step holds
the full state and every gradient, so its update's peak is at least the first's).

On the CPU only, where memory is the bytes alive: for CUDA the simulated caching allocator places each block by the
history before it, and state made up front leaves other segments (less reserved memory: 0.9 GiB less for a Llama-3-8B
step under ZeRO-3) than state made inside the update, between its temporaries, as a real first step makes it.

Only state that can be remade exactly is kept: plain strided tensors, each on a storage of its own that it fills
from offset 0, and values that are numbers, strings, ``None`` or tuples of them. Any other state (a storage shared
between parameters, a view, an object) runs the real step every time.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn

from ..tracing.tracer import BACKWARD, OPTIMIZER, ZERO_GRAD, StepTracer

#: a state tensor's spec: ``("T", shape, stride, dtype, device)``; a plain value's: ``("V", value)``
Spec = tuple[Any, ...]
#: per parameter the optimizer updates, its state as ``((key, spec), ...)``, or None where it has none
StateLayout = tuple[tuple[tuple[Any, Spec], ...] | None, ...]

_PLAIN = (int, float, bool, str, type(None))


def state_key(optimizer_spec: Any, device: str, master_weights: bool, updated: list[nn.Parameter]) -> Hashable:
    """What decides the state a first step leaves: the optimizer (name, class or hyper-parameters), the device, master
    weights, and the shape and dtype of each tensor the optimizer updates."""
    return (optimizer_spec, device, master_weights, tuple((tuple(p.shape), p.dtype) for p in updated))


def run_first_step(updater: Any, optimizer: torch.optim.Optimizer, updated: list[nn.Parameter],
                   trainable: list[nn.Parameter], tracer: StepTracer, claim: Callable[..., int | None],
                   host_scalars: set[int], states: dict[Hashable, StateLayout] | None, key: Hashable | None) -> None:
    """The first step: the state made from ``states[key]`` where a first step of this key left one that can be
    remade, else a real update by ``updater`` (the optimizer, or the step of fp32 master weights around it) on
    stand-in gradients of ``trainable``, its state kept in ``states`` for the next fake run. ``updated``: the tensors
    ``optimizer`` updates (the master weights, where there are any)."""
    layout = states.get(key) if states is not None and key is not None else None
    if layout is not None:
        tracer.stage = OPTIMIZER
        for p, entries in zip(updated, layout):
            if entries is not None:
                optimizer.state[p] = {k: _remade(spec) for k, spec in entries}
        claim_state(optimizer, claim, host_scalars)
        tracer.stage = ZERO_GRAD
        return
    _stand_in_step(updater, trainable, tracer, claim, host_scalars)
    if states is not None and key is not None:
        made = state_layout(optimizer, updated)
        if made is not None:
            states[key] = made


def _stand_in_step(optimizer: Any, trainable: list[nn.Parameter], tracer: StepTracer,
                   claim: Callable[..., int | None], host_scalars: set[int]) -> None:
    """The first step's forward and backward are the same ops as the second step's (no tensor of theirs outlives the
    step), so stand-in gradients replace them: half the ops of a big model's estimate. A parameter the second step
    leaves without a gradient loses the state stood in for it before that step's update."""
    tracer.stage = BACKWARD
    for p in trainable:
        p.grad = torch.empty_like(p)
        claim(p.grad, ("gradients", "gradients"))
    tracer.stage = OPTIMIZER
    optimizer.step()
    claim_state(optimizer, claim, host_scalars)
    tracer.stage = ZERO_GRAD
    optimizer.zero_grad(set_to_none=True)


def state_layout(optimizer: torch.optim.Optimizer, updated: list[nn.Parameter]) -> StateLayout | None:
    """The state ``optimizer`` holds for each of ``updated``, as specs to remake it from; None where some of it
    cannot be remade exactly (see the module's documentation)."""
    if len(optimizer.state) > len(updated):  # state kept for something else than the parameters
        return None
    seen: set[int] = set()
    out: list[tuple[tuple[Any, Spec], ...] | None] = []
    for p in updated:
        state = optimizer.state.get(p)
        if state is None:
            out.append(None)
            continue
        if not isinstance(state, dict):
            return None
        entries = []
        for k, v in state.items():
            spec = _spec(v, seen)
            if spec is None:
                return None
            entries.append((k, spec))
        out.append(tuple(entries))
    return tuple(out)


def _spec(v: Any, seen: set[int]) -> Spec | None:
    if isinstance(v, torch.Tensor):
        if v.layout != torch.strided or v.requires_grad or v.is_quantized or v.storage_offset() != 0:
            return None
        storage = v.untyped_storage()
        if storage._cdata in seen or storage.nbytes() != _extent(v) * v.element_size():
            return None
        seen.add(storage._cdata)
        return ("T", tuple(v.shape), tuple(v.stride()), v.dtype, str(v.device))
    if isinstance(v, _PLAIN) or isinstance(v, tuple) and all(isinstance(x, _PLAIN) for x in v):
        return ("V", v)
    return None


def _extent(v: torch.Tensor) -> int:
    """Elements from the first to one past the last that ``v`` reaches (what ``empty_strided`` allocates)."""
    if v.numel() == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(v.shape, v.stride()))


def _remade(spec: Spec) -> Any:
    if spec[0] == "V":
        return spec[1]
    _, shape, stride, dtype, device = spec
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)


def claim_state(optimizer: torch.optim.Optimizer, claim: Callable[..., int | None], host_scalars: set[int]) -> None:
    for state in optimizer.state.values():
        for key, v in state.items():
            if isinstance(v, torch.Tensor):
                scalar = v.dim() == 0
                s = claim(v, ("optimizer_state", "step counters" if scalar else str(key)))
                if scalar and s is not None:
                    host_scalars.add(s)
