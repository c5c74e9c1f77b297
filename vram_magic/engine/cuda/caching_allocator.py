"""The rules of PyTorch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp``), as plain arithmetic.

The engine uses them to turn the allocator's history (which records *requested* sizes) into the block sizes its
counters use; the estimator replays a traced step through :class:`CachingAllocator` to predict what
``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` will say.

The rules, for the default configuration:

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

Three settings of ``PYTORCH_CUDA_ALLOC_CONF`` change block sizes, and are modelled (:class:`AllocatorSettings`):

* ``roundup_power2_divisions``: a request above ``512 × divisions`` bytes is rounded up to the next of
  ``divisions`` equal steps between two powers of two (``roundup_power2_next_division``), the divisions chosen
  per size interval (1 MiB, 2 MiB, … 32 GiB; below 2 MiB the first);
* ``max_split_size_mb``: blocks of that size or more are never split; a request below it never takes a cached
  block that large, a request at or above it takes a cached block only if it is less than
  ``max_non_split_rounding_mb`` (20 MiB by default) larger; before giving up, such oversize cached blocks are
  released first (``release_available_cached_blocks``);
* ``expandable_segments:True``: one segment per pool that grows by mapping pages (2 MiB for the small pool,
  20 MiB for the large one) at the lowest address with room; every block is split when at least 512 bytes are
  left, in both pools, so a block is its rounded request; best fit counts a free block followed by unmapped
  space as that much larger; giving up unmaps the free pages first.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from .alloc_conf import DEFAULT_SETTINGS, LARGE_BUFFER, MIN_BLOCK, SMALL_SIZE, AllocatorSettings, power_of_two

SMALL_BUFFER = 2 << 20  # kSmallBuffer: segment size of the small pool (and an expandable segment's small page)
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: requests below it share a 20 MiB segment
ROUND_LARGE = 2 << 20  # kRoundLarge: larger segments are rounded up to 2 MiB
_ADDRESS_SPACE = 1 << 46  # an expandable segment's reserved addresses: never the limit


# --- the rules as functions -----------------------------------------------------------------------------------
def roundup_power2_next_division(size: int, divisions: int) -> int:
    """``size`` rounded up to the next of ``divisions`` equal steps between the powers of two around it."""
    if power_of_two(size):
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    low = size & ~(step - 1)
    return size if low == size else low + step


def round_size(nbytes: int, settings: AllocatorSettings | None = None) -> int:
    """The block size the allocator looks for: ``nbytes`` rounded up to 512 (at least 512), or to a power-of-two
    division where ``roundup_power2_divisions`` asks for one."""
    if nbytes < MIN_BLOCK:
        return MIN_BLOCK
    divisions = settings.divisions(nbytes) if settings is not None else 0
    if divisions > 1 and nbytes > MIN_BLOCK * divisions:
        return roundup_power2_next_division(nbytes, divisions)
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


def should_split(block: int, size: int, settings: AllocatorSettings | None = None) -> bool:
    """Whether a free block of ``block`` bytes is split to serve a (rounded) request of ``size`` bytes."""
    remaining = block - size
    if is_small(size) or (settings is not None and settings.expandable_segments):
        return remaining >= MIN_BLOCK
    if settings is not None and settings.max_split_size is not None and size >= settings.max_split_size:
        return False
    return remaining > SMALL_SIZE


def block_size(request: int, free_block: int | None = None, settings: AllocatorSettings | None = None) -> int:
    """The size of the block handed out for ``request`` bytes, taken from a free block of ``free_block`` bytes
    (default: a new segment made for it; with expandable segments, always the rounded request)."""
    size = round_size(request, settings)
    if settings is not None and settings.expandable_segments:
        return size
    source = allocation_size(size) if free_block is None else free_block
    return size if should_split(source, size, settings) else source


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
    mapped: bool = True  # False: an expandable segment's address space with no pages behind it


@dataclass
class CachingAllocator:
    """A simulation of one device's caching allocator (one stream). ``malloc`` returns a handle; ``free`` gives
    it back. ``allocated`` and ``reserved`` are what ``memory_allocated`` / ``memory_reserved`` would say, with
    their peaks. ``capacity``: bytes the allocator may reserve (a smaller GPU, or a memory fraction);
    ``settings``: the allocator's configuration (:class:`AllocatorSettings`)."""

    capacity: int | None = None
    settings: AllocatorSettings = DEFAULT_SETTINGS
    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    _free: tuple[list[tuple[int, int]], list[tuple[int, int]]] = field(default_factory=lambda: ([], []))
    _by_addr: dict[int, _Block] = field(default_factory=dict)
    _live: dict[int, _Block] = field(default_factory=dict)
    _holes: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))  # unmapped blocks by address
    _hole_at: dict[int, _Block] = field(default_factory=dict)
    _base: dict[bool, int] = field(default_factory=dict)  # an expandable segment's first address, per pool
    _next_addr: int = 1 << 40
    _next_handle: int = 1

    def malloc(self, nbytes: int) -> int:
        """Allocate ``nbytes`` (0 allocates nothing and returns handle 0)."""
        if nbytes <= 0:
            return 0
        size = round_size(nbytes, self.settings)
        small = is_small(size)
        block = self._take_free(size, small)
        if block is None:
            block = self._new_block(size, small)
        if should_split(block.size, size, self.settings):
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
            if other is not None and not other.allocated and other.mapped:
                self._remove_free(other)
                self._absorb(block, other)
        self._insert_free(block)

    def release_cached(self) -> int:
        """Give every cached segment that is entirely free back to the device (``empty_cache``; also what the
        allocator does before giving up on a request); with expandable segments, unmap every free page. Returns
        the bytes released."""
        released = 0
        for pool in self._free:
            for size, addr in list(pool):
                block = self._by_addr[addr]
                if self.settings.expandable_segments:
                    released += self._unmap(block)
                elif block.prev is None and block.next is None:
                    self._remove_free(block)
                    self.reserved -= size
                    released += size
        return released

    # --- finding a block ----------------------------------------------------------------------------------
    def _take_free(self, size: int, small: bool) -> _Block | None:
        """``get_free_block``: best fit, where a free block followed by unmapped space counts as that much larger,
        and with ``max_split_size`` no oversize block for a smaller request, nor one much larger than a large
        request."""
        pool = self._free[0 if small else 1]
        i = bisect.bisect_left(pool, (size, -1))
        if i == len(pool):
            return None
        if self.settings.expandable_segments:
            while i + 1 < len(pool) and self._expandable_size(pool[i + 1]) < self._expandable_size(pool[i]):
                i += 1
        found, split = pool[i][0], self.settings.max_split_size
        if split is not None and ((size < split <= found) or
                                  (size >= split and found >= size + self.settings.max_non_split_rounding)):
            return None
        _, addr = pool.pop(i)
        return self._by_addr.pop(addr)

    def _expandable_size(self, entry: tuple[int, int]) -> int:
        block = self._by_addr[entry[1]]
        after = block.next
        return block.size + (after.size if after is not None and not after.mapped else 0)

    def _new_block(self, size: int, small: bool) -> _Block:
        """A free block of at least ``size`` bytes from the device: a new segment, or pages mapped onto the pool's
        expandable segment; first releasing oversize cached blocks, then every cached one, if the device is
        full."""
        grow = self._map_for if self.settings.expandable_segments else self._segment
        block = grow(size, small)
        if block is None and self._release_oversize(size, small):
            block = grow(size, small)
        if block is None:
            self.release_cached()
            block = grow(size, small)
        if block is None:
            raise OutOfMemory(size, allocation_size(size))
        return block

    def _fits(self, nbytes: int) -> bool:
        return self.capacity is None or self.reserved + nbytes <= self.capacity

    def _reserve(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _segment(self, size: int, small: bool) -> _Block | None:
        segment = allocation_size(size)
        if not self._fits(segment):
            return None
        block = _Block(self._next_addr, segment, small)
        self._next_addr += segment + (1 << 30)  # segments never touch: no merging across them
        self._reserve(segment)
        return block

    def _release_oversize(self, size: int, small: bool) -> bool:
        """``release_available_cached_blocks``: with ``max_split_size``, free the smallest oversize cached segment
        that covers the request, or else oversize ones from the largest down until as much is released."""
        split = self.settings.max_split_size
        if split is None or self.settings.expandable_segments:
            return False
        pool = self._free[0 if small else 1]
        key = max(size, split)
        i = bisect.bisect_left(pool, (key, -1))
        whole = [e for e in pool[i:] if self._whole(e)]
        if whole:
            self._drop(whole[0])
            return True
        released = 0
        for entry in sorted((e for e in pool[:i] if e[0] >= split and self._whole(e)), reverse=True):
            if released >= key:
                break
            released += entry[0]
            self._drop(entry)
        return released >= key

    def _whole(self, entry: tuple[int, int]) -> bool:
        block = self._by_addr[entry[1]]
        return block.prev is None and block.next is None

    def _drop(self, entry: tuple[int, int]) -> None:
        self._remove_free(self._by_addr[entry[1]])
        self.reserved -= entry[0]

    # --- expandable segments ------------------------------------------------------------------------------
    def _page(self, small: bool) -> int:
        return SMALL_BUFFER if small else LARGE_BUFFER

    def _map_for(self, size: int, small: bool) -> _Block | None:
        """``try_allocate_expandable_block``: at the lowest hole whose free block before it plus the hole hold
        ``size``, map pages until that free block is large enough; it is taken out of the free pool."""
        if small not in self._base:
            self._base[small] = self._next_addr
            self._next_addr += _ADDRESS_SPACE + (1 << 30)
            self._add_hole(_Block(self._base[small], _ADDRESS_SPACE, small, mapped=False))
        candidate = None
        for addr in self._holes[0 if small else 1]:
            hole = self._hole_at[addr]
            start = hole.prev if hole.prev is not None and not hole.prev.allocated else hole
            room, b = 0, start
            while room < size and b is not None and not b.allocated:
                room, b = room + b.size, b.next
            if room >= size:
                candidate = start
                break
        if candidate is None:
            return None
        if not candidate.mapped:
            candidate = self._map(candidate, min(candidate.size, size))
            if candidate is None:
                return None
        while candidate.size < size:
            after = candidate.next
            assert after is not None and not after.mapped
            mapped = self._map(after, min(size - candidate.size, after.size))
            if mapped is None:
                return None
            candidate = mapped
        self._remove_free(candidate)
        return candidate

    def _map(self, hole: _Block, nbytes: int) -> _Block | None:
        """Map the pages that cover the first ``nbytes`` of ``hole``; the mapped block joins its free neighbours
        and the free pool. ``None`` when the device is full."""
        page = self._page(hole.small)
        mapped = min(-(-nbytes // page) * page, hole.size)
        if not self._fits(mapped):
            return None
        self._remove_hole(hole)
        if mapped < hole.size:
            rest = _Block(hole.addr + mapped, hole.size - mapped, hole.small, prev=hole, next=hole.next,
                          mapped=False)
            if hole.next is not None:
                hole.next.prev = rest
            hole.next = rest
            hole.size = mapped
            self._add_hole(rest)
        hole.mapped = True
        self._reserve(mapped)
        for other in (hole.prev, hole.next):
            if other is not None and not other.allocated and other.mapped:
                self._remove_free(other)
                self._absorb(hole, other)
        self._insert_free(hole)
        return hole

    def _unmap(self, block: _Block) -> int:
        """``unmap_block``: give back the whole pages inside a free block; the rest stays free and mapped."""
        page = self._page(block.small)
        base = self._base[block.small]
        begin = base + -(-(block.addr - base) // page) * page
        end = base + (block.addr + block.size - base) // page * page
        if begin >= end:
            return 0
        self._remove_free(block)
        pieces = [(block.addr, begin - block.addr, True), (begin, end - begin, False),
                  (end, block.addr + block.size - end, True)]
        prev, after = block.prev, block.next
        middle = None
        for addr, size, mapped in pieces:
            if not size:
                continue
            piece = _Block(addr, size, block.small, prev=prev, mapped=mapped)
            if prev is not None:
                prev.next = piece
            prev = piece
            if mapped:
                self._insert_free(piece)
            else:
                middle = piece
        assert prev is not None and middle is not None
        prev.next = after
        if after is not None:
            after.prev = prev
        for other in (middle.prev, middle.next):
            if other is not None and not other.mapped:
                self._remove_hole(other)
                self._absorb(middle, other)
        self._add_hole(middle)
        self.reserved -= end - begin
        return end - begin

    # --- bookkeeping ------------------------------------------------------------------------------------
    @staticmethod
    def _absorb(block: _Block, other: _Block) -> None:
        """Merge ``other``, a neighbour of ``block``, into ``block`` (``try_merge_blocks``)."""
        if other is block.prev:
            block.addr, block.prev = other.addr, other.prev
            if other.prev is not None:
                other.prev.next = block
        else:
            block.next = other.next
            if other.next is not None:
                other.next.prev = block
        block.size += other.size

    def _add_hole(self, block: _Block) -> None:
        bisect.insort(self._holes[0 if block.small else 1], block.addr)
        self._hole_at[block.addr] = block

    def _remove_hole(self, block: _Block) -> None:
        holes = self._holes[0 if block.small else 1]
        del holes[bisect.bisect_left(holes, block.addr)]
        del self._hole_at[block.addr]

    def _insert_free(self, block: _Block) -> None:
        bisect.insort(self._free[0 if block.small else 1], (block.size, block.addr))
        self._by_addr[block.addr] = block

    def _remove_free(self, block: _Block) -> None:
        pool = self._free[0 if block.small else 1]
        i = bisect.bisect_left(pool, (block.size, block.addr))
        del pool[i]
        del self._by_addr[block.addr]


__all__ = ["LARGE_BUFFER", "MIN_BLOCK", "SMALL_BUFFER", "SMALL_SIZE", "CachingAllocator", "OutOfMemory",
           "allocation_size", "block_size", "is_small", "round_size", "roundup_power2_next_division",
           "segment_request_range", "should_split"]
