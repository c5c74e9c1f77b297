"""``measure()``: the context manager that turns a block of code into a :class:`CellReport`.

Two backends record what happens inside the block (see README, "How it measures"):

* ``tracker`` — a dispatch mode that sees every tensor each op returns: the phase, module and line of every
  allocation, and a simulated budget enforced on the CPU; compiled code runs eagerly under it.
* ``allocator`` — the profiler's record of the allocator's own allocations and frees: compiled code runs as
  compiled and kernel scratch is seen; phases come from the profiler's scopes, lines and modules are not known.

``auto`` (the default) takes the tracker unless the block runs compiled code, or a dispatch mode of the user's
is active when it starts.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import torch

from ..breakdown import Breakdown
from ..device_stats import DeviceStats
from ..live_status import LiveStatus
from ..report import CellReport, OomInfo
from ..trace import Block, Trace
from ..units import format_bytes, parse_size
from . import cuda
from .allocator import AllocatorRecorder, Replayed, profiler_busy, replay
from .attribution import Scan, scan_namespace
from .categories import (
    KV_SAME_LINE,
    LIVE_PHASE_CATEGORY,
    PHASE_CATEGORY,
    UNATTRIBUTED,
    UNSCOPED,
    holder_name,
    kv_cache_sites,
)
from .compiled import compiled_reason, eager_while_tracked
from .counted import Counted
from .frames import SiteNamer
from .namespace import FrameNamespace, add_other
from .oom import release_traceback
from .registry import LiveStorages
from .scratch import ScratchRecorder, add_scratch, sizes_of, spikes, window_events
from .torch_private import current_mode_stack
from .tracker import FORWARD, PHASE_NAMES, Tracker

BACKENDS = ("auto", "tracker", "allocator")

_shared_registry = LiveStorages()


def _default_registry() -> LiveStorages:
    """The registry of ``measure()`` blocks run outside a session: one for the process, so storages seen by
    an earlier block are not registered again (weakrefs only; entries leave with their storages). A block
    measured inside another gets its own, as the outer one is listening to the shared one."""
    if _shared_registry.on_free is None:
        return _shared_registry
    return LiveStorages()


def check_backend(backend: Any) -> str:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    return backend


def _dispatch_modes_active() -> bool:
    """A dispatch mode of the user's (not a measuring block's own tracker) is on the stack."""
    try:
        return any(not isinstance(m, Tracker) for m in current_mode_stack())
    except Exception:
        return False


class Measurement:
    """``with measure() as m: ...`` — after the block, ``m.report`` (and ``m.before``, ``m.peak``, …) hold
    the result. Attribute access is forwarded to the report, so ``m`` reads like one.
    """

    def __init__(
        self,
        device: Any = None,
        *,
        namespace: Mapping[str, Any] | None = None,
        budget: int | str | None = None,
        previous: CellReport | None = None,
        registry: LiveStorages | None = None,
        record_sites: bool = True,
        cell: int | None = None,
        source: str = "",
        cell_files: Mapping[str, int] | None = None,
        backend: str = "auto",
    ) -> None:
        self.device = cuda.resolve_device(device)
        self.namespace = namespace
        self.budget = parse_size(budget) if budget is not None else None
        self.previous = previous
        # None: chosen when the block starts (see _default_registry)
        self.registry: LiveStorages = registry  # type: ignore[assignment]
        self.record_sites = record_sites
        self.cell = cell
        self.source = source
        self.cell_files = cell_files
        self.requested_backend = check_backend(backend)
        self.backend = ""  # the one chosen when the block starts
        self.backend_reason = ""
        self.report: CellReport | None = None
        self._tracker: Tracker | None = None
        self._recorder: AllocatorRecorder | None = None
        self._running = False

    # --- forward to the report once there is one --------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("report",):
            raise AttributeError(name)
        report = self.__dict__.get("report")
        if report is None:
            raise AttributeError(f"{name!r}: the measurement has not finished yet (use it after the with-block)")
        return getattr(report, name)

    def __repr__(self) -> str:
        return repr(self.report) if self.report is not None else "<vram_magic measurement in progress>"

    def __str__(self) -> str:
        return str(self.report) if self.report is not None else repr(self)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        if self.report is None:
            return {"text/plain": repr(self)}
        return self.report._repr_mimebundle_(include, exclude)

    def status(self) -> LiveStatus | None:
        """The block so far (safe to call from another thread while it runs); ``None`` before it starts and
        after it ends. The allocator backend knows its numbers only at the end: ``now``/``peak`` are ``None``."""
        if not self._running:
            return None
        elapsed = time.perf_counter() - self._t0
        tracker = self._tracker
        if tracker is None:
            return LiveStatus(device=self.device, backend=self.backend, elapsed=elapsed, phase="")
        rows = dict(self._before_rows)
        for serial, size in list(tracker.initial_freed.items()):
            cat = self._counted.before_category(serial, tracker)
            rows[cat] = rows.get(cat, 0) - size
        for phase, size in enumerate(list(tracker.phase_bytes)):
            if size:
                cat = LIVE_PHASE_CATEGORY[phase]
                rows[cat] = rows.get(cat, 0) + size
        for size in list(tracker.late.values()):
            rows[UNATTRIBUTED] = rows.get(UNATTRIBUTED, 0) + size
        rows = {k: v for k, v in rows.items() if v > 0}
        phase = PHASE_NAMES[tracker.last_phase]
        if tracker.generating:  # inside generate(): its stage, not the cache updates within each step
            phase = "decode" if tracker.gen_step else "prefill"
        return LiveStatus(device=self.device, backend="tracker", elapsed=elapsed, phase=phase, now=tracker.current,
                          peak=tracker.peak, breakdown=Breakdown.from_rows(rows),
                          step=tracker.gen_step if tracker.generating else 0)

    # --- which backend ---------------------------------------------------------------------------
    def _choose_backend(self) -> tuple[str, str]:
        want = self.requested_backend
        busy = profiler_busy()
        if want == "tracker":
            return "tracker", "asked for"
        if want == "allocator":
            if busy:
                return "tracker", ("the allocator backend was asked for, but a profiler is already recording in this "
                                   "process (PyTorch runs one at a time): measured by the tracker")
            return "allocator", "asked for"
        compiled = compiled_reason(self.namespace, self.source)
        if _dispatch_modes_active():
            if busy:
                return "tracker", ""
            return "allocator", "a dispatch mode of yours was active when the block started"
        if not compiled:
            return "tracker", ""
        if self.budget is not None and self.device == "cpu":
            return "tracker", (f"{compiled}, but a --budget on the CPU is enforced by the tracker, under which "
                               "compiled code runs eagerly: the figures are the eager step's")
        if busy:
            return "tracker", (f"{compiled}, but a profiler is already recording in this process: compiled code "
                               "runs eagerly under the tracker, and the figures are the eager step's")
        if "profile" in self.source:
            return "tracker", (f"{compiled}, but the cell may start PyTorch's profiler, which would end the "
                               "allocator recording: measured by the tracker, under which compiled code runs "
                               "eagerly (use --backend allocator to measure it compiled)")
        return "allocator", compiled

    # --- measuring -------------------------------------------------------------------------------
    def __enter__(self) -> Measurement:
        if self.registry is None:
            self.registry = _default_registry()
        self._stats_before = self._stats()
        self._scan_before = scan = scan_namespace(self.namespace, self.registry)
        self.backend, self.backend_reason = self._choose_backend()
        # the storages of big unchanged containers are counted by their sums (the tracker only: the allocator's
        # replay needs every storage's address)
        groups = [g for g in scan.groups if g.device == self.device] if self.backend == "tracker" else []
        self._counted = counted = Counted(self.registry, self.device, groups, scan)
        # one pass over the rest of what is alive: the split before, who owned what, the backend's starting point
        rows: dict[tuple[str, str], int] = {}
        owner: dict[int, tuple[str, str]] = {}
        initial: dict[int, int] = {}
        category = scan.owner_get()
        for key, entry in counted.individually(groups):
            cat = category(key, UNATTRIBUTED)
            size = entry.size
            rows[cat] = rows.get(cat, 0) + size
            initial[entry.serial] = size
            owner[entry.serial] = cat
        for g in groups:
            rows[g.owner] = rows.get(g.owner, 0) + g.total
        counted.start_serial = self.registry.next_serial()
        self._before_rows = rows
        counted.before_owner = owner
        self._cuda: cuda.CudaCell | None = None
        self._stance: Any = None
        try:
            if self.device.startswith("cuda"):  # counters, history and --budget of the allocator (engine/cuda.py)
                self._cuda = cuda.CudaCell(self.device, budget=self.budget).start()
            if self.backend == "allocator":
                self._initial_addrs = self._addresses(initial)
                self._recorder = AllocatorRecorder(self.device, registry=self.registry)
                self._t0 = time.perf_counter()
                self._recorder.start()
            else:
                self._tracker = Tracker(self.registry, self.device, budget=self.budget,
                                        record_sites=self.record_sites, initial=initial,
                                        grouped=(counted.start_serial, counted.bytes))
                if self.device == "cpu" and "profile" not in self.source:
                    # kernel scratch (scratch.py); a cell that may start PyTorch's profiler keeps it to itself
                    self._tracker.scratch = ScratchRecorder()
                self._stance = eager_while_tracked(self.source)  # compiled code: eagerly, nothing cached
                self._t0 = time.perf_counter()
                self._tracker.__enter__()
        except BaseException:
            self._undo_stance()
            self._undo_cuda()
            raise
        self._running = True
        return self

    def _addresses(self, initial: Mapping[int, int]) -> dict[int, tuple[int, int]]:
        """serial → (address, size) of the storages alive at the start (the allocator reports addresses)."""
        out: dict[int, tuple[int, int]] = {}
        for _, entry in self.registry.live(self.device):
            storage = entry()
            if storage is None or entry.serial not in initial:
                continue
            try:
                addr = int(storage.data_ptr())
            except Exception:
                addr = 0
            out[entry.serial] = (addr, entry.size)
        return out

    def _undo_stance(self) -> None:
        stance, self._stance = self._stance, None
        if stance is not None:
            try:
                stance.__exit__(None, None, None)
            except Exception:
                pass

    def _undo_cuda(self) -> None:
        """Put back the allocator's history and fraction and read its figures (never raises; idempotent)."""
        if self._cuda is not None:
            self._cuda.stop()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Stop recording (always), then build the report. A report that cannot be built is a warning, never
        an error that would replace what the block itself raised or did."""
        self._running = False
        notes: list[str] = []
        tracker = self._tracker
        recorder = self._recorder
        self._tracker = self._recorder = None
        replayed: Replayed | None = None
        self._scratch_events = None
        try:
            if tracker is not None:
                try:
                    tracker.__exit__(exc_type, exc, tb)
                finally:
                    self._undo_stance()
                    if tracker.scratch is not None:
                        self._scratch_events = tracker.scratch.stop()
            elif recorder is not None:
                recording = recorder.stop()
                if not recording.complete:
                    notes.append("PyTorch's profiler was started inside the block and ended the allocator's "
                                 "recording (PyTorch runs one profiler at a time): the peak is the larger of before "
                                 "and after")
                replayed = replay(recording, self._initial_addrs, self.registry.next_serial)
                regions = sorted({n.split(" ##")[0].strip("# ") for n in recording.scopes if "Compiled" in n})
                if regions:
                    notes.append(f"compiled code ran inside the block ({', '.join(regions)})")
        finally:
            wall = time.perf_counter() - self._t0
            self._undo_cuda()
        try:
            self._build(tracker, replayed, notes, wall, exc_type, exc, tb)
        except Exception as err:
            import warnings

            self.report = None
            self.namespace = None
            warnings.warn(f"vram_magic could not build the report of this block: {type(err).__name__}: {err}",
                          RuntimeWarning, stacklevel=2)

    def _build(self, tracker: Tracker | None, replayed: Replayed | None, notes: list[str], wall: float,
               exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        source = tracker if tracker is not None else replayed
        assert source is not None
        if tracker is not None and tracker.scratch is not None:
            notes.extend(self._kernel_scratch(tracker))
        oom_index = (source.oom or {}).get("index", len(source.events))
        is_oom = exc_type is not None and issubclass(exc_type, torch.OutOfMemoryError)
        # Frees caused by the clean-up below still count as this cell's events.
        if tracker is not None:
            self.registry.on_free = tracker.on_free
        try:
            if is_oom and tb is not None:
                release_traceback(tb)
                gc.collect()
            scan_after = scan_namespace(self.namespace, self.registry)
        finally:
            if tracker is not None:
                self.registry.on_free = None
        expanded = self._counted.settle(tracker, scan_after)
        if tracker is not None:
            alive = self._alive_tracked(tracker)
        else:
            assert replayed is not None
            alive = self._alive_replayed(replayed)
        trace = self._trace(source, scan_after, alive, expanded, tracker)
        stats_after = self._stats()
        after = trace.breakdown_at(len(trace.events)) if not trace.truncated else Breakdown.from_rows(
            self._rows(scan_after, source.allocs))
        peak = after if trace.peak_index == len(trace.events) else trace.breakdown_at(trace.peak_index)
        if source.truncated:
            notes.append("history was truncated after 2,000,000 events; the peak split is approximate")
        notes.extend(self._scan_before.notes)
        notes.extend(n for n in scan_after.notes if n not in self._scan_before.notes)
        if self.backend == "allocator":
            notes.append(f"measured at the allocator ({self.backend_reason}): memory is split by phase, not by "
                         "line or module")
        elif self.backend_reason and self.backend_reason != "asked for":
            notes.append(self.backend_reason)
        before_rows = dict(self._before_rows)
        for size in source.late.values():
            before_rows[UNATTRIBUTED] = before_rows.get(UNATTRIBUTED, 0) + size
        before = Breakdown.from_rows(before_rows)
        before, after, peak = self._reconcile(before, after, peak, stats_after, notes)
        base = self.previous.after if self.previous is not None else before
        oom = self._oom_info(source, trace, oom_index, exc, notes) if is_oom else None
        from ..advice import advise

        report = CellReport(
            device=self.device,
            before=before,
            after=after,
            peak=peak,
            delta=after - base,
            cell=self.cell,
            previous=self.previous.cell if self.previous is not None else None,
            wall_time=wall,
            capacity=self.budget if self.budget is not None else cuda.capacity(self.device),
            budget=self.budget,
            stats=stats_after,
            error=None if exc_type is None else f"{exc_type.__name__}: {exc}",
            oom=oom,
            notes=tuple(dict.fromkeys(notes)),
            source=self.source,
            trace=trace,
            backend=self.backend,
        )
        # the report is not shared yet: set its advice in place (dataclasses.replace would build it twice)
        object.__setattr__(report, "advice", tuple(advise(report)))
        self.report = report
        self.namespace = None  # may be a live frame's namespace: hold nothing after the block

    def _kernel_scratch(self, tracker: Tracker) -> list[str]:
        """What the CPU kernels of the block's ops allocated inside themselves, into the tracker's history
        (scratch.py)."""
        recorder = tracker.scratch
        roots, self._scratch_events = self._scratch_events, None
        if recorder.refused:
            return ["kernel scratch inside ops was not measured: another profiler was recording (PyTorch runs one "
                    "at a time)"]
        if not recorder.started or tracker.truncated:  # no timed op ran (or the history is incomplete)
            return []
        if roots is None:
            return ["PyTorch's profiler was started inside the block and ended the recording of kernel scratch: "
                    "the peak counts only the tensors of the ops it times"]
        windows = tracker.windows
        add_scratch(tracker, spikes(window_events(roots, windows), windows, sizes_of(tracker), tracker.events))
        return []

    def _alive_tracked(self, tracker: Tracker) -> dict[int, int]:
        """serial → key of every storage alive now; storages that appeared without passing through dispatch
        (``torch.from_numpy``, compiled kernels) are counted as allocated at the end of the block."""
        allocs, late, start = tracker.allocs, tracker.late, self._counted.start_serial
        alive: dict[int, int] = {}
        for key, entry in self._counted.individually(self._counted.stable):
            serial = entry.serial
            alive[serial] = key
            if serial >= start and serial not in allocs and serial not in late:
                tracker.adopt(entry)
        return alive

    def _alive_replayed(self, rep: Replayed) -> dict[int, int]:
        """The same from the allocator's record: blocks alive at the end are matched to the storages the scan
        found by address."""
        by_addr: dict[int, tuple[int, Any]] = {}
        alive: dict[int, int] = {}
        freed = {-ev for ev in rep.events if ev < 0}
        for key, entry in self.registry.live(self.device):
            if entry.serial in rep.initial:
                if entry.serial not in freed:
                    alive[entry.serial] = key
                continue
            storage = entry()
            try:
                addr = int(storage.data_ptr()) if storage is not None else 0
            except Exception:
                addr = 0
            by_addr.setdefault(addr, (key, entry))
        for serial, addr in rep.addr.items():
            hit = by_addr.pop(addr, None) if addr else None
            if hit is not None:
                alive[serial] = hit[0]
                hit[1].serial = serial  # the storage's entry takes the block's serial: later blocks see it
        for key, entry in by_addr.values():  # found by the scan, never allocated through the allocator
            if entry.serial in rep.allocs or entry.serial in rep.late:
                continue
            rep.allocs[entry.serial] = (entry.size, FORWARD, (), 0)
            rep.events.append(entry.serial)
            rep.current += entry.size
            if rep.current > rep.peak:
                rep.peak = rep.current
                rep.peak_index = len(rep.events)
            alive[entry.serial] = key
        return alive

    def _stats(self) -> DeviceStats | None:
        if self.device.startswith("cuda"):
            return cuda.device_stats(self.device)
        return None

    def _rows(self, scan: Scan, allocs: Mapping[int, tuple[Any, ...]]) -> dict[tuple[str, str], int]:
        rows: dict[tuple[str, str], int] = {}
        for key, entry in self.registry.live(self.device):
            alloc = allocs.get(entry.serial)
            owner = scan.lookup(key)
            cat = owner if owner is not None else PHASE_CATEGORY[alloc[1]] if alloc is not None else UNATTRIBUTED
            rows[cat] = rows.get(cat, 0) + entry.size
        return rows

    def _trace(self, source: Tracker | Replayed, scan_after: Scan, alive: Mapping[int, int],
               expanded: Mapping[int, int], tracker: Tracker | None) -> Trace:
        blocks: dict[int, Block] = {}
        freed = {-ev for ev in source.events if ev < 0}
        base: dict[tuple[str, str], int] = {}
        initial = []
        category = scan_after.owner_get()
        counted = self._counted
        for g in counted.stable:  # alive throughout, counted as a whole
            base[g.owner] = base.get(g.owner, 0) + g.total
        # the storages of the groups that changed, still alive or freed in the block, go one by one
        for start in (source.initial, expanded, counted.grouped_freed(tracker), source.late):
            for serial, size in start.items():
                key = alive.get(serial)
                if key is None or serial in freed:
                    cat = category(key, UNATTRIBUTED) if key is not None else \
                        counted.before_category(serial, tracker)
                    blocks[serial] = Block(serial, size, cat[0], cat[1])
                    initial.append(serial)
                else:  # alive throughout: a constant, summed
                    cat = category(key, UNATTRIBUTED)
                    base[cat] = base.get(cat, 0) + size
        names = {**self._scan_before.module_names, **scan_after.module_names}
        sites = SiteNamer(self.cell_files)
        optimizers = {**self._scan_before.optimizer_names, **scan_after.optimizer_names}
        roles = source.roles
        phase_names = PHASE_NAMES
        unscoped = isinstance(source, Replayed)
        kv_sites = kv_cache_sites(source.allocs, alive, category)
        for serial, (size, phase, site, module) in source.allocs.items():
            key = alive.get(serial)
            cat = category(key) if key is not None else None
            if cat is None:
                role = roles.get(serial)
                if role is not None:
                    label = role[1]
                    cat = (role[0], optimizers.get(label, "optimizer") if isinstance(label, int) else label)
                elif unscoped and phase == FORWARD:
                    cat = UNSCOPED
                elif site and id(site) in kv_sites:
                    cat = KV_SAME_LINE
                else:
                    cat = PHASE_CATEGORY[phase]
            blocks[serial] = Block(serial, size, cat[0], cat[1], sites(site) if site else (), phase_names[phase],
                                   names.get(module, "") if module else "")
        return Trace(self.device, blocks, tuple(initial), source.events, source.peak_index, source.truncated,
                     base=tuple((c, lab, n) for (c, lab), n in base.items()),
                     steps=tuple((i, phase_names[p], n) for i, p, n in getattr(source, "steps", ())))

    def _reconcile(self, before: Breakdown, after: Breakdown, peak: Breakdown, stats: DeviceStats | None,
                   notes: list[str]) -> tuple[Breakdown, Breakdown, Breakdown]:
        """On CUDA, add what the allocator holds beyond the tracked storages (workspaces, kernel scratch, unsplit
        remainders of blocks) to before, after and the peak alike: all three in the allocator's blocks."""
        cell = self._cuda
        if cell is not None:
            notes.extend(cell.notes)
        usage = cell.usage.get(self.device) if cell is not None else None
        if usage is None:  # CUDA not initialised, before the block and after it
            return before, after, peak
        label = "allocator: workspaces, rounding and untracked"
        if usage.before > before.total:
            before = add_other(before, label, usage.before - before.total)
        if usage.after > after.total:
            after = add_other(after, label, usage.after - after.total)
        if usage.peak > peak.total:
            peak = add_other(peak, "allocator: kernel scratch, rounding and untracked", usage.peak - peak.total)
        return before, after, peak

    def _oom_info(self, source: Tracker | Replayed, trace: Trace, index: int,
                  exc: BaseException | None, notes: list[str]) -> OomInfo:
        info = source.oom or {}
        if not info.get("requested") and exc is not None:  # raised by the CUDA allocator itself
            traced = self._cuda.oom_request if self._cuda is not None else None
            requested, note = cuda.oom_requested(str(exc), traced)
            info = {**info, "requested": requested}
            if note:
                notes.append(note)
        live = trace.breakdown_at(index)
        names = source.oom_holders
        holders: dict[str, int] = {}
        for _, label, n in trace.base:
            name = holder_name(label)
            if name:
                holders[name] = holders.get(name, 0) + n
        for serial in trace.alive_at(index):
            b = trace.blocks[serial]
            name = names.get(serial) or holder_name(b.label)
            if name:
                holders[name] = holders.get(name, 0) + b.size
        return OomInfo(
            message=str(exc) if exc is not None else "",
            requested=info.get("requested"),
            capacity=self.budget if self.budget is not None else cuda.capacity(self.device),
            live=live,
            holders=tuple(sorted(holders.items(), key=lambda kv: -kv[1])),
            site=SiteNamer(self.cell_files)(info.get("site", ())),
            phase=PHASE_NAMES[info["phase"]] if "phase" in info else "",
        )


