"""KV caches: which objects are one, and the tensors they keep.

Three kinds are recognised:

* Hugging Face cache objects: every subclass of ``transformers.cache_utils.Cache`` (dynamic, sliding-window,
  static, quantized, offloaded, hybrid and linear-attention layers, ``EncoderDecoderCache``'s self- and
  cross-attention caches, and the ``key_cache``/``value_cache`` lists of older releases). Their tensors are
  found by walking the cache and its layers, whatever the layer type keeps (``keys``/``values``, a quantized
  backend's packed data and scales, a sliding window's length tensor, conv and recurrent states).
* Legacy tuple caches (``past_key_values`` of older models, ``to_legacy_cache()``): a tuple of per-layer
  tuples ``(key, value[, ...])`` of 4-D tensors whose batch, heads and length agree.
* A hand-written decoder's cache, told by the name that holds it (:data:`CACHE_NAMES`: ``past_key_values``,
  ``past``, ``layer_past``, ``cache``, ``kv_cache``, ...): a tensor of 3 or more dimensions, or tuples and
  lists (dicts, for the names that say "key/value") of tensors.

An object that *holds* a cache (a ``GenerateDecoderOnlyOutput`` or any ``ModelOutput``: ``cache`` in transformers
5, ``past_key_values`` before; a dict; an attribute) gives that cache's tensors to :func:`kv_cache_tensors`.

transformers is never imported here: its classes are looked up in ``sys.modules``, and where it is not
loaded no object can be one of its caches.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch

KV_CACHE = "kv_cache"
"""The category name of KV-cache memory in reports and estimates."""

#: variable (attribute, key) names whose tensors are taken for a KV cache
CACHE_NAMES = frozenset({"past_key_values", "past_key_value", "past", "layer_past", "cache", "kv_cache",
                         "kv_caches", "key_value_cache"})
# names that say key/value outright: a dict held by one of them is a cache too (a plain `cache` dict is often a
# memo of something else)
_KV_NAMES = frozenset({"past_key_values", "past_key_value", "layer_past", "kv_cache", "kv_caches",
                       "key_value_cache"})
#: the endings of a scan's path names (``out.past``, ``d['past']``) that may name a cache: a cheap first test
CACHE_NAME_ENDINGS = tuple(sorted({*CACHE_NAMES, *(f"'{n}']" for n in CACHE_NAMES), *(f'"{n}"]' for n in CACHE_NAMES)}))

_CACHE_UTILS = "transformers.cache_utils"
_MAX_DEPTH = 8  # cache -> self_attention_cache -> layers -> [i] -> layer -> _quantized_keys -> (data, meta) -> scale
_Tensor = torch.Tensor


def _cache_module() -> Any:
    return sys.modules.get(_CACHE_UTILS)


def cache_base() -> type | None:
    """``transformers.cache_utils.Cache`` if transformers is loaded, else ``None``."""
    mod = _cache_module()
    base = getattr(mod, "Cache", None) if mod is not None else None
    return base if isinstance(base, type) else None


def is_cache_class(cls: type) -> bool:
    """``cls`` is a Hugging Face cache class (a subclass of ``transformers.cache_utils.Cache``)."""
    base = cache_base()
    if base is None:
        return False
    try:
        return issubclass(cls, base)
    except TypeError:
        return False


def _is_cache_part(obj: Any) -> bool:
    """An object inside a Hugging Face cache whose attributes hold its tensors: a cache, or one of its layers
    (any class of ``cache_utils``, a model's own cache class, or a layer type defined elsewhere in transformers)."""
    cls = type(obj)
    module = str(getattr(cls, "__module__", ""))
    if module == _CACHE_UTILS:
        return True
    if not module.startswith("transformers."):
        return False
    mod = _cache_module()
    if mod is None:
        return False
    names = ("Cache", "CacheLayerMixin", "LinearAttentionCacheLayerMixin")
    bases = tuple(b for b in (getattr(mod, n, None) for n in names) if isinstance(b, type))
    return bool(bases) and isinstance(obj, bases)


def name_leaf(name: str) -> str:
    """The last part of a scan's path name: ``out.past_key_values`` and ``out['past_key_values']`` →
    ``past_key_values``; ``caches[3]`` → ``3``."""
    if name.endswith("]"):
        inner = name[name.rfind("[") + 1:-1]
        return inner.strip("'\"")
    return name[name.rfind(".") + 1:]


def is_legacy_cache(obj: Any) -> bool:
    """A tuple of per-layer tuples ``(key, value[, ...])`` of 4-D tensors, key and value agreeing on batch, heads
    and length (the rest of a layer's tuple: tensors or ``None``, as ``DynamicCache``'s own iteration gives);
    every layer the same length of tuple. Strict, as it needs no name to be believed."""
    if type(obj) is not tuple or not obj:
        return False
    first = obj[0]
    if type(first) is not tuple or len(first) < 2 or len(first) > 6:
        return False
    n = len(first)
    try:
        for layer in obj:
            if type(layer) is not tuple or len(layer) != n:
                return False
            k, v = layer[0], layer[1]
            if not isinstance(k, _Tensor) or not isinstance(v, _Tensor) or k.dim() != 4 or v.dim() != 4:
                return False
            if k.shape[:3] != v.shape[:3]:
                return False
            for rest in layer[2:]:
                if rest is not None and not isinstance(rest, _Tensor):
                    return False
    except Exception:  # a tensor subclass that raises on access
        return False
    return True


def _all_tensors(obj: Any, depth: int) -> bool:
    """Nested tuples/lists (dicts, where ``mappings``) of tensors or ``None``, with at least one tensor."""
    found = False
    stack = [(obj, depth)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, _Tensor):
            found = True
        elif o is None:
            continue
        elif isinstance(o, (tuple, list)) and d > 0:
            stack.extend((v, d - 1) for v in o)
        elif isinstance(o, Mapping) and d > 0:
            stack.extend((v, d - 1) for v in list(o.values()))
        else:
            return False
    return found


def is_named_cache(obj: Any, name: str) -> bool:
    """A hand-written decoder's cache, told by the name that holds it (see :data:`CACHE_NAMES`)."""
    leaf = name_leaf(name) if name else ""
    if leaf not in CACHE_NAMES:
        return False
    try:
        if isinstance(obj, _Tensor):
            return obj.dim() >= 3
        if isinstance(obj, (tuple, list)):
            return bool(obj) and _all_tensors(obj, 3)
        if isinstance(obj, Mapping) and leaf in _KV_NAMES:
            return bool(obj) and _all_tensors(obj, 3)
    except Exception:
        return False
    return False


def is_kv_cache(obj: Any, name: str = "") -> bool:
    """``obj`` is a KV cache: a Hugging Face cache object, a legacy tuple cache, or (given the ``name`` that holds
    it: a variable, attribute or key) a hand-written decoder's cache. Never raises."""
    try:
        if is_cache_class(type(obj)):
            return True
    except Exception:
        return False
    return is_legacy_cache(obj) or (bool(name) and is_named_cache(obj, name))


_HOLDING_KEYS = ("cache", "past_key_values")  # transformers 5 names a model output's cache `cache`; 4 did not


def _held_cache(obj: Any) -> tuple[Any, str]:
    """The cache an object holds, and the key it holds it under: a ``ModelOutput`` or generate() output
    (``cache``, ``past_key_values`` before transformers 5), a dict, an object's attribute. Read without going
    through a ``ModelOutput``'s own ``get``, which warns about the old name."""
    try:
        if isinstance(obj, dict):
            items: Any = {k: dict.get(obj, k) for k in _HOLDING_KEYS}
        elif isinstance(obj, Mapping):
            items = {k: obj.get(k) for k in _HOLDING_KEYS}
        else:
            attrs = getattr(obj, "__dict__", None)
            items = {k: attrs.get(k) for k in _HOLDING_KEYS} if isinstance(attrs, dict) else {}
        for key, held in items.items():
            if held is not None and is_kv_cache(held, key):
                return held, key
    except Exception:
        pass
    return None, ""


def kv_cache_tensors(obj: Any, name: str = "") -> list[tuple[str, torch.Tensor]]:
    """``[(path, tensor), ...]``: the tensors of the KV cache ``obj`` is (see :func:`is_kv_cache`), or of the one it
    holds (a model output's ``cache``, ``past_key_values``); ``[]`` when there is none. Paths are relative to ``obj``
    (``layers[0].keys``, ``[3][1]``). Each tensor once, however many paths reach it. Never raises."""
    target, prefix = obj, ""
    if not is_kv_cache(obj, name):
        target, prefix = _held_cache(obj)
        if target is None:
            return []
    out: list[tuple[str, torch.Tensor]] = []
    _walk(target, prefix, out, set(), _MAX_DEPTH)
    return out


def _walk(obj: Any, path: str, out: list[tuple[str, torch.Tensor]], seen: set[int], depth: int) -> None:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    try:
        if isinstance(obj, _Tensor):
            out.append((path, obj))
            return
        if depth <= 0 or obj is None:
            return
        if isinstance(obj, (tuple, list)):
            for i, v in enumerate(obj):
                _walk(v, f"{path}[{i}]", out, seen, depth - 1)
        elif isinstance(obj, Mapping):
            for k, v in list(obj.items()):
                _walk(v, f"{path}[{k!r}]", out, seen, depth - 1)
        elif _is_cache_part(obj):
            attrs = object.__getattribute__(obj, "__dict__")
            for k, v in list(attrs.items()):
                _walk(v, f"{path}.{k}" if path else k, out, seen, depth - 1)
    except Exception:  # a part that raises when read: what it holds stays with whoever else holds it
        return


def kv_cache_bytes(obj: Any, name: str = "") -> int:
    """Bytes of the distinct storages behind :func:`kv_cache_tensors` (a storage shared by two views counts
    once; a quantized backend's packed tensors by their parts)."""
    from ..tensors import storage_parts

    seen: set[int] = set()
    total = 0
    for _, t in kv_cache_tensors(obj, name):
        for storage, _kind in storage_parts(t) or ():
            if id(storage) not in seen:
                seen.add(id(storage))
                try:
                    total += int(storage.nbytes())
                except Exception:
                    pass
    return total


__all__ = ["CACHE_NAMES", "CACHE_NAME_ENDINGS", "KV_CACHE", "cache_base", "is_cache_class", "is_kv_cache",
           "is_legacy_cache", "is_named_cache", "kv_cache_bytes", "kv_cache_tensors", "name_leaf"]
