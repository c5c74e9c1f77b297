"""What a GPU does differently during ``generate()``, modelled on the fake CPU run.

**Attention.** Each ``scaled_dot_product_attention`` call runs as the CUDA kernel PyTorch would pick and
allocates what it allocates: one model for every workload, in :mod:`.cuda_attention` (the kernel choice by the
installed release's ``sdp_utils.cpp``; flash, memory-efficient, cuDNN and math attention). So a padding mask
moves an A100 from flash to memory-efficient attention, and a grouped-query model on a T4 (no flash before 8.0,
memory-efficient attention refuses GQA up to 2.15) gets the math kernel whenever transformers passes
``enable_gqa`` (no mask): at long prompts its scores dominate the prefill.

**The caching allocator and a growing cache.** A dynamic cache asks for one token more per layer every step,
and a freed block is never quite large enough for the next, longer request; blocks in different segments
never merge; a long prompt's large freed blocks (its MLP's intermediates) are split to hold the growing
cache, which pins them. :func:`unrolled_reserved` replays every decoding step (the traced last step
repeated, each allocation at the size it has at that step) through the allocator's rules, from the traced
prefill to the last token, and reports the reserved peak, what is reserved above allocated when the loop
ends, and the peak of the segments that hold a live block — what a GPU must have, since the allocator gives
back entirely free segments when ``cudaMalloc`` fails.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...engine.caching_allocator import CachingAllocator
from ..target.attention import DEFAULT_CAPABILITY, CudaAttention, kernel_note, sdpa_kernel
from ..tracing.tracer import StepTracer


class GenerateTracer(StepTracer):
    """The estimator's tracer; with ``cuda`` (a compute capability) each SDPA call allocates what the CUDA
    kernel PyTorch would pick allocates (:class:`.cuda_attention.CudaAttention`)."""

    def __init__(self, registry: Any, names: dict[int, str], cuda: tuple[int, int] | None = None) -> None:
        super().__init__(registry, names)
        self.capability = cuda
        if cuda is not None:
            self.attention = CudaAttention(cuda)

    @property
    def kernels(self) -> Counter[str]:
        return self.attention.kernels if self.attention is not None else Counter()


@dataclass
class PinnedAllocator(CachingAllocator):
    """The caching allocator, also counting the bytes of the segments that hold a live block (``pinned``): what it
    cannot give back to the device. When ``cudaMalloc`` fails, PyTorch's allocator frees every cached segment that
    is entirely free and tries again, so a GPU needs ``peak_pinned``, not the ``peak_reserved`` it reaches when it
    has room to spare."""

    pinned: int = 0
    peak_pinned: int = 0
    _pin_bases: list[int] = field(default_factory=list)
    _pin_segment: dict[int, int] = field(default_factory=dict)  # base -> bytes
    _pin_count: dict[int, int] = field(default_factory=dict)  # base -> live blocks
    _pin_base: dict[int, int] = field(default_factory=dict)  # handle -> base

    def malloc(self, nbytes: int) -> int:
        before = self.reserved
        handle = super().malloc(nbytes)
        if not handle:
            return 0
        addr = self._live[handle].addr  # the block's address (a segment's first block starts at its base)
        if self.reserved > before:
            bisect.insort(self._pin_bases, addr)
            self._pin_segment[addr] = self.reserved - before
        base = self._pin_bases[bisect.bisect_right(self._pin_bases, addr) - 1]
        self._pin_base[handle] = base
        self._pin_count[base] = self._pin_count.get(base, 0) + 1
        if self._pin_count[base] == 1:
            self.pinned += self._pin_segment[base]
            self.peak_pinned = max(self.peak_pinned, self.pinned)
        return handle

    def free(self, handle: int) -> None:
        base = self._pin_base.pop(handle, None)
        if base is not None:
            self._pin_count[base] -= 1
            if not self._pin_count[base]:
                self.pinned -= self._pin_segment[base]
        super().free(handle)


def unrolled_reserved(initial: Iterable[int], events: Sequence[int], sizes: Mapping[int, int],
                      bounds: tuple[int, int, int, int, int, int], steps: int, first: int, cached: int, *,
                      slot: Mapping[int, str], replaced: Mapping[int, int], token_bytes: Mapping[int, int],
                      persistent: Iterable[int] = ()) -> tuple[int, int, int, int] | None:
    """``(peak reserved, reserved at the end, allocated at the end, peak pinned)`` of the whole loop replayed
    through the caching allocator (:class:`PinnedAllocator`): the trace up to the jump, then steps ``first`` ..
    ``steps`` made from the traced last step, each allocation at the size it has at that step (a cache tensor
    of ``b`` bytes per token holds ``min(cached + step, its length in the last step)`` tokens; the loop's own
    tensors are between their sizes before the jump and in the last step).

    ``bounds``: the event indices where the forward before the jump ended (its bookkeeping follows), where the
    jump starts and ends, where the last step starts, where its forward ends, and where the loop ends;
    ``cached``: tokens in the cache after the prefill; ``slot``: cache storages by slot (``layers[3].keys``);
    ``replaced``: storage the jump made → the one it stands in for; ``token_bytes``: a cache storage's bytes
    per token; ``persistent``: sizes allocated once after the initial storages (cuBLAS workspaces).
    Transient small-pool allocations (≤ 1 MiB, made and freed within a step) repeat identically and are
    left out. ``None`` when the steps do not line up."""
    b0, j0, j1, sl, bl, end = bounds
    if not (b0 <= j0 <= j1 <= sl <= bl <= end) or steps < first:
        return None
    a_last = [e for e in events[sl:end] if e > 0]
    bk_prev = [e for e in events[b0:j0] if e > 0]
    bk_last = [e for e in events[bl:end] if e > 0]
    if len(bk_prev) != len(bk_last):
        return None
    pos = {s: i for i, s in enumerate(a_last)}
    role = {s: pos[t] for s, t in zip(bk_prev, bk_last)}  # the loop's tensors: before the jump -> last step
    by_path = {slot[s]: i for s, i in pos.items() if s in slot}
    template: list[tuple[int, int]] = []  # (+1 alloc / -1 free of this step's / -2 free of the previous step's, pos)
    freed_here: set[int] = set()
    for e in events[sl:end]:
        if e > 0:
            template.append((1, pos[e]))
            continue
        x = -e
        if x in pos:
            template.append((-1, pos[x]))
            freed_here.add(pos[x])
            continue
        x = replaced.get(x, x)
        if x in role:
            template.append((-2, role[x]))
        elif x in slot and slot[x] in by_path:
            template.append((-2, by_path[slot[x]]))
        else:
            return None  # the last step frees something no step makes: the steps are not alike
    base = {p: sizes[s] for s, p in role.items()}
    small = 1 << 20
    template = [(k, p) for k, p in template
                if k == -2 or p not in freed_here or max(sizes[a_last[p]], base.get(p, 0)) > small]

    def size(p: int, m: int) -> int:
        s = a_last[p]
        tb = token_bytes.get(s, 0)
        if tb:
            return min(sizes[s], tb * (cached + m))
        if p in base:
            return base[p] + (sizes[s] - base[p]) * m // max(steps, 1)
        return sizes[s]

    a = PinnedAllocator()
    handles: dict[int, int] = {}
    for s in initial:
        handles[s] = a.malloc(sizes[s])
    for n in persistent:
        a.malloc(n)
    for e in events[:j0]:
        if e > 0:
            handles[e] = a.malloc(sizes[e])
        else:
            a.free(handles.pop(-e, 0))
    previous = [0] * len(a_last)
    for s, h in handles.items():
        p = role.get(s, by_path.get(slot.get(s, "\x00"), -1))
        if p >= 0:
            previous[p] = h
    for m in range(first, steps + 1):
        current = [0] * len(a_last)
        for kind, p in template:
            if kind == 1:
                current[p] = a.malloc(size(p, m))
            elif kind == -1:
                a.free(current[p])
                current[p] = 0
            else:
                a.free(previous[p])
                previous[p] = 0
        previous = current
    return a.peak_reserved, a.reserved, a.allocated, a.peak_pinned


__all__ = ["DEFAULT_CAPABILITY", "GenerateTracer", "PinnedAllocator", "kernel_note", "sdpa_kernel", "unrolled_reserved"]
