"""What the device itself says about its memory, beside what the tracker attributes: :class:`DeviceStats`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceStats:
    """What the device itself says. On CUDA this reconciles with nvidia-smi:
    ``used_by_process ≈ reserved + cuda_context_and_other``."""

    device: str
    allocated: int
    reserved: int | None = None
    total: int | None = None
    free: int | None = None
    inactive_split: int | None = None
    peak_allocated: int | None = None

    @property
    def used(self) -> int | None:
        """Bytes in use on the whole device (what nvidia-smi shows for all processes)."""
        if self.total is None or self.free is None:
            return None
        return self.total - self.free

    @property
    def outside_allocator(self) -> int | None:
        """CUDA context, other libraries and other processes: used minus PyTorch's reserved."""
        if self.used is None or self.reserved is None:
            return None
        return max(self.used - self.reserved, 0)

    @property
    def cached(self) -> int | None:
        """Reserved by PyTorch's caching allocator but not holding a tensor."""
        return None if self.reserved is None else self.reserved - self.allocated
