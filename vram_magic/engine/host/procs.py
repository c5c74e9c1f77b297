"""What this machine's process table says about a pid: alive, resident memory, parent, pid namespaces.

Linux answers from ``/proc`` (one small read per figure); elsewhere psutil, where installed. Every function
returns ``None`` (or an empty answer) for a process that is gone or cannot be read, never raises.
"""

from __future__ import annotations

import functools
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
    # os.read, not open(): a third of the time for the small files of /proc, read at every measured block's start
    # and end
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        chunks = []
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks).decode("utf-8", errors="replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def status(pid: int | str = "self", root: str = _PROC) -> str | None:
    """The text of ``/proc/<pid>/status`` (``"self"``: this process), ``None`` if it cannot be read."""
    return _read(os.path.join(root, str(pid), "status"))


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


def children(pid: int, root: str = _PROC, limit: int = 256) -> list[int]:
    """The processes ``pid`` started and theirs, nearest first: each thread's ``task/<tid>/children`` (Linux 3.5+,
    no scan of the whole process table), else :func:`descendants`."""
    tasks = os.path.join(root, str(pid), "task")
    try:
        tids = os.listdir(tasks)
    except OSError:
        return descendants(pid, root, limit)
    out: list[int] = []
    queue = [pid]
    while queue and len(out) < limit:
        p = queue.pop(0)
        try:
            tids = os.listdir(os.path.join(root, str(p), "task")) if p != pid else tids
        except OSError:
            continue
        for tid in tids:
            text = _read(os.path.join(root, str(p), "task", tid, "children"))
            if text is None:
                if p == pid:
                    return descendants(pid, root, limit)  # a kernel without the file
                continue
            for c in text.split():
                if c.isdigit() and int(c) not in out:
                    out.append(int(c))
                    queue.append(int(c))
    return out[:limit]


def available(root: str = _PROC) -> int | None:
    """What this machine has left for a process: ``MemAvailable``, or what the process's cgroup (v2 or v1) still
    allows when that is less; ``None`` where neither can be read."""
    text = _read(os.path.join(root, "meminfo"))
    left = None
    if text is not None:
        value = status_field(text, "MemAvailable")
        if value and value.split()[0].isdigit():
            left = int(value.split()[0]) * 1024
    limit = _cgroup_left(root)
    if limit is not None and (left is None or limit < left):
        left = limit
    return left


@functools.lru_cache(maxsize=8)
def _cgroup_files(root: str) -> tuple[tuple[str, str], ...]:
    """The (limit, usage) files of this process's memory cgroups, v2 and v1 (a process's cgroup stays for its
    life: read once)."""
    text = _read(os.path.join(root, "self", "cgroup")) or ""
    files = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":  # cgroup v2
            base = os.path.join("/sys/fs/cgroup", parts[2].lstrip("/"))
            files.append((os.path.join(base, "memory.max"), os.path.join(base, "memory.current")))
        elif "memory" in parts[1].split(","):  # cgroup v1
            base = os.path.join("/sys/fs/cgroup/memory", parts[2].lstrip("/"))
            files.append((os.path.join(base, "memory.limit_in_bytes"), os.path.join(base, "memory.usage_in_bytes")))
    return tuple(files)


def _cgroup_left(root: str) -> int | None:
    for limit_file, usage_file in _cgroup_files(root):
        limit, usage = _read(limit_file), _read(usage_file)
        if limit is None and usage is None:  # a hierarchy this system does not mount
            continue
        try:
            lim, used = int((limit or "").strip()), int((usage or "").strip())
        except ValueError:  # "max": no limit
            return None
        return None if lim >= 1 << 60 else max(lim - used, 0)
    return None


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
