"""A dict's version tag: whether an exact ``dict`` changed since it was last read, in constant time.

CPython keeps a version in every dict object (``ma_version_tag``, PEP 509), set from a process-wide counter at
each change: an item added, replaced or deleted, the dict cleared. The namespace scan reads it to tell that a big
dict of tensors is as it was without comparing the ids of its hundred thousand values (about 10 ms a scan on a
2-core machine). It is read straight from the object's memory (the field after the object header and the item
count), so it is used only where a check at import shows it behaving as a version: unchanged when nothing
happens, different after each kind of change, unique across dicts. Elsewhere (another Python, a free-threaded
build, a release that dropped the field) :func:`version` returns None and the ids are compared as before.
"""

from __future__ import annotations

import ctypes
import sys
import sysconfig
from typing import Any

_OFFSET = 3 * ctypes.sizeof(ctypes.c_ssize_t)  # ob_refcnt, ob_type, ma_used


def _read(d: dict[Any, Any]) -> int:
    return ctypes.c_uint64.from_address(id(d) + _OFFSET).value


def _behaves() -> bool:
    if sys.implementation.name != "cpython" or sysconfig.get_config_var("Py_GIL_DISABLED"):
        return False
    try:
        d: dict[Any, Any] = {"a": 1}
        seen = [_read(d)]
        if _read(d) != seen[0] or d.get("a") != 1 or _read(d) != seen[0]:  # reads change nothing
            return False
        for change in (lambda: d.__setitem__("a", 2), lambda: d.__setitem__("b", 3), lambda: d.pop("b"),
                       lambda: d.clear(), lambda: d.update(c=4)):
            change()
            seen.append(_read(d))
        other: dict[Any, Any] = {}
        other["x"] = 1
        seen.append(_read(other))
        return len(set(seen)) == len(seen)  # each change a new value, another dict's too
    except Exception:
        return False


WORKS = _behaves()


def version(d: Any) -> int | None:
    """The version of an exact dict (a new value after any change to it), or None where it cannot be read."""
    if WORKS and type(d) is dict:
        return _read(d)
    return None


__all__ = ["WORKS", "version"]
