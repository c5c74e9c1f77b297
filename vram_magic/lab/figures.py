"""A kernel's own figures, shared with the Jupyter server through a small file, without running code in the kernel.

While ``%load_ext vram_magic`` is active in a kernel started by a Jupyter server, the kernel writes
``<folder of its connection file>/vram-magic/<pid>.json`` after each cell where a figure changed (and after each
measured cell's report):
allocated and reserved bytes per CUDA device that has a context, and the last measured cell's categories.
The file's shape is :class:`.schema.Figures`. The server's route reads these files by kernel id or pid
(:class:`FiguresReader`), each checked against that shape; unloading the extension removes the file. Writing one
costs a fraction of a millisecond; nothing here creates a CUDA context.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import sys
import time
from typing import Any

from .schema import FOLDER, FORMAT, Figures, LastCell, OwnDevice, fields, problems

_KERNEL_FILE = re.compile(r"kernel-(.+)\.json$")


def kernel_id_from(connection_file: str) -> str | None:
    """The kernel id in a connection file's name (``kernel-<id>.json``, as Jupyter servers name them)."""
    m = _KERNEL_FILE.search(os.path.basename(connection_file))
    return m.group(1) if m else None


def _connection_file(shell: Any) -> str | None:
    if getattr(shell, "kernel", None) is None:
        return None
    try:
        from ipykernel.connect import get_connection_file

        return os.path.abspath(get_connection_file())
    except Exception:
        return None


def last_cell(report: Any) -> LastCell | None:
    """The fields :class:`.schema.LastCell` names of the report as a rank's payload holds it, without detail rows."""
    if report is None:
        return None
    from ..ranks.payload import report_to_dict  # a report exists, so torch is imported already

    whole = report_to_dict(report, detail=False)
    return LastCell(**{k: whole[k] for k in fields(LastCell)})


class FiguresWriter:
    """Writes this kernel's figures file after each cell; :meth:`stop` unhooks it and removes the file."""

    def __init__(self, shell: Any, session: Any, folder: str, kernel_id: str | None = None) -> None:
        self.shell = shell
        self.session = session
        self.kernel_id = kernel_id
        self.path = os.path.join(folder, f"{os.getpid()}.json")
        self._properties: dict[int, tuple[int, str]] = {}
        self._failed = False
        self._written: dict[str, Any] | None = None
        os.makedirs(folder, exist_ok=True)
        shell.events.register("post_run_cell", self._after_cell)
        session.on_report.append(self._on_report)
        atexit.register(self.remove)  # a kernel shut down without unloading the extension leaves no file
        self.write()

    def _after_cell(self, result: Any = None) -> None:
        self.write()

    def _on_report(self, report: Any) -> None:
        self.write()

    def cuda_devices(self) -> list[OwnDevice]:
        """Allocated and reserved bytes of each CUDA device with a context (none before CUDA is initialised)."""
        if "torch" not in sys.modules:
            return []
        import torch

        from ..engine.cuda import device as cuda

        if not cuda.initialized():
            return []
        out = []
        for index in range(torch.cuda.device_count()):
            if not cuda.has_context(index):
                continue
            if index not in self._properties:
                props = torch.cuda.get_device_properties(index)
                self._properties[index] = (int(props.total_memory), str(getattr(props, "uuid", "") or ""))
            total, uuid = self._properties[index]
            out.append(OwnDevice(device=f"cuda:{index}", uuid=uuid, allocated=int(torch.cuda.memory_allocated(index)),
                                 reserved=int(torch.cuda.memory_reserved(index)), total=total))
        return out

    def figures(self) -> Figures:
        return Figures(format=FORMAT, pid=os.getpid(), kernel_id=self.kernel_id,
                       notebook=os.environ.get("JPY_SESSION_NAME"), time=time.time(), devices=self.cuda_devices(),
                       last_cell=last_cell(self.session.last), measured_cells=len(self.session.history))

    def write(self) -> None:
        """Replace the file in one step (a reader never sees half of it) when a figure changed (``time`` is when
        they last changed); a failure never reaches the cell."""
        try:
            figures = self.figures()
            same = {k: v for k, v in figures.items() if k != "time"}
            if same == self._written and os.path.exists(self.path):
                return
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(figures, f, separators=(",", ":"))
            os.replace(tmp, self.path)
            self._written = same
        except Exception as err:
            if not self._failed:
                self._failed = True
                import warnings

                warnings.warn(f"vram_magic could not write its figures for JupyterLab to {self.path} "
                              f"({type(err).__name__}: {err}); the magics are unaffected", RuntimeWarning,
                              stacklevel=2)

    def stop(self) -> None:
        try:
            self.shell.events.unregister("post_run_cell", self._after_cell)
        except ValueError:
            pass
        if self._on_report in self.session.on_report:
            self.session.on_report.remove(self._on_report)
        atexit.unregister(self.remove)
        self.remove()

    def remove(self) -> None:
        try:
            os.remove(self.path)
        except OSError:
            pass


def start_figures(shell: Any, session: Any, folder: str | None = None) -> FiguresWriter | None:
    """A writer for ``shell`` in a kernel (``None`` in a terminal IPython or where the kernel's connection file
    is unknown); ``folder`` overrides where the file goes."""
    kernel_id = None
    if folder is None:
        connection = _connection_file(shell)
        if connection is None:
            return None
        folder = os.path.join(os.path.dirname(connection), FOLDER)
        kernel_id = kernel_id_from(connection)
    try:
        return FiguresWriter(shell, session, folder, kernel_id)
    except Exception:
        return None


class FiguresReader:
    """The figures files in one folder, parsed again only when a file changed (size or modification time); a file
    that is not a :class:`.schema.Figures` of this format is left out."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._cache: dict[str, tuple[tuple[int, int], dict[str, Any]]] = {}

    def read(self) -> list[dict[str, Any]]:
        try:
            entries = [e for e in os.scandir(self.folder) if e.name.endswith(".json")]
        except OSError:
            self._cache.clear()
            return []
        out, seen = [], set()
        for e in entries:
            try:
                st = e.stat()
            except OSError:
                continue
            key = (st.st_mtime_ns, st.st_size)
            seen.add(e.path)
            cached = self._cache.get(e.path)
            if cached is not None and cached[0] == key:
                out.append(cached[1])
                continue
            data = _load(e.path)
            if data is not None:
                data["_file"] = e.path
                self._cache[e.path] = (key, data)
                out.append(data)
        for gone in set(self._cache) - seen:
            del self._cache[gone]
        return out

    def match(self, figures: list[dict[str, Any]], kernel_id: str, pids: tuple[int | None, ...]
              ) -> dict[str, Any] | None:
        """The file of kernel ``kernel_id`` (by the id in it, else by one of its pids), newest first."""
        by_id = [f for f in figures if f["kernel_id"] == kernel_id]
        if not by_id:
            wanted = {p for p in pids if p}
            by_id = [f for f in figures if f["pid"] in wanted and not f["kernel_id"]]
        return max(by_id, key=lambda f: f["time"], default=None)

    def remove_stale(self, figures: list[dict[str, Any]], kernel_ids: set[str], is_alive: Any) -> None:
        """Files of kernels that are gone (not this server's, and their pid is no process here) are deleted:
        a kernel killed without unloading the extension leaves its file behind."""
        for f in figures:
            if f["kernel_id"] in kernel_ids or is_alive(f["pid"]):
                continue
            try:
                os.remove(f["_file"])
            except OSError:
                pass


def _load(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    # another version's file (its format), or one that is not what this format says: not read
    if not isinstance(data, dict) or data.get("format") != FORMAT or problems(data, Figures):
        return None
    return data
