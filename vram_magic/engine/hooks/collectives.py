"""The buffers of FSDP, DDP and tensor parallelism, told from the model's memory while the tracker measures.

FSDP2 wraps its collectives in named scopes (``FSDP::…``, passed through dispatch as the profiler's two scope
ops): what is made inside one and freed before the block ends is the collective's buffer, and storages resized
inside its all-gather are a unit's unsharded parameters. What ``DistributedDataParallel`` allocates in its own
part of the forward, before the wrapped module's, is its reducer's gradient buckets.

Tensor parallelism (``DTensor``'s redistributions, which ``parallelize_module``'s styles run; any functional
collective) passes through dispatch as the ops of ``_c10d_functional``, each returning a new tensor: the
all-reduced output of a ``RowwiseParallel`` layer, the all-gathered input of a ``ColwiseParallel`` one under
sequence parallelism, a reduce-scatter's shard. What such an op returns is that collective's buffer ("other"), unless
the forward keeps it for backward (made in a forward, freed while backward runs: an activation, named after the
collective) or something holds it at the end of the block (its holder names it). Pipeline stages are
:mod:`.pipeline`'s.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

from ..phases import Phase
from . import pipeline

FSDP_ALL_GATHER = ("other", "FSDP all-gather buffers")
FSDP_REDUCE_SCATTER = ("other", "FSDP reduce-scatter buffers")
FSDP_UNSHARDED = ("other", "FSDP unsharded parameters (all-gathered)")
FSDP_UNSHARDED_GRADS = ("gradients", "FSDP unsharded gradients (before reduce-scatter)")
DDP_BUCKETS = ("other", "DDP gradient buckets")
_DDP = "torch.nn.parallel.distributed"

# tensor parallelism: the functional collectives' ops (``_c10d_functional``; ``_c10d_functional_autograd`` for the
# ones with a backward of their own) that return new memory, by what they do
_FUNCTIONAL = ("_c10d_functional", "_c10d_functional_autograd", "c10d_functional")
_TP_KINDS = {"all_reduce": "all-reduce", "all_reduce_coalesced": "all-reduce",
             "all_gather_into_tensor": "all-gather", "all_gather_into_tensor_coalesced": "all-gather",
             "reduce_scatter_tensor": "reduce-scatter", "reduce_scatter_tensor_coalesced": "reduce-scatter",
             "all_to_all_single": "all-to-all", "broadcast": "broadcast"}
#: what a tensor-parallel collective's output counts as: (its buffer, the same kept by the forward for backward)
TP_ROLES: dict[str, tuple[tuple[str, str], tuple[str, str]]] = {
    kind: (("other", f"tensor-parallel {kind} buffers"),
           ("activations", f"tensor-parallel {kind} output (saved for backward)"))
    for kind in dict.fromkeys(_TP_KINDS.values())}
_MADE_IN_FORWARD = (Phase.FORWARD, Phase.INFERENCE)  # the functional collectives run without grad
#: What gloo (the CPU's backend) allocates for a collective out of the dispatcher's sight (PyTorch 2.13's profiler,
#: tests/support/parallel_runs.py): an all-gather fills a flat buffer of the output's size on gloo's worker thread and
#: copies it out (a copy of the input's size made on the calling thread is freed before); a reduce-scatter reduces a
#: copy of its input, alive until the caller waits. DTensor waits at once, so each is counted beside the output, at
#: the collective. gloo's work lets go of these and of the collective's input when its worker thread is done,
#: sometimes after the caller went on; what Python held is counted freed when Python lets go of it, so a real run
#: may peak a few such buffers higher than measured, by an amount that varies from run to run (docs/ranks.md).
GLOO_STAGING = {"all-gather": ("other", "gloo all-gather staging buffer (CPU)"),
                "reduce-scatter": ("other", "gloo reduce-scatter input copy (CPU)")}


def tp_collective(func: Any) -> str | None:
    """What ``func`` does if it is a functional collective that returns new memory (``"all-reduce"``, …), else
    ``None`` (in-place variants, ``wait_tensor`` and every other op)."""
    if getattr(func, "namespace", None) not in _FUNCTIONAL:
        return None
    return _TP_KINDS.get(str(getattr(func, "__name__", "")).split(".")[0])


def _nbytes(t: Any) -> int:
    """Bytes of a tensor, or of a list of them (a coalesced collective's inputs)."""
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    try:
        return int(t.numel() * t.element_size())
    except AttributeError:
        return 0


class _Handle:
    """Something the tracker removes when it leaves: what :meth:`CollectiveScopes.watch` set up."""

    def __init__(self, remove: Any) -> None:
        self.remove = remove


def fsdp_role(scope: str) -> tuple[str, str]:
    """What memory made inside FSDP's scope ``scope`` is."""
    return FSDP_REDUCE_SCATTER if "reduce" in scope or "rs_wait" in scope else FSDP_ALL_GATHER


class CollectiveScopes:
    """The tracker's part in this: the named scopes open now and DDP's own forward, and the roles they reveal
    (kept in the counts' ``roles``: serial -> category, beside the optimizer's)."""

    def __init__(self, counts: Any) -> None:
        self.counts = counts
        self.roles, self.allocs, self.registry = counts.roles, counts.allocs, counts.registry
        # named scopes open now, innermost last: (FSDP's role for what is made inside it or None, the serial it
        # started at); scopes close in the order they opened (the handle an exit receives is a new Python object)
        self.scopes: list[tuple[tuple[str, str] | None, int]] = []
        self.fsdp_scopes = 0
        # DistributedDataParallel's own part of its forward (before the wrapped module's): the serial it began at
        self.ddp_types: tuple[type, ...] = ()
        self.ddp_open: int | None = None
        # serial -> a weak reference to a tensor-parallel collective's output, which says, when it dies, whether
        # the forward kept it for backward
        self.tp_outputs: dict[int, Any] = {}

    def watch(self) -> Any:
        """As the tracker enters: know DDP's module type, if torch's DDP is imported (it is not imported for
        this), and hear of pipeline stages' micro-batches (:mod:`.pipeline`), until the handle returned is
        removed."""
        ddp = sys.modules.get(_DDP)
        self.ddp_types = (ddp.DistributedDataParallel,) if ddp is not None else ()
        pipeline.watch(self)
        return _Handle(self._unwatch_parallel)

    def _unwatch_parallel(self) -> None:
        pipeline.unwatch(self)
        self.tp_outputs.clear()  # their callbacks die with them: nothing of this tracker outlives it

    def freed(self, serial: int, phase: int) -> None:
        """A storage made in the block is freed while one of FSDP's scopes or DDP's own forward is open."""
        if self.fsdp_scopes and phase == Phase.BACKWARD and self.scopes[-1][0] is FSDP_REDUCE_SCATTER \
                and serial < self.scopes[-1][1]:
            # made by backward, dropped by FSDP's reduce-scatter once copied in: a unit's unsharded gradients
            self.roles.setdefault(serial, FSDP_UNSHARDED_GRADS)
        elif self.ddp_open is not None and phase == Phase.CELL:
            # dropped by DDP's own forward: the buckets its reducer made when DDP was built, now rebuilt
            self.roles.setdefault(serial, DDP_BUCKETS)

    # --- tensor parallelism ----------------------------------------------------------------------------------
    def collective_done(self, func: Any, args: Any, out: Any) -> Any:
        """A functional collective returned ``out`` (new memory): counted, and named after the collective."""
        import torch

        if torch.compiler.is_compiling():
            return out
        counts = self.counts
        first, before = self.registry.next_serial(), len(counts.events)
        counts.see_outputs(out, func)
        kind = tp_collective(func) or "all-reduce"
        buffer, saved = TP_ROLES[kind]
        made = 0
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            try:
                storage = t.untyped_storage()
            except (AttributeError, RuntimeError, NotImplementedError):
                continue
            entry = self.registry.get(id(storage))
            if entry is None or entry.serial < first or entry.serial not in self.allocs:
                continue  # not made here
            serial = entry.serial
            made += entry.size
            self.roles[serial] = buffer
            if self.allocs[serial][1] in _MADE_IN_FORWARD:
                self.tp_outputs[serial] = weakref.ref(storage, self._tp_output_freed(serial, saved))
        staging = GLOO_STAGING.get(kind) if counts.cpu and made else None
        if staging is not None:  # gloo's own buffer, beside the output
            size = made if kind == "all-gather" else _nbytes(args[0] if args else None)
            events = len(counts.events)
            if size:
                counts.scratch_block(size, before)
            if len(counts.events) == events + 2:
                self.roles[-counts.events[-1]] = staging
        return out

    def _tp_output_freed(self, serial: int, saved: tuple[str, str]) -> Any:
        def freed(_: Any) -> None:
            # freed while backward runs: the forward kept it (a saved input of the next layer's matmul, the
            # residual stream's shard under sequence parallelism)
            if self.tp_outputs.pop(serial, None) is not None and self.counts.now.phase() == Phase.BACKWARD:
                self.roles[serial] = saved

        return freed

    # --- pipeline stages (pipeline.py wraps their methods) ---------------------------------------------------------
    def stage_work_began(self) -> int:
        """A stage's forward or backward of one micro-batch begins: the serial it begins at."""
        return int(self.registry.next_serial())

    def stage_work_done(self, first: int, role: tuple[str, str], named: Any = ()) -> None:
        """What the micro-batch's forward or backward made and no other role names is the stage's (``role``);
        ``named``: ``(tensor, role)`` for what the call left that is something else (receive buffers, the last
        stage's outputs)."""
        roles, allocs = self.roles, self.allocs
        for serial in range(first + 1, self.registry.next_serial()):
            if serial in allocs and serial not in roles:
                roles[serial] = role
        for t, other in named:
            try:
                entry = self.registry.get(id(t.untyped_storage()))
            except (AttributeError, RuntimeError, NotImplementedError):
                continue
            if entry is not None and entry.serial in allocs:
                roles[entry.serial] = other

    def ddp_module_entered(self, module: Any) -> None:
        """A module's forward begins (after the tracker's own bookkeeping)."""
        if self.ddp_open is not None:  # the wrapped module's forward begins: DDP's own part is over
            self.close_ddp()
        elif self.ddp_types and type(module) in self.ddp_types:
            self.ddp_open = self.registry.next_serial()

    def close_ddp(self) -> None:
        """What DDP allocates before its module's forward is its reducer's gradient buckets (rebuilt, in the
        order gradients arrived, at the second forward)."""
        first, self.ddp_open = self.ddp_open, None
        roles, allocs = self.roles, self.allocs
        for serial in range(first + 1, self.registry.next_serial()):  # type: ignore[operator]
            if serial in allocs:
                roles.setdefault(serial, DDP_BUCKETS)

    def scope_entered(self, args: Any, out: Any) -> None:
        name = args[0] if args else None
        if isinstance(name, str) and name.startswith("FSDP::"):
            self.scopes.append((fsdp_role(name), self.registry.next_serial()))
            self.fsdp_scopes += 1
        else:
            self.scopes.append((None, 0))

    def scope_exited(self, args: Any, out: Any) -> None:
        if not self.scopes:
            return  # a scope opened before the block began
        role, first = self.scopes.pop()
        if role is None:
            return
        self.fsdp_scopes -= 1
        # what was made inside the scope and is freed before the block ends counts as the collective's buffer
        # (the innermost scope names it; memory still alive at the end is named by the namespace scan)
        roles, allocs = self.roles, self.allocs
        for serial in range(first + 1, self.registry.next_serial()):
            if serial in allocs and serial not in roles:
                roles[serial] = role


__all__ = ["DDP_BUCKETS", "FSDP_ALL_GATHER", "FSDP_REDUCE_SCATTER", "FSDP_UNSHARDED", "FSDP_UNSHARDED_GRADS",
           "GLOO_STAGING", "TP_ROLES", "CollectiveScopes", "fsdp_role", "tp_collective"]
