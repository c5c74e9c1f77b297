"""Storages resized in place, which dispatch never sees.

``UntypedStorage.resize_`` is a method of the storage object, not an op. While a tracker is active it is wrapped
(once, whatever the number of trackers) so that each active tracker hears of it through
``tracker.storage_resized(storage)``; the last tracker to leave puts PyTorch's method back.
"""

from __future__ import annotations

from typing import Any

import torch

from ..torch_private import patch_storage_resize, storage_resize, unpatch_storage_resize

_watchers: list[Any] = []
_original: Any = None


def _resize_(self: Any, size: int) -> Any:
    out = _original(self, size)
    for tracker in list(_watchers):
        try:
            tracker.storage_resized(self)
        except torch.OutOfMemoryError:
            raise
        except Exception:  # a storage we cannot read: its old size stays counted
            pass
    return out


def watch_resizes(tracker: Any) -> None:
    """Tell ``tracker`` of every storage resized from now on (wraps ``UntypedStorage.resize_`` if not yet)."""
    global _original
    if not _watchers:
        _original = storage_resize()
        patch_storage_resize(_resize_)
    _watchers.append(tracker)


def unwatch_resizes(tracker: Any) -> None:
    """Stop telling ``tracker``; the last tracker to leave puts ``UntypedStorage.resize_`` back."""
    global _original
    if tracker in _watchers:
        _watchers.remove(tracker)
        if not _watchers:
            unpatch_storage_resize(_resize_)
            _original = None


__all__ = ["unwatch_resizes", "watch_resizes"]
