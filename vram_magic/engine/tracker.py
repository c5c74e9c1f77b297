"""The live-storage tracker: a ``TorchDispatchMode`` that sees every tensor an op returns.

It counts new storages (allocations) as they appear and frees by weakref callback, so it knows live
bytes, the peak and the order of events — what the CPU allocator does not tell us. It also notes the
phase of each allocation (module forward, backward, optimizer step, plain cell code) and, cheaply, the
user's frames, so allocations that are gone by the end of the cell can still be attributed.

Tools built on it (the estimator's step tracer) pass a :class:`~vram_magic.engine.observer.TrackerObserver`,
which hears of module forwards, new storages and frees, and count storages through the public
:meth:`Tracker.count_new`, :meth:`Tracker.count_late` and :meth:`Tracker.count_free`.
"""

from __future__ import annotations

import sys
from array import array
from typing import Any

import torch

from ..units import format_bytes
from . import generation, op_kinds
from .collectives import DDP_BUCKETS as DDP_BUCKETS
from .collectives import FSDP_ALL_GATHER as FSDP_ALL_GATHER
from .collectives import FSDP_REDUCE_SCATTER, FSDP_UNSHARDED, FSDP_UNSHARDED_GRADS, CollectiveScopes
from .frames import user_site
from .generation import GenerationStages
from .observer import TrackerObserver
from .oom import name_holders
from .op_kinds import (
    ADDMM,
    ALIASING,
    COLLECTIVE,
    COMPILER,
    DECOMPOSE,
    DYNAMO,
    FRESH_IDS,
    LOADED,
    MM,
    RESIZING,
    SCOPE_IN,
    SCRATCH_OP,
    SKIPPING,
    run_decomposed,
)
from .phases import PHASE_NAMES as PHASE_NAMES
from .phases import Phase
from .registry import Entry, LiveStorages, storage_size
from .scratch_ops import HALF, SCRATCH, gemm_copies
from .scratch_ops import now as _now
from .storage_resize import unwatch_resizes, watch_resizes
from .tensors import is_wrapper, storage_parts
from .torch_private import OpOverload as _OpOverload
from .torch_private import TorchDispatchMode, never_compiled
from .torch_private import current_autograd_node as _current_node
from .torch_private import leave_mode_stack as leave_mode_stack

_grad_enabled = torch.is_grad_enabled
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter

# Allocation phases, stored per allocation (phases.py holds them all), under the names they always had here
CELL, FORWARD, BACKWARD, OPTIMIZER, INFERENCE = Phase.CELL, Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER, \
    Phase.INFERENCE
PREFILL, DECODE, KV_UPDATE = Phase.PREFILL, Phase.DECODE, Phase.KV_UPDATE


