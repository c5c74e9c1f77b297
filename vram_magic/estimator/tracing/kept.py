"""The traces a workload keeps: a fake run is made once per configuration that changes it and replayed for every
other option, the least recently used dropped past a limit (a trace holds no tensors, only its numbers)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class KeptTraces(Generic[T]):
    """At most ``limit`` traces by key; :attr:`made` counts the fake runs made (the rest were replays)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.made = 0
        self._kept: OrderedDict[Hashable, T] = OrderedDict()

    def get(self, key: Hashable, make: Callable[[], T]) -> T:
        """The trace kept for ``key``, else ``make()``'s, kept."""
        kept = self._kept.get(key)
        if kept is not None:
            self._kept.move_to_end(key)
            return kept
        kept = make()
        self.made += 1
        self._kept[key] = kept
        while len(self._kept) > self.limit:
            self._kept.popitem(last=False)
        return kept

    def __len__(self) -> int:
        return len(self._kept)
