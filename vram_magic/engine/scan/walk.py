"""What a scan finds in the user's namespace, a few levels deep: modules, optimizers, tensors (and IPython's cached
outputs), KV caches, big containers of plain data (read at C speed, containers.py), what modules hold beside their
parameters and buffers, pipeline stages; what could not be read, and what the bound on objects left out.

The walk only collects; engine/scan/attribution.py then claims the storages of what was found, in order of priority.
Nothing here may fail the user's cell: every read of a user object is guarded, and what could not be read is
named (:meth:`NamespaceWalk.unread`).
"""

from __future__ import annotations

import re
import sys
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..hooks import pipeline
from ..hooks.kv_cache import CACHE_NAME_ENDINGS, is_kv_cache
from ..hooks.quantized import packed_objects
from .containers import KV_CACHE, MAPPING, MODULE, OPTIMIZER, SCALARS, SEQUENCE, SKIP, TENSOR, FastReader, object_kind
from .experts import NAME as EXPERTS_NAME
from .experts import is_experts
from .registry import LiveStorages

_IPYTHON_NAMES = frozenset(
    {"In", "Out", "_ih", "_oh", "_dh", "_i", "_ii", "_iii", "exit", "quit", "get_ipython", "__builtins__",
     "__builtin__", "__name__", "__doc__", "__package__", "__loader__", "__spec__"}
)
_OUTPUT_CACHE = re.compile(r"^(_+|_\d+)$")
_INPUT_CACHE = re.compile(r"^_i+\d*$")
#: names of what could not be read, at most, in a scan's notes
MAX_NOTES = 5