class Tracker(GenerationStages, CollectiveScopes, TorchDispatchMode):
    """Track allocations on one device while active.

    ``budget``: simulated capacity in bytes; an op whose result would push live memory beyond it raises
    ``torch.OutOfMemoryError``, as a full GPU would. ``observer``: hears of module forwards, new storages and
    frees (see observer.py).
    """

    def __init__(
        self,
        registry: LiveStorages,
        device: str,
        *,
        budget: int | None = None,
        record_sites: bool = True,
        max_events: int = 2_000_000,
        initial: dict[int, int] | None = None,
        observer: TrackerObserver | None = None,
        grouped: tuple[int, int] = (0, 0),
    ) -> None:
        super().__init__()
        self.registry = registry
        self.device = device
        self.budget = budget
        self.record_sites = record_sites
        self.max_events = max_events
        self.observer = observer
        # what the registry calls when a storage is freed while the tracker is active
        self.on_free = self.count_free if observer is None else self._free_observed
        # serial -> size of the storages alive at the start, and of those first seen later as an op's input
        if initial is None:
            initial = {e.serial: e.size for _, e in registry.entries(device)}
        self.initial = initial
        # (first serial of the block, bytes): storages alive at the start that `initial` leaves out, counted as a
        # whole (the big containers of a scan, engine/cell.py); each one freed is named in `grouped_freed`
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
        self._optimizer_depth = 0
        self._modules: list[int] = []  # ids of the modules whose forward is running, innermost last
        # per-op decisions, shared by every tracker of the process (see op_kinds.py)
        self._aliasing = ALIASING
        self._deferring: dict[Any, bool] = {}  # subclass types -> their ops are left to them (see op_kinds.defers)
        self._skipping = SKIPPING
        self._site: tuple[Any, ...] | None = None  # the site of every allocation while it is set
        self._resizing = RESIZING
        self._hooks: list[Any] = []
        self._lookup = registry.get
        # serial -> (category, id of the optimizer) for storages whose role the optimizer step revealed
        self.roles: dict[int, tuple[str, int]] = {}
        self._cpu = device == "cpu"
        self._torch_device = torch.device(device)
        # live bytes allocated during the block, per phase (what a live view reads from another thread), the
        # bytes of the storages alive at the start that were freed since, and the phase of the last allocation
        self.phase_bytes = [0] * len(PHASE_NAMES)
        self.initial_freed: dict[int, int] = {}
        self.last_phase = CELL
        self.collectives_init()  # FSDP's scopes and DDP's own forward (see collectives.py)
        # kernel scratch on the CPU (scratch.py): the recorder of the allocator's events, started by the first timed
        # op, and each timed call's (start, end, events before it, events after it, phase, module)
        self.scratch: Any = None
        self.windows: list[tuple[int, int, int, int, int, int]] = []
        self._stages_init()  # generate() and KV caches (see generation.py)

    # --- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> Tracker:
        self.registry.on_free = self.on_free
        import torch.nn.modules.module as mod
        import torch.optim.optimizer as opt

        self._hooks = [
            opt.register_optimizer_step_pre_hook(self._opt_pre),
            opt.register_optimizer_step_post_hook(self._opt_post),
            mod.register_module_forward_pre_hook(self._mod_pre),
            mod.register_module_forward_hook(self._mod_post, always_call=True),
        ]
        watch_resizes(self)
        generation.watch(self)
        self.watch_ddp()
        try:
            return super().__enter__()
        except BaseException:
            self._remove_hooks()
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            leave_mode_stack(self)
        finally:
            self._remove_hooks()

    def _remove_hooks(self) -> None:
        unwatch_resizes(self)
        generation.unwatch(self)
        for h in self._hooks:
            try:
                h.remove()
            except Exception:
                pass
        self._hooks = []
        if self.registry.on_free == self.on_free:
            self.registry.on_free = None

    def _opt_pre(self, optimizer: Any, *_: Any) -> None:
        self._optimizer_depth += 1
        if self.record_sites and self._optimizer_depth == 1 and not _user_step(optimizer):
            # PyTorch's own step: every allocation it makes has the site of the line that called it
            self._site = user_site(sys._getframe(1))
        # The parameters and the gradients the step reads: remembered as such even if they are freed before the
        # end of the block (zero_grad; a rank's function that returns before its measurement ends).
        for group in optimizer.param_groups:
            for p in group.get("params", ()):
                self._note_role(p, "parameters", optimizer)
                if p.grad is not None:
                    self._note_role(p.grad, "gradients", optimizer)

    def _opt_post(self, optimizer: Any, *_: Any) -> None:
        self._optimizer_depth = max(self._optimizer_depth - 1, 0)
        if not self._optimizer_depth:
            self._site = None
        for state in optimizer.state.values():
            if isinstance(state, dict):
                for v in state.values():
                    if isinstance(v, torch.Tensor):
                        self._note_role(v, "optimizer_state", optimizer)

    def _note_role(self, t: torch.Tensor, category: str, owner: Any) -> None:
        cls = type(t)
        if cls is not _Tensor and cls is not _Parameter and is_wrapper(t):  # a DTensor's shard, a quantized tensor
            for storage, kind in storage_parts(t) or ():
                entry = self._lookup(id(storage))
                if entry is not None:
                    self.roles[entry.serial] = (category, f"{kind} {category.replace('_', ' ')}")
            return
        try:
            entry = self._lookup(id(t.untyped_storage()))
        except (RuntimeError, NotImplementedError):
            return
        if entry is not None:
            self.roles[entry.serial] = (category, id(owner))

    def _mod_pre(self, module: Any, *_: Any) -> None:
        if not self._modules:
            self.root_forward()
        self._modules.append(id(module))
        if self.ddp_open is not None or self.ddp_types:
            self.ddp_module_entered(module)
        if self.observer is not None:
            self.observer.module_entered(module)

    def _mod_post(self, module: Any, *_: Any) -> None:
        if self._modules:
            self._modules.pop()
        if self.ddp_open is not None:
            self.close_ddp()
        if self.observer is not None:
            self.observer.module_exited(module)

    def phase(self) -> int:
        if self._stage:
            return self._stage
        if self._optimizer_depth:
            return OPTIMIZER
        if _current_node() is not None:
            return BACKWARD
        if self._modules:
            return FORWARD if _grad_enabled() else INFERENCE
        return CELL

    # --- events ----------------------------------------------------------------------------------
    def _free_observed(self, entry: Entry) -> None:
        if entry.device == self.device and self.observer.storage_freed(entry):  # type: ignore[union-attr]
            self.count_free(entry)

    def count_free(self, entry: Entry) -> None:
        """``entry``'s storage is freed: counted in the history and the live bytes (once; the registry calls
        :attr:`on_free` when a storage dies, which is this method unless an observer may veto)."""
        if entry.device != self.device:
            return
        record = self.allocs.get(entry.serial)
        if record is None and entry.serial not in self.initial and entry.serial not in self.late:
            if entry.serial >= self.grouped_below:
                # registered during the block but never counted: an empty or memory-sharing torch.tensor (size
                # 0), a storage the end-of-block scan met first. Its free has no allocation in the history to pair
                # with.
                return
            self.grouped_freed[entry.serial] = entry.key
        self.current -= entry.size
        if record is not None:
            self.phase_bytes[record[1]] -= entry.size
            if self.fsdp_scopes and record[1] == BACKWARD and self.scopes[-1][0] is FSDP_REDUCE_SCATTER \
                    and entry.serial < self.scopes[-1][1]:
                # made by backward, dropped by FSDP's reduce-scatter once copied in: a unit's unsharded gradients
                self.roles.setdefault(entry.serial, FSDP_UNSHARDED_GRADS)
            elif self.ddp_open is not None and record[1] == CELL:
                # dropped by DDP's own forward: the buckets its reducer made when DDP was built, now rebuilt
                self.roles.setdefault(entry.serial, DDP_BUCKETS)
        else:
            self.initial_freed[entry.serial] = entry.size
        if len(self.events) < self.max_events:
            self.events.append(-entry.serial)
        else:
            self.truncated = True

    def _resized(self, entry: Entry, size: int) -> None:
        """A storage that changed size: in the history, the old block is freed and a new one allocated."""
        if self.budget is not None and self.current - entry.size + size > self.budget:
            self._raise_oom(size - entry.size)
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
            size = storage.nbytes() if self._cpu else storage_size(storage, self.device)
        if self.budget is not None and self.current + size > self.budget:
            self._raise_oom(size)
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
        """Count a new block (``depth``: frames from here up to the op's caller). :meth:`_see` inlines this
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
        modules = self._modules
        phase = self.phase()
        self.allocs[entry.serial] = (size, phase, site, modules[-1] if modules else 0)
        self.phase_bytes[phase] += size
        self.last_phase = phase
        if self.current > self.peak:
            self.peak = self.current
            self.peak_index = len(self.events)

    def _raise_oom(self, size: int, depth: int = 4) -> None:
        site = user_site(sys._getframe(depth))
        # "index": the events before the failed request — what was alive then, before the exception unwinds
        # the frames that held the cell's temporaries
        self.oom = {"requested": size, "in_use": self.current, "site": site, "phase": self.phase(),
                    "index": len(self.events)}
        name_holders(sys._getframe(depth), self.registry, self.oom_holders)
        msg = (
            f"{self.device} out of memory under the simulated budget: tried to allocate "
            f"{format_bytes(size)}; {format_bytes(self.current)} of the {format_bytes(self.budget or 0)} "
            f"budget already in use ({format_bytes(max((self.budget or 0) - self.current, 0))} free)."
        )
        raise torch.OutOfMemoryError(msg)

    def count_late(self, storage: Any) -> None:
        """A storage alive before the cell that no scan found (seen as an op's input/alias): counted as alive
        from the start."""
        entry = self.registry.add(storage)
        self.late[entry.serial] = entry.size
        self.current += entry.size
        self.peak += entry.size

    def _see(self, t: torch.Tensor, func: Any) -> None:
        # The hot path: runs for every tensor every op returns. Keep it to dict look-ups.
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
                    self._resized(entry, size)
            return
        cls = type(t)
        if cls is not _Tensor and cls is not _Parameter and is_wrapper(t):
            return  # a wrapper subclass (DTensor, quantized tensors): no memory of its own; its parts are counted
        if (not t.is_cpu) if self._cpu else (t.device != self._torch_device):
            self.registry.add(storage)  # another device: known for its own reports, not counted here
            return
        if id(func) in FRESH_IDS:  # torch.tensor, torch.from_numpy: memory made outside dispatch, maybe shared
            entry = self.registry.add(storage)  # size 0 when it shares a live storage's memory
            if entry.size:
                if self.budget is not None and self.current + entry.size > self.budget:
                    self._raise_oom(entry.size, depth=3)
                self._record(entry, depth=3)
                if self.observer is not None:
                    self.observer.storage_counted(entry)
            return
        aliases = self._aliasing.get(id(func))
        if aliases is None:
            aliases = op_kinds.aliases(func)
        if aliases:
            self.count_late(storage)
            return
        # A new storage: count_new and _record, inlined (this runs for every allocation, in between kernels that
        # have evicted the interpreter from the CPU caches: each Python call here costs several times what
        # it costs in a tight loop).
        size = storage.nbytes() if self._cpu else storage_size(storage, self.device)
        if self.budget is not None and self.current + size > self.budget:
            self._raise_oom(size, depth=3)
        entry = self.registry.add_new(storage, id(storage), size, self.device)
        serial = entry.serial
        self.current += size
        events = self.events
        if len(events) < self.max_events:
            events.append(serial)
        else:
            self.truncated = True
        modules = self._modules
        if self._stage:  # self.phase(), inlined
            phase = self._stage
        elif self._optimizer_depth:
            phase = OPTIMIZER
        elif _current_node() is not None:
            phase = BACKWARD
        elif modules:
            phase = FORWARD if _grad_enabled() else INFERENCE
        else:
            phase = CELL
        site = self._site
        if site is None:
            site = user_site(sys._getframe(2)) if self.record_sites else ()
        self.allocs[serial] = (size, phase, site, modules[-1] if modules else 0)
        self.phase_bytes[phase] += size
        self.last_phase = phase
        if self.current > self.peak:
            self.peak = self.current
            self.peak_index = len(events)
        if self.observer is not None:
            self.observer.storage_counted(entry)

    # --- storages resized in place (storage_resize.py) -----------------------------------------------
    def storage_resized(self, storage: Any) -> None:
        """A storage resized by ``UntypedStorage.resize_``, outside dispatch: FSDP frees a unit's unsharded
        parameters so (size 0) after its forward and backward, and allocates them again before the next use."""
        entry = self._lookup(id(storage))
        if entry is None or entry.device != self.device:
            return
        size = storage.nbytes() if self._cpu else storage_size(storage, self.device)
        if size == entry.size:
            return
        fsdp = self.fsdp_scopes > 0
        if fsdp:  # first made by torch.empty inside FSDP's all-gather scope: it is the unit's unsharded parameters
            self.roles[entry.serial] = FSDP_UNSHARDED
        self._resized(entry, size)
        if fsdp:
            self.roles[entry.serial] = FSDP_UNSHARDED

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # PyTorch wraps a mode's __torch_dispatch__ so that torch.compile skips it: that wrapper costs ~1.4 µs
        # on every op and imports torch._dynamo (~2 s) on a session's first measured cell. Without it, a
        # compiled function traced inside a measured cell sees the pass-through branch below instead.
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if types:  # empty for plain tensors and parameters: one truth test per op
            defer = self._deferring.get(types)
            if defer is None:
                defer = op_kinds.defers(types, self._deferring)
            if defer:
                # A wrapper subclass (DTensor, quantized tensors) runs the op on its inner tensors: handing it the
                # op lets those inner ops come back through this mode, so the memory they make is seen when it
                # is made (FSDP2's optimizer state and temporaries), not only at the end of the block.
                return NotImplemented
        # What to do with the op, decided once per op (see op_kinds.skips)
        skip = self._skipping.get(id(func))
        if skip is None:
            skip = op_kinds.skips(func)
        if skip is DECOMPOSE:
            # Under inference_mode, composite ops (linear, cross_entropy) reach the mode whole, and their parts
            # (the log-softmax inside a loss) would allocate out of sight: run their decomposition, with this
            # mode seeing each part (not while torch.compile traces: its graph is its own).
            if not (DYNAMO in LOADED and COMPILER._is_compiling_flag):
                out = run_decomposed(self, func, args, kwargs)
                if out is not NotImplemented:
                    return out
            skip = False
        elif skip is SCRATCH_OP:
            return self._scratch_op(func, args, kwargs)
        # A plain OpOverload's __call__ only forwards to its C++ entry point: calling that directly saves a
        # Python frame per op. Subclasses (torchbind ops) and higher-order operators are called as they are.
        out = (func._op if type(func) is _OpOverload else func)(*args, **(kwargs or {}))
        # In-place ops and views return an input's storage (known, or alive before the block): nothing new.
        if skip:
            if skip is not True:  # a named scope opens or closes, or a collective returned (collectives.py)
                if skip is COLLECTIVE:
                    return self.collective_done(func, args, out)
                (self.scope_entered if skip is SCOPE_IN else self.scope_exited)(args, out)
            return out
        # torch.compile tracing: stay out of its graph
        if DYNAMO in LOADED and COMPILER._is_compiling_flag:  # no tracing without dynamo imported
            return out
        # _see_outputs, inlined: this runs once per op
        if isinstance(out, torch.Tensor):
            self._see(out, func)
        elif isinstance(out, (tuple, list)):
            for o in out:
                if isinstance(o, torch.Tensor):
                    self._see(o, func)
        return out

    def _scratch_op(self, func: Any, args: Any, kwargs: Any) -> Any:
        """An op whose CPU kernel allocates inside itself (scratch_ops.py), on the CPU: an fp32 GEMM's operand
        copies are added at once; any other call is timed, so that the allocator's events inside it are found at
        the end of the block (scratch.py)."""
        recorder = self.scratch
        rule = func is MM or func is ADDMM
        timed = recorder is not None and not (rule and args[0 if func is MM else 1].dtype not in HALF) \
            and recorder.start()
        before = len(self.events)
        t0 = _now() if timed else 0
        out = (func._op if type(func) is _OpOverload else func)(*args, **(kwargs or {}))
        t1 = _now() if timed else 0
        if DYNAMO in LOADED and COMPILER._is_compiling_flag:
            return out
        self._see_outputs(out, func)
        if timed:
            modules = self._modules
            self.windows.append((t0, t1, before, len(self.events), self.phase(), modules[-1] if modules else 0))
        elif rule and self._cpu and isinstance(out, torch.Tensor) and out.is_cpu:
            extra = gemm_copies(func, args, out)
            if extra:
                self._scratch_block(extra, before)
        return out

    def _scratch_block(self, size: int, before: int) -> None:
        """Scratch an op just made and freed: a block allocated and freed at once, after the op's outputs."""
        events = self.events
        if len(events) + 2 > self.max_events:
            self.truncated = True
            return
        serial = self.registry.next_serial()
        last = events[-1] if len(events) > before else 0
        modules = self._modules
        self.allocs[serial] = (size, self.phase(), self.allocs[last][2] if last > 0 and last in self.allocs else (),
                               modules[-1] if modules else 0)
        self.roles[serial] = SCRATCH
        events.append(serial)
        if self.current + size > self.peak:
            self.peak = self.current + size
            self.peak_index = len(events)
        events.append(-serial)

    def _see_outputs(self, out: Any, func: Any) -> None:
        if isinstance(out, torch.Tensor):
            self._see(out, func)
        elif isinstance(out, (tuple, list)):
            for o in out:
                if isinstance(o, torch.Tensor):
                    self._see(o, func)


_user_steps: dict[type, bool] = {}


never_compiled(Tracker.__torch_dispatch__)  # see torch_private.never_compiled


def _user_step(optimizer: Any) -> bool:
    """The optimizer's ``step`` is code of the user's (a class written in the notebook), whose own lines are
    worth naming."""
    cls = type(optimizer)
    hit = _user_steps.get(cls)
    if hit is None:
        from .frames import is_user_code

        step = getattr(cls, "step", None)
        code = getattr(getattr(step, "__wrapped__", step), "__code__", None)
        hit = _user_steps[cls] = code is not None and is_user_code(code)
    return hit