def measure(
    device: Any = None,
    *,
    namespace: Mapping[str, Any] | None = None,
    budget: int | str | None = None,
    previous: CellReport | None = None,
    record_sites: bool = True,
    backend: str = "auto",
) -> Measurement:
    """Measure the memory of a block of code::

        with vram_magic.measure() as m:
            loss = model(x).sum()
        print(m.peak["activations"], m.report)

    ``namespace``: where to look for models, optimizers and tensors to attribute memory to (default: the
    caller's globals and locals). ``budget``: simulated device size (``"48MiB"``); past it the block raises
    ``torch.OutOfMemoryError``. ``previous``: a report to diff against. ``backend``: ``"auto"``,
    ``"tracker"`` or ``"allocator"`` (see the module's docstring); the report's ``backend`` says which measured.

    Blocks may nest (each counts what happens inside it). Between blocks, storages stay known to one
    process-wide weak registry: what an earlier block saw and is still alive counts in the next block's
    ``before`` even where ``namespace`` does not reach it (as "other"), and is not registered again.
    """
    if namespace is None:
        namespace = FrameNamespace(sys._getframe(1))
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, str))):
        raise TypeError(f"budget must be a size like '4GiB' or a number of bytes, not {type(budget).__name__}")
    return Measurement(device, namespace=namespace, budget=budget, previous=previous, record_sites=record_sites,
                       backend=backend)


__all__ = ["BACKENDS", "Measurement", "format_bytes", "measure"]
