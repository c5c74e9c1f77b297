"""Keep one line of PyTorch's own out of the user's cell while the allocator backend records.

While PyTorch's profiler records memory, freeing a CPU block that was allocated before the recording started makes
c10 log ``Memory block of unknown size was allocated before the profiling started, profiler results will not
include the deallocation event`` straight to the process's stderr (file descriptor 2, not Python's
``sys.stderr``). In a notebook that line shows in the cell's output (ipykernel forwards descriptor 2), on the first
such free and every thousandth after it — and almost every measured cell frees something made before it. The
line is about the recording, which is vram_magic's, not the user's.

:class:`StderrFilter` puts a pipe in front of descriptor 2 for the duration of the recording; a thread copies
everything that comes through to the real stderr as it arrives, except that line. Lines that cannot be that line
are never held back; a partial line that could be is held until its end (c10 writes each log line whole).
Whatever goes wrong, the filter steps aside and the user's output goes where it went before.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

#: the line dropped (c10's CPUAllocator.cpp, ``ProfiledCPUMemoryReporter::Delete``)
UNKNOWN_BLOCK = b"Memory block of unknown size was allocated before the profiling started"
#: how c10 starts a warning line: ``[W1201 03:52:15.161092958 CPUAllocator.cpp:245] ...``
_LOG_START = b"[W"
_HOLD_AT_MOST = 1024  # a held partial line longer than this is not c10's line: it goes out


def _filtered(lines: bytes) -> bytes:
    return b"".join(line for line in lines.splitlines(keepends=True) if UNKNOWN_BLOCK not in line)


def _split(buf: bytes) -> tuple[bytes, bytes]:
    """``(ready, held)``: everything up to the last newline, filtered; the rest is held only if it may be the
    start of c10's line."""
    cut = buf.rfind(b"\n") + 1
    ready, rest = _filtered(buf[:cut]), buf[cut:]
    if rest and not (rest.startswith(_LOG_START) or _LOG_START.startswith(rest)) or len(rest) > _HOLD_AT_MOST:
        return ready + rest, b""
    return ready, rest


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def _pump(read_fd: int, out_fd: int) -> None:
    """Copy ``read_fd`` to ``out_fd`` until end of file (every writer gone), without c10's line."""
    held = b""
    try:
        while True:
            chunk = os.read(read_fd, 65536)
            if not chunk:
                break
            ready, held = _split(held + chunk)
            if ready:
                _write_all(out_fd, ready)
        if held:
            _write_all(out_fd, _filtered(held))
    except OSError:
        pass
    finally:
        for fd in (read_fd, out_fd):
            try:
                os.close(fd)
            except OSError:
                pass


class StderrFilter:
    """``start()`` before the recording, ``stop()`` after it; both never raise."""

    def __init__(self) -> None:
        self._saved: int | None = None  # the real stderr, to put back
        self._pipe: Any = None  # os.fstat of the pipe's write end: is descriptor 2 still ours at stop()?
        self._thread: threading.Thread | None = None
        self._read_fd = -1

    def start(self) -> StderrFilter:
        saved = out = read_fd = write_fd = None
        started = False
        try:
            saved = os.dup(2)
            out = os.dup(2)  # the thread's own copy: it closes it at end of file
            read_fd, write_fd = os.pipe()
            self._pipe = os.fstat(write_fd)
            thread = threading.Thread(target=_pump, args=(read_fd, out), name="vram_magic-stderr", daemon=True)
            thread.start()
            started = True
            os.dup2(write_fd, 2)
            os.close(write_fd)
            self._saved, self._thread, self._read_fd = saved, thread, read_fd
        except Exception:
            # closing the write end lets a started thread see end of file and close its own descriptors
            for fd in (saved, write_fd) if started else (saved, write_fd, read_fd, out):
                if fd is not None:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            self._saved = None
        return self

    def stop(self, drain: float = 1.0) -> None:
        saved, self._saved = self._saved, None
        if saved is None:
            return
        try:
            now = os.fstat(2)
            if (now.st_dev, now.st_ino) == (self._pipe.st_dev, self._pipe.st_ino):
                os.dup2(saved, 2)  # closes the pipe's last write end here: the thread drains it and ends
            # else: code in the cell pointed descriptor 2 elsewhere and left it so; that stays as it is
        except OSError:
            pass
        finally:
            try:
                os.close(saved)
            except OSError:
                pass
        thread, self._thread = self._thread, None
        if thread is not None:
            _drain(thread, self._read_fd, drain)


def _pending(fd: int) -> int | None:
    """Bytes waiting in the pipe (None where that cannot be asked)."""
    try:
        import fcntl
        import termios

        buf = bytearray(4)
        fcntl.ioctl(fd, termios.FIONREAD, buf)
        return int.from_bytes(buf, sys.byteorder)
    except Exception:
        return None


def _drain(thread: threading.Thread, read_fd: int, limit: float) -> None:
    """Wait until what was written before the end has come out (the order of the output), at most ``limit`` s.
    Usually the pipe's last write end has just closed and the thread ends at once; a process started during the
    recording (a data-loader worker, a compile worker) may hold it open — the thread then keeps forwarding its
    output for as long as it lives, and this returns once the pipe has stayed empty for a moment."""
    deadline = time.monotonic() + limit
    empty_since = None
    while thread.is_alive() and time.monotonic() < deadline:
        thread.join(0.01)
        pending = _pending(read_fd) if thread.is_alive() else 0
        if pending == 0:
            now = time.monotonic()
            if empty_since is None:
                empty_since = now
            elif now - empty_since >= 0.03:  # the thread has had time to write out its last read
                return
        else:
            empty_since = None
