"""``measure()``: the context manager that turns a block of code into a :class:`CellReport`."""

from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import torch

from ..report import Breakdown, CellReport, DeviceStats, LiveStatus, OomInfo
from ..trace import Block, Trace
from ..units import format_bytes, parse_size
from . import cuda
from .attribution import Scan, scan_namespace
from .frames import is_user_code, resolve_site
from .registry import LiveStorages
from .tracker import BACKWARD, CELL, FORWARD, INFERENCE, OPTIMIZER, PHASE_NAMES, Tracker

_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What an allocation freed before the cell ended counts as, by the phase it was made in.
PHASE_CATEGORY = {
    FORWARD: ("activations", "forward intermediates"),
    INFERENCE: ("activations", "forward intermediates (no grad)"),
    # gradients of activations flowing through backward: they scale with the batch like activations do
    BACKWARD: ("activations", "activation gradients (backward)"),
    OPTIMIZER: ("other", "optimizer temporaries"),
    CELL: ("other", "temporaries"),
}

# While the block runs: what memory made in each phase counts as in the live view (before the end-of-block scan
# tells which of it became gradients or optimizer state).
LIVE_PHASE_CATEGORY = {
    FORWARD: ("activations", "forward intermediates"),
    INFERENCE: ("activations", "forward intermediates (no grad)"),
    BACKWARD: ("activations", "made during backward"),
    OPTIMIZER: ("other", "made by the optimizer step"),
    CELL: ("other", "made by the cell's code"),
}

_shared_registry = LiveStorages()


