"""The live-storage tracker: a ``TorchDispatchMode`` that sees every tensor an op returns.

It counts new storages (allocations) as they appear and frees by weakref callback, so it knows live
bytes, the peak and the order of events — what the CPU allocator does not tell us. It also notes the
phase of each allocation (module forward, backward, optimizer step, plain cell code) and, cheaply, the
user's frames, so allocations that are gone by the end of the cell can still be attributed.
"""

from __future__ import annotations

import sys
from array import array
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode, _push_mode

from ..units import format_bytes
from . import generation
from .frames import user_site
from .generation import DECODE as DECODE
from .generation import KV_UPDATE as KV_UPDATE
from .generation import PREFILL as PREFILL
from .generation import GenerationStages
from .registry import Entry, LiveStorages, storage_size
from .scratch_ops import HALF, SCRATCH, gemm_copies, uses_scratch
from .scratch_ops import now as _now
from .tensors import is_wrapper

_is_compiling = getattr(torch.compiler, "is_compiling", lambda: False)


class _CompilingFlag:
    """For a torch without ``torch.compiler._is_compiling_flag``: the same attribute, read through the function."""

    @property
    def _is_compiling_flag(self) -> bool:
        return bool(_is_compiling())


# Read as an attribute on every op: torch.compiler.is_compiling() is a Python call (~1 µs in between kernels)
# that returns this flag, which dynamo holds True while it traces.
_compiler: Any = torch.compiler if hasattr(torch.compiler, "_is_compiling_flag") else _CompilingFlag()
_current_node = torch._C._current_autograd_node
_OpOverload = torch._ops.OpOverload
_loaded = sys.modules
_DYNAMO = "torch._dynamo"
_grad_enabled = torch.is_grad_enabled
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
# `torch.tensor(...)` builds its data outside dispatch and hands it over through lift_fresh, which returns an
# alias: its storage is new memory, made now.
_FRESH = frozenset(op for op in (getattr(torch.ops.aten, "lift_fresh", None),) if op is not None) | frozenset(
    op.default for op in (getattr(torch.ops.aten, "lift_fresh", None),) if op is not None)
_FRESH_IDS = frozenset(map(id, _FRESH))  # looked up by id: hashing an OpOverload runs Python (they live forever)

# PyTorch's named scopes (``torch.profiler.record_function``) pass through dispatch as these two ops; FSDP2 wraps
# its collectives in scopes named ``FSDP::…``, which is how its buffers are told from the model's memory.
_SCOPE_ENTER = getattr(getattr(torch.ops.profiler, "_record_function_enter_new", None), "default", None)
_SCOPE_EXIT = getattr(getattr(torch.ops.profiler, "_record_function_exit", None), "_RecordFunction", None)
FSDP_ALL_GATHER = ("other", "FSDP all-gather buffers")
FSDP_REDUCE_SCATTER = ("other", "FSDP reduce-scatter buffers")
FSDP_UNSHARDED = ("other", "FSDP unsharded parameters (all-gathered)")
FSDP_UNSHARDED_GRADS = ("gradients", "FSDP unsharded gradients (before reduce-scatter)")
DDP_BUCKETS = ("other", "DDP gradient buckets")
_DDP = "torch.nn.parallel.distributed"


def _fsdp_role(scope: str) -> tuple[str, str]:
    return FSDP_REDUCE_SCATTER if "reduce" in scope or "rs_wait" in scope else FSDP_ALL_GATHER


# Allocation phases, stored per allocation.
CELL, FORWARD, BACKWARD, OPTIMIZER, INFERENCE = 0, 1, 2, 3, 4
# PREFILL, DECODE and KV_UPDATE (5, 6, 7: generate()'s prompt and its decode loop, a KV cache's update) are
# generation.py's
PHASE_NAMES = ("cell", "forward", "backward", "optimizer", "inference",  # inference: forward without grad
               "prefill", "decode", "cache update")


