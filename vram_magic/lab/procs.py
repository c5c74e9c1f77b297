"""What this machine's process table says about a pid: alive, resident memory, parent, pid namespaces.

Linux answers from ``/proc`` (one small read per figure); elsewhere psutil, where installed. Every function
returns ``None`` (or an empty answer) for a process that is gone or cannot be read, never raises.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

_PROC = "/proc"
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def has_proc(root: str = _PROC) -> bool:
    return os.path.isfile(os.path.join(root, "self", "status"))


def alive(pid: int) -> bool:
    """Whether ``pid`` is a process of this machine's pid namespace (zombies count: they still hold a pid)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    except OSError:
        return False
    return True


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def status_field(text: str, name: str) -> str | None:
    """The value of ``name:`` in a ``/proc/<pid>/status`` text, or ``None``."""
    prefix = name + ":"
    for line in text.splitlines():
        if line.startswith(prefix):
            return line[len(prefix):].strip()
    return None


def parse_nspid(text: str) -> tuple[int, ...]:
    """The ``NSpid`` line of a ``/proc/<pid>/status`` text: the process's pid in each pid namespace, from the
    namespace of the ``/proc`` that was read down to the process's own (Linux ≥ 4.1). One entry: the process
    lives in the reader's namespace; more: in a nested one (a container), whose own pid is the last.
    ``()`` where the line is missing (older kernels, other systems)."""
    value = status_field(text, "NSpid")
    if not value:
        return ()
    try:
        return tuple(int(v) for v in value.split())
    except ValueError:
        return ()


def nspid(pid: int | str, root: str = _PROC) -> tuple[int, ...]:
    """:func:`parse_nspid` of a live process (``"self"`` for this one); ``()`` if it cannot be read."""
    text = _read(os.path.join(root, str(pid), "status"))
    return parse_nspid(text) if text is not None else ()


def rss(pid: int, root: str = _PROC) -> int | None:
    """Resident memory of ``pid`` in bytes (``/proc/<pid>/statm``'s second field times the page size)."""
    text = _read(os.path.join(root, str(pid), "statm"))
    if text is not None:
        try:
            return int(text.split()[1]) * _PAGE
        except (IndexError, ValueError):
            return None
    if has_proc(root):
        return None
    try:
        import psutil

        return int(psutil.Process(pid).memory_info().rss)
    except Exception:
        return None


def parent(pid: int, root: str = _PROC) -> int | None:
    """The parent pid of ``pid`` (``/proc/<pid>/stat``'s fourth field), ``None`` if gone."""
    text = _read(os.path.join(root, str(pid), "stat"))
    if text is not None:
        # the command name (field 2) is in parentheses and may hold spaces or ")": split after the last ")"
        try:
            return int(text[text.rindex(")") + 1:].split()[1])
        except (ValueError, IndexError):
            return None
    if has_proc(root):
        return None
    try:
        import psutil

        return int(psutil.Process(pid).ppid())
    except Exception:
        return None


def owners(pids: Iterable[int], targets: Mapping[int, str], root: str = _PROC, depth: int = 32) -> dict[int, str]:
    """For each pid in ``pids``, the value of ``targets`` for the pid itself or its nearest ancestor in
    ``targets`` (``targets`` maps a kernel's pid to its id): a DataLoader worker or a forked rank counts for
    the kernel that started it. Pids with no such ancestor are left out."""
    found: dict[int, str] = {}
    for pid in pids:
        p: int | None = pid
        for _ in range(depth):
            if p is None or p <= 1:
                break
            if p in targets:
                found[pid] = targets[p]
                break
            p = parent(p, root)
    return found


def descendants(pid: int, root: str = _PROC, limit: int = 256) -> list[int]:
    """Pids whose chain of parents leads to ``pid`` (one scan of ``/proc``), nearest first."""
    if not has_proc(root):
        try:
            import psutil

            return [c.pid for c in psutil.Process(pid).children(recursive=True)][:limit]
        except Exception:
            return []
    children: dict[int, list[int]] = {}
    try:
        names = os.listdir(root)
    except OSError:
        return []
    for name in names:
        if name.isdigit():
            ppid = parent(int(name), root)
            if ppid is not None:
                children.setdefault(ppid, []).append(int(name))
    out: list[int] = []
    queue = list(children.get(pid, ()))
    while queue and len(out) < limit:
        p = queue.pop(0)
        out.append(p)
        queue.extend(children.get(p, ()))
    return out


def local_pid(reported: int | None, launched: int | None, root: str = _PROC) -> tuple[int | None, tuple[int, ...]]:
    """The kernel's pid in this machine's namespace, and its ``NSpid`` chain.

    ``reported`` is the pid the kernel gives for itself (``os.getpid()`` in its own namespace), ``launched`` the
    pid of the process the server started (the local provisioner's). They agree for a kernel started directly;
    a kernel in a nested pid namespace (a container started by the launcher) reports its inner pid, found as the
    last ``NSpid`` entry of the launcher or one of its descendants. Without a launched process (a remote kernel)
    the reported pid is not this machine's: ``(None, ())``.
    """
    if launched is None or not alive(launched):
        return None, ()
    own = nspid(launched, root)
    if reported is None or reported == launched or (own and own[-1] == reported):
        return launched, own
    for child in descendants(launched, root):
        chain = nspid(child, root)
        if (chain and chain[-1] == reported) or (not chain and child == reported):
            return child, chain
    return launched, own
