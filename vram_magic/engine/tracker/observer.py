"""What a tracker tells a tool built on it while it measures: the public hooks of ``Tracker``.

Pass an observer to ``Tracker(..., observer=...)`` (the estimator's step tracer does, to note which stage and
module of a traced step made each storage). Every hook runs inside the measured code, on the tracker's own
path: keep it to a few dict and list operations, and never raise. A tracker without an observer pays one
``is None`` test per new storage and per free.
"""

from __future__ import annotations

from typing import Any

from ..scan.registry import Entry


class TrackerObserver:
    """Override what you need; each hook here does nothing (and a free is counted)."""

    def module_entered(self, module: Any) -> None:
        """A module's forward begins: called after the tracker has pushed it on its module stack."""

    def module_exited(self, module: Any) -> None:
        """A module's forward ended (or raised): called after the tracker has popped it."""

    def storage_counted(self, entry: Entry) -> None:
        """An op returned a new storage and the tracker has just counted it (``entry.serial``, ``entry.size``;
        its record is ``tracker.counts.allocs[entry.serial]``). Storages met later (the end-of-block scan's, resized
        ones) are not reported here."""

    def storage_freed(self, entry: Entry) -> bool:
        """A storage on the tracker's device was freed, before the tracker counts the free: return ``False`` to
        leave it uncounted (one the tool already counted as freed through ``tracker.counts.count_free``)."""
        return True


__all__ = ["TrackerObserver"]
