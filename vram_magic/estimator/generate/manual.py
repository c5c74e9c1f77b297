"""A hand-written decoder's generation loop, for models without transformers' ``generate()``.

The convention: ``forward(input_ids, past_key_values=None)`` (or ``past=``, ``layer_past=``, ``cache=``,
``kv_cache=``) returns the logits and the new cache — as ``(logits, cache)``, or an object or dict with
``logits`` and ``past_key_values`` (``past``, ``cache``). The loop modelled is the usual greedy one::

    logits, past = model(ids, past_key_values=None)          # the prefill
    for _ in range(new_tokens - 1):
        token = logits[:, -1, :].argmax(-1, keepdim=True)
        ids = torch.cat([ids, token], dim=-1)
        logits, past = model(token, past_key_values=past)    # one token, the cache passed back

(the last token comes from the last logits; each step's logits live until the next step's replace them). As
for transformers models, the prefill and the first step run, then the cache (each tensor grown along the
dimension that grew by one token from the prefill to the first step) is advanced to the start of the last
step, which runs at the longest cache.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

from ...engine.hooks.kv_cache import CACHE_NAMES
from ..fake.convert import tensors_in
from .facts import GenerateSpec
from .loop import DecodePlan

#: the cache argument's names, in the order they are looked for in a forward's signature
ARGUMENTS = ("past_key_values", "past", "layer_past", "cache", "kv_cache", "past_key_value", "kv_caches",
             "key_value_cache")
_OUTPUT_NAMES = ("past_key_values", "past", "cache", "kv_cache", "past_key_value", "layer_past")


def cache_argument(model: Any) -> str | None:
    """The name under which ``model``'s forward takes a cache, or ``None``."""
    forward = getattr(model, "forward", None)
    if forward is None:
        return None
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return None
    for name in ARGUMENTS:
        if name in params and name in CACHE_NAMES:
            return name
    return None


def split_output(out: Any, name: str) -> tuple[torch.Tensor, Any]:
    """``(logits, cache)`` from a forward's output, else ``ValueError`` saying what the convention is."""
    logits: Any = None
    past: Any = None
    if isinstance(out, Mapping) or hasattr(out, "logits"):
        get = out.get if isinstance(out, Mapping) else (lambda k, d=None: getattr(out, k, d))
        logits = get("logits")
        for key in (name, *_OUTPUT_NAMES):
            if get(key) is not None:
                past = get(key)
                break
    elif isinstance(out, (tuple, list)) and len(out) >= 2 and isinstance(out[0], torch.Tensor):
        logits, past = out[0], out[1]
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or past is None:
        raise ValueError(f"the model's forward must return (logits, cache) or an object with .logits (batch, length, "
                         f"vocabulary) and .past_key_values when given {name}=; it returned {type(out).__name__}")
    return logits, past


def growth_dims(before: list[torch.Size], after: Any) -> list[int | None]:
    """For each tensor of the cache: the dimension that grew by one token from the shapes ``before`` to the
    cache ``after`` (``None`` for one that did not)."""
    out: list[int | None] = []
    b = tensors_in(after)
    if len(before) != len(b):
        return [None] * len(b)
    for x, y in zip(before, b):
        grown = [d for d in range(min(len(x), y.dim())) if y.shape[d] == x[d] + 1]
        out.append(grown[0] if len(grown) == 1 and len(x) == y.dim() else None)
    return out


def _shape_only(past: Any) -> Any:
    """The cache's structure with each tensor replaced by ``(shape, dtype)``: nothing of it stays alive."""
    if isinstance(past, torch.Tensor):
        return torch.Size(past.shape), past.dtype
    if isinstance(past, (tuple, list)):
        return [_shape_only(v) for v in past]
    if isinstance(past, Mapping):
        return {k: _shape_only(v) for k, v in past.items()}
    return past