class Tracker(GenerationStages, TorchDispatchMode):
    """Track allocations on one device while active.

    ``budget``: simulated capacity in bytes; an op whose result would push live memory beyond it raises
    ``torch.OutOfMemoryError``, as a full GPU would.
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
    ) -> None:
        super().__init__()
        self.registry = registry
        self.device = device
        self.budget = budget
        self.record_sites = record_sites
        self.max_events = max_events
        # serial -> size of the storages alive at the start, and of those first seen later as an op's input
        if initial is None:
            initial = {e.serial: e.size for _, e in registry.entries(device)}
        self.initial = initial
        self.current = sum(initial.values())
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
        # per-op decisions, shared by every tracker of the process (see _decided)
        self._aliasing = _ALIASING
        self._deferring: dict[Any, bool] = {}  # subclass types -> their ops are left to them (see _defers)
        self._skipping = _SKIPPING
        self._site: tuple[Any, ...] | None = None  # the site of every allocation while it is set
        self._resizing = _RESIZING
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
        # named scopes open now, innermost last: (FSDP's role for what is made inside it or None, the serial it
        # started at); scopes close in the order they opened (the handle an exit receives is a new Python object)
        self._scopes: list[tuple[tuple[str, str] | None, int]] = []
        self._fsdp_scopes = 0
        # DistributedDataParallel's own part of its forward (before the wrapped module's): the serial it began at
        self._ddp_types: tuple[type, ...] = ()
        self._ddp_open: int | None = None
        # kernel scratch on the CPU (scratch.py): the recorder of the allocator's events, started by the first timed
        # op, and each timed call's (start, end, events before it, events after it, phase, module)
        self.scratch: Any = None
        self.windows: list[tuple[int, int, int, int, int, int]] = []
        self._stages_init()  # generate() and KV caches (see generation.py)

    # --- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> Tracker:
        self.registry.on_free = self._freed
        import torch.nn.modules.module as mod
        import torch.optim.optimizer as opt

        self._hooks = [
            opt.register_optimizer_step_pre_hook(self._opt_pre),
            opt.register_optimizer_step_post_hook(self._opt_post),
            mod.register_module_forward_pre_hook(self._mod_pre),
            mod.register_module_forward_hook(self._mod_post, always_call=True),
        ]
        _watch_resizes(self)
        generation.watch(self)
        ddp = _loaded.get(_DDP)
        self._ddp_types = (ddp.DistributedDataParallel,) if ddp is not None else ()
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
        _unwatch_resizes(self)
        generation.unwatch(self)
        for h in self._hooks:
            try:
                h.remove()
            except Exception:
                pass
        self._hooks = []
        if self.registry.on_free == self._freed:
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
            from .tensors import storage_parts

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
        if self._ddp_open is not None:  # the wrapped module's forward begins: DDP's own part is over
            self._close_ddp()
        elif self._ddp_types and type(module) in self._ddp_types:
            self._ddp_open = self.registry.next_serial()

    def _mod_post(self, module: Any, *_: Any) -> None:
        if self._modules:
            self._modules.pop()
        if self._ddp_open is not None:
            self._close_ddp()

    def _close_ddp(self) -> None:
        """What DDP allocates before its module's forward is its reducer's gradient buckets (rebuilt, in the
        order gradients arrived, at the second forward)."""
        first, self._ddp_open = self._ddp_open, None
        roles, allocs = self.roles, self.allocs
        for serial in range(first + 1, self.registry.next_serial()):  # type: ignore[operator]
            if serial in allocs:
                roles.setdefault(serial, DDP_BUCKETS)

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
    def _freed(self, entry: Entry) -> None:
        if entry.device != self.device:
            return
        record = self.allocs.get(entry.serial)
        if record is None and entry.serial not in self.initial and entry.serial not in self.late:
            # registered during the block but never counted: an empty or memory-sharing torch.tensor (size 0),
            # a storage the end-of-block scan met first. Its free has no allocation in the history to pair with.
            return
        self.current -= entry.size
        if record is not None:
            self.phase_bytes[record[1]] -= entry.size
            if self._fsdp_scopes and record[1] == BACKWARD and self._scopes[-1][0] is FSDP_REDUCE_SCATTER \
                    and entry.serial < self._scopes[-1][1]:
                # made by backward, dropped by FSDP's reduce-scatter once copied in: a unit's unsharded gradients
                self.roles.setdefault(entry.serial, FSDP_UNSHARDED_GRADS)
            elif self._ddp_open is not None and record[1] == CELL:
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
        self._freed(entry)
        entry.serial = self.registry.next_serial()
        entry.size = size
        self._record(entry)

    def _new(self, storage: Any) -> None:
        size = storage.nbytes() if self._cpu else storage_size(storage, self.device)
        if self.budget is not None and self.current + size > self.budget:
            self._raise_oom(size)
        self._record(self.registry.add_new(storage, id(storage), size, self.device))

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
        self._name_locals(sys._getframe(depth))
        msg = (
            f"{self.device} out of memory under the simulated budget: tried to allocate "
            f"{format_bytes(size)}; {format_bytes(self.current)} of the {format_bytes(self.budget or 0)} "
            f"budget already in use ({format_bytes(max((self.budget or 0) - self.current, 0))} free)."
        )
        raise torch.OutOfMemoryError(msg)

    def _name_locals(self, frame: Any) -> None:
        """Which local variables of the user's frames hold memory at an OOM (names and serials only). Never
        raises: the OOM is what the user must see, whatever their locals hold."""
        from .frames import is_user_code
        from .tensors import storage_parts

        try:
            while frame is not None:
                if is_user_code(frame.f_code):
                    func = frame.f_code.co_name
                    for name, value in list(frame.f_locals.items()):
                        if not issubclass(type(value), torch.Tensor):  # type(), not isinstance: no __class__
                            continue
                        for storage, _ in storage_parts(value) or ():
                            entry = self.registry.get(id(storage))
                            if entry is not None and entry.serial not in self.oom_holders:
                                # module-level code: the variable is a global, named as such
                                label = name if func == "<module>" else f"{name} in {func}()"
                                self.oom_holders[entry.serial] = label
                frame = frame.f_back
        except Exception:
            pass

    def _late(self, storage: Any) -> None:
        """A storage alive before the cell that no scan found (seen as an op's input/alias)."""
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
                resizes = self._resizes(func)
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
        if id(func) in _FRESH_IDS:  # torch.tensor, torch.from_numpy: memory made outside dispatch, maybe shared
            entry = self.registry.add(storage)  # size 0 when it shares a live storage's memory
            if entry.size:
                if self.budget is not None and self.current + entry.size > self.budget:
                    self._raise_oom(entry.size, depth=3)
                self._record(entry, depth=3)
            return
        aliases = self._aliasing.get(id(func))
        if aliases is None:
            aliases = self._aliases(func)
        if aliases:
            self._late(storage)
            return
        # A new storage: _new and _record, inlined (this runs for every allocation, in between kernels that
        # have evicted the interpreter from the CPU caches: each Python call here costs several times what
        # it costs in a tight loop).
        size = storage.nbytes() if self._cpu else storage_size(storage, self.device)
        if self.budget is not None and self.current + size > self.budget:
            self._raise_oom(size, depth=3)
        serial = self.registry.add_new(storage, id(storage), size, self.device).serial
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

    def _resizes(self, func: Any) -> bool:
        hit = self._resizing.get(id(func))
        if hit is None:
            name = getattr(func, "_overloadname", "")
            base = str(getattr(func, "__name__", "")).split(".")[0]
            hit = "out" in name or base in ("resize_", "resize_as_", "set_")
            self._resizing[_decided(func)] = hit
        return hit

    def _skips(self, func: Any) -> Any:
        """Ops whose every output aliases an input and cannot grow its storage (in-place ops, views); the scope
        ops are skipped too, with their handler in place of ``True``; ``_DECOMPOSE`` for an op whose only kernel
        is its decomposition (it reaches a mode whole only under inference_mode)."""
        if func is _SCOPE_ENTER or func is _SCOPE_EXIT:
            hit: Any = _SCOPE_IN if func is _SCOPE_ENTER else _SCOPE_OUT
            self._skipping[_decided(func)] = hit
            return hit
        try:
            returns = func._schema.returns
            hit = bool(returns) and all(r.alias_info is not None for r in returns) and not self._resizes(func) \
                and func not in _FRESH
        except AttributeError:
            hit = False
        if not hit and _is_composite(func):
            hit = _DECOMPOSE
        elif not hit and uses_scratch(func):
            hit = _SCRATCH
        self._skipping[_decided(func)] = hit
        return hit

    def _defers(self, types: Any) -> bool:
        """Ops on these subclasses are left to the subclasses themselves: traceable wrappers, except PyTorch's
        own tracing tensors (fake and functional tensors belong to compilation, which runs unmeasured)."""
        hit = bool(types) and all(getattr(t, "__tensor_flatten__", None) is not None
                                  and not str(getattr(t, "__module__", "")).startswith("torch._subclasses")
                                  for t in types)
        if _DYNAMO in _loaded and _is_compiling():
            return False  # not cached: the same types outside compilation are deferred
        self._deferring[types] = hit
        return hit

    def _aliases(self, func: Any) -> bool:
        hit = self._aliasing.get(id(func))
        if hit is None:
            try:
                hit = any(r.alias_info is not None for r in func._schema.returns) and func not in _FRESH
            except AttributeError:
                hit = False
            self._aliasing[_decided(func)] = hit
        return hit

    # --- FSDP's collectives and storages resized in place ------------------------------------------
    def _scope_enter(self, args: Any, out: Any) -> None:
        name = args[0] if args else None
        if isinstance(name, str) and name.startswith("FSDP::"):
            self._scopes.append((_fsdp_role(name), self.registry.next_serial()))
            self._fsdp_scopes += 1
        else:
            self._scopes.append((None, 0))

    def _scope_exit(self, args: Any, out: Any) -> None:
        if not self._scopes:
            return  # a scope opened before the block began
        role, first = self._scopes.pop()
        if role is None:
            return
        self._fsdp_scopes -= 1
        # what was made inside the scope and is freed before the block ends counts as the collective's buffer
        # (the innermost scope names it; memory still alive at the end is named by the namespace scan)
        roles, allocs = self.roles, self.allocs
        for serial in range(first + 1, self.registry.next_serial()):
            if serial in allocs and serial not in roles:
                roles[serial] = role

    def _storage_resized(self, storage: Any) -> None:
        """A storage resized by ``UntypedStorage.resize_``, outside dispatch: FSDP frees a unit's unsharded
        parameters so (size 0) after its forward and backward, and allocates them again before the next use."""
        entry = self._lookup(id(storage))
        if entry is None or entry.device != self.device:
            return
        size = storage.nbytes() if self._cpu else storage_size(storage, self.device)
        if size == entry.size:
            return
        fsdp = self._fsdp_scopes > 0
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
                defer = self._defers(types)
            if defer:
                # A wrapper subclass (DTensor, quantized tensors) runs the op on its inner tensors: handing it the
                # op lets those inner ops come back through this mode, so the memory they make is seen when it
                # is made (FSDP2's optimizer state and temporaries), not only at the end of the block.
                return NotImplemented
        # What to do with the op, decided once per op (see _skips)
        skip = self._skipping.get(id(func))
        if skip is None:
            skip = self._skips(func)
        if skip is _DECOMPOSE:
            # Under inference_mode, composite ops (linear, cross_entropy) reach the mode whole, and their parts
            # (the log-softmax inside a loss) would allocate out of sight: run their decomposition, with this
            # mode seeing each part (not while torch.compile traces: its graph is its own).
            if not (_DYNAMO in _loaded and _compiler._is_compiling_flag):
                _push_mode(self)
                try:
                    out = func.decompose(*args, **(kwargs or {}))
                finally:
                    _pop_mode()
                if out is not NotImplemented:
                    return out
            skip = False
        elif skip is _SCRATCH:
            return self._scratch_op(func, args, kwargs)
        # A plain OpOverload's __call__ only forwards to its C++ entry point: calling that directly saves a
        # Python frame per op. Subclasses (torchbind ops) and higher-order operators are called as they are.
        out = (func._op if type(func) is _OpOverload else func)(*args, **(kwargs or {}))
        # In-place ops and views return an input's storage (known, or alive before the block): nothing new.
        if skip:
            if skip is not True:  # a named scope opens or closes
                (self._scope_enter if skip is _SCOPE_IN else self._scope_exit)(args, out)
            return out
        # torch.compile tracing: stay out of its graph
        if _DYNAMO in _loaded and _compiler._is_compiling_flag:  # no tracing without dynamo imported
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
        rule = func is _MM or func is _ADDMM
        timed = recorder is not None and not (rule and args[0 if func is _MM else 1].dtype not in HALF) \
            and recorder.start()
        before = len(self.events)
        t0 = _now() if timed else 0
        out = (func._op if type(func) is _OpOverload else func)(*args, **(kwargs or {}))
        t1 = _now() if timed else 0
        if _DYNAMO in _loaded and _compiler._is_compiling_flag:
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


# ``UntypedStorage.resize_`` is a method of the storage object, not an op: dispatch never sees it. While a tracker
# is active it is wrapped (once, whatever the number of trackers) so that each active tracker hears of it.
_resize_watchers: list[Tracker] = []
_resize_original: Any = None


def _resize_(self: Any, size: int) -> Any:
    out = _resize_original(self, size)
    for tracker in list(_resize_watchers):
        try:
            tracker._storage_resized(self)
        except torch.OutOfMemoryError:
            raise
        except Exception:  # a storage we cannot read: its old size stays counted
            pass
    return out


def _watch_resizes(tracker: Tracker) -> None:
    global _resize_original
    if not _resize_watchers:
        _resize_original = torch.UntypedStorage.resize_
        torch.UntypedStorage.resize_ = _resize_  # type: ignore[method-assign]
    _resize_watchers.append(tracker)


def _unwatch_resizes(tracker: Tracker) -> None:
    global _resize_original
    if tracker in _resize_watchers:
        _resize_watchers.remove(tracker)
        if not _resize_watchers:
            if torch.UntypedStorage.__dict__.get("resize_") is _resize_:
                del torch.UntypedStorage.resize_
            _resize_original = None


_user_steps: dict[type, bool] = {}


_DECOMPOSE = object()
_SCRATCH = object()  # what _skips says of an op whose kernel allocates inside itself (scratch_ops.py)
_MM, _ADDMM = torch.ops.aten.mm.default, torch.ops.aten.addmm.default
_SCOPE_IN, _SCOPE_OUT = object(), object()  # what _skips says of the two scope ops

# What each op is, decided once per process and shared by every tracker (a measured block used to decide them
# again for every op it met, at its own cost): id(op) -> the decision. The ops are kept in _DECIDED so that an
# id is never reused by another op (an op defined with torch.library and later destroyed).
_ALIASING: dict[int, bool] = {}
_SKIPPING: dict[int, Any] = {}
_RESIZING: dict[int, bool] = {}
_DECIDED: dict[int, Any] = {}


def _decided(func: Any) -> int:
    """``id(func)``, with ``func`` kept alive for as long as a decision about it is."""
    key = id(func)
    _DECIDED[key] = func
    return key


def _is_composite(func: Any) -> bool:
    """An op with no kernel of its own, only its decomposition (``linear``, ``cross_entropy_loss``)."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    try:
        name = func.name()
        return bool(has(name, "CompositeImplicitAutograd") and not has(name, "CPU") and not has(name, "CUDA")
                    and not has(name, "CompositeExplicitAutograd"))
    except (AttributeError, RuntimeError, TypeError):
        return False


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


def leave_mode_stack(mode: TorchDispatchMode) -> None:
    """Take ``mode`` off the dispatch-mode stack wherever it is, leaving the modes above it (the user's own,
    entered inside the measured block and left on) in place and in order, with PyTorch's "a mode is active"
    flags as if ``mode`` had never been there."""
    from torch.utils import _python_dispatch as pd

    stack = pd._get_current_dispatch_mode_stack()
    if stack and stack[-1] is mode:
        TorchDispatchMode.__exit__(mode, None, None, None)
        return
    above: list[TorchDispatchMode] = []
    found = False
    for m in stack:
        if found:
            above.append(m)
        elif m is mode:
            found = True
    if found:
        for _ in above:
            pd._pop_mode()
        pd._pop_mode()
        for m in above:
            pd._push_mode(m)
    # the flags our __enter__ saved are the state before us; the modes above saved states that included us
    for saved, flag, combine in _MODE_FLAGS:
        ours = getattr(mode, saved, None)
        if ours is None or not hasattr(pd, flag):
            continue  # a PyTorch without this flag
        value = ours.pop() if ours else False
        for m in above:
            theirs = getattr(m, saved, None)
            if theirs:
                theirs[-1] = value
            value = combine(m, value)
        setattr(pd, flag, value)
        if flag == "_is_in_any_mode_without_ignore_compile_internals":
            setter = getattr(pd, "set_is_in_mode_without_ignore_compile_internals", None)
            if setter is not None:
                setter(value)


# (the deque a mode keeps the flag's old values in, the module's flag, how a mode sets the flag on entering)
_MODE_FLAGS = (
    ("old_dispatch_mode_flags", "_is_in_torch_dispatch_mode", lambda m, v: True),
    ("old_non_infra_dispatch_mode_flags", "_is_in_non_infra_torch_dispatch_mode",
     lambda m, v: v or not getattr(m, "is_infra_mode", lambda: False)()),
    ("old_without_ignore_compile_internals_dispatch_mode_flags", "_is_in_any_mode_without_ignore_compile_internals",
     lambda m, v: v or not getattr(m, "ignore_compile_internals", lambda: False)()),
)
