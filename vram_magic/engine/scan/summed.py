"""The big containers a measured block counts by their sums, not storage by storage.

A dict of a hundred thousand tensors, read at C speed by the scan (containers.py), is one group of the scan
(``attribution.Group``) and of the registry (held out of its loose view). While the container stays as it was,
a block counts the group's bytes once at the start and once in the history's constant part, and never goes
through its storages: each cell costs what its two scans cost. A group that changed in the block (a tensor of
it freed, resized or replaced, the container gone, its tensors claimed by a module) is gone through one by one
at the end, as any other storage is.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..tracker.counts import StorageCounts
from .attribution import Group, Scan
from .categories import UNATTRIBUTED
from .registry import Entry, LiveStorages


class Counted:
    """The groups one block counts by their sums (``groups``: those of the scan before, on the block's device)."""

    def __init__(self, registry: LiveStorages, device: str, groups: list[Group], scan_before: Scan) -> None:
        self.registry = registry
        self.device = device
        self.groups = groups
        self.scan_before = scan_before
        self.bytes = sum(g.total for g in groups)
        self.start_serial = 0  # the first serial of the block: every storage alive at its start has a smaller one
        self.before_owner: dict[int, tuple[str, str]] = {}  # serial -> owner at the start, of the others
        self.stable: list[Group] = []  # those found the same at the end (settle)

    def individually(self, summed: list[Group]) -> Iterator[tuple[int, Entry]]:
        """``(key, entry)`` of the live storages of the device but those of the groups ``summed``: the registry's
        loose ones, then those of its other groups."""
        registry = self.registry
        ids = {id(g.found) for g in summed}
        yield from registry.loose(self.device)
        for gid in registry.groups():
            if gid not in ids:
                yield from registry.members(gid, self.device)

    def before_category(self, serial: int, counts: StorageCounts | None) -> tuple[str, str]:
        """Who held a storage alive at the start (and freed since) when the block began."""
        cat = self.before_owner.get(serial)
        if cat is not None:
            return cat
        key = counts.grouped_freed.get(serial) if counts is not None else None
        if key is not None:
            group = self.scan_before.group_of(key)
            if group is not None:
                return group.owner
        return UNATTRIBUTED

    def settle(self, counts: StorageCounts | None, scan_after: Scan) -> dict[int, int]:
        """Which groups are the same at the end (the same container found unchanged, the same owner and bytes,
        no storage of theirs freed or resized in the block): those stay sums (``stable``). Returns serial → size
        of the still-alive storages of the others, for the history's starting point."""
        self.stable = []
        if not self.groups:
            return {}
        after = {id(g.found): g for g in scan_after.groups}
        touched = set(counts.grouped_freed.values()) if counts is not None else set()
        expanded: dict[int, int] = {}
        get = self.registry.get
        for g in self.groups:
            same = after.get(id(g.found))
            if (same is not None and same.owner == g.owner and same.total == g.total and not g.found.flag.stale
                    and touched.isdisjoint(g.keys)):
                self.stable.append(g)
                continue
            for key in g.keys:
                entry = get(key)
                if entry is not None and entry.serial < self.start_serial:
                    expanded[entry.serial] = entry.size
        return expanded

    def grouped_freed(self, counts: StorageCounts | None) -> dict[int, int]:
        """serial → size of the groups' storages the block freed."""
        if counts is None:
            return {}
        freed = counts.initial_freed
        return {s: freed[s] for s in counts.grouped_freed if s in freed}


__all__ = ["Counted"]
