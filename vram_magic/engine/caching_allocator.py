"""The rules of PyTorch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp``), as plain arithmetic.

The engine uses them to turn the allocator's history (which records *requested* sizes) into the block sizes its
counters use; the estimator replays a traced step through :class:`CachingAllocator` to predict what
``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` will say.

The rules, for the default configuration (no ``max_split_size_mb``, no ``roundup_power2_divisions``, no
``expandable_segments``):

* every request is rounded up to a multiple of 512 bytes (``round_size``; at least 512);
* requests of up to 1 MiB come from the *small* pool, larger ones from the *large* pool;
* a request no cached block can serve makes a new segment (``cudaMalloc``): 2 MiB for the small pool, 20 MiB for
  requests of 1–10 MiB, and above that the request rounded up to 2 MiB (``allocation_size``);
* the block handed out is split off the free block it came from only if what is left is worth keeping: at least
  512 bytes in the small pool, more than 1 MiB in the large pool (``should_split``); otherwise the whole free
  block is handed out, and the *unsplit remainder* counts as allocated;
* freed blocks merge with free neighbours of the same segment and stay cached; the smallest cached block that
  fits is reused first (best fit);
* when ``cudaMalloc`` fails (or a memory fraction is reached), cached segments that are entirely free are
  released and the allocation is tried once more before ``torch.OutOfMemoryError``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 << 20  # kSmallSize: the largest request of the small pool
SMALL_BUFFER = 2 << 20  # kSmallBuffer: segment size of the small pool
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: requests below it share a 20 MiB segment
LARGE_BUFFER = 20 << 20  # kLargeBuffer
ROUND_LARGE = 2 << 20  # kRoundLarge: larger segments are rounded up to 2 MiB


def round_size(nbytes: int) -> int:
    """The block size the allocator looks for: ``nbytes`` rounded up to 512 (at least 512)."""
    if nbytes < MIN_BLOCK:
        return MIN_BLOCK
    return -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def is_small(size: int) -> bool:
    """Whether a (rounded) request is served by the small pool."""
    return size <= SMALL_SIZE


def allocation_size(size: int) -> int:
    """The segment ``cudaMalloc``'d for a (rounded) request no cached block can serve."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


def should_split(block: int, size: int) -> bool:
    """Whether a free block of ``block`` bytes is split to serve a (rounded) request of ``size`` bytes."""
    remaining = block - size
    if is_small(size):
        return remaining >= MIN_BLOCK
    return remaining > SMALL_SIZE


def block_size(request: int, free_block: int | None = None) -> int:
    """The size of the block handed out for ``request`` bytes, taken from a free block of ``free_block`` bytes
    (default: a new segment made for it)."""
    size = round_size(request)
    source = allocation_size(size) if free_block is None else free_block
    return size if should_split(source, size) else source


def segment_request_range(segment: int) -> tuple[int, int]:
    """The requests (rounded, inclusive bounds) for which the allocator asks the device for a new segment of
    ``segment`` bytes: what PyTorch's "Tried to allocate N" out-of-memory message allows one to infer."""
    if segment == SMALL_BUFFER:
        return MIN_BLOCK, SMALL_SIZE
    if segment == LARGE_BUFFER:  # requests of 1-10 MiB, and those of 18-20 MiB rounded up to 2 MiB
        return SMALL_SIZE + MIN_BLOCK, LARGE_BUFFER
    return max(segment - ROUND_LARGE + MIN_BLOCK, MIN_LARGE_ALLOC), segment


class OutOfMemory(Exception):
    """The simulated device cannot hold another segment of ``segment`` bytes for a request of ``size``."""

    def __init__(self, size: int, segment: int) -> None:
        super().__init__(f"cannot reserve a segment of {segment} bytes for a request of {size} bytes")
        self.size = size
        self.segment = segment


@dataclass
class _Block:
    addr: int
    size: int
    small: bool
    prev: _Block | None = None
    next: _Block | None = None
    allocated: bool = False


@dataclass
class CachingAllocator:
    """A simulation of one device's caching allocator (one stream). ``malloc`` returns a handle; ``free`` gives
    it back. ``allocated`` and ``reserved`` are what ``memory_allocated`` / ``memory_reserved`` would say, with
    their peaks. ``capacity``: bytes the allocator may reserve (a smaller GPU, or a memory fraction)."""

    capacity: int | None = None
    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    _free: tuple[list[tuple[int, int]], list[tuple[int, int]]] = field(default_factory=lambda: ([], []))
    _by_addr: dict[int, _Block] = field(default_factory=dict)
    _live: dict[int, _Block] = field(default_factory=dict)
    _next_addr: int = 1 << 40
    _next_handle: int = 1

    def malloc(self, nbytes: int) -> int:
        """Allocate ``nbytes`` (0 allocates nothing and returns handle 0)."""
        if nbytes <= 0:
            return 0
        size = round_size(nbytes)
        small = is_small(size)
        block = self._take_free(size, small)
        if block is None:
            segment = allocation_size(size)
            if self.capacity is not None and self.reserved + segment > self.capacity:
                self.release_cached()
                if self.reserved + segment > self.capacity:
                    raise OutOfMemory(size, segment)
            block = _Block(self._next_addr, segment, small)
            self._next_addr += segment + (1 << 30)  # segments never touch: no merging across them
            self.reserved += segment
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        if should_split(block.size, size):
            rest = _Block(block.addr + size, block.size - size, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self._insert_free(rest)
        block.allocated = True
        handle = self._next_handle
        self._next_handle += 1
        self._live[handle] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return handle

    def block_size(self, handle: int) -> int:
        """The size of the block behind a live handle (its request rounded, plus any unsplit remainder)."""
        return self._live[handle].size if handle else 0

    def free(self, handle: int) -> None:
        if not handle:
            return
        block = self._live.pop(handle)
        block.allocated = False
        self.allocated -= block.size
        for other in (block.prev, block.next):
            if other is not None and not other.allocated:
                self._remove_free(other)
                if other is block.prev:
                    block.addr, block.prev = other.addr, other.prev
                    if other.prev is not None:
                        other.prev.next = block
                else:
                    block.next = other.next
                    if other.next is not None:
                        other.next.prev = block
                block.size += other.size
        self._insert_free(block)

    def release_cached(self) -> int:
        """Give every cached segment that is entirely free back to the device (``empty_cache``; also what the
        allocator does before giving up on a request). Returns the bytes released."""
        released = 0
        for pool in self._free:
            for size, addr in list(pool):
                block = self._by_addr[addr]
                if block.prev is None and block.next is None:
                    self._remove_free(block)
                    self.reserved -= size
                    released += size
        return released

    # --- the free pools: (size, address) kept sorted, best fit = the first entry that is large enough ------
    def _take_free(self, size: int, small: bool) -> _Block | None:
        pool = self._free[0 if small else 1]
        i = bisect.bisect_left(pool, (size, -1))
        if i == len(pool):
            return None
        _, addr = pool.pop(i)
        return self._by_addr.pop(addr)

    def _insert_free(self, block: _Block) -> None:
        bisect.insort(self._free[0 if block.small else 1], (block.size, block.addr))
        self._by_addr[block.addr] = block

    def _remove_free(self, block: _Block) -> None:
        pool = self._free[0 if block.small else 1]
        i = bisect.bisect_left(pool, (block.size, block.addr))
        del pool[i]
        del self._by_addr[block.addr]


__all__ = ["CachingAllocator", "OutOfMemory", "allocation_size", "block_size", "is_small", "round_size",
           "segment_request_range", "should_split"]
