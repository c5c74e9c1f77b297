"""One answer of ``GET vram-magic/kernels``: every kernel of this server with its notebook, pid, resident memory,
GPU memory per device (NVML, joined by pid) and its own figures where vram_magic is loaded; every device with
what the kernels and other processes hold; notes that say what could not be known and why.

Cheap by design: kernels are asked for their pid once per start (:mod:`.pids`), resident memory is one read of
``/proc/<pid>/statm``, the figures files are parsed again only when they changed, NVML is one call per device.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from ..core.breakdown import CATEGORIES, LABELS
from ..engine.host import procs
from ..render import COLORS
from . import schema
from .figures import FiguresReader
from .nvml import Nvml, NvmlDevice, same_device
from .pids import KernelPid, KernelPids


def join_processes(devices: Iterable[NvmlDevice], kernels: Mapping[int, str], root: str = "/proc"
                   ) -> tuple[dict[str, dict[int, int]], dict[int, int | None], dict[int, int]]:
    """Attribute NVML's processes to kernels: ``kernels`` maps a kernel's local pid to its id; a process counts for
    the kernel that is it or its nearest ancestor. Returns bytes per kernel id and device index, bytes of the
    other processes per device (``None`` where some have no per-process figure), and the kernels' share per
    device."""
    per_kernel: dict[str, dict[int, int]] = {}
    other: dict[int, int | None] = {}
    by_kernels: dict[int, int] = {}
    for dev in devices:
        owner = procs.owners([p.pid for p in dev.processes], kernels, root)
        rest: int | None = 0
        by_kernels[dev.index] = 0
        for p in dev.processes:
            kid = owner.get(p.pid)
            if kid is not None:
                if p.used is not None:
                    per = per_kernel.setdefault(kid, {})
                    per[dev.index] = per.get(dev.index, 0) + p.used
                    by_kernels[dev.index] += p.used
            elif p.used is None or rest is None:
                rest = None
            else:
                rest += p.used
        other[dev.index] = rest
    return per_kernel, other, by_kernels


def foreign_pids(devices: Iterable[NvmlDevice], is_alive: Any = procs.alive) -> list[int]:
    """NVML pids that are no process of this pid namespace: the driver reports the host's pids, so a server in a
    container without the host's pid namespace sees numbers that are not its processes."""
    return sorted({p.pid for d in devices for p in d.processes if not is_alive(p.pid)})


def namespace_notes(devices: list[NvmlDevice], foreign: list[int], kernels: list[schema.Kernel]) -> list[str]:
    notes = []
    if foreign:
        shown = ", ".join(str(p) for p in foreign[:5]) + (" …" if len(foreign) > 5 else "")
        notes.append(f"NVML lists {len(foreign)} process(es) whose pids ({shown}) are not processes here: the driver "
                     "reports the host's pids and this server runs in another pid namespace (a container started "
                     "without --pid=host). Their GPU memory cannot be joined to kernels; kernels with vram_magic "
                     "loaded report their own.")
    for k in kernels:
        if k.get("nspid"):
            chain = k["nspid"]
            notes.append(f"The kernel of {k.get('path') or k['id']} runs in a nested pid namespace: its pid "
                         f"{chain[-1]} is {chain[0]} here.")
        own = k["vram_magic"]["devices"] if k["vram_magic"] else []
        for d in own:
            dev = next((x for x in devices if same_device(x.uuid, d["uuid"])), None)
            if dev is None or not dev.processes or any(g["source"] == "nvml" and g.get("index") == dev.index
                                                       for g in k["gpu"]):
                continue
            notes.append(f"The kernel of {k.get('path') or k['id']} holds {d['device']} (its own figures) but its pid "
                         f"{k.get('local_pid')} is not among the {len(dev.processes)} NVML lists on device "
                         f"{dev.index}: NVML's pids are not this pid namespace's; its own figures are shown.")
    for dev in devices:
        if dev.mig or (dev.processes and all(p.used is None for p in dev.processes)):
            notes.append(f"Device {dev.index} ({dev.name}) gives no per-process memory"
                         f"{' (MIG mode)' if dev.mig else ''}: kernels' GPU memory there comes from their own "
                         "figures where vram_magic is loaded.")
    return notes


def _with_children(pid: int) -> int | None:
    own = procs.rss(pid)
    if own is None:
        return None
    return own + sum(procs.rss(c) or 0 for c in procs.children(pid))


def _own_gpu(figures: schema.Figures | None, devices: list[NvmlDevice], nvml_gpu: list[schema.Gpu]) -> list[schema.Gpu]:
    """The kernel's reserved bytes per device from its own figures, for devices NVML attributed nothing on."""
    out = []
    for d in figures["devices"] if figures else []:
        dev = next((x for x in devices if same_device(x.uuid, d["uuid"])), None)
        if dev is not None and any(g["index"] == dev.index for g in nvml_gpu):
            continue
        out.append(schema.Gpu(index=dev.index if dev else None, device=d["device"], name=dev.name if dev else None,
                              used=d["reserved"], total=d["total"] or (dev.total if dev else 0) or None,
                              allocated=d["allocated"], source="vram_magic"))
    return out


