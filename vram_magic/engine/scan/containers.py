"""What the namespace scan does with each kind of object, and big containers of plain data read at C speed.

A notebook's namespace may hold a million file paths, a dataset as a list of ``(tensor, label)`` pairs or a
dict of a hundred thousand tensors. Walked item by item in Python each costs a second a scan, and a measured
cell scans twice. An exact list, tuple or dict of at least ``FAST_MIN`` items is instead read level by level
with C-level iteration (``set(map(type, level))``, ``itertools.chain``), as deep as the walker would go, and
what was found is remembered under the container's id until a scan of the same namespace no longer reaches it:

- plain data only (str, bytes, numbers, paths, None, and lists, tuples and dicts of them): a copy of its
  structure is kept (the containers copied, the immutable leaves shared) and the next scan compares the
  container with it (``==``: identical items compare in C without being read). A tensor put in an item's
  place would be compared by its ``__eq__``; a torch-function mode stops any tensor operation during the
  comparison, so a tensor is always a change, never an equal value.
- plain tensors among plain data (a dict of tensors, a list of ``(tensor, label)`` tuples, a list of dicts of
  tensors): the storages are found once. Each next scan compares the ids of the items at every level a
  mutable container could have changed (a tuple's items are fixed while it lives; a dict whose version,
  dict_version.py, is unchanged holds the same items), and weakrefs to the
  tensors and to their storages mark the entry stale as soon as one is freed: an id reused by a new object, a
  tensor given other memory (``set_``, ``.data =``) whose old storage went.

Anything else inside (modules, other objects, tensor subclasses, a tensor holding an autograd graph, list
subclasses) sends the container back to the walker, item by item. Nothing here holds a user's tensor: the
copies keep immutable scalars only, the rest is ids and weakrefs.
"""

from __future__ import annotations

import itertools
import weakref
from collections import OrderedDict, defaultdict
from collections.abc import Mapping
from itertools import chain
from operator import attrgetter, itemgetter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..hooks.kv_cache import is_cache_class
from ..tensors import storage_parts
from .dict_version import version as dict_version
from .registry import LiveStorages

#: exact lists, tuples and dicts this long or longer are read at C speed (shorter ones item by item, named
#: ``xs[0]``); the tensors of a container read so are named by the container (``xs``)
FAST_MIN = 256
#: entries remembered at most (a namespace with more big containers is read afresh past this)
MAX_ENTRIES = 4096

# --- what the walker does with an object, decided once per type -------------------------------------------
# (isinstance chains are slow for many objects). Keyed by id, with a weakref to check it: a class defined in a
# cell may hold tensors, and must not be kept alive by a cache.
TENSOR, MODULE, OPTIMIZER, SKIP, MAPPING, SEQUENCE, OBJECT, KV_CACHE = range(8)
_kinds: dict[int, tuple[int, weakref.ref]] = {}


def object_kind(cls: type) -> int:
    """What the namespace walker does with instances of ``cls``: one of the constants above."""
    hit = _kinds.get(id(cls))
    if hit is not None and hit[1]() is cls:
        return hit[0]
    try:
        if issubclass(cls, torch.Tensor):
            kind = TENSOR
        elif issubclass(cls, torch.nn.Module):
            kind = MODULE
        elif issubclass(cls, torch.optim.Optimizer):
            kind = OPTIMIZER
        elif issubclass(cls, (str, bytes, bytearray, int, float, complex, bool, type, type(None), set, frozenset,
                              range, memoryview)):
            kind = SKIP
        elif is_cache_class(cls):  # a Hugging Face KV cache (see engine/hooks/kv_cache.py)
            kind = KV_CACHE
        elif issubclass(cls, Mapping):
            kind = MAPPING
        elif issubclass(cls, (list, tuple)):
            kind = SEQUENCE
        elif str(cls.__module__).startswith("vram_magic") or cls.__module__ == "builtins":
            kind = SKIP
        else:
            kind = OBJECT
        ref = weakref.ref(cls)
    except Exception:  # a class whose subclass checks raise: leave its objects alone
        return SKIP
    if len(_kinds) > 10_000:
        _kinds.clear()
    _kinds[id(cls)] = (kind, ref)
    return kind


#: exact types whose objects hold no tensor and may be kept by a copy (immutable, no attributes of their own)
SCALARS = frozenset({str, bytes, int, float, complex, bool, type(None)})
_PATHS = frozenset({"PurePath", "PurePosixPath", "PureWindowsPath", "Path", "PosixPath", "WindowsPath"})