def _default_registry() -> LiveStorages:
    """The registry of ``measure()`` blocks run outside a session: one for the process, so storages seen by
    an earlier block are not registered again (weakrefs only; entries leave with their storages). A block
    measured inside another gets its own, as the outer one is listening to the shared one."""
    if _shared_registry.on_free is None:
        return _shared_registry
    return LiveStorages()


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
        self.report: CellReport | None = None
        self._tracker: Tracker | None = None

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
        after it ends."""
        tracker = self._tracker
        if tracker is None:
            return None
        elapsed = time.perf_counter() - self._t0
        rows = dict(self._before_rows)
        owner = self._before_owner
        for serial, size in list(tracker.initial_freed.items()):
            cat = owner.get(serial, _UNATTRIBUTED)
            rows[cat] = rows.get(cat, 0) - size
        for phase, size in enumerate(list(tracker.phase_bytes)):
            if size:
                cat = LIVE_PHASE_CATEGORY[phase]
                rows[cat] = rows.get(cat, 0) + size
        for size in list(tracker.late.values()):
            rows[_UNATTRIBUTED] = rows.get(_UNATTRIBUTED, 0) + size
        rows = {k: v for k, v in rows.items() if v > 0}
        return LiveStatus(device=self.device, backend="tracker", elapsed=elapsed,
                          phase=PHASE_NAMES[tracker.last_phase], now=tracker.current, peak=tracker.peak,
                          breakdown=Breakdown.from_rows(rows))

    # --- measuring -------------------------------------------------------------------------------
    def __enter__(self) -> Measurement:
        if self.registry is None:
            self.registry = _default_registry()
        self._stats_before = self._stats()
        self._scan_before = scan = scan_namespace(self.namespace, self.registry)
        # one pass over what is alive: the split before, who owned what, and the tracker's starting point
        rows: dict[tuple[str, str], int] = {}
        owner: dict[int, tuple[str, str]] = {}
        initial: dict[int, int] = {}
        category = scan.owner.get
        for key, entry in self.registry.entries(self.device):
            cat = category(key, _UNATTRIBUTED)
            size = entry.size
            rows[cat] = rows.get(cat, 0) + size
            initial[entry.serial] = size
            owner[entry.serial] = cat
        self._before_rows, self._before_owner = rows, owner
        self._history = None
        self._fraction = None
        if self.device.startswith("cuda"):
            if self.record_sites:
                self._history = cuda.History(self.device).start()
            if self.budget is not None:  # the allocator itself stops at the budget, as a smaller GPU would
                self._fraction = cuda.Fraction(self.device, self.budget).__enter__()
        self._tracker = Tracker(self.registry, self.device, budget=self.budget, record_sites=self.record_sites,
                                initial=initial)
        self._t0 = time.perf_counter()
        self._tracker.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        tracker = self._tracker
        assert tracker is not None
        tracker.__exit__(exc_type, exc, tb)
        wall = time.perf_counter() - self._t0
        if self._fraction is not None:
            self._fraction.__exit__()
        self._history_peak = None
        if self._history is not None:
            self._history_peak = self._history.cell_peak(self._history.stop())
        oom_index = len(tracker.events)
        notes: list[str] = []
        is_oom = exc_type is not None and issubclass(exc_type, torch.OutOfMemoryError)
        # Frees caused by the clean-up below still count as this cell's events.
        self.registry.on_free = tracker._freed
        try:
            if is_oom and tb is not None:
                release_traceback(tb)
                gc.collect()
            scan_after = scan_namespace(self.namespace, self.registry)
        finally:
            self.registry.on_free = None
        allocs, initial, late = tracker.allocs, tracker.initial, tracker.late
        alive: dict[int, int] = {}  # serial -> key of every storage alive now
        for key, entry in self.registry.entries(self.device):
            serial = entry.serial
            alive[serial] = key
            if serial not in initial and serial not in allocs and serial not in late:
                tracker.adopt(entry)
        stats_after = self._stats()
        trace = self._trace(tracker, scan_after, alive)
        after = trace.breakdown_at(len(trace.events)) if not trace.truncated else Breakdown.from_rows(
            self._rows(scan_after, tracker.allocs))
        peak = after if trace.peak_index == len(trace.events) else trace.breakdown_at(trace.peak_index)
        if tracker.truncated:
            notes.append("history was truncated after 2,000,000 events; the peak split is approximate")
        before_rows = dict(self._before_rows)
        for size in tracker.late.values():
            before_rows[("other", "unattributed")] = before_rows.get(("other", "unattributed"), 0) + size
        before = Breakdown.from_rows(before_rows)
        after, peak = self._reconcile(after, peak, stats_after, notes)
        base = self.previous.after if self.previous is not None else before
        oom = self._oom_info(tracker, trace, oom_index, exc) if is_oom else None
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
            notes=tuple(notes),
            source=self.source,
            trace=trace,
        )
        # the report is not shared yet: set its advice in place (dataclasses.replace would build it twice)
        object.__setattr__(report, "advice", tuple(advise(report)))
        self.report = report
        self._tracker = None
        self.namespace = None  # may be a live frame's namespace: hold nothing after the block

    def _stats(self) -> DeviceStats | None:
        if self.device.startswith("cuda"):
            return cuda.device_stats(self.device)
        return None

    def _rows(self, scan: Scan, allocs: Mapping[int, tuple[Any, ...]]) -> dict[tuple[str, str], int]:
        rows: dict[tuple[str, str], int] = {}
        for key, entry in self.registry.entries(self.device):
            alloc = allocs.get(entry.serial)
            cat = _category(scan, key, alloc[1] if alloc is not None else None)
            rows[cat] = rows.get(cat, 0) + entry.size
        return rows

    def _trace(self, tracker: Tracker, scan_after: Scan, alive: Mapping[int, int]) -> Trace:
        blocks: dict[int, Block] = {}
        freed = {-ev for ev in tracker.events if ev < 0}
        base: dict[tuple[str, str], int] = {}
        initial = []
        category = scan_after.owner.get
        for start in (tracker.initial, tracker.late):
            for serial, size in start.items():
                key = alive.get(serial)
                if key is None or serial in freed:
                    cat = category(key, _UNATTRIBUTED) if key is not None else \
                        self._before_owner.get(serial, _UNATTRIBUTED)
                    blocks[serial] = Block(serial, size, cat[0], cat[1])
                    initial.append(serial)
                else:  # alive throughout: a constant, summed
                    cat = category(key, _UNATTRIBUTED)
                    base[cat] = base.get(cat, 0) + size
        names = {**self._scan_before.module_names, **scan_after.module_names}
        sites = _SiteNamer(self.cell_files)
        optimizers = {**self._scan_before.optimizer_names, **scan_after.optimizer_names}
        roles = tracker.roles
        phase_names = PHASE_NAMES
        for serial, (size, phase, site, module) in tracker.allocs.items():
            key = alive.get(serial)
            cat = category(key) if key is not None else None
            if cat is None:
                if key is None and serial in roles:  # freed in the cell, but the optimizer step saw what it was
                    role, owner = roles[serial]
                    cat = (role, optimizers.get(owner, "optimizer"))
                else:
                    cat = PHASE_CATEGORY[phase]
            blocks[serial] = Block(serial, size, cat[0], cat[1], sites(site) if site else (), phase_names[phase],
                                   names.get(module, "") if module else "")
        return Trace(self.device, blocks, tuple(initial), tracker.events, tracker.peak_index, tracker.truncated,
                     base=tuple((c, lab, n) for (c, lab), n in base.items()))

    def _reconcile(self, after: Breakdown, peak: Breakdown, stats: DeviceStats | None,
                   notes: list[str]) -> tuple[Breakdown, Breakdown]:
        """On CUDA, add what the allocator holds beyond the tracked storages (workspaces, scratch)."""
        if stats is None:
            return after, peak
        extra = stats.allocated - after.total
        if extra > 0:
            after = _add_other(after, "allocator: workspaces and untracked", extra)
        alloc_peak = self._history_peak
        if alloc_peak is None:
            alloc_peak = cuda.peak_if_risen(self._stats_before, stats)
        if alloc_peak is not None and alloc_peak > peak.total:
            peak = _add_other(peak, "allocator: kernel scratch and untracked", alloc_peak - peak.total)
        elif alloc_peak is None:
            notes.append("without the allocator's history (--no-trace) and with the global peak not rising in "
                         "this cell, the cell's peak is the tracked one; max_memory_allocated was left untouched")
        return after, peak

    def _oom_info(self, tracker: Tracker, trace: Trace, index: int, exc: BaseException | None) -> OomInfo:
        info = tracker.oom or {}
        if not info and exc is not None:  # raised by the CUDA allocator itself, not by the tracker's budget
            info = {"requested": cuda.requested_bytes(str(exc))}
        live = trace.breakdown_at(index)
        names = tracker.oom_holders
        holders: dict[str, int] = {}
        for _, label, n in trace.base:
            name = _holder_name(label)
            if name:
                holders[name] = holders.get(name, 0) + n
        for serial in trace.alive_at(index):
            b = trace.blocks[serial]
            name = names.get(serial) or _holder_name(b.label)
            if name:
                holders[name] = holders.get(name, 0) + b.size
        return OomInfo(
            message=str(exc) if exc is not None else "",
            requested=info.get("requested"),
            capacity=self.budget if self.budget is not None else cuda.capacity(self.device),
            live=live,
            holders=tuple(sorted(holders.items(), key=lambda kv: -kv[1])),
            site=_SiteNamer(self.cell_files)(info.get("site", ())),
            phase=PHASE_NAMES[info["phase"]] if "phase" in info else "",
        )


_UNATTRIBUTED = ("other", "unattributed")
_NOT_VARIABLES = {label for _, label in PHASE_CATEGORY.values()} | {"unattributed", ""}


def _holder_name(label: str) -> str:
    """The variable behind a detail label (``graph held by loss`` → ``loss``); "" for labels that name none."""
    if label in _NOT_VARIABLES or label.startswith(("buffers of ", "output cache ", "held by the graph of ")):
        return ""
    if label.startswith("graph held by "):
        return label[len("graph held by "):]
    return label


class _SiteNamer:
    """Resolves raw sites (``(code, lasti, …)``) to ``(file, line, function)`` frames, once per distinct site,
    and names the files IPython compiles cells into (``/tmp/ipykernel_…/123.py``) as ``<cell N>``."""

    def __init__(self, cell_files: Mapping[str, int] | None) -> None:
        self.cell_files = cell_files or {}
        self.done: dict[int, tuple[tuple[str, int, str], ...]] = {}

    def __call__(self, raw: tuple[Any, ...]) -> tuple[tuple[str, int, str], ...]:
        if not raw:
            return ()
        named = self.done.get(id(raw))
        if named is None:
            files = self.cell_files
            named = tuple((f"<cell {files[f]}>" if f in files else f, line, name)
                          for f, line, name in resolve_site(raw))
            self.done[id(raw)] = named
        return named


def release_traceback(tb: TracebackType) -> None:
    """After an OOM: end the traceback at the user's last frame (as a real CUDA OOM does) and clear the
    locals of the finished frames, which hold the memory that ran out. Our own frames keep theirs."""
    last_user = None
    t: TracebackType | None = tb
    while t is not None:
        if is_user_code(t.tb_frame.f_code):
            last_user = t
        t = t.tb_next
    if last_user is not None and last_user.tb_next is not None:
        rest: TracebackType | None = last_user.tb_next
        last_user.tb_next = None
        while rest is not None:
            try:
                rest.tb_frame.clear()
                rest.tb_frame.f_locals  # noqa: B018
            except RuntimeError:
                pass
            rest = rest.tb_next
    t = tb
    while t is not None:
        if not t.tb_frame.f_code.co_filename.startswith(_OWN_DIR):
            try:
                t.tb_frame.clear()
                # A dict made earlier by reading `f_locals` outlives clear(); reading it again empties it.
                t.tb_frame.f_locals  # noqa: B018
            except RuntimeError:  # still executing
                pass
        t = t.tb_next


def _category(scan: Scan, key: int, phase: int | None) -> tuple[str, str]:
    owner = scan.owner.get(key)
    if owner is not None:
        return owner
    if phase is not None:
        return PHASE_CATEGORY[phase]
    return ("other", "unattributed")


def _add_other(b: Breakdown, label: str, n: int) -> Breakdown:
    rows = {(c, lab): v for c, lab, v in b.detail}
    for c in b:
        covered = sum(v for (cc, _), v in rows.items() if cc == c)
        if b[c] - covered:
            rows[(c, "")] = rows.get((c, ""), 0) + b[c] - covered
    rows[("other", label)] = rows.get(("other", label), 0) + n
    return Breakdown.from_rows(rows)


def snapshot(device: str, namespace: Mapping[str, Any] | None,
             registry: LiveStorages) -> tuple[Breakdown, DeviceStats | None]:
    """The memory of ``device`` now, split by category (no tracking: a scan of the namespace)."""
    scan = scan_namespace(namespace, registry)
    rows: dict[tuple[str, str], int] = {}
    for key, entry in registry.entries(device):
        cat = scan.category(key)
        rows[cat] = rows.get(cat, 0) + entry.size
    now = Breakdown.from_rows(rows)
    stats = cuda.device_stats(device) if device.startswith("cuda") else None
    if stats is not None and stats.allocated > now.total:
        now = _add_other(now, "allocator: workspaces and untracked", stats.allocated - now.total)
    return now, stats


class _FrameNamespace(Mapping[str, Any]):
    """The caller's globals and locals, read afresh at each scan (variables made in the block count)."""

    def __init__(self, frame: Any) -> None:
        self._frame = frame

    def _merged(self) -> dict[str, Any]:
        merged = dict(self._frame.f_globals)
        merged.update(self._frame.f_locals)
        return merged

    def __getitem__(self, key: str) -> Any:
        return self._merged()[key]

    def __iter__(self) -> Any:
        return iter(self._merged())

    def __len__(self) -> int:
        return len(self._merged())

    def items(self) -> Any:
        return self._merged().items()