class NamespaceWalk:
    """What one scan found (the lists below), walking at most ``max_objects`` objects one by one."""

    def __init__(self, registry: LiveStorages, namespace: Any, max_objects: int) -> None:
        self.registry = registry
        self.max_objects = max_objects
        self.reader = FastReader(registry, namespace)
        self.modules: list[tuple[str, torch.nn.Module]] = []
        self.optimizers: list[tuple[str, torch.optim.Optimizer]] = []
        self.tensors: list[tuple[str, Any]] = []  # (name, tensor, or what a big container holds)
        self.cache_tensors: list[tuple[str, Any]] = []
        self.kv_caches: list[tuple[str, Any]] = []  # (name, KV cache): see engine/hooks/kv_cache.py
        self.seen: set[int] = set()
        self.count = 0  # objects visited one by one, scalars included (not those of containers read at C speed)
        self.unread_names: list[str] = []
        self.skipped: dict[str, int] = {}  # container name -> items left out by the object bound
        self.fsdp: dict[int, tuple[str, Any]] = {}  # id(FSDP state) -> (module name, state)
        self.packed: list[tuple[Any, str]] = []  # (packed quantized weights of a torch.ao module, holder)
        self.expert_params: set[int] = set()  # id() of the parameters of MoE blocks' routed experts (experts.py)
        # no FSDP module can exist before FSDP2 is imported: looked up once a scan, not once a module
        self.fsdp_loaded = any(path in sys.modules for path in _FSDP)
        # (name, a pipeline stage or schedule): what the stages hold beside their modules (engine/hooks/pipeline.py)
        self.pipelines: list[tuple[str, Any]] | None = [] if pipeline.loaded() else None

    def walk(self, namespace: Mapping[str, Any] | None, depth: int) -> NamespaceWalk:
        """Visit every name of ``namespace`` (an IPython ``user_ns`` or a module's globals) but IPython's own."""
        if not namespace:
            return self
        try:
            items = list(namespace.items())
        except Exception as err:
            self.unread("the namespace", err)
            items = []
        out = namespace.get("Out") if isinstance(namespace, Mapping) else None
        if isinstance(out, dict):  # first, so cached outputs get their `_N` names
            for k, v in list(out.items()):
                self.visit(f"_{k}", v, depth, cache=True)
        for name, value in items:
            if not isinstance(name, str) or name in _IPYTHON_NAMES:
                continue
            if name[:1] == "_":  # IPython's caches and dunder names all start with one
                if name.startswith("__") or _INPUT_CACHE.match(name):
                    continue
                if _OUTPUT_CACHE.match(name):
                    self.visit(name, value, depth, cache=True)
                    continue
            self.visit(name, value, depth)
        self.reader.finish()
        return self

    def visit(self, name: str, obj: Any, depth: int, cache: bool = False) -> None:
        try:
            self._visit(name, obj, depth, cache)
        except Exception as err:  # a user object whose attributes or items raise: skip it, never fail the cell
            self.unread(name, err)

    def unread(self, name: str, err: BaseException) -> None:
        """``name`` could not be read (``err``): named in the scan's notes, the first few."""
        if len(self.unread_names) < MAX_NOTES:
            self.unread_names.append(f"{name} ({type(err).__name__})")
        elif len(self.unread_names) == MAX_NOTES:
            self.unread_names.append("…")

    def _full(self) -> bool:
        return self.count >= self.max_objects

    def _visit(self, name: str, obj: Any, depth: int, cache: bool = False) -> None:
        self.count += 1
        if id(obj) in self.seen:
            return
        kind = object_kind(type(obj))
        if kind == SKIP:
            return
        self.seen.add(id(obj))
        # --- KV caches: a Hugging Face cache at any depth; a legacy tuple cache, or a hand-written one by its name
        if kind == KV_CACHE or (kind in (TENSOR, SEQUENCE, MAPPING) and (
                name.endswith(CACHE_NAME_ENDINGS) or (type(obj) is tuple and obj and type(obj[0]) is tuple))
                and is_kv_cache(obj, name)):
            self.kv_caches.append((name, obj))
            return
        # ---
        if kind == TENSOR:
            (self.cache_tensors if cache else self.tensors).append((name, obj))
        elif kind == MODULE:
            self.modules.append((name, obj))
        elif kind == OPTIMIZER:
            self.optimizers.append((name, obj))
        elif depth <= 0:
            return
        elif kind == MAPPING or kind == SEQUENCE:
            found = self.reader.read(obj, depth)  # a big container of plain data: at C speed, remembered
            if found is not None:
                if found.keys:
                    (self.cache_tensors if cache else self.tensors).append((name, found))
                return
            if kind == MAPPING:
                self._items(name, list(obj.items()), depth, cache)
            else:
                self._items(name, enumerate(obj), depth, cache, len(obj), True)
        else:
            if self.pipelines is not None and pipeline.stages_of(obj):
                self.pipelines.append((name, obj))
            if callable(obj):
                return
            try:  # the instance's own dict, without running a class's __getattribute__
                d = object.__getattribute__(obj, "__dict__")
            except AttributeError:  # __slots__ only
                return
            if isinstance(d, dict):
                for k, v in list(d.items()):
                    if self._full():
                        break
                    self.visit(f"{name}.{k}", v, depth - 1, cache)

    def _items(self, name: str, items: Iterable[tuple[Any, Any]], depth: int, cache: bool, n: int = -1,
               positions: bool = False) -> None:
        """A container's items one by one, each named (``xs[3]``, ``d['key']``); scalars counted, not named."""
        if n < 0:
            n = len(items)  # type: ignore[arg-type]
        scalars = SCALARS
        for i, (k, v) in enumerate(items):
            if self.count >= self.max_objects:
                self.skipped[name] = self.skipped.get(name, 0) + n - i
                break
            if type(v) in scalars:
                self.count += 1
                continue
            self.visit(f"{name}[{k if positions else _key(k)}]", v, depth - 1, cache)

    def module_contents(self, name: str, m: torch.nn.Module, names: dict[int, str], params: list[tuple[Any, str]],
                        buffers: list[tuple[Any, str]]) -> None:
        """What ``m`` and its submodules hold, into ``params`` and ``buffers`` (with ``name``), ``names`` (id(submodule)
        -> its path), the FSDP states, torch.ao's packed weights, and the tensors and KV caches held as plain
        attributes."""
        # straight from each submodule's dicts: much cheaper than parameters()/buffers() generators
        subs = m.named_modules(prefix=name) if m._modules else ((name, m),)
        fsdp = self.fsdp_loaded
        experts = ""  # the path of the experts module the walk is in (experts.py), with a dot
        for subname, sub in subs:
            names.setdefault(id(sub), subname)
            if experts and not subname.startswith(experts):
                experts = ""
            if not experts and subname.endswith(EXPERTS_NAME) and is_experts(subname, sub):
                experts = subname + "."
                self.expert_params.update(id(p) for p in sub.parameters())
            if fsdp:
                get_state = getattr(type(sub), "_get_fsdp_state", None)
                if get_state is not None:
                    state = get_state(sub)
                    self.fsdp.setdefault(id(state), (name, state))
            for p in sub._parameters.values():
                if p is not None:
                    params.append((p, name))
            if sub._buffers:
                for b in sub._buffers.values():
                    if b is not None:
                        buffers.append((b, name))
            for obj, _ in packed_objects(sub):  # torch.ao quantized modules: weights packed outside any tensor
                self.packed.append((obj, name))
            attrs = sub.__dict__
            if not _MODULE_ATTR_TYPES.issuperset(map(type, attrs.values())):
                self._module_tensors(subname, attrs)

    def _module_tensors(self, name: str, attrs: dict[str, Any]) -> None:
        """Tensors a module holds as plain attributes (not a Parameter, not a buffer): counted as the namespace's
        tensors are (``model.scale``: "other", or activations with the graph it holds), a KV cache by its name."""
        for k, v in list(attrs.items()):
            if object_kind(type(v)) != TENSOR:
                continue
            path = f"{name}.{k}"
            if path.endswith(CACHE_NAME_ENDINGS) and is_kv_cache(v, path):
                self.kv_caches.append((path, v))
            else:
                self.tensors.append((path, v))


# the types of a module's own attributes that are never tensors (its dicts of parameters, buffers, hooks and
# submodules, flags, sizes): a module with nothing else needs no look at each attribute
_MODULE_ATTR_TYPES = frozenset({dict, OrderedDict, set, bool, int, float, str, tuple, list, type(None)})

_FSDP = ("torch.distributed.fsdp._fully_shard._fully_shard",  # FSDP2's module (PyTorch 2.6 on)
         "torch.distributed._composable.fsdp.fully_shard")  # where it lived before


def _key(k: Any) -> str:
    if isinstance(k, torch.Tensor):  # a dict keyed by parameters (one optimizer per parameter): by shape, not values
        kind = "Parameter" if isinstance(k, torch.nn.Parameter) else "tensor"
        return f"<{kind} {'×'.join(str(n) for n in k.shape) or 'scalar'}>"
    try:
        text = repr(k)
    except Exception:
        return "?"
    return text if len(text) <= 40 else text[:37] + "..."


__all__ = ["MAX_NOTES", "NamespaceWalk"]
