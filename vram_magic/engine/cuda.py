"""CUDA specifics: device resolution, allocator statistics, the allocator's rounding.

Everything that only a GPU can answer lives here, small, so the rest of the engine is shared with CPU.
"""

from __future__ import annotations

from typing import Any

import torch

from ..report import DeviceStats


def resolve_device(device: Any = None) -> str:
    """``None`` → the current CUDA device if there is one, else ``cpu``. Returns ``cpu`` or ``cuda:N``."""
    if device is None:
        if torch.cuda.is_available():
            return f"cuda:{torch.cuda.current_device()}"
        return "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"unknown device {device!r}: use 'cpu', 'cuda' or 'cuda:N'") from err
    if dev.type == "cpu":
        return "cpu"
    if dev.type != "cuda":
        raise ValueError(f"device {device!r} is not supported: use 'cpu', 'cuda' or 'cuda:N'")
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available here; use --device cpu")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r} does not exist: this machine has {torch.cuda.device_count()} GPU(s)")
    return f"cuda:{index}"


def device_stats(device: str) -> DeviceStats:
    """Allocator statistics and the driver's free/total for ``cuda:N``."""
    index = int(device.split(":")[1])
    stats = torch.cuda.memory_stats(index)
    free, total = torch.cuda.mem_get_info(index)
    return DeviceStats(
        device=device,
        allocated=int(stats.get("allocated_bytes.all.current", 0)),
        reserved=int(stats.get("reserved_bytes.all.current", 0)),
        total=int(total),
        free=int(free),
        inactive_split=int(stats.get("inactive_split_bytes.all.current", 0)),
        peak_allocated=int(stats.get("allocated_bytes.all.peak", 0)),
    )


def capacity(device: str) -> int | None:
    if device.startswith("cuda"):
        return int(torch.cuda.get_device_properties(int(device.split(":")[1])).total_memory)
    return None


def peak_if_risen(before: DeviceStats | None, after: DeviceStats | None) -> int | None:
    """The allocator's peak during the cell without resetting the user's peak counter.

    If the global peak rose during the cell, the new global peak *is* the cell's peak. If it did not, the
    cell's peak is somewhere at or below it and only the trace can tell (``None``).
    """
    if before is None or after is None or before.peak_allocated is None or after.peak_allocated is None:
        return None
    if after.peak_allocated > before.peak_allocated:
        return after.peak_allocated
    return None


class History:
    """The caching allocator's own history around one cell (Python-only stacks, capped entries).

    If the user already records history, their setting is left alone and only read; otherwise recording is
    switched on for the cell and off again after it.
    """

    def __init__(self, device: str, max_entries: int = 200_000) -> None:
        self.device = device
        self.index = int(device.split(":")[1])
        self.max_entries = max_entries
        self.ours = False
        self.since = 0

    def start(self) -> History:
        enabled = getattr(torch._C, "_cuda_isHistoryEnabled", lambda: False)()
        if enabled:
            snap = torch.cuda.memory._snapshot()
            self.since = len(snap["device_traces"][self.index])
        else:
            record = torch.cuda.memory._record_memory_history
            try:  # a fresh history: nothing of earlier cells in the trace
                record(enabled="all", context="alloc", stacks="python", max_entries=self.max_entries,
                       clear_history=True)
            except TypeError:  # older PyTorch: no clear_history, so skip what is already there
                record(enabled="all", context="alloc", stacks="python", max_entries=self.max_entries)
                self.since = len(torch.cuda.memory._snapshot()["device_traces"][self.index])
            self.ours = True
        return self

    def stop(self) -> dict[str, Any]:
        try:
            return torch.cuda.memory._snapshot()
        finally:
            if self.ours:
                torch.cuda.memory._record_memory_history(enabled=None)

    def cell_peak(self, snapshot: dict[str, Any]) -> int:
        from ..snapshot import replay

        return replay(snapshot, self.index, self.since)[1]


class Fraction:
    """``--budget`` on CUDA: the caching allocator limited to ``budget`` bytes of the device for one cell
    (``set_per_process_memory_fraction``), and the user's own fraction put back afterwards."""

    def __init__(self, device: str, budget: int) -> None:
        self.index = int(device.split(":")[1])
        self.budget = budget
        self.previous: float | None = None

    def __enter__(self) -> Fraction:
        total = torch.cuda.get_device_properties(self.index).total_memory
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        self.previous = float(getter(self.index)) if getter is not None else 1.0
        torch.cuda.set_per_process_memory_fraction(min(self.budget / total, 1.0), self.index)
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.cuda.set_per_process_memory_fraction(self.previous if self.previous is not None else 1.0, self.index)


def requested_bytes(message: str) -> int | None:
    """The size in a CUDA OOM message: ``Tried to allocate 20.00 MiB``."""
    import re

    from ..units import parse_size

    match = re.search(r"Tried to allocate ([0-9.]+) ?([KMGT]i?B)", message)
    if match is None:
        return None
    try:
        return parse_size(match.group(1) + match.group(2))
    except ValueError:
        return None
