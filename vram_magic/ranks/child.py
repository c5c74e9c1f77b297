"""Measuring every rank of a job started from a ``%%vram --ranks`` cell (or ``python -m vram_magic ranks run``),
without changing the code that the ranks run.

How the children report back: one JSON file per rank in a directory the parent names in the environment
(:data:`ENV_DIR`). The environment is the one thing every way of starting ranks passes on — a forked child
(``accelerate.notebook_launcher``, ``torch.multiprocessing`` with ``fork``) inherits it with the parent's memory,
a spawned one (``torch.multiprocessing.spawn``) and ``torchrun``'s workers receive it from their parent process
— and a file per rank needs no server in the kernel, no port, no thread, survives a rank that crashes after
writing, and is what ``python -m vram_magic ranks DIR`` reads for a job run from a terminal.

In a child, the measurement starts when the process joins the job (PyTorch sets its default process group: the
moment ``init_process_group`` — or ``init_device_mesh``, or accelerate's ``Accelerator()`` — has made it a
rank) and ends when the default group is destroyed (``destroy_process_group``) or the process exits. The
namespace scanned is the rank's own code: the frame of the function that joined the job (its variables are
scanned at the end, also when it has returned) or, at ``destroy_process_group``, the frame that called it. A
rank that is stopped (``SIGTERM``: launchers stop the other ranks when one fails) writes what it measured so
far. Spawned processes load this module through :mod:`vram_magic.ranks.boot` (``sitecustomize`` on
``PYTHONPATH``); forked ones inherit it from the parent, which installs it before the cell runs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from ..engine.after_import import after_import

ENV_DIR = "VRAM_MAGIC_RANKS"  # the directory the ranks write their reports into
ENV_PARENT = "VRAM_MAGIC_RANKS_PARENT"  # pid of the process that launches the ranks (never measured itself)

_run: _RankRun | None = None
_installed_by = ""  # "parent" (the launching process; inherited by forked children) or "boot" (a new interpreter)
_patched: dict[str, Any] = {}  # name -> the original function, while patched


def _armed() -> str | None:
    folder = os.environ.get(ENV_DIR)
    if not folder:
        return None
    parent = os.environ.get(ENV_PARENT)
    if parent and parent == str(os.getpid()):
        return None
    return folder


def _is_rank_code(code: Any) -> bool:
    from ..engine.tracker.frames import is_user_code

    name = code.co_filename
    return is_user_code(code) and "site-packages" not in name and "dist-packages" not in name


def _user_frame(frame: Any) -> Any:
    """The innermost frame of the rank's own code at or above ``frame`` (skipping PyTorch, accelerate, …)."""
    f = frame
    while f is not None:
        if _is_rank_code(f.f_code):
            return f
        f = f.f_back
    return None


class _Namespace(Mapping):
    """What the rank's measurement scans: a frame's globals and locals, read afresh at each scan, or the
    ``__main__`` module's variables when no frame of the rank's own code is known."""

    def __init__(self, frame: Any) -> None:
        self.frame = frame

    def _merged(self) -> dict[str, Any]:
        f = self.frame
        if f is None:
            main = sys.modules.get("__main__")
            return dict(getattr(main, "__dict__", {}))
        merged = dict(f.f_globals)
        merged.update(f.f_locals)
        return merged

    def items(self) -> Any:  # type: ignore[override]
        return self._merged().items()

    def __iter__(self) -> Any:
        return iter(self._merged())

    def __len__(self) -> int:
        return len(self._merged())

    def __getitem__(self, key: Any) -> Any:
        return self._merged()[key]


def _launcher() -> str:
    import multiprocessing

    elastic = "TORCHELASTIC_RUN_ID" in os.environ
    child_of_mp = multiprocessing.parent_process() is not None
    if _installed_by == "parent":
        return "torch elastic, forked (e.g. accelerate.notebook_launcher)" if elastic else \
            "forked processes (torch.multiprocessing)"
    if elastic:
        return "torch elastic, spawned" if child_of_mp else "torchrun"
    return "spawned processes (torch.multiprocessing)" if child_of_mp else "separate processes"


class _RankRun:
    """The measurement of this process as a rank, from joining the job to leaving it."""

    def __init__(self, folder: str, frame: Any) -> None:
        import torch.distributed as dist

        from ..engine.cuda import device as cuda
        from ..engine.scan.registry import LiveStorages
        from ..measuring.measurement import Measurement

        self.folder = folder
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.backend = str(dist.get_backend())
        device = "cpu"
        gpus = cuda.device_count()  # NVML's count: is_available() would initialise the driver to look
        if "nccl" in self.backend and gpus:
            local = int(os.environ.get("LOCAL_RANK", self.rank % gpus))
            device = f"cuda:{local}"
        self.launcher = _launcher()
        self.namespace = _Namespace(_user_frame(frame))
        self.measurement = Measurement(device, namespace=self.namespace, registry=LiveStorages(),
                                       source="", backend="tracker")
        self.done = False
        self.measurement.__enter__()

    def finish(self, ended: str, frame: Any = None, error: BaseException | None = None,
               stopped: bool = False) -> None:
        if self.done:
            return
        self.done = True
        from .result import rank_report, write_rank_file

        m = self.measurement
        if frame is not None:
            user = _user_frame(frame)
            if user is not None:
                self.namespace.frame = user
        status = "partial" if stopped else "complete"
        report = None
        try:
            exc_type = type(error) if error is not None else None
            m.__exit__(exc_type, error, None)
            report = m.report
        except Exception:  # stopped in the middle of an op: what the tracker counted so far
            report = None
        if report is None and stopped:
            report = _partial_report(m)
        self.namespace.frame = None  # hold nothing of the rank's once measured
        text = f"{type(error).__name__}: {error}" if error is not None else None
        rr = rank_report(report, rank=self.rank, world=self.world, error=text, status=status,
                         backend=self.backend, ended=ended)
        rr = _with_launcher(rr, self.launcher)
        try:
            os.makedirs(self.folder, exist_ok=True)
            write_rank_file(self.folder, rr)
        except OSError as err:
            print(f"vram_magic: rank {self.rank} could not write its report into {self.folder!r}: {err}",
                  file=sys.stderr)


