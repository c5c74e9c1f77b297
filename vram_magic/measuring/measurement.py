"""``measure()``: the context manager that turns a block of code into a :class:`CellReport`.

Two backends record what happens inside the block (see README, "How it measures"):

* ``tracker`` — a dispatch mode that sees every tensor each op returns: the phase, module and line of every
  allocation, and a simulated budget enforced on the CPU; compiled code runs eagerly under it.
* ``allocator`` — the profiler's record of the allocator's own allocations and frees: compiled code runs as
  compiled and kernel scratch is seen; phases come from the profiler's scopes, lines and modules are not known.

``auto`` (the default) takes the tracker unless the block runs compiled code, or a dispatch mode of the user's
is active when it starts (``backend.py``). This module starts and stops the recording; the report is built
from what it left by ``record.py`` (with the trace from ``cell_trace.py``).
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import torch

from ..core.breakdown import Breakdown
from ..core.units import format_bytes, parse_size
from ..engine.cuda import device as cuda
from ..engine.hooks.compiled import eager_while_tracked
from ..engine.host.sampler import HostSampler
from ..engine.profiler.kernel_scratch import ScratchRecorder
from ..engine.profiler.recorder import AllocatorRecorder, ReplayedBlock, replay
from ..engine.scan.attribution import Scan, scan_namespace
from ..engine.scan.categories import LIVE_PHASE_CATEGORY, UNATTRIBUTED
from ..engine.scan.frame_namespace import FrameNamespace
from ..engine.scan.registry import LiveStorages
from ..engine.scan.summed import Counted
from ..engine.tracker.mode import PHASE_NAMES, Tracker
from ..engine.tracker.oom_frames import release_traceback
from .backend import BACKENDS, check_backend, choose_backend
from .live_status import LiveStatus
from .record import BlockEnd, BlockStart, build_report
from .report import CellReport

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
        backend: str = "auto",
        host: bool = True,
    ) -> None:
        self.device = cuda.resolve_device(device)
        self.host = host
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
        self._host: HostSampler | None = None
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
        counts, generation = tracker.counts, tracker.generation
        rows = dict(self._before_rows)
        for serial, size in list(counts.initial_freed.items()):
            cat = self._counted.before_category(serial, counts)
            rows[cat] = rows.get(cat, 0) - size
        for phase, size in enumerate(list(counts.phase_bytes)):
            if size:
                cat = LIVE_PHASE_CATEGORY[phase]
                rows[cat] = rows.get(cat, 0) + size
        for size in list(counts.late.values()):
            rows[UNATTRIBUTED] = rows.get(UNATTRIBUTED, 0) + size
        rows = {k: v for k, v in rows.items() if v > 0}
        phase = PHASE_NAMES[counts.last_phase]
        if generation.generating:  # inside generate(): its stage, not the cache updates within each step
            phase = "decode" if generation.gen_step else "prefill"
        return LiveStatus(device=self.device, backend="tracker", elapsed=elapsed, phase=phase, now=counts.current,
                          peak=counts.peak, breakdown=Breakdown.from_rows(rows),
                          step=generation.gen_step if generation.generating else 0)

    # --- measuring -------------------------------------------------------------------------------
    def __enter__(self) -> Measurement:
        if self.registry is None:
            self.registry = _default_registry()
        self._scan_before = scan = scan_namespace(self.namespace, self.registry)
        self.backend, self.backend_reason = choose_backend(self.requested_backend, namespace=self.namespace,
                                                           source=self.source, budget=self.budget,
                                                           device=self.device)
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
        self._host = HostSampler().start() if self.host else None
        counted.before_owner = owner
        self._cuda: cuda.CudaCell | None = None
        self._stance: Any = None
        try:
            if self.device.startswith("cuda"):  # counters, history and --budget of the allocator
                                                # (engine/cuda/device.py)
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
                self._tracker.hooks.experts = scan.expert_params  # MoE experts' gradients and state keep their mark
                if self.device == "cpu" and "profile" not in self.source:
                    # kernel scratch (engine/profiler/kernel_scratch.py); a cell that may start PyTorch's profiler
                    # keeps it to itself
                    self._tracker.scratch.recorder = ScratchRecorder()
                self._stance = eager_while_tracked(self.source)  # compiled code: eagerly, nothing cached
                self._t0 = time.perf_counter()
                self._tracker.__enter__()
        except BaseException:
            self._undo_stance()
            self._undo_cuda()
            if self._host is not None:
                self._host.stop()
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
        an error that would replace what the block itself raised or did.

        After an out-of-memory error the traceback's frames are released (and collected) before anything is read:
        their frees are the block's own, the namespace scan no longer finds what they held, and the CUDA
        allocator's counters and history, read last, agree with both."""
        self._running = False
        tracker = self._tracker
        recorder = self._recorder
        self._tracker = self._recorder = None
        oom_tb = tb if exc_type is not None and issubclass(exc_type, torch.OutOfMemoryError) else None
        end: BlockEnd | Exception | None = None
        notes: list[str] = []
        replayed: ReplayedBlock | None = None
        roots = None
        try:
            if tracker is not None:
                try:
                    tracker.__exit__(exc_type, exc, tb)
                finally:
                    self._undo_stance()
                    if tracker.scratch.recorder is not None:
                        roots = tracker.scratch.recorder.stop()
            elif recorder is not None:
                if oom_tb is not None:  # while the allocator is still recorded: the frames' frees are in it
                    self._release(oom_tb)
                    oom_tb = None
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
            try:
                host, self._host = (self._host.stop() if self._host is not None else None), None
                end = BlockEnd(self._settle(tracker, oom_tb), wall, exc_type, exc, tracker, replayed, roots,
                               self._cuda, notes, host)
            except Exception as err:
                end = err
            self._undo_cuda()  # read last: after the frames' frees
        try:
            if isinstance(end, Exception):
                raise end
            assert end is not None
            self.report = build_report(self, BlockStart(self.registry, self._scan_before, self._counted,
                                                        self._before_rows), end)
        except Exception as err:
            import warnings

            self.report = None
            warnings.warn(f"vram_magic could not build the report of this block: {type(err).__name__}: {err}",
                          RuntimeWarning, stacklevel=2)
        finally:
            self.namespace = None  # may be a live frame's namespace: hold nothing after the block

    @staticmethod
    def _release(tb: TracebackType) -> None:
        """Free what the frames of a failed block held, as a real out-of-memory error leaves it
        (``engine/tracker/oom_frames.py``)."""
        release_traceback(tb)
        gc.collect()

    def _settle(self, tracker: Tracker | None, oom_tb: TracebackType | None) -> Scan:
        """Release an out-of-memory traceback's frames (their frees still count as the block's: the tracker hears
        them) and scan the namespace after the block."""
        if tracker is not None:
            self.registry.on_free = tracker.counts.on_free
        try:
            if oom_tb is not None:
                self._release(oom_tb)
            return scan_namespace(self.namespace, self.registry)
        finally:
            if tracker is not None:
                self.registry.on_free = None