def measure(
    device: Any = None,
    *,
    namespace: Mapping[str, Any] | None = None,
    budget: int | str | None = None,
    previous: CellReport | None = None,
    record_sites: bool = True,
) -> Measurement:
    """Measure the memory of a block of code::

        with vram_magic.measure() as m:
            loss = model(x).sum()
        print(m.peak["activations"], m.report)

    ``namespace``: where to look for models, optimizers and tensors to attribute memory to (default: the
    caller's globals). ``budget``: simulated device size (``"48MiB"``); past it the block raises
    ``torch.OutOfMemoryError``. ``previous``: a report to diff against.

    Blocks may nest (each counts what happens inside it). Between blocks, storages stay known to one
    process-wide weak registry: what an earlier block saw and is still alive counts in the next block's
    ``before`` even where ``namespace`` does not reach it (as "other"), and is not registered again.
    """
    if namespace is None:
        namespace = _FrameNamespace(sys._getframe(1))
    if budget is not None and not isinstance(budget, (int, str)):
        raise TypeError(f"budget must be a size like '4GiB' or a number of bytes, not {type(budget).__name__}")
    return Measurement(device, namespace=namespace, budget=budget, previous=previous, record_sites=record_sites)


__all__ = ["Measurement", "measure", "format_bytes"]
