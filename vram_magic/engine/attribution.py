"""Who holds each live storage: parameters, gradients, optimizer state, activations or other.

A scan walks the user's namespace (modules, optimizers, tensors, containers and plain objects, a few levels
deep), then the autograd graphs hanging off the tensors it found. It returns plain data keyed by
``id(storage)``; the storages themselves are only registered (weakly) in the :class:`LiveStorages`.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .registry import LiveStorages

_IPYTHON_NAMES = frozenset(
    {"In", "Out", "_ih", "_oh", "_dh", "_i", "_ii", "_iii", "exit", "quit", "get_ipython", "__builtins__",
     "__builtin__", "__name__", "__doc__", "__package__", "__loader__", "__spec__"}
)
_OUTPUT_CACHE = re.compile(r"^(_+|_\d+)$")
_INPUT_CACHE = re.compile(r"^_i+\d*$")
_MAX_OBJECTS = 20_000
_MAX_ITEMS = 1_000

# What the walker does with an object, decided once per type (isinstance chains are slow for many objects).
# Keyed by id, with a weakref to check it: a class defined in a cell may hold tensors, and must not be kept.
_TENSOR, _MODULE, _OPTIMIZER, _SKIP, _MAPPING, _SEQUENCE, _OBJECT = range(7)
_kinds: dict[int, tuple[int, weakref.ref]] = {}


def _kind(cls: type) -> int:
    hit = _kinds.get(id(cls))
    if hit is not None and hit[1]() is cls:
        return hit[0]
    try:
        if issubclass(cls, torch.Tensor):
            kind = _TENSOR
        elif issubclass(cls, torch.nn.Module):
            kind = _MODULE
        elif issubclass(cls, torch.optim.Optimizer):
            kind = _OPTIMIZER
        elif issubclass(cls, (str, bytes, int, float, complex, bool, type, type(None), set, frozenset)):
            kind = _SKIP
        elif issubclass(cls, Mapping):
            kind = _MAPPING
        elif issubclass(cls, (list, tuple)):
            kind = _SEQUENCE
        elif str(cls.__module__).startswith("vram_magic") or cls.__module__ == "builtins":
            kind = _SKIP
        else:
            kind = _OBJECT
        ref = weakref.ref(cls)
    except Exception:  # a class whose subclass checks raise: leave its objects alone
        return _SKIP
    if len(_kinds) > 10_000:
        _kinds.clear()
    _kinds[id(cls)] = (kind, ref)
    return kind


@dataclass
class Scan:
    """``owner[id(storage)] = (category, label)``, plus the names that hold each graph."""

    owner: dict[int, tuple[str, str]] = field(default_factory=dict)
    holders: dict[int, str] = field(default_factory=dict)  # id(storage) -> variable name holding it
    module_names: dict[int, str] = field(default_factory=dict)  # id(module) -> "model.layers.3.mlp"
    optimizer_names: dict[int, str] = field(default_factory=dict)  # id(optimizer) -> "opt"

    def category(self, key: int) -> tuple[str, str]:
        return self.owner.get(key, ("other", "unattributed"))


class _Walker:
    def __init__(self, registry: LiveStorages) -> None:
        self.registry = registry
        self.scan = Scan()
        self.modules: list[tuple[str, torch.nn.Module]] = []
        self.optimizers: list[tuple[str, torch.optim.Optimizer]] = []
        self.tensors: list[tuple[str, torch.Tensor]] = []
        self.cache_tensors: list[tuple[str, torch.Tensor]] = []
        self.seen: set[int] = set()

    # --- collect -------------------------------------------------------------------------------
    def visit(self, name: str, obj: Any, depth: int, cache: bool = False) -> None:
        try:
            self._visit(name, obj, depth, cache)
        except Exception:  # a user object whose attributes or items raise: skip it, never fail the cell
            pass

    def _visit(self, name: str, obj: Any, depth: int, cache: bool = False) -> None:
        if id(obj) in self.seen or len(self.seen) > _MAX_OBJECTS:
            return
        self.seen.add(id(obj))
        kind = _kind(type(obj))
        if kind == _TENSOR:
            (self.cache_tensors if cache else self.tensors).append((name, obj))
        elif kind == _MODULE:
            self.modules.append((name, obj))
        elif kind == _OPTIMIZER:
            self.optimizers.append((name, obj))
        elif depth <= 0 or kind == _SKIP:
            return
        elif kind == _MAPPING:
            for i, (k, v) in enumerate(obj.items()):
                if i >= _MAX_ITEMS:
                    break
                self.visit(f"{name}[{k!r}]", v, depth - 1, cache)
        elif kind == _SEQUENCE:
            for i, v in enumerate(obj[:_MAX_ITEMS]):
                self.visit(f"{name}[{i}]", v, depth - 1, cache)
        else:
            d = getattr(obj, "__dict__", None)
            if isinstance(d, dict) and not callable(obj):
                for k, v in list(d.items())[:_MAX_ITEMS]:
                    self.visit(f"{name}.{k}", v, depth - 1, cache)

    # --- assign (first claim wins: the order is the priority) -----------------------------------
    def claim(self, t: Any, category: str, label: str, holder: str | None = None) -> int | None:
        try:
            storage = t.untyped_storage()
        except (AttributeError, RuntimeError, NotImplementedError):  # not a tensor, or sparse/nested
            return None
        key = id(storage)
        if self.registry.get(key) is None:
            self.registry.add(storage)
        owner = self.scan.owner
        if key not in owner:
            owner[key] = (category, label)
            if holder:
                self.scan.holders[key] = holder
        return key

    def _claim_all(self, items: Iterable[tuple[Any, str]], category: str, prefix: str = "",
                   grads: list[tuple[Any, str]] | None = None) -> None:
        """``claim`` for many ``(tensor, holder)`` pairs (the scan's hot loop: parameters of big models).
        ``grads``: collects the ``.grad`` of each tensor on the way."""
        reg_get, reg_add = self.registry.get, self.registry.add
        owner, holders = self.scan.owner, self.scan.holders
        labels: dict[str, tuple[str, str]] = {}
        for t, name in items:
            try:
                storage = t.untyped_storage()
            except (AttributeError, RuntimeError, NotImplementedError):
                continue
            key = id(storage)
            if reg_get(key) is None:
                reg_add(storage)
            if key not in owner:
                label = labels.get(name)
                if label is None:
                    label = labels[name] = (category, prefix + name)
                owner[key] = label
                holders[key] = name
            if grads is not None:
                g = t.grad
                if g is not None:
                    grads.append((g, name))

    def assign(self) -> Scan:
        names = self.scan.module_names
        params: list[tuple[Any, str]] = []
        buffers: list[tuple[Any, str]] = []
        for name, m in self.modules:
            # straight from each submodule's dicts: much cheaper than parameters()/buffers() generators
            subs = m.named_modules(prefix=name) if m._modules else ((name, m),)
            for subname, sub in subs:
                names.setdefault(id(sub), subname)
                for p in sub._parameters.values():
                    if p is not None:
                        params.append((p, name))
                if sub._buffers:
                    for b in sub._buffers.values():
                        if b is not None:
                            buffers.append((b, name))
        for name, opt in self.optimizers:
            self.scan.optimizer_names.setdefault(id(opt), name)
            params.extend((p, name) for group in opt.param_groups for p in group.get("params", ()))
        grads: list[tuple[Any, str]] = []
        self._claim_all(params, "parameters", grads=grads)
        self._claim_all(grads, "gradients")
        for name, opt in self.optimizers:
            for state in opt.state.values():
                if isinstance(state, Mapping):
                    for v in state.values():
                        self.claim(v, "optimizer_state", name, name)
        self._claim_all(buffers, "other", "buffers of ")
        for name, t in self.tensors:
            # a forward output (part of a graph) is an activation; a leaf (input, user data) is "other"
            self.claim(t, "activations" if t.grad_fn is not None else "other", name, name)
        for name, t in self.cache_tensors:
            self.claim(t, "other", f"output cache {name}", name)
        for name, t in self.tensors + self.cache_tensors:
            if t.grad_fn is not None:
                for saved, is_leaf in saved_tensors(t.grad_fn):
                    if is_leaf:  # a parameter no module or optimizer in the namespace knows any more
                        self.claim(saved, "parameters", f"held by the graph of {name}", name)
                    else:
                        self.claim(saved, "activations", f"graph held by {name}", name)
        return self.scan


def scan_namespace(namespace: Mapping[str, Any] | None, registry: LiveStorages, depth: int = 3) -> Scan:
    """Attribute every storage reachable from ``namespace`` (an IPython ``user_ns`` or a module's globals)."""
    walker = _Walker(registry)
    if namespace:
        items = list(namespace.items())
        out = namespace.get("Out")
        if isinstance(out, Mapping):  # first, so cached outputs get their `_N` names
            for k, v in list(out.items()):
                walker.visit(f"_{k}", v, depth, cache=True)
        for name, value in items:
            if name in _IPYTHON_NAMES:
                continue
            if name[:1] == "_":  # IPython's caches and dunder names all start with one
                if name.startswith("__") or _INPUT_CACHE.match(name):
                    continue
                if _OUTPUT_CACHE.match(name):
                    walker.visit(name, value, depth, cache=True)
                    continue
            walker.visit(name, value, depth)
    return walker.assign()


_saved_attrs: dict[type, tuple[str, ...]] = {}


def _saved_names(node: Any) -> tuple[str, ...]:
    names = _saved_attrs.get(type(node))
    if names is None:
        names = tuple(a for a in dir(node) if a.startswith("_saved_"))
        if hasattr(node, "saved_tensors"):  # custom autograd.Function
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
        leaf = getattr(node, "variable", None)
        if isinstance(leaf, torch.Tensor):
            yield leaf, True
        for nxt, _ in getattr(node, "next_functions", ()):
            if nxt is not None and id(nxt) not in seen:
                stack.append(nxt)
