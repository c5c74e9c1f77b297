"""The user's frames at an error, an out-of-memory one first: who held what (named while the frames are alive), and the
traceback ended at the user's last frame with the finished frames' locals released, so what they held is freed."""

from __future__ import annotations

from types import FrameType, TracebackType
from typing import Any

import torch

from ..tensors import storage_parts
from .frames import PACKAGE_DIR, is_user_code


class ShownAtUsersLine:
    """An error of this package's whose traceback, in IPython, ends at the user's line: without this package's frames
    or PyTorch's after it (IPython asks the error itself for its traceback: ``_render_traceback_``; elsewhere the whole
    chain prints)."""

    __traceback__: TracebackType | None

    def _render_traceback_(self) -> list[str]:
        from IPython import get_ipython

        # each error of the chain (what this one was raised from) shown down to the user's line of its own
        chain: list[BaseException] = []
        e: BaseException | None = self  # type: ignore[assignment]
        while e is not None and e not in chain:
            chain.append(e)
            e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
        saved = [c.__traceback__ for c in chain]
        try:
            for c in chain:
                c.__traceback__ = user_traceback(c.__traceback__)
            shell = get_ipython()
            if shell is None:
                import traceback

                return traceback.format_exception(type(self), self, self.__traceback__)  # type: ignore[arg-type]
            return shell.InteractiveTB.structured_traceback(type(self), self, self.__traceback__)
        finally:
            for c, tb in zip(chain, saved):
                c.__traceback__ = tb


class BudgetOutOfMemoryError(ShownAtUsersLine, torch.OutOfMemoryError):
    """``torch.OutOfMemoryError`` raised by a simulated budget (``--budget``): its traceback reads as a real device's
    error does, ending at the user's line."""


def user_traceback(tb: TracebackType | None) -> TracebackType | None:
    """A copy of ``tb`` from the user's first frame to their last (what lies outside is this package's, PyTorch's
    and the other libraries' frames: where an error was caught and raised again, and where it was raised); ``tb``
    itself is left as it is. ``tb`` unchanged where no frame is the user's."""
    kept: list[TracebackType] = []
    first_user = last_user = -1
    t = tb
    while t is not None:
        kept.append(t)
        if is_user_code(t.tb_frame.f_code):
            last_user = len(kept) - 1
            first_user = last_user if first_user < 0 else first_user
        t = t.tb_next
    if last_user < 0:
        return tb
    out: TracebackType | None = None
    for t in reversed(kept[first_user:last_user + 1]):
        out = TracebackType(out, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return out


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
