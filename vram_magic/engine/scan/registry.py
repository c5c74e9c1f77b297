"""A weak registry of live storages: what the CPU allocator does not count for us.

Keys are ``id(storage)``: a storage's Python object lives exactly as long as its C++ storage (PyTorch
preserves it), so a weakref callback tells us when the memory is freed. Only weakrefs are held.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterator
from itertools import compress
from operator import attrgetter
from typing import Any


class Entry(weakref.ref):
    """The weakref to one storage, carrying what we know of it (one object per storage: cheap)."""

    __slots__ = ("key", "serial", "size", "device", "ptr")

    key: int
    serial: int
    size: int
    device: str
    ptr: int  # the address, for storages registered by add() (0 for the tracker's own)


_DEVICE = attrgetter("device")


def storage_size(storage: Any, device: str) -> int:
    """Bytes a storage occupies: CUDA's caching allocator rounds each block up to 512 bytes."""
    n = int(storage.nbytes())
    return -(-n // 512) * 512 if device.startswith("cuda") else n


def device_key(device: Any) -> str:
    """``cpu``, ``cuda:0``, ``meta`` — what two storages must share to be counted together."""
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else 0}"
    return str(device.type)


def _view(snap: dict[int, Entry], device: str | None) -> Iterator[tuple[int, Entry]]:
    keys, entries = list(snap), list(snap.values())
    if device is not None:
        devices = list(map(_DEVICE, entries))
        if devices.count(device) != len(devices):
            keep = list(map(device.__eq__, devices))
            keys, entries = list(compress(keys, keep)), list(compress(entries, keep))
    return zip(keys, entries)


class LiveStorages:
    """``id(storage) -> Entry`` for every storage we have seen and that is still alive."""

    def __init__(self) -> None:
        self._entries: dict[int, Entry] = {}
        self._by_ptr: dict[tuple[str, int], Entry] = {}  # storages registered by add(): who owns an address
        self._serials = itertools.count(1)
        # Called with the Entry of each freed storage (the active tracker listens while a cell runs).
        self.on_free: Callable[[Entry], None] | None = None
        # bumped whenever a live entry's size changes (a storage resized): sums kept over entries are stale then
        self.resizes = 0
        self.get = self._entries.get
        # the entries no group holds (what a measured cell goes through one by one), and the groups: the storages
        # of big unchanged containers, counted by their sums (see group())
        self._loose: dict[int, Entry] = {}
        self._groups: dict[int, frozenset[int]] = {}
        self._group_of: dict[int, int] = {}  # key -> the group holding it (a freed storage leaves it)

        entries = self._entries
        loose = self._loose
        group_of = self._group_of

        by_ptr = self._by_ptr

        def freed(entry: Entry) -> None:
            if entry.ptr and by_ptr.get((entry.device, entry.ptr)) is entry:
                del by_ptr[(entry.device, entry.ptr)]
            if group_of.pop(entry.key, None) is None:
                loose.pop(entry.key, None)
            if entries.pop(entry.key, None) is not None:
                listener = self.on_free
                if listener is not None:
                    listener(entry)

        self._freed = freed

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, storage: Any) -> Entry:
        """Register ``storage`` (an ``UntypedStorage``) if new; return its entry.

        Storages made outside PyTorch's allocator can share memory (two ``torch.from_numpy`` on one array,
        ``from_dlpack``, ``frombuffer``): a storage whose memory starts where a live registered one's does
        is registered with size 0, so the memory counts once."""
        entry = self._entries.get(id(storage))
        if entry is not None:
            return entry
        device = device_key(storage.device)
        size = storage_size(storage, device)
        try:
            ptr = int(storage.data_ptr())
        except Exception:  # a wrapper subclass's storage has no memory behind it
            ptr, size = 0, 0
        if ptr:
            other = self._by_ptr.get((device, ptr))
            if other is not None and other() is not None and other.key in self._entries:
                size = 0
        entry = self.add_new(storage, id(storage), size, device)
        if ptr and size:
            entry.ptr = ptr
            self._by_ptr[(device, ptr)] = entry
        return entry

    def add_new(self, storage: Any, key: int, size: int, device: str) -> Entry:
        """Register a storage known to be new (the tracker's hot path)."""
        entry = Entry(storage, self._freed)
        entry.key = key
        entry.serial = next(self._serials)
        entry.size = size
        entry.device = device
        entry.ptr = 0
        self._entries[key] = entry
        self._loose[key] = entry
        return entry

    # --- groups -----------------------------------------------------------------------------------
    def group(self, gid: int, keys: frozenset[int]) -> bool:
        """Hold the storages ``keys`` as one group ``gid`` (a container's, containers.py), out of the loose view:
        True when they are the group's, False when one is not loose (another group's, or not registered)."""
        held = self._groups.get(gid)
        if held is not None:
            return held is keys or held == keys
        loose = self._loose
        if not keys <= loose.keys():
            return False
        for key in keys:
            del loose[key]
        self._group_of.update(dict.fromkeys(keys, gid))
        self._groups[gid] = keys
        return True

    def ungroup(self, gid: int) -> None:
        """Group ``gid`` is no more (its container changed or went): its live storages are loose again."""
        keys = self._groups.pop(gid, None)
        if keys is None:
            return
        entries, loose, group_of = self._entries, self._loose, self._group_of
        for key in keys:
            if group_of.get(key) == gid:
                del group_of[key]
                loose[key] = entries[key]

    def groups(self) -> list[int]:
        """The ids of the groups held now."""
        return list(self._groups)

    def members(self, gid: int, device: str) -> Iterator[tuple[int, Entry]]:
        """``(key, entry)`` of the live storages of ``device`` group ``gid`` holds (its freed ones left it; a new
        storage that took a freed one's id is not its own)."""
        keys = self._groups.get(gid, ())
        group_of, entries = self._group_of, self._entries
        mine = [k for k in keys if group_of.get(k) == gid]
        return ((k, entries[k]) for k in mine if k in entries and entries[k].device == device)

    def loose(self, device: str) -> Iterator[tuple[int, Entry]]:
        """``(key, entry)`` of the live storages of ``device`` that no group holds."""
        return _view(self._loose.copy(), device)

    def next_serial(self) -> int:
        return next(self._serials)

    def entries(self, device: str | None = None) -> list[tuple[int, Entry]]:
        """``(key, entry)`` of the live storages (of one device), as a list: safe to iterate while frees
        remove entries."""
        if device is None:
            return list(self._entries.items())
        return [kv for kv in list(self._entries.items()) if kv[1].device == device]

    def live(self, device: str | None = None) -> Iterator[tuple[int, Entry]]:
        """``(key, entry)`` of the live storages (of one device), as :meth:`entries` gives them but without a
        tuple per storage: with a hundred thousand storages alive, those tuples set off the collector's full
        passes. Safe to iterate while frees remove entries (it reads a copy)."""
        return _view(self._entries.copy(), device)  # a copy in one C call: no callback runs while it is made

    def clear(self) -> None:
        """Forget everything (the weakrefs die with their entries, so no callback fires later)."""
        self.on_free = None
        self._entries.clear()
        self._loose.clear()
        self._groups.clear()
        self._group_of.clear()
        self._by_ptr.clear()