def measure(
    device: Any = None,
    *,
    namespace: Mapping[str, Any] | None = None,
    budget: int | str | None = None,
    previous: CellReport | None = None,
    record_sites: bool = True,
    backend: str = "auto",
    host: bool = True,
) -> Measurement:
    """Measure the memory of a block of code::

        with vram_magic.measure() as m:
            loss = model(x).sum()
        print(m.peak["activations"], m.report)

    ``namespace``: where to look for models, optimizers and tensors to attribute memory to (default: the
    caller's globals and locals). ``budget``: simulated device size (``"48MiB"``); past it the block raises
    ``torch.OutOfMemoryError``. ``previous``: a report to diff against. ``backend``: ``"auto"``,
    ``"tracker"`` or ``"allocator"`` (see the module's docstring); the report's ``backend`` says which measured.
    ``host``: also sample the resident memory of this process and its children while the block runs
    (``report.host``; Linux's ``/proc``).

    Blocks may nest (each counts what happens inside it). Between blocks, storages stay known to one
    process-wide weak registry: what an earlier block saw and is still alive counts in the next block's
    ``before`` even where ``namespace`` does not reach it (as "other"), and is not registered again.
    """
    if namespace is None:
        namespace = FrameNamespace(sys._getframe(1))
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, str))):
        raise TypeError(f"budget must be a size like '4GiB' or a number of bytes, not {type(budget).__name__}")
    return Measurement(device, namespace=namespace, budget=budget, previous=previous, record_sites=record_sites,
                       backend=backend, host=host)


__all__ = ["BACKENDS", "Measurement", "format_bytes", "measure"]
