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
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ...core.units import format_bytes
from ...engine.cuda.alloc_conf import DEFAULT_SETTINGS, AllocatorSettings
from ...engine.cuda.caching_allocator import CachingAllocator
from ..device.sdpa import CudaAttention
from ..tracing.tracer import StepTracer
from .facts import GenerateSpec, Generation

if TYPE_CHECKING:
    from ..device import Target
    from ..replay import Replayed
    from ..tracing.traced import FakeRun


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


@dataclass(frozen=True)
class Stranded:
    """A segment holding live blocks beside free space it cannot give back: ``segment`` bytes, ``free`` of them
    unused; ``made_for``: the tag of the request it was made for; ``holders``: tags and block sizes of the live
    blocks in it, largest first (at most three)."""

    segment: int
    free: int
    made_for: Any
    holders: tuple[tuple[Any, int], ...]


@dataclass
class PinnedAllocator(CachingAllocator):
    """The caching allocator, also counting the bytes of the segments that hold a live block (``pinned``): what it
    cannot give back to the device. When ``cudaMalloc`` fails, PyTorch's allocator frees every cached segment that
    is entirely free and tries again, so a GPU needs ``peak_pinned``, not the ``peak_reserved`` it reaches when it
    has room to spare.

    ``peak_pinned`` is ``in_use`` (the live blocks when the peak is reached) plus the free space inside the segments
    that hold them: a freed block split for a smaller request (best fit takes the smallest free block that is
    large enough, and splits it) stays reserved while any part of it is in use, and a request larger than every
    free block gets a segment of its own. ``stranded``: the largest such segments at the peak (``malloc``'s
    ``tag`` names their blocks)."""

    pinned: int = 0
    peak_pinned: int = 0
    in_use: int = 0  # allocated when peak_pinned was reached
    stranded: tuple[Stranded, ...] = ()
    _pin_bases: list[int] = field(default_factory=list)
    _pin_segment: dict[int, int] = field(default_factory=dict)  # base -> bytes
    _pin_made_for: dict[int, Any] = field(default_factory=dict)  # base -> tag of the request that made it
    _pin_live: dict[int, dict[int, Any]] = field(default_factory=dict)  # base -> {handle: tag} of its live blocks
    _pin_used: dict[int, int] = field(default_factory=dict)  # base -> bytes of its live blocks
    _pin_base: dict[int, int] = field(default_factory=dict)  # handle -> base

    def malloc(self, nbytes: int, tag: Any = None) -> int:
        before = self.reserved
        handle = super().malloc(nbytes)
        if not handle:
            return 0
        block = self._live[handle]  # a segment's first block starts at its base
        if self.reserved > before:
            bisect.insort(self._pin_bases, block.addr)
            self._pin_segment[block.addr] = self.reserved - before
            self._pin_made_for[block.addr] = tag
        base = self._pin_bases[bisect.bisect_right(self._pin_bases, block.addr) - 1]
        self._pin_base[handle] = base
        live = self._pin_live.setdefault(base, {})
        live[handle] = tag
        self._pin_used[base] = self._pin_used.get(base, 0) + block.size
        if len(live) == 1:
            self.pinned += self._pin_segment[base]
            if self.pinned > self.peak_pinned:
                self.peak_pinned, self.in_use = self.pinned, self.allocated
                self.stranded = self._stranded()
        return handle

    def free(self, handle: int) -> None:
        base = self._pin_base.pop(handle, None)
        if base is not None:
            live = self._pin_live[base]
            del live[handle]
            self._pin_used[base] -= self._live[handle].size
            if not live:
                self.pinned -= self._pin_segment[base]
        super().free(handle)

    def _stranded(self, top: int = 3) -> tuple[Stranded, ...]:
        worst = sorted(((self._pin_segment[b] - used, b) for b, used in self._pin_used.items()
                        if self._pin_live[b] and self._pin_segment[b] > used), reverse=True)[:top]
        out = []
        for free, b in worst:
            holders = sorted(((tag, self._live[h].size) for h, tag in self._pin_live[b].items()),
                             key=lambda x: -x[1])[:3]
            out.append(Stranded(self._pin_segment[b], free, self._pin_made_for.get(b), tuple(holders)))
        return tuple(out)


@dataclass(frozen=True)
class LoopReplay:
    """What :func:`unrolled_reserved` found: the reserved peak (room to spare), reserved and allocated when the loop
    ends, the peak of the segments holding live blocks (what a GPU needs), the live blocks then (``in_use``) and
    the segments whose free space was stranded then (:class:`Stranded`; tags are serials of the trace, or
    ``(serial, step)`` for a decoding step's tensor made from the traced last step)."""

    peak_reserved: int
    reserved: int
    allocated: int
    peak_pinned: int
    in_use: int
    stranded: tuple[Stranded, ...] = ()


