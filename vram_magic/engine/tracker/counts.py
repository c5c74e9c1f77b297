"""What a tracker counts: the storages alive (their bytes, the peak), the history of allocations and frees with
each allocation's record, and how the tensors an op returns become counted storages.

:class:`StorageCounts` is one of the parts :class:`~vram_magic.engine.tracker.mode.Tracker` is made of, and the
record a measured block is built from (``allocs``, ``events``, ``roles``, ...). Its counting methods are public for
the tools built on the tracker (``count_new``, ``count_late``, ``count_free``, ``adopt``); :meth:`StorageCounts.see_new`
is the hot path, run for every tensor an op returns, with the phase of an allocation (``now.py``) worked out inline.
"""

from __future__ import annotations

import sys
from array import array
from typing import Any

import torch

from ...core.units import format_bytes
from ..phases import PHASE_NAMES, Phase
from ..scan.registry import Entry, LiveStorages, storage_size
from ..tensors import is_wrapper
from ..torch_private import current_autograd_node as _current_node
from ..torch_private import current_graph_task_id as _graph_task
from . import op_kinds
from .frames import user_site
from .now import Now
from .observer import TrackerObserver
from .oom_frames import BudgetOutOfMemoryError, name_holders
from .op_kinds import ALIASING, FRESH_IDS, RESIZING
from .scratch_ops import SCRATCH
from .sites import engine_frame

_grad_enabled = torch.is_grad_enabled
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
LOSS = Phase.LOSS
CELL, FORWARD, BACKWARD, OPTIMIZER, INFERENCE = Phase.CELL, Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER, \
    Phase.INFERENCE


