"""The host memory of a measured block, in bytes: the process's resident memory and its child processes' (data-loader
workers, forked ranks) before, after and at the block's peak, beside what the machine has."""

from __future__ import annotations

from dataclasses import dataclass

#: a peak within this share of what the machine had left before the block is worth a warning
NEAR = 0.10


@dataclass(frozen=True)
class HostUsage:
    """``before``/``after``/``peak``: resident bytes of the process and its children (a sum: pages a forked child
    shares with its parent count in both); ``children_peak``: the children's part at the peak; ``available``: what
    the machine (or the memory limit of the process's cgroup, when lower) had left before the block, ``None`` where
    it cannot be read; ``pinned``: page-locked host memory PyTorch held after the block (CUDA only)."""

    before: int
    after: int
    peak: int
    children_peak: int = 0
    available: int | None = None
    pinned: int | None = None

    @property
    def near_limit(self) -> bool:
        """The block's growth came within :data:`NEAR` of what the machine had left: the next one may be killed
        (Colab's "session crashed after using all available RAM")."""
        if self.available is None:
            return False
        return self.peak - self.before >= (1 - NEAR) * self.available

    def worth_saying(self) -> bool:
        """The block grew the host's memory by a mebibyte or more, or had child processes, or came near the limit."""
        return self.peak - self.before >= 1 << 20 or self.children_peak > 0 or self.near_limit

    def line(self) -> str:
        """``host: peak 1.20 GiB (+312 MiB; children 312 MiB), 19.7 GiB available``."""
        from .units import format_bytes

        parts = [f"+{format_bytes(self.peak - self.before)}"]
        if self.children_peak:
            parts.append(f"child processes {format_bytes(self.children_peak)}")
        if self.pinned:
            parts.append(f"pinned {format_bytes(self.pinned)}")
        left = f", {format_bytes(self.available)} available before the cell" if self.available is not None else ""
        return f"host: peak {format_bytes(self.peak)} ({'; '.join(parts)}){left}"

    def warning(self) -> str:
        from .units import format_bytes

        if not self.near_limit:
            return ""
        return (f"host memory: the peak grew by {format_bytes(self.peak - self.before)} of the "
                f"{format_bytes(self.available or 0)} the machine had left: close to the limit at which the kernel "
                "is killed (free host tensors, fewer data-loader workers, smaller prefetch)")


__all__ = ["NEAR", "HostUsage"]