def _loop_template(events: Sequence[int], sizes: Mapping[int, int], bounds: tuple[int, int, int, int, int, int],
                   slot: Mapping[int, str], replaced: Mapping[int, int]) -> Any:
    """The traced last step as a template: ``(its allocations, the loop's tensors before the jump → their place in
    it, cache slots → their place, [(+1 alloc / -1 free of this step's / -2 free of the previous step's, place)],
    base sizes)``, or ``None`` when the steps do not line up."""
    b0, j0, _j1, sl, bl, end = bounds
    a_last = [e for e in events[sl:end] if e > 0]
    bk_prev = [e for e in events[b0:j0] if e > 0]
    bk_last = [e for e in events[bl:end] if e > 0]
    if len(bk_prev) != len(bk_last):
        return None
    pos = {s: i for i, s in enumerate(a_last)}
    role = {s: pos[t] for s, t in zip(bk_prev, bk_last)}  # the loop's tensors: before the jump -> last step
    by_path = {slot[s]: i for s, i in pos.items() if s in slot}
    template: list[tuple[int, int]] = []
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
    return a_last, role, by_path, template, base


def unrolled_reserved(initial: Iterable[int], events: Sequence[int], sizes: Mapping[int, int],
                      bounds: tuple[int, int, int, int, int, int], steps: int, first: int, cached: int, *,
                      slot: Mapping[int, str], replaced: Mapping[int, int], token_bytes: Mapping[int, int],
                      persistent: Iterable[int] = (), settings: AllocatorSettings = DEFAULT_SETTINGS
                      ) -> LoopReplay | None:
    """The whole loop replayed through the caching allocator (:class:`PinnedAllocator`): the trace up to the jump,
    then steps ``first`` .. ``steps`` made from the traced last step, each allocation at the size it has at that
    step (a cache tensor of ``b`` bytes per token holds ``min(cached + step, its length in the last step)``
    tokens; the loop's own tensors are between their sizes before the jump and in the last step).

    ``bounds``: the event indices where the forward before the jump ended (its bookkeeping follows), where the
    jump starts and ends, where the last step starts, where its forward ends, and where the loop ends;
    ``cached``: tokens in the cache after the prefill; ``slot``: cache storages by slot (``layers[3].keys``);
    ``replaced``: storage the jump made → the one it stands in for; ``token_bytes``: a cache storage's bytes
    per token; ``persistent``: sizes allocated once after the initial storages (cuBLAS workspaces, tagged
    ``"workspace"``); ``settings``: the allocator's (not expandable segments: their pages are not segments).
    Transient small-pool allocations (≤ 1 MiB, made and freed within a step) repeat identically and are left out.
    ``None`` when the steps do not line up."""
    b0, j0, j1, sl, bl, end = bounds
    if not (b0 <= j0 <= j1 <= sl <= bl <= end) or steps < first:
        return None
    made = _loop_template(events, sizes, bounds, slot, replaced)
    if made is None:
        return None
    a_last, role, by_path, template, base = made

    def size(p: int, m: int) -> int:
        s = a_last[p]
        tb = token_bytes.get(s, 0)
        if tb:
            return min(sizes[s], tb * (cached + m))
        if p in base:
            return base[p] + (sizes[s] - base[p]) * m // max(steps, 1)
        return sizes[s]

    a = PinnedAllocator(settings=settings)
    handles: dict[int, int] = {}
    for s in initial:
        handles[s] = a.malloc(sizes[s], s)
    for n in persistent:
        a.malloc(n, "workspace")
    for e in events[:j0]:
        if e > 0:
            handles[e] = a.malloc(sizes[e], e)
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
                current[p] = a.malloc(size(p, m), (a_last[p], m))
            elif kind == -1:
                a.free(current[p])
                current[p] = 0
            else:
                a.free(previous[p])
                previous[p] = 0
        previous = current
    return LoopReplay(a.peak_reserved, a.reserved, a.allocated, a.peak_pinned, a.in_use, a.stranded)


