"""``python -m vram_magic run [--out DIR] (script.py | -m module) [args ...]``: a script (or each rank a ``torchrun``
starts: ``torchrun … -m vram_magic run train.py``) run with the out-of-memory black box.

The script runs as ``python script.py args`` runs it: a real ``__main__`` module kept in ``sys.modules`` (pickling and
``multiprocessing``'s spawn find what it defines), an absolute ``__file__``, ``sys.argv`` as typed and the script's
folder first on ``sys.path``; a module as ``python -m module args`` runs it. When an out-of-memory error leaves the
script, or any of its threads, the process writes its report into ``DIR`` (``oom-rank<RANK>.json``, ``.txt`` and
``.html``, and a PyTorch memory snapshot ``.pickle`` that PyTorch's memory viewer opens: the allocator's own on CUDA,
the holders' blocks elsewhere) before anything else: ``torchrun`` stops the other ranks as soon as one fails. The
traceback then prints from the script's first frame, and the process exits with the script's own status
(``sys.exit(n)`` keeps ``n``, an uncaught error is 1, an interrupt is Python's).
"""

from __future__ import annotations

import builtins
import importlib.machinery
import io
import json
import os
import pickle
import runpy
import sys
import threading
import types
from typing import Any

from ..engine.cuda.oom_watch import OomWatch
from ..engine.scan.registry import LiveStorages
from ..engine.tracker.oom_frames import user_traceback
from .black_box import remember
from .build import build_oom_report, find_oom
from .readback import PREFIX
from .report import OomReport

USAGE = "usage: python -m vram_magic run [--out DIR] (script.py | -m module) [args ...]"
_REPORTED = "_vram_magic_oom_reported"


