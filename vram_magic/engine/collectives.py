"""FSDP's and DDP's own buffers, told from the model's memory while the tracker measures.

FSDP2 wraps its collectives in named scopes (``FSDP::…``, passed through dispatch as the profiler's two scope
ops): what is made inside one and freed before the block ends is the collective's buffer, and storages resized
inside its all-gather are a unit's unsharded parameters. What ``DistributedDataParallel`` allocates in its own
part of the forward, before the wrapped module's, is its reducer's gradient buckets.
"""

from __future__ import annotations

import sys
from typing import Any

FSDP_ALL_GATHER = ("other", "FSDP all-gather buffers")
FSDP_REDUCE_SCATTER = ("other", "FSDP reduce-scatter buffers")
FSDP_UNSHARDED = ("other", "FSDP unsharded parameters (all-gathered)")
FSDP_UNSHARDED_GRADS = ("gradients", "FSDP unsharded gradients (before reduce-scatter)")
DDP_BUCKETS = ("other", "DDP gradient buckets")
_DDP = "torch.nn.parallel.distributed"


def fsdp_role(scope: str) -> tuple[str, str]:
    """What memory made inside FSDP's scope ``scope`` is."""
    return FSDP_REDUCE_SCATTER if "reduce" in scope or "rs_wait" in scope else FSDP_ALL_GATHER


class CollectiveScopes:
    """The tracker's part in this: the named scopes open now and DDP's own forward, and the roles they reveal
    (kept in ``roles``: serial -> category, beside the optimizer's)."""

    roles: dict[int, Any]
    allocs: dict[int, Any]
    registry: Any

    def collectives_init(self) -> None:
        # named scopes open now, innermost last: (FSDP's role for what is made inside it or None, the serial it
        # started at); scopes close in the order they opened (the handle an exit receives is a new Python object)
        self.scopes: list[tuple[tuple[str, str] | None, int]] = []
        self.fsdp_scopes = 0
        # DistributedDataParallel's own part of its forward (before the wrapped module's): the serial it began at
        self.ddp_types: tuple[type, ...] = ()
        self.ddp_open: int | None = None

    def watch_ddp(self) -> None:
        """Know DDP's module type, if torch's DDP is imported (it is not imported for this)."""
        ddp = sys.modules.get(_DDP)
        self.ddp_types = (ddp.DistributedDataParallel,) if ddp is not None else ()

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
           "CollectiveScopes", "fsdp_role"]
