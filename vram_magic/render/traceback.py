"""Tracebacks of measured cells that start at the user's code.

A cell magic runs through ``get_ipython().run_cell_magic('vram', '...', '<the whole cell as a string>')``,
and IPython's traceback opens with that line. An exception that leaves a ``%%vram`` cell gets a
``_render_traceback_`` (IPython's hook for exceptions that format themselves) that formats the same
traceback from the first frame of the cell's own code. The exception itself — its type, message,
``__traceback__`` and chaining — is unchanged.
"""

from __future__ import annotations

import os
from types import TracebackType
from typing import Any

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _ours(tb: TracebackType) -> bool:
    return tb.tb_frame.f_code.co_filename.startswith(_PACKAGE)


def cell_start(tb: TracebackType | None) -> TracebackType | None:
    """The first traceback entry after this package's frames: the cell's own code (None if there is none)."""
    seen_ours = False
    while tb is not None:
        if _ours(tb):
            seen_ours = True
        elif seen_ours:
            return tb
        tb = tb.tb_next
    return None


def start_at_cell(exc: BaseException, shell: Any) -> None:
    """Make IPython show ``exc``'s traceback from the cell's code on (no-op if it formats itself already)."""
    if hasattr(exc, "_render_traceback_"):
        return

    def _render_traceback_() -> list[str]:
        etype, tb = type(exc), exc.__traceback__
        try:
            start = cell_start(tb)
            if start is not None:
                return list(shell.InteractiveTB.structured_traceback(etype, exc, start, tb_offset=0))
        except Exception:
            pass
        return list(shell.InteractiveTB.structured_traceback(etype, exc, tb, tb_offset=1))

    try:
        exc._render_traceback_ = _render_traceback_  # type: ignore[attr-defined]
    except (AttributeError, TypeError):  # an exception type without a __dict__: the usual traceback shows
        pass