def _with_launcher(rr: Any, launcher: str) -> Any:
    from dataclasses import replace

    return replace(rr, launched_by=launcher)


def _partial_report(m: Any) -> Any:
    """A report from what a running measurement knows (its live status): the split now, the peak so far."""
    from ..core.breakdown import Breakdown
    from ..engine.scan.frame_namespace import add_other
    from ..measuring.report import CellReport

    status = m.status()
    if status is None or status.breakdown is None:
        return None
    now = status.breakdown
    peak = now
    if status.peak and status.peak > now.total:
        peak = add_other(now, "not split: the rank was stopped before its measurement ended",
                         status.peak - now.total)
    before = Breakdown.from_rows(dict(m._before_rows))
    return CellReport(device=m.device, before=before, after=now, peak=peak, delta=now - before,
                      wall_time=status.elapsed, backend=m.backend,
                      notes=("stopped before the end: the peak's split is approximate",))


# --- the hooks: joining and leaving the job, exit, SIGTERM ---------------------------------------------
def _joined(frame: Any) -> None:
    global _run
    folder = _armed()
    if folder is None or _run is not None:
        return
    try:
        _run = _RankRun(folder, frame)
    except Exception as err:
        print(f"vram_magic: this rank could not be measured ({type(err).__name__}: {err})", file=sys.stderr)
        return
    _on_exit()


def _left(frame: Any) -> None:
    run = _run
    if run is not None and not run.done:
        run.finish("destroy_process_group", frame=frame)


def _exiting() -> None:
    run = _run
    if run is None or run.done:
        return
    exc = sys.exc_info()[1] or getattr(sys, "last_value", None)
    if isinstance(exc, SystemExit):  # torch.multiprocessing catches the error, writes it and exits with 1
        exc = exc.__context__ if exc.code not in (0, None) else None
    if isinstance(exc, KeyboardInterrupt):
        exc = None
    run.finish("exit", error=exc if isinstance(exc, BaseException) else None)


def _on_exit() -> None:
    import atexit
    import multiprocessing.util as mp_util
    import signal
    import threading

    atexit.register(_exiting)  # a plain interpreter (torchrun's workers)
    mp_util.Finalize(None, _exiting, exitpriority=100)  # a multiprocessing child (its exit skips atexit)
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminated)


def _terminated(signum: int, frame: Any) -> None:
    import signal

    run = _run
    try:
        if run is not None and not run.done:
            run.finish("SIGTERM", stopped=True)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


# --- installing the hooks ----------------------------------------------------------------------------
def _update_default_pg(original: Any) -> Any:
    def update(pg: Any, *args: Any, **kwargs: Any) -> Any:
        if pg is None:
            _left(sys._getframe(1))
        out = original(pg, *args, **kwargs)
        if pg is not None:
            _joined(sys._getframe(1))
        return out

    update._vram_magic_original = original  # type: ignore[attr-defined]
    return update


def _patch(c10d: Any) -> None:
    """Hear when the process joins and leaves the job: PyTorch sets its default process group in one place,
    whichever function started the job."""
    if "_update_default_pg" in _patched:
        return
    original = getattr(c10d, "_update_default_pg", None)
    if original is None or getattr(original, "_vram_magic_original", None) is not None:
        return
    _patched["_update_default_pg"] = original
    c10d._update_default_pg = _update_default_pg(original)


def unpatch() -> None:
    """Put PyTorch's function back (the launching process, once its cell has run)."""
    original = _patched.pop("_update_default_pg", None)
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if original is not None and c10d is not None and \
            getattr(c10d._update_default_pg, "_vram_magic_original", None) is original:
        c10d._update_default_pg = original


def install(by: str = "parent") -> None:
    """Arm this process: once PyTorch's distributed package is loaded (now, or when it gets imported), joining a
    job starts this rank's measurement."""
    global _installed_by
    _installed_by = _installed_by or by
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is not None:
        _patch(c10d)
        return
    after_import("torch.distributed.distributed_c10d", _patch)


def boot() -> None:
    """What a new interpreter runs at startup (``sitecustomize``) when the environment asks for it."""
    if _armed() is not None:
        install(by="boot")