class StorageCounts:
    """The counts of one device's storages while a tracker is active (see the module's docstring). ``now``: where
    the measured code is (written by the step hooks and generate()'s stages); ``collectives``: told of each free
    while one of FSDP's scopes or DDP's own forward is open (set by the tracker)."""

    def __init__(self, registry: LiveStorages, device: str, *, now: Now, budget: int | None = None,
                 record_sites: bool = True, max_events: int = 2_000_000, initial: dict[int, int] | None = None,
                 grouped: tuple[int, int] = (0, 0), observer: TrackerObserver | None = None) -> None:
        self.now = now
        self.observer = observer
        self.collectives: Any = None
        # what the registry calls when a storage is freed while the tracker is active
        self.on_free = self.count_free if observer is None else self._free_observed
        self.registry = registry
        self.device = device
        self.budget = budget
        self.record_sites = record_sites
        self.max_events = max_events
        # serial -> size of the storages alive at the start, and of those first seen later as an op's input
        if initial is None:
            initial = {e.serial: e.size for _, e in registry.entries(device)}
        self.initial = initial
        # (first serial of the block, bytes): storages alive at the start that `initial` leaves out, counted as a
        # whole (the big containers of a scan, measuring/measurement.py); each one freed is named in `grouped_freed`
        self.grouped_below, self.grouped_bytes = grouped
        self.grouped_freed: dict[int, int] = {}  # serial -> key
        self.current = sum(initial.values()) + self.grouped_bytes
        self.late: dict[int, int] = {}
        self.oom_holders: dict[int, str] = {}  # serial -> "x in f" for the locals alive at an OOM
        self.peak = self.current
        self.peak_index = 0
        self.events = array("q")
        self.truncated = False
        # serial -> (size, phase, raw site (see frames.user_site), id of the innermost module whose forward
        # made it, or 0)
        self.allocs: dict[int, tuple[int, int, tuple[Any, ...], int]] = {}
        self.oom: dict[str, Any] | None = None
        # serial -> (category, id of the optimizer) for storages whose role the optimizer step revealed
        self.roles: dict[int, tuple[str, Any]] = {}
        # live bytes allocated during the block, per phase (what a live view reads from another thread), the
        # bytes of the storages alive at the start that were freed since, and the phase of the last allocation
        self.phase_bytes = [0] * len(PHASE_NAMES)
        self.initial_freed: dict[int, int] = {}
        self.last_phase = CELL
        # per-op decisions, shared by every tracker of the process (see op_kinds.py)
        self._aliasing = ALIASING
        self._resizing = RESIZING
        self._lookup = registry.get
        self._add_new = registry.add_new
        self.cpu = device == "cpu"
        self._torch_device = torch.device(device)
        self._task_site: tuple[int, tuple[Any, ...]] = (-2, ())  # (graph task, the site of its backward() call)

    # --- frees, resizes, storages met late ----------------------------------------------------------
    def _free_observed(self, entry: Entry) -> None:
        if entry.device == self.device and self.observer.storage_freed(entry):  # type: ignore[union-attr]
            self.count_free(entry)

    def count_free(self, entry: Entry) -> None:
        """``entry``'s storage is freed: counted in the history and the live bytes (once; the registry calls
        :attr:`on_free` when a storage dies, which is this method unless an observer may veto)."""
        if entry.device != self.device:
            return
        serial, size = entry.serial, entry.size
        record = self.allocs.get(serial)
        if record is None and serial not in self.initial and serial not in self.late:
            if serial >= self.grouped_below:
                # registered during the block but never counted: an empty or memory-sharing torch.tensor (size
                # 0), a storage the end-of-block scan met first. Its free has no allocation in the history to pair
                # with.
                return
            self.grouped_freed[serial] = entry.key
        self.current -= size
        if record is not None:
            phase = record[1]
            self.phase_bytes[phase] -= size
            collectives = self.collectives
            if collectives is not None and (collectives.fsdp_scopes or collectives.ddp_open is not None):
                collectives.freed(serial, phase)
        else:
            self.initial_freed[serial] = size
        events = self.events
        if len(events) < self.max_events:
            events.append(-serial)
        else:
            self.truncated = True

    def resized(self, entry: Entry, size: int) -> None:
        """A storage that changed size: in the history, the old block is freed and a new one allocated."""
        if self.budget is not None and self.current - entry.size + size > self.budget:
            self.raise_oom(size - entry.size)
        self.on_free(entry)
        entry.serial = self.registry.next_serial()
        entry.size = size
        self.registry.resizes += 1
        self._record(entry)

    def count_new(self, storage: Any, size: int | None = None) -> Entry:
        """A storage an op just returned, new memory: counted as allocated now (its phase, module and site noted,
        the observer told). ``size``: its bytes, where the tracker's device would not give them (fake tensors);
        raises ``torch.OutOfMemoryError`` past the budget."""
        if size is None:
            size = storage.nbytes() if self.cpu else storage_size(storage, self.device)
        if self.budget is not None and self.current + size > self.budget:
            self.raise_oom(size)
        entry = self.registry.add_new(storage, id(storage), size, self.device)
        self._record(entry)
        if self.observer is not None:
            self.observer.storage_counted(entry)
        return entry

    def adopt(self, entry: Entry) -> None:
        """A storage that appeared without passing through dispatch (``torch.from_numpy``, ``torch.load``,
        compiled kernels): counted as allocated when it was first seen, at the end of the cell."""
        self.current += entry.size
        if len(self.events) < self.max_events:
            self.events.append(entry.serial)
        self.allocs[entry.serial] = (entry.size, CELL, (), 0)
        self.phase_bytes[CELL] += entry.size
        if self.current > self.peak:
            self.peak = self.current
            self.peak_index = len(self.events)

    def _record(self, entry: Entry, depth: int = 4) -> None:
        """Count a new block (``depth``: frames from here up to the op's caller). :meth:`see_new` inlines this
        for the common case; keep the two alike."""
        size = entry.size
        self.current += size
        if len(self.events) < self.max_events:
            self.events.append(entry.serial)
        else:
            self.truncated = True
        site: tuple[Any, ...] = ()
        if self.record_sites:
            site = user_site(sys._getframe(depth))  # one tuple per distinct site
        modules = self.now.modules
        phase = self.now.phase()
        self.allocs[entry.serial] = (size, phase, site, modules[-1] if modules else 0)
        self.phase_bytes[phase] += size
        self.last_phase = phase
        if self.current > self.peak:
            self.peak = self.current
            self.peak_index = len(self.events)

    def raise_oom(self, size: int, depth: int = 4) -> None:
        site = user_site(sys._getframe(depth))
        # "index": the events before the failed request — what was alive then, before the exception unwinds
        # the frames that held the cell's temporaries
        self.oom = {"requested": size, "in_use": self.current, "site": site, "phase": self.now.phase(),
                    "index": len(self.events)}
        name_holders(sys._getframe(depth), self.registry, self.oom_holders)
        msg = (
            f"{self.device} out of memory under the simulated budget: tried to allocate "
            f"{format_bytes(size)}; {format_bytes(self.current)} of the {format_bytes(self.budget or 0)} "
            f"budget already in use ({format_bytes(max((self.budget or 0) - self.current, 0))} free)."
        )
        raise BudgetOutOfMemoryError(msg)

    def count_late(self, storage: Any) -> None:
        """A storage alive before the cell that no scan found (seen as an op's input/alias): counted as alive
        from the start."""
        entry = self.registry.add(storage)
        self.late[entry.serial] = entry.size
        self.current += entry.size
        self.peak += entry.size

    # --- what an op returned ----------------------------------------------------------------------------
    def see(self, t: torch.Tensor, func: Any) -> None:
        """A tensor an op returned, whatever the op (op_kinds.SEEN, the scratch ops): a known storage the op can grow
        (``out=``, ``resize_``, ``set_``) is counted at its new size; memory made outside dispatch (``torch.tensor``,
        ``torch.from_numpy``) as new where it is not shared; an unknown storage of an op that returns views as alive
        from the start; anything else as :meth:`see_new` does."""
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested and other storage-less tensors
            return
        entry = self._lookup(id(storage))
        if entry is not None:
            resizes = self._resizing.get(id(func))
            if resizes is None:
                resizes = op_kinds.resizes(func)
            if resizes and entry.device == self.device:  # out=, resize_, set_ can grow it
                size = storage_size(storage, entry.device)
                if entry.size != size:
                    self.resized(entry, size)
            return
        fresh = id(func) in FRESH_IDS  # torch.tensor, torch.from_numpy: memory made outside dispatch, maybe shared
        aliases = False if fresh else self._aliasing.get(id(func))
        if aliases is None:
            aliases = op_kinds.aliases(func)
        if not (fresh or aliases):
            self.see_new(t)
            return
        cls = type(t)
        if cls is not _Tensor and cls is not _Parameter and is_wrapper(t):
            return  # a wrapper subclass (DTensor, quantized tensors): no memory of its own; its parts are counted
        if (not t.is_cpu) if self.cpu else (t.device != self._torch_device):
            self.registry.add(storage)  # another device: known for its own reports, not counted here
        elif aliases:
            self.count_late(storage)
        else:
            entry = self.registry.add(storage)  # size 0 when it shares a live storage's memory
            if entry.size:
                if self.budget is not None and self.current + entry.size > self.budget:
                    self.raise_oom(entry.size, depth=3)
                self._record(entry, depth=3)
                if self.observer is not None:
                    self.observer.storage_counted(entry)

    def see_new(self, t: torch.Tensor, depth: int = 2) -> None:
        """A tensor an op returned whose storage, if not known, is new memory made now (most ops: op_kinds.skips
        says ``False``). The hot path: ``count_new`` and ``_record`` inlined (this runs for every allocation, in
        between kernels that have evicted the interpreter from the CPU caches: each Python call here costs several
        times what it costs in a tight loop)."""
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested and other storage-less tensors
            return
        key = id(storage)
        if self._lookup(key) is not None:
            return
        cls = type(t)
        if cls is not _Tensor and cls is not _Parameter and is_wrapper(t):
            return  # a wrapper subclass (DTensor, quantized tensors): no memory of its own; its parts are counted
        if (not t.is_cpu) if self.cpu else (t.device != self._torch_device):
            self.registry.add(storage)  # another device: known for its own reports, not counted here
            return
        size = storage.nbytes() if self.cpu else storage_size(storage, self.device)
        current = self.current + size
        if self.budget is not None and current > self.budget:
            self.raise_oom(size, depth=3)
        entry = self._add_new(storage, key, size, self.device)
        serial = entry.serial
        self.current = current
        events = self.events
        if len(events) < self.max_events:
            events.append(serial)
        else:
            self.truncated = True
        now = self.now
        modules = now.modules
        if now.stage:  # now.phase(), inlined
            phase = now.stage
        elif now.optimizer_depth:
            phase = OPTIMIZER
        elif _current_node() is not None:
            phase, now.loss = BACKWARD, False
        elif modules:
            phase = FORWARD if _grad_enabled() else INFERENCE
        else:
            phase = LOSS if now.loss and _grad_enabled() else CELL
        site = now.site
        if site is None:
            if not self.record_sites:
                site = ()
            elif phase == BACKWARD:  # one walk per backward() call where the engine runs the op (sites.py)
                frame = sys._getframe(depth)
                if engine_frame(frame):
                    task = _graph_task()
                    if self._task_site[0] != task:
                        self._task_site = (task, user_site(frame))
                    site = self._task_site[1]
                else:
                    site = user_site(frame)
            else:
                site = user_site(sys._getframe(depth))
        self.allocs[serial] = (size, phase, site, modules[-1] if modules else 0)
        self.phase_bytes[phase] += size
        self.last_phase = phase
        if current > self.peak:
            self.peak = current
            self.peak_index = len(events)
        if self.observer is not None:
            self.observer.storage_counted(entry)

    def see_outputs(self, out: Any, func: Any) -> None:
        if isinstance(out, torch.Tensor):  # on the per-op path: no tuple made, no call more
            self.see(out, func)
            return
        for o in out if isinstance(out, (tuple, list)) else ():
            if isinstance(o, torch.Tensor):
                self.see(o, func)

    def scratch_block(self, size: int, before: int) -> None:
        """Scratch an op just made and freed: a block allocated and freed at once, after the op's outputs
        (``before``: the events before the op)."""
        events = self.events
        if len(events) + 2 > self.max_events:
            self.truncated = True
            return
        serial = self.registry.next_serial()
        last = events[-1] if len(events) > before else 0
        self.allocs[serial] = (size, self.now.phase(), self.allocs[last][2] if last > 0 and last in self.allocs else (),
                               self.now.module())
        self.roles[serial] = SCRATCH
        events.append(serial)
        if self.current + size > self.peak:
            self.peak = self.current + size
            self.peak_index = len(events)
        events.append(-serial)


__all__ = ["StorageCounts"]