# What a fast read does with an item's type.
_LEAF, _OPAQUE, _PLAIN_TENSOR, _TUPLE, _LIST, _DICT, _OTHER = range(7)
_CONTAINER = frozenset({_TUPLE, _LIST, _DICT})
_MUTABLE = frozenset({_LIST, _DICT})
_GRAD_FN = attrgetter("grad_fn")
_DICTS = frozenset({dict, OrderedDict, defaultdict})
_plain: dict[type, int] = {cls: _LEAF for cls in SCALARS}
_plain.update({torch.Tensor: _PLAIN_TENSOR, torch.nn.Parameter: _PLAIN_TENSOR, tuple: _TUPLE, list: _LIST})
_plain.update({cls: _DICT for cls in _DICTS})
_plain_other: dict[int, tuple[int, weakref.ref]] = {}


def _plain_kind(cls: type) -> int:
    hit = _plain.get(cls)
    if hit is not None:
        return hit
    other = _plain_other.get(id(cls))
    if other is not None and other[1]() is cls:
        return other[0]
    module = str(getattr(cls, "__module__", ""))
    kind = object_kind(cls)
    numpy = module == "numpy"
    if module == "pathlib" and cls.__name__ in _PATHS or numpy and any(b.__name__ == "generic" for b in cls.__mro__):
        out = _LEAF  # pathlib's own paths, numpy's scalar types
    elif numpy and cls.__name__ == "ndarray":
        out = _OPAQUE  # the walker finds nothing in one (no __dict__); it may be a view of a tensor's memory
    elif kind == SKIP:
        out = _OPAQUE  # skipped by the walker, but not kept: a set, a class, a str subclass may hold tensors
    elif kind == SEQUENCE and issubclass(cls, tuple) and getattr(cls, "__iter__", None) is tuple.__iter__:
        out = _TUPLE  # named tuples, torch.Size
    else:
        out = _OTHER
    try:
        ref = weakref.ref(cls)
    except TypeError:
        return _OTHER
    if len(_plain_other) > 10_000:
        _plain_other.clear()
    _plain_other[id(cls)] = (out, ref)
    return out


def _items(c: Any) -> list[Any]:
    return list(dict.values(c)) if type(c) in _DICTS else list(c)


def _flatten(level: list[Any], positions: list[int] | None, mode: int) -> list[Any]:
    """The items of the containers of ``level`` (those at ``positions``; all when None), in order."""
    if positions is None:
        conts: Any = level
    elif len(positions) == 1:
        conts = (level[positions[0]],)
    else:
        conts = itemgetter(*positions)(level)
    if mode == _DICT:
        return list(chain.from_iterable(map(dict.values, conts)))
    if mode == _TUPLE:
        return list(chain.from_iterable(conts))
    return list(chain.from_iterable(dict.values(c) if type(c) in _DICTS else c for c in conts))


class _TensorSeen(Exception):
    pass