def rank() -> int | None:
    """This process's rank under ``torchrun`` (``RANK``, else ``LOCAL_RANK``), ``None`` outside one."""
    for name in ("RANK", "LOCAL_RANK"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def run_script(path: str) -> None:
    """Run a file as ``python path`` does (``runpy.run_path`` would give a temporary ``__main__``, a relative
    ``__file__`` and no loader)."""
    path = os.path.abspath(path)
    with io.open_code(path) as f:
        source = f.read()
    code = compile(source, path, "exec", dont_inherit=True)  # not this module's __future__ imports
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __cached__=None, __package__=None, __spec__=None, __builtins__=builtins,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def oom_snapshot(report: OomReport, state: Any) -> dict[str, Any]:
    """A PyTorch memory snapshot of the failure: the allocator's own where it was kept (CUDA), else one block per
    holder of what was alive, by category, and the failed request as an ``oom`` entry."""
    if state is not None and state.snapshot:
        return dict(state.snapshot)
    segments, base = [], 0x7F00_0000_0000
    for i, (cat, label, n) in enumerate(report.alive.detail):
        addr = base - (i + 1) * 2**40
        block = {"address": addr, "size": n, "requested_size": n, "state": "active_allocated", "frames": [],
                 "category": cat, "label": label}
        segments.append({"device": 0, "address": addr, "total_size": n, "allocated_size": n, "active_size": n,
                         "requested_size": n, "stream": 0, "segment_type": "large", "segment_pool_id": (0, 0),
                         "is_expandable": False, "frames": [], "blocks": [block]})
    trace = [{"action": "oom", "addr": 0, "size": report.requested or 0, "stream": 0, "frames": [],
              "device_free": max((report.capacity or 0) - report.alive.total, 0)},
             {"action": "snapshot", "addr": 0, "size": 0, "stream": 0, "frames": [], "category": "unknown"}]
    return {"segments": segments, "device_traces": [trace], "allocator_settings": {},
            "vram_magic": {"device": report.device, "where": report.where}}


def write_report(report: OomReport, folder: str, state: Any = None) -> str:
    """The report's files in ``folder``: ``oom-<rank or pid>.json``, ``.txt``, ``.html`` and ``.pickle``; the JSON's
    path."""
    os.makedirs(folder, exist_ok=True)
    tag = f"rank{report.rank}" if report.rank is not None else f"pid{os.getpid()}"
    stem = os.path.join(folder, f"{PREFIX}{tag}")
    with open(stem + ".json", "w", encoding="utf-8") as f:
        json.dump(report.to_dict(), f, indent=1)
    with open(stem + ".txt", "w", encoding="utf-8") as f:
        f.write(report._text() + "\n")
    with open(stem + ".html", "w", encoding="utf-8") as f:
        f.write(f"<!doctype html><meta charset='utf-8'><title>{tag}</title>{report._html()}\n")
    with open(stem + ".pickle", "wb") as f:
        pickle.dump(oom_snapshot(report, state), f)
    return stem + ".json"


class Runner:
    """The black box of one script: what it ran, where its reports go."""

    def __init__(self, folder: str, where: str) -> None:
        self.folder = folder
        self.where = where
        self.watch = OomWatch()
        self.registry = LiveStorages()
        self.written: list[str] = []

    def explain(self, exc: BaseException, thread: str = "") -> None:
        """Write the report of ``exc`` if it is (or came from) an out-of-memory error; never raises."""
        try:
            oom = find_oom(exc)
            if oom is None or getattr(oom, _REPORTED, False):
                return
            setattr(oom, _REPORTED, True)
            main = sys.modules.get("__main__")
            namespace = dict(vars(main)) if main is not None else {}
            state = self.watch.take()
            where = self.where + (f", thread {thread}" if thread else "")
            report = build_oom_report(exc, where=where, namespace=namespace, registry=self.registry, state=state,
                                      rank=rank(), notes=(self.watch.note,) if self.watch.note else ())
            remember(report)
            path = write_report(report, self.folder, state)
            self.written.append(path)
            print(f"vram_magic: out of memory — report in {path}", file=sys.stderr)
        except Exception as err:  # the script's own error is what must reach the user
            print(f"vram_magic: the out-of-memory report could not be written ({type(err).__name__}: {err})",
                  file=sys.stderr)

    def thread_hook(self, previous: Any) -> Any:
        def hook(args: Any) -> None:
            if args.exc_value is not None:
                self.explain(args.exc_value, args.thread.name if args.thread is not None else "?")
            previous(args)  # Python's own "Exception in thread …"

        return hook


def parse(argv: list[str]) -> tuple[str, list[str]] | str:
    """``(folder, the rest)`` or the usage error to print."""
    folder = os.environ.get("VRAM_MAGIC_OOM_DIR", "vram-oom")
    while argv[:1] and argv[0] in ("--out", "-o"):
        if len(argv) < 2:
            return f"{argv[0]} needs a folder\n{USAGE}"
        folder, argv = argv[1], argv[2:]
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        return USAGE
    if argv[0] != "-m" and not os.path.isfile(argv[0]):
        return f"no script {argv[0]!r}\n{USAGE}"
    return folder, argv


def main(argv: list[str]) -> int:
    parsed = parse(list(argv))
    if isinstance(parsed, str):
        print(parsed, file=sys.stderr)
        return 2
    folder, argv = parsed
    module = argv[1] if argv[0] == "-m" else None
    target = module or argv[0]
    runner = Runner(folder, f"{os.path.basename(target)}" + (f" (rank {rank()})" if rank() is not None else ""))
    runner.watch.arm()
    threading.excepthook = runner.thread_hook(threading.excepthook)
    if module is not None:
        sys.argv = [module, *argv[2:]]

        def run() -> None:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))  # as `python script.py`: its folder

        def run() -> None:
            run_script(argv[0])
    try:
        run()
    except (SystemExit, KeyboardInterrupt):
        raise  # the script's own status, as Python maps it
    except BaseException as exc:
        runner.explain(exc)
        trimmed = _from_the_script(exc.__traceback__)
        if trimmed is not None:
            exc.__traceback__ = trimmed  # Python prints the exception's own traceback, whatever it is handed
        sys.excepthook(type(exc), exc, exc.__traceback__)
        return 1
    return 0


def _from_the_script(tb: Any) -> Any:
    """The traceback from the script's (or module's) first frame to the user's last: this runner's, runpy's and the
    libraries' frames after the user's line left out."""
    return user_traceback(tb)


__all__ = ["Runner", "main", "oom_snapshot", "rank", "run_script", "write_report"]
