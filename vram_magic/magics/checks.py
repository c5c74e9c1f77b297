"""What every magic checks the same way: variable names, paths to write, sizes; warnings that never fail a cell.

``Host`` is what the magic modules need of the magics object (``VramMagics``): its shell, its session and
its settings (the ``%config VramMagics.…`` traitlets).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from IPython.core.error import UsageError

from ..core.units import parse_size

if TYPE_CHECKING:
    from ..session.state import Session


class Host(Protocol):
    """The magics object as the magic modules see it."""

    shell: Any
    session: Session
    widget: bool
    live: float
    live_interval: float
    backend: str
    record_sites: bool
    oom: bool

    def set_auto(self, on: bool) -> None: ...


def size(text: str) -> int:
    """``parse_size(text)``; bad input is a UsageError naming what is accepted."""
    try:
        return parse_size(text)
    except (TypeError, ValueError) as err:
        raise UsageError(str(err)) from None


def check_name(name: str | None, option: str) -> None:
    """``-o NAME`` must be a name a variable can have."""
    import keyword

    if name is not None and (not name.isidentifier() or keyword.iskeyword(name)):
        raise UsageError(f"{option} needs a variable name (letters, digits and _; not a Python keyword), "
                         f"got {name!r}")


def check_path(path: str) -> None:
    """A file can be written at ``path``: its folder exists and is writable (else a UsageError naming it)."""
    import os

    folder = os.path.dirname(os.path.abspath(os.path.expanduser(path)))
    if os.path.isdir(path):
        raise UsageError(f"cannot write {path!r}: it is a folder; give a file name inside it")
    if not os.path.isdir(folder):
        raise UsageError(f"cannot write {path!r}: the folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"cannot write {path!r}: the folder {folder!r} is not writable")


def warn(message: str, stacklevel: int = 3) -> None:
    """A RuntimeWarning: what vram_magic could not do, while the user's cell goes on."""
    import warnings

    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)