def _json_time(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value


class Collector:
    """Holds what lasts between polls: the pid cache, NVML's session, the parsed figures, each kernel's history."""

    def __init__(self, kernel_manager: Any, session_manager: Any, *, nvml: Nvml | None = None,
                 figures_folder: str | None = None, history_seconds: float = 600, sample_every: float = 2.0) -> None:
        self.kernel_manager = kernel_manager
        self.session_manager = session_manager
        self.pids = KernelPids()
        self.nvml = nvml if nvml is not None else Nvml()
        folder = figures_folder or os.path.join(getattr(kernel_manager, "connection_dir", "") or ".", schema.FOLDER)
        self.figures = FiguresReader(folder)
        self.sample_every = sample_every
        self.history: dict[str, deque] = {}
        self._history_len = max(2, int(history_seconds / sample_every))

    async def collect(self) -> schema.KernelsReply:
        started = time.perf_counter()
        kernel_ids = list(self.kernel_manager.list_kernel_ids())
        sessions = {s["kernel"]["id"]: s for s in await self.session_manager.list_sessions() if s.get("kernel")}
        entries = await self.pids.update(self.kernel_manager, kernel_ids)
        devices, notes = self.nvml.read()
        files = self.figures.read()
        kernels = [self._kernel(kid, sessions.get(kid), entries.get(kid), files) for kid in kernel_ids]
        local = {k["local_pid"]: k["id"] for k in kernels if k["local_pid"]}
        per_kernel, other, by_kernels = join_processes(devices, local)
        for k in kernels:
            held = per_kernel.get(k["id"], {})
            nvml_gpu = [schema.Gpu(index=d.index, device=None, name=d.name, used=held[d.index], total=d.total,
                                   allocated=None, source="nvml") for d in devices if d.index in held]
            k["gpu"] = nvml_gpu + _own_gpu(k["vram_magic"], devices, nvml_gpu)
        notes += namespace_notes(devices, foreign_pids(devices), kernels)
        for k in kernels:
            if k["local_pid"] is None:
                notes.append(f"The kernel of {k.get('path') or k['id']} has no process on this machine (a remote "
                             "kernel): its memory is what it reports itself.")
        self._record(kernels)
        self.figures.remove_stale(files, set(kernel_ids), procs.alive)
        kernels.sort(key=lambda k: (-sum(g["used"] for g in k["gpu"]), -(k["rss"] or 0), k.get("path") or ""))
        return schema.KernelsReply(
            kernels=kernels,
            devices=[schema.Device(index=d.index, name=d.name, uuid=d.uuid, total=d.total, used=d.used, free=d.free,
                                   mig=d.mig, processes=len(d.processes), kernels=by_kernels.get(d.index, 0),
                                   other=other.get(d.index)) for d in devices],
            notes=notes,
            categories=[schema.Category(name=c, label=LABELS.get(c, c), color=COLORS.get(c, "#AAAAAA"))
                        for c in CATEGORIES],
            server=schema.Server(pid=os.getpid(), time=time.time()),
            took_ms=round((time.perf_counter() - started) * 1000, 2),
        )

    def _kernel(self, kid: str, session: Mapping[str, Any] | None, entry: KernelPid | None,
                files: list[dict[str, Any]]) -> schema.Kernel:
        try:
            model = self.kernel_manager.kernel_model(kid)
        except Exception:
            model = {"id": kid}
        reported, launched = (entry.reported, entry.launched) if entry else (None, None)
        pid_local, chain = procs.local_pid(reported, launched)
        # the kernel's and its children's (data-loader workers, forked ranks): what the notebook holds of the host
        rss = _with_children(pid_local) if pid_local else None
        if pid_local is None and entry is not None and entry.usage:
            rss = entry.usage.get("kernel_memory")
        figures = self.figures.match(files, kid, (reported, pid_local))
        return schema.Kernel(
            id=kid,
            name=model.get("name"),
            execution_state=model.get("execution_state"),
            last_activity=_json_time(model.get("last_activity")),
            session=session.get("id") if session else None,
            path=session.get("path") if session else None,
            type=session.get("type") if session else None,
            pid=reported if reported is not None else launched,
            pid_source="kernel" if reported is not None else ("provisioner" if launched is not None else None),
            local_pid=pid_local,
            nspid=list(chain) if len(chain) > 1 else None,
            rss=rss,
            gpu=[],
            vram_magic=schema.Figures(**{k: figures[k] for k in schema.fields(schema.Figures)}) if figures else None,
            history=[],
        )

    def _record(self, kernels: list[schema.Kernel]) -> None:
        now = time.time()
        for k in kernels:
            h = self.history.setdefault(k["id"], deque(maxlen=self._history_len))
            gpu = sum(g["used"] for g in k["gpu"])
            if not h or now - h[-1][0] >= self.sample_every * 0.9:
                h.append((round(now, 1), k["rss"], gpu))
            k["history"] = [list(s) for s in h]
        for gone in set(self.history) - {k["id"] for k in kernels}:
            del self.history[gone]

    def close(self) -> None:
        self.pids.close()
        self.nvml.close()