class _NoTensorOps(TorchFunctionMode):
    """While a copy is compared: a tensor where plain data was is a change, and runs no operation."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise _TensorSeen


class _Flag:
    __slots__ = ("stale",)

    def __init__(self) -> None:
        self.stale = False

    def set(self, _ref: Any = None) -> None:
        self.stale = True


class Found:
    """What a fast read found in one container, and how the next scan tells whether it still holds."""

    __slots__ = ("type", "depth", "ns", "stamp", "copy", "plan", "sig", "keys", "flag", "refs", "registry",
                 "first", "_owners", "_owner_of", "_keyset", "_total", "version")

    def __init__(self, cls: type, depth: int, registry: LiveStorages) -> None:
        self.type = cls
        self.depth = depth
        self.ns = 0
        self.stamp = 0
        self.copy: Any = None  # plain data only: the structure, containers copied, leaves shared
        self.plan: list[tuple[list[int] | None, int]] = []  # per level: where its containers are, their kind
        self.sig: list[tuple[int, list[int]]] = []  # (level, ids of its items), for the levels that can change
        self.keys: list[int] = []  # id(storage) of the tensors found, in order, each once
        self.flag = _Flag()
        self.refs: list[weakref.ref] = []  # to the tensors and storages found: a free marks the entry stale
        self.registry = weakref.ref(registry)
        self.first: Any = None  # the registry's entry of keys[0]: another one there means the registry was cleared
        self._owners: dict[int, tuple[str, str]] = {}
        self._owner_of: tuple[str, str] | None = None
        self._keyset: frozenset[int] | None = None
        self.version: int | None = None  # an exact dict's version when its items were last compared (dict_version)
        self._total: tuple[int, str, int] | None = None  # (registry.resizes, device, bytes)

    def keyset(self) -> frozenset[int]:
        """The storage keys found, as a set (built once)."""
        if self._keyset is None:
            self._keyset = frozenset(self.keys)
        return self._keyset

    def total(self) -> tuple[str, int] | None:
        """``(device, bytes)`` of the storages found, or None when they lie on several devices or one is not
        registered (worked out once, again after a storage was resized)."""
        registry = self.registry()
        if registry is None:
            return None
        cached = self._total
        if cached is not None and cached[0] == registry.resizes:
            return cached[1], cached[2]
        entries = list(map(registry.get, self.keys))
        if not entries or None in entries:
            return None
        devices = {e.device for e in entries}
        if len(devices) != 1:
            return None
        device = devices.pop()
        self._total = (registry.resizes, device, sum(e.size for e in entries))
        return device, self._total[2]

    def owners(self, owner_of: tuple[str, str]) -> dict[int, tuple[str, str]]:
        """``{key: owner_of}`` for every storage found (built once per label, then reused scan after scan)."""
        if self._owner_of != owner_of:
            self._owners, self._owner_of = dict.fromkeys(self.keys, owner_of), owner_of
        return self._owners


_cache: dict[int, Found] = {}
_stamps = itertools.count(1)


_watched: dict[int, Any] = {}  # id(registry) -> its finalizer: what was read for it goes with it


def remembered() -> dict[int, Found]:
    """``{id(container): what was found}`` for the containers remembered now (a copy)."""
    return dict(_cache)


def _drop(key: int) -> None:
    """Forget container ``key``: the group its storages formed in the registry (if any) ends with it."""
    entry = _cache.pop(key, None)
    if entry is not None:
        registry = entry.registry()
        if registry is not None:
            registry.ungroup(id(entry))


def forget(registry: LiveStorages | None = None) -> None:
    """Drop the containers remembered for ``registry`` (a session closing), or all of them."""
    for key, entry in list(_cache.items()):
        if registry is None or entry.registry() in (registry, None):
            _drop(key)


def _forget_dead_registries() -> None:
    for key, entry in list(_cache.items()):
        if entry.registry() is None:
            _drop(key)


def _watch(registry: LiveStorages) -> None:
    """Forget the containers read for ``registry`` once it is gone (a session unloaded): the copies of plain
    data would otherwise outlive every scan."""
    key = id(registry)
    if key not in _watched:
        _watched[key] = weakref.finalize(registry, _gone, key)


def _gone(key: int) -> None:
    _watched.pop(key, None)
    _forget_dead_registries()


class FastReader:
    """Reads big containers for one scan of one namespace; ``finish()`` forgets what the scan no longer met."""

    def __init__(self, registry: LiveStorages, namespace: Any) -> None:
        self.registry = registry
        # a namespace made afresh for each block (measure()'s view of a frame) says what it stands for
        self.ns = getattr(namespace, "scan_id", None) or id(namespace)
        self.stamp = next(_stamps)

    def read(self, obj: Any, depth: int) -> Found | None:
        """What ``obj`` holds (a list, tuple or dict the walker would open at ``depth``: its tensors' storage
        keys), or None: not plain data, for the walker to read item by item."""
        cls = type(obj)
        if _plain.get(cls) not in _CONTAINER or len(obj) < FAST_MIN or depth <= 0:
            return None
        key = id(obj)
        entry = _cache.get(key)
        if entry is not None and self._holds(entry, obj, depth):
            entry.ns, entry.stamp = self.ns, self.stamp
            return entry
        _drop(key)
        entry = _build(obj, depth, self.registry)
        if entry is None:
            return None
        entry.ns, entry.stamp = self.ns, self.stamp
        if len(_cache) >= MAX_ENTRIES:  # namespaces that are never scanned again (measure() in many functions)
            forget()
        _watch(self.registry)
        _cache[key] = entry
        return entry

    def _holds(self, entry: Found, obj: Any, depth: int) -> bool:
        if entry.type is not type(obj) or entry.depth != depth or entry.flag.stale \
                or entry.registry() is not self.registry:
            return False
        if entry.copy is not None:
            return _same_data(obj, entry.copy)
        ver = dict_version(obj)
        if ver is None or ver != entry.version or len(entry.sig) > 1:  # (a dict unchanged holds the same items)
            if list(map(id, dict.values(obj) if type(obj) in _DICTS else obj)) != entry.sig[0][1]:
                return False
            entry.version = ver
        level, at = _items(obj) if len(entry.sig) > 1 else [], 0
        for want, ids in entry.sig[1:]:
            while at < want:
                positions, mode = entry.plan[at]
                level, at = _flatten(level, positions, mode), at + 1
            if list(map(id, level)) != ids:
                return False
        # a storage found is freed only with a callback (stale above); it leaves the registry otherwise only when
        # that is cleared, which drops every entry: the first one standing tells
        return not entry.keys or self.registry.get(entry.keys[0]) is entry.first

    def finish(self) -> None:
        """Forget the containers of this namespace that this scan did not reach."""
        ns, stamp = self.ns, self.stamp
        for key, entry in list(_cache.items()):
            if entry.ns == ns and entry.stamp != stamp:
                _drop(key)


def _same_data(obj: Any, copy: Any) -> bool:
    try:
        with _NoTensorOps():
            return bool(obj == copy)
    except Exception:  # a tensor, or an object whose __eq__ raises, in a place plain data was
        return False


def _build(obj: Any, depth: int, registry: LiveStorages) -> Found | None:
    """Read ``obj`` level by level; None when something in it is not plain data or a plain tensor."""
    try:
        return _read(obj, depth, registry)
    except Exception:  # a container changed while read (another thread), a tensor that raises: the walker's
        return None


def _read(obj: Any, depth: int, registry: LiveStorages) -> Found | None:
    entry = Found(type(obj), depth, registry)
    entry.version = dict_version(obj)  # before its items are read: a change while they are makes it differ
    levels: list[list[Any]] = []
    tensors: list[Any] = []
    check = [0]  # levels whose ids can change: the first, and each below a list or a dict
    holdable = True  # only scalars and containers opened in full: a copy may be kept
    level = _items(obj)
    left = depth - 1  # the depth the walker gives the items of `level`
    in_tuples = nested_tuples = False  # tuples of tuples of tensors may be legacy KV caches: the walker's
    while True:
        levels.append(level)  # an empty one too: the lists it came from may grow
        if not level:
            break
        kinds = {cls: _plain_kind(cls) for cls in set(map(type, level))}
        found = set(kinds.values())
        if _OTHER in found:
            return None
        if _PLAIN_TENSOR in found:
            holdable = False
            ts = [x for x in level if kinds[type(x)] == _PLAIN_TENSOR]
            if any(map(_GRAD_FN, ts)):
                return None  # a graph to walk and name per tensor: the walker's
            tensors.extend(ts)
        if _OPAQUE in found:
            holdable = False
        if in_tuples and _TUPLE in found:
            nested_tuples = True
        conts = found & _CONTAINER
        in_tuples = _TUPLE in conts
        if not conts:
            break
        if left <= 0:  # containers the walker would not open: kept by id, never by a copy
            holdable = False
            break
        positions = None if found <= _CONTAINER else [i for i, x in enumerate(level) if kinds[type(x)] in _CONTAINER]
        mode = conts.pop() if len(conts) == 1 else _OTHER
        if mode == _LIST:
            mode = _TUPLE  # both flatten by iteration
        entry.plan.append((positions, mode))
        if found & _MUTABLE:
            check.append(len(levels))
        level = _flatten(level, positions, mode)
        left -= 1
    if holdable:
        entry.copy = _clone(obj, depth)
        entry.plan = []
        return entry
    if nested_tuples and tensors:
        return None
    entry.sig = [(i, list(map(id, levels[i]))) for i in check if i < len(levels)]
    entry.plan = entry.plan[:max(i for i, _ in entry.sig)]
    _claim_storages(entry, tensors, registry)
    return entry


def _claim_storages(entry: Found, tensors: list[Any], registry: LiveStorages) -> None:
    keys: dict[int, None] = {}
    refs = entry.refs
    stale = entry.flag.set
    for t in tensors:
        parts = storage_parts(t)
        if parts is None:
            raise RuntimeError("a tensor that raises when read")
        refs.append(weakref.ref(t, stale))
        for storage, _ in parts:
            key = id(storage)
            if key in keys:
                continue
            keys[key] = None
            if registry.get(key) is None:
                registry.add(storage)
            refs.append(weakref.ref(storage, stale))
    entry.keys = list(keys)
    if entry.keys:
        entry.first = registry.get(entry.keys[0])


def _clone(obj: Any, depth: int) -> Any:
    """``obj``'s structure with every container copied (a tuple of scalars is itself immutable) and the
    scalars shared; ``obj == _clone(obj)`` compares items by identity first."""
    cls = type(obj)
    kind = _plain.get(cls)
    if kind is None:
        kind = _plain_kind(cls)
    if kind not in _CONTAINER:
        return obj
    values = dict.values(obj) if kind == _DICT else obj
    flat = set(map(type, values)) <= SCALARS
    if kind == _DICT:
        return dict(obj) if flat else {k: _clone(v, depth - 1) for k, v in dict.items(obj)}
    if kind == _LIST:
        return list(obj) if flat else [_clone(v, depth - 1) for v in obj]
    return obj if flat and cls is tuple else tuple(obj) if flat else tuple(_clone(v, depth - 1) for v in obj)