def _grown(structure: Any, dims: list[int | None], tokens: int, seen: list[int]) -> Any:
    if isinstance(structure, tuple) and len(structure) == 2 and isinstance(structure[0], torch.Size):
        shape, dtype = list(structure[0]), structure[1]
        d = dims[seen[0]] if seen[0] < len(dims) else None
        seen[0] += 1
        if d is not None:
            shape[d] += tokens
        return torch.empty(shape, dtype=dtype)
    if isinstance(structure, list):
        return tuple(_grown(v, dims, tokens, seen) for v in structure)
    if isinstance(structure, dict):
        return {k: _grown(v, dims, tokens, seen) for k, v in structure.items()}
    return structure


def manual_generate(model: Any, inputs: Any, spec: GenerateSpec, plan: DecodePlan, learnt: Any) -> torch.Tensor:
    """The greedy loop above on fake tensors, steps chosen by ``plan``."""
    if spec.num_beams != 1 or spec.cache_implementation is not None or spec.do_sample:
        raise ValueError("a hand-written decoder is estimated with greedy decoding and its own cache: num_beams, "
                         "cache_implementation and sampling apply to transformers models")
    name = cache_argument(model)
    assert name is not None
    learnt.cache_name = name
    if isinstance(inputs, Mapping):
        ids, extra = inputs.get("input_ids"), {k: v for k, v in inputs.items() if k != "input_ids"}
    elif isinstance(inputs, (tuple, list)):
        ids, extra = inputs[0], {}
    else:
        ids, extra = inputs, {}
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError("a hand-written decoder's inputs must be token ids of shape (batch, prompt length), or a "
                         "dict with input_ids")
    params = inspect.signature(model.forward).parameters
    flags = {"use_cache": True} if "use_cache" in params else {}
    plan.jump_at = 1  # the dimension each cache tensor grows along is seen from the prefill to step 1
    plan.on_event("prompt", int(ids.shape[1]))
    plan.on_event("prefill_start", None)
    out = model(ids, **{name: None}, **flags, **extra)
    logits, past = split_output(out, name)
    del out
    plan.on_event("prefill_end", past)
    before = [torch.Size(t.shape) for t in tensors_in(past)]
    dims: list[int | None] = []
    step: int | None = 0
    while step is not None:
        plan.steps_run.append(step)
        plan.on_event("step", step)
        if step > 0:
            out = model(token, **{name: past}, **flags)  # noqa: F821 (set by the step before)
            logits, past = split_output(out, name)  # the step before's logits lived until now, as in a loop
            del out                                 # that writes `logits, past = model(token, past)`
            plan.on_event("decode_forward", past)
            if step == 1:
                dims = growth_dims(before, past)
                plan.jump = any(d is not None for d in dims)
        token = logits[:, -1, :].argmax(dim=-1, keepdim=True)
        ids = torch.cat([ids, token], dim=-1)
        following = plan.next_step(step)
        if following is not None and following > step + 1:
            skip = following - step - 1
            plan.on_event("jump_start", None)
            plan.on_event("replacing", ids)
            structure, ids_shape = _shape_only(past), tuple(ids.shape)
            past = ids = None
            past = _grown(structure, dims, skip, [0])
            ids = torch.empty((ids_shape[0], ids_shape[1] + skip), dtype=torch.long)
            plan.on_event("replaced", ids)
            plan.jumped = skip
            plan.on_event("jump_end", past)
        step = following
    plan.on_event("loop_end", None)
    learnt.cache = past
    learnt.hand_written = (past, dims)
    return ids


def describe_tuple_cache(past: Any, dims: list[int | None]) -> tuple[str, str, int, int]:
    """``(class, layers, bytes per token, fixed bytes)`` of a hand-written decoder's cache."""
    tensors = tensors_in(past)
    per_token = fixed = 0
    for i, t in enumerate(tensors):
        d = dims[i] if i < len(dims) else None
        n = t.numel() * t.element_size()
        if d is not None and t.shape[d]:
            per_token += n // int(t.shape[d])
        else:
            fixed += n
    layers = f"{len(past)} layers" if isinstance(past, (tuple, list)) else "one tensor"
    return f"{type(past).__name__} cache ({len(tensors)} tensors)", layers, per_token, fixed


__all__ = ["ARGUMENTS", "cache_argument", "describe_tuple_cache", "growth_dims", "manual_generate", "split_output"]
