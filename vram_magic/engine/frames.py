"""The user's own frames at an allocation: cheap, cached per code object."""

from __future__ import annotations

import os
import sys
import sysconfig
from types import CodeType, FrameType

_OWN_PREFIXES: list[str] = []
_is_user: dict[CodeType, bool] = {}


def _prefixes() -> list[str]:
    if not _OWN_PREFIXES:
        import torch

        dirs = [os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__))]
        for name in ("stdlib", "platstdlib"):
            path = sysconfig.get_paths().get(name)
            if path:
                dirs.append(path)
        for mod in ("IPython", "ipykernel", "traitlets", "tornado", "zmq", "asyncio", "pytest", "_pytest",
                    "pluggy", "nbclient", "ipywidgets", "matplotlib"):
            m = sys.modules.get(mod)
            if m is not None and getattr(m, "__file__", None):
                dirs.append(os.path.dirname(m.__file__))  # type: ignore[arg-type]
        _OWN_PREFIXES.extend(os.path.realpath(d) + os.sep for d in dirs)
        _OWN_PREFIXES.extend(d + os.sep for d in dirs)
    return _OWN_PREFIXES


def is_user_code(code: CodeType) -> bool:
    hit = _is_user.get(code)
    if hit is None:
        filename = code.co_filename
        if filename.startswith("<frozen") or filename.startswith("<string"):
            hit = False
        elif filename.startswith("<"):
            hit = True  # <ipython-input-…>, <timed exec>, …
        else:
            hit = not any(filename.startswith(p) for p in _prefixes())
        _is_user[code] = hit
    return hit


def user_frames(frame: FrameType | None, limit: int = 4) -> tuple[tuple[str, int, str], ...]:
    """Innermost-first ``(filename, line, function)`` of user frames, at most ``limit``.

    Stops at the first frame of the shell that runs the cell (nothing above it is the user's)."""
    out = []
    is_user = _is_user.get
    while frame is not None and len(out) < limit:
        code = frame.f_code
        hit = is_user(code)
        if hit is None:
            hit = is_user_code(code)
        if hit:
            out.append((code.co_filename, frame.f_lineno, code.co_name))
        elif out and code in _SHELL_CODES:
            break
        frame = frame.f_back
    return tuple(out)


def _shell_codes() -> set[CodeType]:
    codes: set[CodeType] = set()
    try:
        from IPython.core.interactiveshell import InteractiveShell

        codes.add(InteractiveShell.run_code.__code__)
    except Exception:
        pass
    try:
        from ..magics import VramMagics

        codes.add(VramMagics._run_code.__code__)
    except Exception:
        pass
    return codes


_SHELL_CODES: set[CodeType] = set()


def refresh_shell_codes() -> None:
    """Learn the shell's cell-running frames (called when a measurement starts in IPython)."""
    if not _SHELL_CODES:
        _SHELL_CODES.update(_shell_codes())
