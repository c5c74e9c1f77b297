"""What a CUDA out-of-memory error says about the request that failed.

The allocator's history, when it is recorded, has an ``oom`` entry whose ``size`` is the request rounded to 512
bytes: that is the figure to use. Without a history (the ``cudaMallocAsync`` backend, CUDA initialised by the
cell itself, a user's recording that keeps no trace) only the exception's message is left, and what it says
depends on the allocator:

* the native caching allocator (``c10/cuda/CUDACachingAllocator.cpp``): ``CUDA out of memory. Tried to allocate
  20.00 MiB. GPU 0 has a total capacity of ...`` — the size is the *segment* it asked the device for, not the
  request: 2 MiB for any request up to 1 MiB, 20 MiB for requests of 1–10 MiB, the request rounded up to 2 MiB
  above that;
* ``cudaMallocAsync`` (``c10/cuda/CUDAMallocAsyncAllocator.cpp``): ``Allocation on device 0 would exceed allowed
  memory. (out of memory)`` followed by ``Requested               : 4.00 MiB`` — the request itself.

Sizes are printed by c10's ``format_size``: ``N bytes`` up to 1024, then two decimals of KiB up to 1 MiB, MiB up
to 1 GiB, GiB above; so a size read from a message is exact only to those two decimals.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .caching_allocator import segment_request_range

_UNITS = {"bytes": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}
_SIZE = r"([0-9]+(?:\.[0-9]+)?) (bytes|KiB|MiB|GiB|TiB)"
_NATIVE = re.compile(r"Tried to allocate " + _SIZE)
_ASYNC = re.compile(r"Requested\s*:\s*" + _SIZE)
# "GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB is free" (2.1's "capacty" too)
_CAPACITY = re.compile(r"total capac\w* of " + _SIZE + r" of which " + _SIZE + r" is free")


def format_size(n: int) -> str:
    """c10's ``format_size``, the way PyTorch prints sizes in its CUDA messages."""
    if n <= 1024:
        return f"{n} bytes"
    if n <= 1024**2:
        return f"{n / 1024:.2f} KiB"
    if n <= 1024**3:
        return f"{n / 1024**2:.2f} MiB"
    return f"{n / 1024**3:.2f} GiB"


def _bytes(number: str, unit: str) -> int:
    return round(float(number) * _UNITS[unit])


@dataclass(frozen=True)
class OomRequest:
    """A failed request as far as a message tells it: ``low``–``high`` bytes (equal when the message gives the
    request itself), and the segment the native allocator tried to reserve for it, if that is what it printed."""

    low: int
    high: int
    segment: int | None = None

    @property
    def exact(self) -> bool:
        return self.low == self.high

    @property
    def requested(self) -> int | None:
        """The request when the message gives it, or pins it down to within 2 MiB (a segment of 10 MiB or more,
        other than 20 MiB, is the request rounded up to 2 MiB); else ``None``."""
        if self.segment is None:
            return self.high
        return self.high if self.segment >= 10 * 1024**2 and self.segment != 20 * 1024**2 else None

    def describe(self) -> str:
        from ...core.units import format_bytes

        if self.segment is None:
            return f"the request was {format_bytes(self.high)}"
        if self.requested is not None:
            return (f"PyTorch's message gives the {format_bytes(self.segment)} segment it asked the device for: the "
                    f"request was at most that and more than {format_bytes(self.low - 512)}")
        return (f"PyTorch's message gives the {format_bytes(self.segment)} segment it asked the device for, which "
                f"serves requests of {format_bytes(self.low)} to {format_bytes(self.high)}: the request itself is "
                "not in the message")


def parse_oom_message(message: str) -> OomRequest | None:
    """The request in a CUDA out-of-memory message (either allocator), or ``None`` if the message has none."""
    match = _ASYNC.search(message)
    if match is not None:
        n = _bytes(*match.groups())
        return OomRequest(n, n)
    match = _NATIVE.search(message)
    if match is None:
        return None
    segment = _bytes(*match.groups())
    if "CUDA out of memory" not in message:  # another allocator's wording (the simulated budget): the request
        return OomRequest(segment, segment)
    low, high = segment_request_range(segment)
    return OomRequest(low, high, segment)


def requested_bytes(message: str) -> int | None:
    """The failed request's size from a message, when the message pins it down (see :class:`OomRequest`)."""
    parsed = parse_oom_message(message)
    return parsed.requested if parsed is not None else None


def device_in_message(message: str) -> tuple[int, int] | None:
    """``(total, free)`` bytes of the device, as the native allocator's message gives them (two decimals)."""
    match = _CAPACITY.search(message)
    if match is None:
        return None
    total, unit, free, free_unit = match.groups()
    return _bytes(total, unit), _bytes(free, free_unit)


def oom_from_trace(entries: Iterable[Mapping[str, Any]]) -> int | None:
    """The ``size`` of the last ``oom`` entry of an allocator trace (``torch/csrc/cuda/memory_snapshot.cpp``
    writes ``{"action": "oom", "device_free": ..., "size": ...}``): the request rounded up to 512 bytes."""
    size = None
    for entry in entries:
        if entry.get("action") == "oom":
            size = int(entry["size"])
    return size


__all__ = ["OomRequest", "device_in_message", "format_size", "oom_from_trace", "parse_oom_message",
           "requested_bytes"]
