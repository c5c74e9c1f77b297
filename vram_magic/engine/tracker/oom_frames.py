"""The user's frames at an out-of-memory error: who held what (named while the frames are alive), and the
traceback ended at the user's last frame with the finished frames' locals released, so what they held is freed."""

from __future__ import annotations

from types import FrameType, TracebackType
from typing import Any

import torch

from ..tensors import storage_parts
from .frames import PACKAGE_DIR, is_user_code


def release_traceback(tb: TracebackType) -> None:
    """End the traceback at the user's last frame (as a real CUDA OOM does) and clear the locals of the
    finished frames, which hold the memory that ran out. Our own frames keep theirs. Never raises: the
    user's exception is what propagates, whatever its frames hold."""
    try:
        _release(tb)
    except Exception:
        pass


def name_holders(frame: FrameType | None, registry: Any, holders: dict[int, str]) -> None:
    """Which local variables of the user's frames (``frame`` and its callers) hold memory at an OOM: serial ->
    ``"x in f()"`` (a global's plain name) into ``holders``, names and serials only. Never raises: the OOM is what
    the user must see, whatever their locals hold."""
    try:
        while frame is not None:
            if is_user_code(frame.f_code):
                func = frame.f_code.co_name
                for name, value in list(frame.f_locals.items()):
                    if not issubclass(type(value), torch.Tensor):  # type(), not isinstance: no __class__
                        continue
                    for storage, _ in storage_parts(value) or ():
                        entry = registry.get(id(storage))
                        if entry is not None and entry.serial not in holders:
                            # module-level code: the variable is a global, named as such
                            holders[entry.serial] = name if func == "<module>" else f"{name} in {func}()"
            frame = frame.f_back
    except Exception:
        pass


def _release(tb: TracebackType) -> None:
    last_user = None
    t: TracebackType | None = tb
    while t is not None:
        if is_user_code(t.tb_frame.f_code):
            last_user = t
        t = t.tb_next
    if last_user is not None and last_user.tb_next is not None:
        rest: TracebackType | None = last_user.tb_next
        last_user.tb_next = None
        while rest is not None:
            _clear(rest)
            rest = rest.tb_next
    t = tb
    while t is not None:
        if not t.tb_frame.f_code.co_filename.startswith(PACKAGE_DIR):
            _clear(t)
        t = t.tb_next


def _clear(t: TracebackType) -> None:
    try:
        t.tb_frame.clear()
        # A dict made earlier by reading `f_locals` outlives clear(); reading it again empties it.
        t.tb_frame.f_locals  # noqa: B018
    except RuntimeError:  # still executing
        pass
