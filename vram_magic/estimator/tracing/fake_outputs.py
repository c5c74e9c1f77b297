"""How the tensors a fake op returns become counted storages: a new storage counted unless a compiled kernel
would keep it to itself (fused), a known one grown in place counted at its new size, a view of memory from before the
step counted as alive from the start; and a value whose buffer the next result takes over, counted as freed then."""

from __future__ import annotations

from typing import Any

import torch

from ...engine.tensors import returned_tensors
from ...engine.tracker.op_kinds import aliases


class FakeOutputs:
    """The step tracer's counting of what its fake ops return, into the tracker's ``counts``. ``fused``: the
    serials of values a compiled kernel would not materialize; ``fusing``: set while a compiled graph computes a
    value that lives inside a fused kernel."""

    def __init__(self, counts: Any, registry: Any) -> None:
        self.counts, self.registry = counts, registry
        self.fused: set[int] = set()
        self.fusing = False

    def release(self, value: Any) -> None:
        """``value``'s buffer is taken over by the next result (written in place): counted as freed now, its
        real free later not counted again."""
        if not isinstance(value, torch.Tensor):
            return
        try:
            entry = self.registry.get(id(value.untyped_storage()))
        except (RuntimeError, NotImplementedError):
            return
        if entry is not None and entry.serial not in self.fused:
            self.counts.count_free(entry)
            self.fused.add(entry.serial)

    def see(self, t: torch.Tensor, func: Any) -> None:
        """A tensor an op returned: a new storage is counted (unless a fused kernel makes it), a known one grown
        in place is counted at its new size, a view of memory from before the step is counted as alive from the
        start."""
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        entry = self.registry.get(id(storage))
        if entry is not None:
            if entry.serial in self.fused:
                return
            size = int(storage.nbytes())
            if entry.size != size:  # resized in place
                counts = self.counts
                counts.current += size - entry.size
                entry.size = size
                counts.peak = max(counts.peak, counts.current)
            return
        if aliases(func):
            self.counts.count_late(storage)
            return
        if self.fusing:  # never written to memory: known (its views resolve to it), not counted
            entry = self.registry.add_new(storage, id(storage), int(storage.nbytes()), self.counts.device)
            self.fused.add(entry.serial)
            return
        self.counts.count_new(storage)

    def see_outputs(self, out: Any, func: Any) -> None:
        for t in returned_tensors(out):
            self.see(t, func)
