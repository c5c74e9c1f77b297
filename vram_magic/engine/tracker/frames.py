"""The user's own frames at an allocation: cheap, cached per code object."""

from __future__ import annotations

import os
import sys
import sysconfig
from types import CodeType, FrameType
from typing import Any

#: this package's folder: its frames are never the user's
PACKAGE_DIR = os.path.dirname(os.path.abspath(sys.modules[__name__.split(".")[0]].__file__ or ""))
_OWN_PREFIXES: list[str] = []
_is_user: dict[int, tuple[bool, CodeType]] = {}


def _prefixes() -> list[str]:
    if not _OWN_PREFIXES:
        import torch

        dirs = [os.path.dirname(torch.__file__), PACKAGE_DIR]
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
    # Keyed by id: hashing a code object hashes its bytecode and constants, too slow for every allocation.
    # The cache holds the code object itself, so an id is never reused while it is cached.
    hit = _is_user.get(id(code))
    if hit is None:
        filename = code.co_filename
        if filename.startswith("<frozen") or filename.startswith("<string"):
            user = False
        elif filename.startswith("<"):
            user = True  # <ipython-input-…>, <timed exec>, …
        else:
            user = not any(filename.startswith(p) for p in _prefixes())
        if len(_is_user) > 50_000:
            _is_user.clear()
        hit = _is_user[id(code)] = (user, code)
    return hit[0]


# Raw sites interned for the process, keyed by ``(id(code), lasti, …)``: one tuple per distinct site, so what is
# derived from a site (its lines) is worked out once, not once per allocation or per cell.
_sites: dict[tuple[int, ...], tuple[Any, ...]] = {}
_resolved: dict[int, tuple[tuple[Any, ...], tuple[tuple[str, int, str], ...]]] = {}


def user_site(frame: FrameType | None, limit: int = 4) -> tuple[Any, ...]:
    """The user's frames, innermost first, as a flat ``(code, lasti, code, lasti, …)`` tuple (at most ``limit``
    frames): cheap enough to take at every allocation; :func:`resolve` turns it into file, line, function.
    Interned: the same site gives the same tuple (code objects hash slowly, so the key is built from their
    ids while walking — stable, as the tuple holds the codes).

    Stops at the first frame of the shell that runs the cell (nothing above it is the user's)."""
    key: list[int] = []
    raw: list[Any] = []
    cached = _is_user.get
    n = 0
    while frame is not None and n < limit:
        code = frame.f_code
        cid = id(code)
        hit = cached(cid)
        if hit is None:
            hit = (is_user_code(code),)
        if hit[0]:
            lasti = frame.f_lasti
            key.append(cid)
            key.append(lasti)
            raw.append(code)
            raw.append(lasti)
            n += 1
        elif n and cid in _SHELL_CODES:
            break
        frame = frame.f_back
    k = tuple(key)
    site = _sites.get(k)
    if site is None:
        if len(_sites) > 100_000:
            _sites.clear()
            _resolved.clear()
        site = _sites[k] = tuple(raw)
    return site


def resolve_site(raw: tuple[Any, ...]) -> tuple[tuple[str, int, str], ...]:
    """:func:`resolve`, remembered per site tuple (checked by identity, so a recycled id is never trusted)."""
    hit = _resolved.get(id(raw))
    if hit is not None and hit[0] is raw:
        return hit[1]
    frames = resolve(raw)
    _resolved[id(raw)] = (raw, frames)
    return frames


_lines: dict[tuple[int, int], int] = {}


def _line(code: CodeType, lasti: int) -> int:
    key = (id(code), lasti)
    line = _lines.get(key)
    if line is None:
        line = code.co_firstlineno
        for start, end, ln in code.co_lines():
            if start <= lasti < end:
                line = ln if ln is not None else line
                break
        if len(_lines) > 100_000:
            _lines.clear()
        _lines[key] = line
    return line


def resolve(raw: tuple[Any, ...]) -> tuple[tuple[str, int, str], ...]:
    """``(code, lasti, …)`` → ``((filename, line, function), …)``."""
    return tuple((raw[i].co_filename, _line(raw[i], raw[i + 1]), raw[i].co_name) for i in range(0, len(raw), 2))


class SiteNamer:
    """Resolves raw sites (``(code, lasti, …)``) to ``(file, line, function)`` frames, once per distinct site,
    and names the files IPython compiles cells into (``/tmp/ipykernel_…/123.py``) as ``<cell N>``."""

    def __init__(self, cell_files: Any = None) -> None:
        self.cell_files = cell_files or {}
        self.done: dict[int, tuple[tuple[str, int, str], ...]] = {}

    def __call__(self, raw: tuple[Any, ...]) -> tuple[tuple[str, int, str], ...]:
        if not raw:
            return ()
        named = self.done.get(id(raw))
        if named is None:
            files = self.cell_files
            named = tuple((f"<cell {files[f]}>" if f in files else f, line, name)
                          for f, line, name in resolve_site(raw))
            self.done[id(raw)] = named
        return named


# ids of the code objects of the shell's cell-running functions (functions live as long as the process): a
# site's walk stops there, as nothing above them is the user's. The shell layer registers its own.
_SHELL_CODES: set[int] = set()


def register_shell_code(code: CodeType) -> None:
    """Stop site walks at frames running ``code`` (a shell's function that runs the user's cell)."""
    _SHELL_CODES.add(id(code))


def refresh_shell_codes() -> None:
    """Learn IPython's cell-running frame (called when a measurement starts in IPython)."""
    try:
        from IPython.core.interactiveshell import InteractiveShell

        register_shell_code(InteractiveShell.run_code.__code__)
    except Exception:
        pass
