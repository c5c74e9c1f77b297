"""What a GPU does differently during ``generate()``, modelled on the fake CPU run.

**Attention.** On the CPU every ``scaled_dot_product_attention`` call runs the CPU flash kernel (no
``L × L`` scores). On CUDA, PyTorch picks a kernel by its rules (``aten/src/ATen/native/transformers/
cuda/sdp_utils.cpp``), tried in the order flash, memory-efficient, math:

* flash attention: fp16/bf16, compute capability ≥ 8.0, no ``attn_mask``, equal head dims ≤ 256;
  grouped-query attention (``enable_gqa``) allowed. Allocates the output and an fp32 log-sum-exp
  (batch × heads × queries).
* memory-efficient attention: fp32/fp16 (bf16 from 8.0), capability ≥ 5.0, any mask, head dims a
  multiple of 8 (4 in fp32); *not* grouped-query attention (key and query heads must agree). A mask is
  converted to the query's dtype and its last dimension padded to a multiple of 16 (a copy).
* math: anything else — the ``L × L`` scores, their softmax, a boolean mask as a float tensor, GQA's keys
  and values repeated. It is run as PyTorch's own ``_scaled_dot_product_attention_math`` on fake tensors.

So a padding mask moves a GPU from flash to memory-efficient attention, and a grouped-query model on a T4
(no flash before 8.0, memory-efficient refuses GQA) gets the math kernel whenever transformers passes
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

import torch
from torch.nn import functional as F

from ..engine.caching_allocator import CachingAllocator
from .torch_private import pop_mode as _pop_mode
from .torch_private import push_mode as _push_mode
from .tracer import StepTracer

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_MATH = torch.ops.aten._scaled_dot_product_attention_math.default
#: compute capability assumed when no GPU is named (Ampere, as an A100)
DEFAULT_CAPABILITY = (8, 0)


def sdpa_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, enable_gqa: bool,
                capability: tuple[int, int]) -> str:
    """``"flash"``, ``"efficient"`` or ``"math"``: what PyTorch's CUDA dispatcher picks for these arguments."""
    dt = q.dtype
    half = dt in (torch.float16, torch.bfloat16)
    same_dims = q.shape[-1] == k.shape[-1] == v.shape[-1]
    gqa = q.shape[-3] != k.shape[-3]
    if (half and capability >= (8, 0) and mask is None and same_dims and q.shape[-1] <= 256
            and (not gqa or enable_gqa)):
        return "flash"
    bf16_ok = dt != torch.bfloat16 or capability >= (8, 0)
    align = 8 if half else 4
    if (dt in (torch.float32, torch.float16, torch.bfloat16) and bf16_ok and capability >= (5, 0) and not gqa
            and q.shape[-1] == k.shape[-1] and q.shape[-1] % align == 0 and v.shape[-1] % align == 0):
        return "efficient"
    return "math"


class GenerateTracer(StepTracer):
    """The estimator's tracer; with ``cuda`` (a compute capability) each SDPA call allocates what the CUDA
    kernel PyTorch would pick allocates."""

    def __init__(self, registry: Any, names: dict[int, str], cuda: tuple[int, int] | None = None) -> None:
        super().__init__(registry, names)
        self.capability = cuda
        self.kernels: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _SDPA and self.capability is not None:
            return self._sdpa(args, kwargs or {})
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _sdpa(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        q, k, v = args[:3]
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        dropout = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
        causal = args[5] if len(args) > 5 else kwargs.get("is_causal", False)
        scale, gqa = kwargs.get("scale"), bool(kwargs.get("enable_gqa", False))
        kernel = sdpa_kernel(q, k, v, mask, gqa, self.capability or DEFAULT_CAPABILITY)
        self.kernels[kernel] += 1
        _push_mode(self)
        try:
            if kernel == "math":
                return _MATH(q, k, v, mask, dropout, causal, None, scale=scale, enable_gqa=gqa)[0]
            if mask is not None and mask.dtype == torch.bool:  # convert_boolean_attn_mask
                mask = torch.where(mask, torch.zeros((), dtype=q.dtype), float("-inf"))
            if kernel == "efficient" and mask is not None and mask.shape[-1] % 16:
                pad = 16 - mask.shape[-1] % 16
                mask = F.pad(mask, (0, pad))[..., : mask.shape[-1]]
            out = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype)
            if kernel == "flash":
                lse = torch.empty(q.shape[:-1], dtype=torch.float32)
                del lse
            del mask
            return out
        finally:
            _pop_mode()


def kernel_note(kernels: Mapping[str, int], capability: tuple[int, int], named: bool) -> str:
    if not kernels:
        return ""
    counts = ", ".join(f"{kernel} × {n}" for kernel, n in sorted(kernels.items()))
    where = f"compute capability {capability[0]}.{capability[1]}" + ("" if named else " assumed (pass gpu=)")
    text = f"SDPA on CUDA modelled by PyTorch's kernel choice ({where}): {counts}"
    if kernels.get("math"):
        text += ("; the math kernel materializes the L × L attention scores (no flash attention before compute "
                 "capability 8.0, and memory-efficient attention refuses grouped-query attention)")
    return text


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
