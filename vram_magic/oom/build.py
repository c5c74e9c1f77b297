"""An out-of-memory error turned into its report: what was alive by category and who held it, the request that
failed, and on CUDA what the allocator held (kept by :class:`~vram_magic.engine.cuda.oom_watch.OomWatch` at the
failure), whether other allocator settings would have served the request, and advice with bytes.

What was alive is found as ``%vram`` finds it: a scan of the namespace (a notebook's variables, a script's globals),
here joined by the locals of the failed frames (``x in step()``), read before those frames are released. On CUDA what
the scan cannot name (kernel workspaces, rounding, tensors only C++ holds) is "other", up to what the allocator had
allocated.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

from ..core.breakdown import Breakdown
from ..core.host import HostUsage
from ..core.units import format_bytes
from ..engine.cuda import device as cuda
from ..engine.cuda.oom_message import device_in_message, parse_oom_message
from ..engine.cuda.oom_watch import AllocatorAtOom
from ..engine.cuda.settings_replay import what_ifs
from ..engine.host import procs
from ..engine.host.sampler import resident
from ..engine.scan.frame_namespace import add_other, snapshot
from ..engine.scan.registry import LiveStorages
from ..engine.tracker.frames import is_user_code
from ..measuring.advice import advise
from ..measuring.report import Advice, CellReport, OomInfo
from .report import CudaAtOom, OomReport

_OOM_WORDS = ("CUDA out of memory", "out of memory under the simulated budget", "CUDA error: out of memory")


def find_oom(exc: BaseException | None) -> BaseException | None:
    """The out-of-memory error in ``exc``'s chain (``raise … from``, or raised while handling one): a
    ``torch.OutOfMemoryError``, or a ``RuntimeError`` that says CUDA ran out of memory (older code, other
    allocators). ``None`` where there is none."""
    import torch

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, torch.OutOfMemoryError) or (
                isinstance(exc, RuntimeError) and any(w in str(exc) for w in _OOM_WORDS)):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def frame_locals(tb: TracebackType | None) -> dict[str, Any]:
    """The locals of the user's functions the traceback went through, named ``"x in step()"``: what the failed
    frames held (a module-level frame's locals are its globals, which the namespace has)."""
    out: dict[str, Any] = {}
    while tb is not None:
        frame = tb.tb_frame
        code = frame.f_code
        if code.co_name != "<module>" and is_user_code(code):
            for name, value in list(frame.f_locals.items()):
                out.setdefault(f"{name} in {code.co_name}()", value)
        tb = tb.tb_next
    return out


def _device_of(exc: BaseException, state: AllocatorAtOom | None) -> str:
    if state is not None:
        return f"cuda:{state.device}"
    if "CUDA" in str(exc) and cuda.initialized():
        return cuda.resolve_device("cuda")
    return "cpu"


def cuda_side(state: AllocatorAtOom, cell_start: float | None) -> tuple[CudaAtOom, list[str]]:
    """What the allocator held at the failure, and whether other settings would have served the request."""
    stats = state.stats
    allocated = int(stats.get("allocated_bytes.all.current", 0))
    reserved = int(stats.get("reserved_bytes.all.current", 0))
    largest, biggest = 0, []
    for seg in state.segments:
        for block in seg.get("blocks", ()):
            size = int(block.get("size", 0))
            if block.get("state") == "inactive":
                largest = max(largest, size)
            elif block.get("state") == "active_allocated":
                biggest.append((_site(block.get("frames") or ()), size))
    biggest.sort(key=lambda kv: -kv[1])
    recent = _recent(state.trace, cell_start)
    tries, notes = what_ifs(state.trace, state.settings, stats, state.limit, state.free, state.request,
                            whole=state.history_from_start)
    side = CudaAtOom(
        device=f"cuda:{state.device}", total=state.limit, free=state.free, allocated=allocated, reserved=reserved,
        outside=max(state.limit - state.free - reserved, 0), largest_free=largest,
        inactive_split=int(stats.get("inactive_split_bytes.all.current", 0)),
        alloc_retries=int(stats.get("num_alloc_retries", 0)), ooms=int(stats.get("num_ooms", 0)),
        recent=tuple(recent), biggest=tuple(biggest[:5]),
        what_ifs=tuple((w.setting, w.fits, w.margin, w.how, w.conf) for w in tries),
        history=("the whole history since CUDA started" if state.history_from_start
                 else f"the last {len(state.trace):,} allocator events"))
    return side, notes


def _site(frames: Sequence[Mapping[str, Any]]) -> str:
    for f in frames:
        name = str(f.get("filename", ""))
        if name and "site-packages" not in name and "/torch/" not in name:
            return f"{name.rsplit('/', 1)[-1]}:{f.get('line', '?')} in {f.get('name', '?')}"
    return ""


def _recent(trace: Sequence[Mapping[str, Any]], since: float | None) -> list[tuple[str, int]]:
    """The largest blocks the cell allocated (entries after ``since``, a Unix time) that were alive at the failure."""
    live: dict[int, tuple[str, int]] = {}
    start_us = int(since * 1e6) if since is not None else None
    for entry in trace:
        if start_us is not None and int(entry.get("time_us", start_us)) < start_us:
            continue
        action = entry.get("action")
        if action == "alloc":
            live[int(entry["addr"])] = (_site(entry.get("frames") or ()), int(entry["size"]))
        elif action in ("free_requested", "free_completed"):
            live.pop(int(entry.get("addr", -1)), None)
    return sorted(live.values(), key=lambda kv: -kv[1])[:5]


def build_oom_report(exc: BaseException, *, where: str, namespace: Mapping[str, Any] | None,
                     registry: LiveStorages, state: AllocatorAtOom | None = None, cell: int | None = None,
                     rank: int | None = None, cell_start: float | None = None, capacity: int | None = None,
                     notes: Sequence[str] = ()) -> OomReport:
    """The report of ``exc`` (an out-of-memory error, or an error raised from one), read while its frames are
    still alive. ``state``: the allocator at the failure (CUDA); ``capacity``: a simulated budget's size."""
    oom = find_oom(exc) or exc
    message = f"{type(oom).__name__}: {str(oom).splitlines()[0] if str(oom) else ''}"
    device = _device_of(oom, state)
    merged = dict(namespace or {})
    merged.update(frame_locals(oom.__traceback__))
    alive, _, scan_notes = snapshot(device, merged, registry)
    all_notes = list(notes) + list(scan_notes)
    side = None
    parsed = parse_oom_message(str(oom))
    requested = parsed.requested if parsed is not None else None
    request = parsed.describe() if parsed is not None and requested is None else ""
    if state is not None:
        side, replay_notes = cuda_side(state, cell_start)
        all_notes += replay_notes
        if side.allocated > alive.total:
            alive = add_other(alive, "allocator: workspaces and untracked", side.allocated - alive.total)
        capacity = capacity or side.total - side.outside
        requested = requested or state.request
    elif device.startswith("cuda"):
        all_notes.append("the allocator's state at the failure was not kept (the black box was armed after CUDA "
                         "started, or it is off): figures are read after the error")
        capacity = capacity or cuda.capacity(device)
    if capacity is None:  # what the message says of the device (an error raised without a device to read)
        said = device_in_message(str(oom))
        capacity = said[0] if said is not None else None
    host = None
    if procs.has_proc():
        now, kids = resident(os.getpid())
        host = HostUsage(before=now, after=now, peak=now, children_peak=kids, available=procs.available())
    report = OomReport(where=where, error=message, device=device, alive=alive, requested=requested,
                       request=request, capacity=capacity, cuda=side, host=host,
                       notes=tuple(dict.fromkeys(all_notes)), rank=rank, cell=cell, time=time.time())
    return _with_advice(report)


def _with_advice(report: OomReport) -> OomReport:
    """The advice a measured cell that ran out of memory would get (the same rules, on what was alive), and the
    allocator's own: settings that would have served the request, memory held outside PyTorch."""
    from dataclasses import replace

    alive = report.alive
    zero = Breakdown()
    as_cell = CellReport(device=report.device, before=alive, after=alive, peak=alive, delta=zero,
                         capacity=report.capacity, error=report.error,
                         oom=OomInfo(report.error, report.requested, report.capacity, alive, tuple(report.holders())))
    # a graph a failed call's local held is the step's own activations, released with the call: no leak to fix
    advice = [a for a in advise(as_cell) if not (a.kind == "graph" and " in " in a.concerns)]
    side = report.cuda
    if side is not None:
        for setting, fits, margin, how, conf in side.what_ifs:
            if fits:
                advice.append(Advice(
                    f"`{conf}` would have served the request",
                    f"({how}; {format_bytes(margin)} left after it). Set it before CUDA starts: restart the kernel "
                    "with it in the environment, or `os.environ['PYTORCH_CUDA_ALLOC_CONF']` in the first cell.",
                    side.fragmented, setting, "fragmentation"))
                break
        if side.outside >= 512 << 20:
            advice.append(Advice(
                f"{format_bytes(side.outside)} of the device was held outside this process's PyTorch",
                "the CUDA context and other processes: another notebook's kernel may hold the GPU (JupyterLab's "
                "kernel panel lists them); shut it down or free its tensors.", side.outside, "", "other-processes"))
    return replace(report, advice=tuple(advice))


__all__ = ["build_oom_report", "cuda_side", "find_oom", "frame_locals"]
