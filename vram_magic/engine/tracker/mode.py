"""The live-storage tracker: a ``TorchDispatchMode`` that sees every tensor an op returns.

It counts new storages (allocations) as they appear and frees by weakref callback, so it knows live bytes, the peak
and the order of events — what the CPU allocator does not tell us. It also notes the phase of each allocation
(module forward, backward, optimizer step, plain cell code) and, cheaply, the user's frames, so allocations that are
gone by the end of the cell can still be attributed.

:class:`Tracker` is the dispatch mode itself: what it does with each op (decided once per op, ``op_kinds.py``) and
the parts it is made of, each owning its state: ``now`` (where the measured code is: ``now.py``), ``counts`` (the
storages alive, the peak and the history, the record a block is built from: ``counts.py``), ``hooks`` (module
forwards and optimizer steps: ``step_hooks.py``), ``scratch`` (ops whose kernels allocate inside themselves:
``engine/profiler/kernel_scratch.py``), ``generation`` (``generate()`` and KV caches:
``engine/hooks/generation.py``) and ``collectives`` (FSDP's, DDP's and tensor parallelism's buffers:
``engine/hooks/collectives.py``). The hot path's containers and methods are aliased on the mode once.

Tools built on it (the estimator's step tracer) pass a :class:`~vram_magic.engine.tracker.observer.TrackerObserver`,
which hears of module forwards, new storages and frees, and count storages through the counts' public
``count_new``, ``count_late`` and ``count_free``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..hooks import generation
from ..hooks.collectives import FSDP_UNSHARDED, CollectiveScopes
from ..hooks.generation import GenerationStages
from ..phases import PHASE_NAMES as PHASE_NAMES
from ..phases import Phase
from ..profiler.kernel_scratch import ScratchOps
from ..scan.registry import LiveStorages, storage_size
from ..torch_private import OpOverload as _OpOverload
from ..torch_private import TorchDispatchMode, never_compiled
from ..torch_private import leave_mode_stack as leave_mode_stack
from . import op_kinds
from .counts import StorageCounts
from .now import Now
from .observer import TrackerObserver
from .op_kinds import (
    COLLECTIVE,
    COMPILER,
    DECOMPOSE,
    DYNAMO,
    GEMM,
    LOADED,
    SCOPE_IN,
    SCOPE_OUT,
    SCRATCH_OP,
    SKIPPING,
    run_decomposed,
)
from .step_hooks import StepHooks
from .storage_resize import unwatch_resizes, watch_resizes

# Allocation phases, stored per allocation (phases.py holds them all), under the names they always had here
CELL, FORWARD, BACKWARD, OPTIMIZER, INFERENCE = Phase.CELL, Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER, \
    Phase.INFERENCE
PREFILL, DECODE, KV_UPDATE = Phase.PREFILL, Phase.DECODE, Phase.KV_UPDATE


class Tracker(TorchDispatchMode):
    """Track allocations on one device while active.

    ``budget``: simulated capacity in bytes; an op whose result (or, on the CPU, whose kernel's scratch) would push
    live memory beyond it raises ``torch.OutOfMemoryError``, as a full GPU would. ``observer``: hears of module
    forwards, new storages and frees (see observer.py).
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
        self.registry, self.device = registry, device
        self.now = now = Now()
        self.counts = counts = StorageCounts(registry, device, now=now, budget=budget, record_sites=record_sites,
                                             max_events=max_events, initial=initial, grouped=grouped,
                                             observer=observer)
        self.collectives = counts.collectives = CollectiveScopes(counts)
        self.generation = GenerationStages(now, counts)
        self.scratch = ScratchOps(counts)
        self.hooks = StepHooks(now, counts.roles, registry.get, record_sites=record_sites, observer=observer,
                               on_root_forward=self.generation.root_forward, ddp=self.collectives)
        # the per-op path's parts, aliased once: no attribute hop through a part for every op
        self._see_new, self._see_outputs = counts.see_new, counts.see_outputs
        self._deferring: dict[Any, bool] = {}  # subclass types -> their ops are left to them (see op_kinds.defers)
        self._skipping = SKIPPING  # per-op decisions, shared by every tracker of the process (see op_kinds.py)
        self._handles: list[Any] = []

    # --- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> Tracker:
        self.registry.on_free = self.counts.on_free
        self._handles = self.hooks.install()
        watch_resizes(self)
        generation.watch(self.generation)
        self._handles.append(self.collectives.watch())
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
        generation.unwatch(self.generation)
        for h in self._handles:
            try:
                h.remove()
            except Exception:
                pass
        self._handles = []
        if self.registry.on_free == self.counts.on_free:
            self.registry.on_free = None

    # --- storages resized in place (storage_resize.py) -----------------------------------------------
    def storage_resized(self, storage: Any) -> None:
        """A storage resized by ``UntypedStorage.resize_``, outside dispatch: FSDP frees a unit's unsharded
        parameters so (size 0) after its forward and backward, and allocates them again before the next use."""
        counts = self.counts
        entry = self.registry.get(id(storage))
        if entry is None or entry.device != self.device:
            return
        size = storage.nbytes() if counts.cpu else storage_size(storage, self.device)
        if size == entry.size:
            return
        fsdp = self.collectives.fsdp_scopes > 0
        if fsdp:  # first made by torch.empty inside FSDP's all-gather scope: it is the unit's unsharded parameters
            counts.roles[entry.serial] = FSDP_UNSHARDED
        counts.resized(entry, size)
        if fsdp:
            counts.roles[entry.serial] = FSDP_UNSHARDED

    # --- the ops -----------------------------------------------------------------------------------
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
        # What to do with the op, decided once per op (see op_kinds.skips); the two common answers first. A plain
        # OpOverload's __call__ only forwards to its C++ entry point: calling that directly saves a Python frame per
        # op. Subclasses (torchbind ops) and higher-order operators are called as they are.
        skip = self._skipping.get(id(func))
        if skip is True:  # in-place ops and views return an input's storage (known, or alive before the block)
            return (func._op if type(func) is _OpOverload else func)(*args, **(kwargs or {}))
        if skip is False:  # what it returns is new memory, unless known
            out = (func._op if type(func) is _OpOverload else func)(*args, **(kwargs or {}))
            if DYNAMO in LOADED and COMPILER._is_compiling_flag:  # torch.compile tracing: stay out of its graph
                return out
            if isinstance(out, torch.Tensor):
                self._see_new(out)
            elif isinstance(out, (tuple, list)):
                for o in out:
                    if isinstance(o, torch.Tensor):
                        self._see_new(o)
            return out
        if skip is GEMM:
            return self.scratch.gemm(func, args, kwargs)
        return self._other_op(func, args, kwargs, op_kinds.skips(func) if skip is None else skip)

    def _other_op(self, func: Any, args: Any, kwargs: Any, skip: Any) -> Any:
        """An op of any other kind (see op_kinds.skips), and one met for the first time."""
        if skip is True or skip is False or skip is GEMM:
            return self.__torch_dispatch__(func, (), args, kwargs)
        if skip is DECOMPOSE:
            # Under inference_mode, composite ops (linear, cross_entropy) reach the mode whole, and their parts
            # (the log-softmax inside a loss) would allocate out of sight: run their decomposition, with this
            # mode seeing each part (not while torch.compile traces: its graph is its own).
            if not (DYNAMO in LOADED and COMPILER._is_compiling_flag):
                out = run_decomposed(self, func, args, kwargs)
                if out is not NotImplemented:
                    return out
        elif skip is SCRATCH_OP:
            return self.scratch.scratch_op(func, args, kwargs)
        out = (func._op if type(func) is _OpOverload else func)(*args, **(kwargs or {}))
        if skip is COLLECTIVE:  # a collective returned (engine/hooks/collectives.py)
            return self.collectives.collective_done(func, args, out)
        if skip is SCOPE_IN or skip is SCOPE_OUT:  # a named scope opens or closes
            (self.collectives.scope_entered if skip is SCOPE_IN else self.collectives.scope_exited)(args, out)
            return out
        if DYNAMO in LOADED and COMPILER._is_compiling_flag:  # torch.compile tracing: stay out of its graph
            return out
        self._see_outputs(out, func)
        return out


never_compiled(Tracker.__torch_dispatch__)  # see torch_private.never_compiled
