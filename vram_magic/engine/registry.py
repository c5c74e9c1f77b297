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


class LiveStorages:
    """``id(storage) -> Entry`` for every storage we have seen and that is still alive."""

    def __init__(self) -> None:
        self._entries: dict[int, Entry] = {}
        self._by_ptr: dict[tuple[str, int], Entry] = {}  # storages registered by add(): who owns an address
        self._serials = itertools.count(1)
        # Called with the Entry of each freed storage (the active tracker listens while a cell runs).
        self.on_free: Callable[[Entry], None] | None = None
        self.get = self._entries.get

        entries = self._entries

        by_ptr = self._by_ptr

        def freed(entry: Entry) -> None:
            if entry.ptr and by_ptr.get((entry.device, entry.ptr)) is entry:
                del by_ptr[(entry.device, entry.ptr)]
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
        return entry

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
        snap = self._entries.copy()  # one C call: no callback can run while the entries are read
        keys, entries = list(snap), list(snap.values())
        if device is not None:
            devices = list(map(_DEVICE, entries))
            if devices.count(device) != len(devices):
                keep = list(map(device.__eq__, devices))
                keys, entries = list(compress(keys, keep)), list(compress(entries, keep))
        return zip(keys, entries)

    def clear(self) -> None:
        """Forget everything (the weakrefs die with their entries, so no callback fires later)."""
        self.on_free = None
        self._entries.clear()
        self._by_ptr.clear()