def loop_allocation(r: Replayed, gen: Generation, trace: FakeRun, facts: dict[str, Any], spec: GenerateSpec,
                    target: Target) -> tuple[Replayed, Generation, str]:
    """The replayed trace ``r`` and the facts ``gen`` with what the caching allocator's replay of the whole loop says,
    and its note (``""``: the steps do not line up, nothing replayed)."""
    replay = _loop_replay(trace, facts, spec, target)
    if replay is None:
        return r, gen, ""
    reserved = max(r.reserved, replay.peak_reserved)
    growth = max(replay.reserved - replay.allocated, 0)
    pinned = replay.peak_pinned
    stranded = max(pinned - replay.in_use, 0)
    why = stranded_reason(replay.stranded, trace, pinned)
    gen = replace(gen, reserved_growth=growth, in_use=replay.in_use, stranded=stranded, stranded_by=why)
    r = replace(r, reserved=reserved, needed=max(pinned, r.peak.total) + r.context)
    note = (f"the caching allocator replayed over all {spec.new_tokens - 1} decoding steps (the cache asks for one "
            f"token more per layer each step): with room to spare it reserves up to {format_bytes(reserved)}, "
            f"{format_bytes(growth)} above allocated when the loop ends; a GPU needs the {format_bytes(pinned)} of "
            "segments holding live blocks at their peak (the allocator frees its cached segments when cudaMalloc "
            f"fails) + the CUDA context: {format_bytes(replay.in_use)} in use then and {format_bytes(stranded)} free "
            "inside those segments (a free block is split for a smaller request when no smaller one is large enough, "
            "and a segment goes back to the device only when nothing in it is in use)")
    if why:
        note += f"; {why}"
        if target.cuda.allocator.max_split_size is None:
            note += "; " + _max_split_hint(replay.stranded[0].segment)
    return r, gen, note


def _max_split_hint(segment: int) -> str:
    """PyTorch's allocator serves no request below ``max_split_size`` from a cached block of that size or more,
    nor a larger one from a block 20 MiB or more too large: such blocks are not split."""
    mib = 512
    while mib > 2 and mib << 20 > segment // 2:
        mib //= 2
    return (f"PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:{mib} keeps blocks of {mib} MiB or more from being split "
            f"(estimate it with alloc_conf='max_split_size_mb:{mib}')")


def stranded_reason(stranded: Any, trace: FakeRun, needed: int) -> str:
    """Words for the largest segment whose free space counts in what a GPU needs, when it holds a tenth of it or
    more: what it was made for and what keeps it (``""`` otherwise)."""
    if not stranded or stranded[0].free * 10 < needed:
        return ""
    top = stranded[0]
    holder, size = top.holders[0] if top.holders else (None, 0)
    return (f"{format_bytes(top.free)} of it in a {format_bytes(top.segment)} segment made for "
            f"{_tag_name(top.made_for, trace)}, which {_tag_name(holder, trace)} ({format_bytes(size)}) keeps "
            "from being given back")


def _tag_name(tag: Any, trace: FakeRun) -> str:
    """What a block of the allocator's replay holds, in words (its module and label; its decoding step)."""
    if tag == "workspace":
        return "the cuBLAS workspace"
    serial, step = tag if isinstance(tag, tuple) else (tag, None)
    label = trace.owner.get(serial, ("", "a tensor"))[1] if isinstance(serial, int) else "a tensor"
    module = trace.module.get(serial, "") if isinstance(serial, int) else ""
    text = f"{module}'s {label}" if module else label
    return text if step is None else f"{text} (decoding step {step})"


def _loop_replay(trace: FakeRun, facts: dict[str, Any], spec: GenerateSpec, target: Target) -> LoopReplay | None:
    marks = trace.marks
    last = spec.new_tokens - 1
    keys = ("bookkeeping_before_jump", "jump_start", "jump_end", f"step{last}", "forward_done", "loop_end")
    if not all(k in marks for k in keys):
        return None
    workspace = target.cuda.workspace(target.gpu)[0] if trace.uses_matmul else 0
    bounds = tuple(marks[k] for k in keys)
    first = max(s for s in facts["steps"] if s < last) + 1
    cached = facts["cached"]
    settings = target.cuda.allocator
    if settings.expandable_segments:  # pages mapped into one segment a pool: what stays pinned is not modelled
        settings = DEFAULT_SETTINGS
    return unrolled_reserved(trace.initial, trace.events, trace.sizes, bounds, last, first, cached,  # type: ignore[arg-type]
                             slot=facts["slot"], replaced=facts["replaced"], token_bytes=facts["token_bytes"],
                             persistent=(workspace,), settings=settings)


__all__ = ["GenerateTracer", "LoopReplay", "PinnedAllocator", "Stranded", "loop_allocation", "unrolled_reserved"]
