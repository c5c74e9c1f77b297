"""``offload_activations=True``: what autograd saves for backward kept on the host, as
``torch.autograd.graph.save_on_cpu(pin_memory=True)`` keeps it (torchtune's ``OffloadActivations`` is the same idea
with streams that overlap the copies; its memory is the same, its time less).

``save_on_cpu``'s pack hook runs for every tensor autograd saves (the weights a matmul saves included) and copies it
into a new host tensor of its shape (``torch.empty(size, pin_memory=True)`` + ``copy_``); autograd then holds the host
copy instead of the device tensor, which is freed unless something else holds it. Its unpack hook copies the tensor back
to the device (``.to(device, non_blocking=True)``) each time backward asks for it: a new device tensor, alive while that
node's backward runs.

Modelled for the target: on CUDA the host copies are pinned memory, outside the device's bytes — each block rounded up
to a power of two by PyTorch's caching host allocator (``CachingHostAllocator``: ``PowerOf2Ceil(size)``), which keeps
freed blocks for reuse, so the pinned memory held is the peak of what was alive (``estimate.host_pinned``); the copies
back are device tensors made in backward. On a CPU-only machine there is no pinned memory (``save_on_cpu`` pins only
where CUDA is available) and the "host" is the device: the copies are CPU tensors the peak counts, and unpacking
returns them as they are.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

#: the copies' labels in the estimate
PACKED = ("activations", "saved for backward, host copies (save_on_cpu)")
UNPACKED = ("activations", "saved for backward, copied back from the host")


def pinned_block(nbytes: int) -> int:
    """The pinned block PyTorch's caching host allocator hands out for ``nbytes``: the next power of two."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


class _OnHost:
    """A saved tensor's host copy on CUDA: its shape and dtype, and its pinned block's bytes, counted while autograd
    holds it."""

    __slots__ = ("__weakref__", "dtype", "layout", "size")

    def __init__(self, t: torch.Tensor, block: int, ledger: SavedOnHost) -> None:
        self.size, self.dtype, self.layout = t.size(), t.dtype, t.layout
        ledger.live += block
        ledger.peak = max(ledger.peak, ledger.live)
        weakref.finalize(self, ledger.freed, block)


class SavedOnHost:
    """The pack and unpack hooks of ``save_on_cpu(pin_memory=True)`` for the target ``device`` (``"cuda"`` or
    ``"cpu"``), with the ledger of the pinned bytes (``live``, ``peak``) and of the bytes copied each way in the step
    (``down``, ``up``; :meth:`new_step` starts them again). ``claim(t, category)`` names a device tensor they make."""

    def __init__(self, device: str, claim: Any) -> None:
        self.cuda = device == "cuda"
        self.claim = claim
        self.live = self.peak = 0
        self.down = self.up = 0

    def hooks(self) -> Any:
        """The context in which autograd saves through these hooks."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def new_step(self) -> None:
        self.down = self.up = 0

    def freed(self, block: int) -> None:
        self.live -= block

    def pack(self, t: torch.Tensor) -> Any:
        nbytes = t.numel() * t.element_size()
        self.down += nbytes
        if self.cuda:
            return _OnHost(t, pinned_block(nbytes), self)
        packed = torch.empty(t.size(), dtype=t.dtype, layout=t.layout)
        packed.copy_(t)
        self.claim(packed, PACKED)
        return (t.device, packed)

    def unpack(self, packed: Any) -> torch.Tensor:
        if not self.cuda:
            device, tensor = packed
            return tensor.to(device)
        back = torch.empty(packed.size, dtype=packed.dtype, layout=packed.layout)
        self.up += back.numel() * back.element_size()
        self.claim(back, UNPACKED)
        return back

    def note(self) -> str:
        if not self.cuda:
            return ("activations on the host (save_on_cpu(pin_memory=True)): every tensor saved for backward copied "
                    "into a new CPU tensor; on a CPU the host is the device, so the copies are in the peak (no pinned "
                    "memory without CUDA)")
        return ("activations on the host (save_on_cpu(pin_memory=True)): every tensor saved for backward (weights a "
                "matmul saves included) copied to pinned host memory in the forward and back to the device in the "
                "backward; the pinned memory is the caching host allocator's blocks (powers of two) at their peak, "
                "outside the device's bytes; the copies are timed over PCIe with no overlap")


__all__ = ["PACKED", "UNPACKED", "SavedOnHost", "pinned_block"]
