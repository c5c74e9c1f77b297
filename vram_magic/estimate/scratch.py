"""Kernel scratch on the CPU that dispatch-level counting cannot see.

oneDNN (mkldnn) convolutions reorder their input, weight and gradients into blocked layouts inside the op,
in buffers from PyTorch's allocator that are gone again when the op returns: invisible to a dispatch mode,
visible to the allocator (and the profiler's memory timeline). How much depends on the layer and on the
algorithm oneDNN picks on this machine, so it is measured rather than guessed: each distinct convolution
of the step is run for real at batch 1 and 2 under the profiler, and its scratch extrapolated linearly in
the batch. That costs a few milliseconds per distinct layer and kilobytes to megabytes of real memory.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


def conv_scratch(convs: list[tuple[int, Any, Any]]) -> dict[int, int]:
    """``{event index: scratch bytes}`` for the convolutions of a trace (``StepTracer.convs``)."""
    if not convs:
        return {}
    out: dict[int, int] = {}
    for index, func, spec in convs:
        extra = _scratch_for(str(func), _freeze(spec))
        if extra > 0:
            out[index] = max(out.get(index, 0), extra)
    return out


def _freeze(spec: Any) -> Any:
    if isinstance(spec, (list, tuple)):
        return tuple(_freeze(s) for s in spec)
    return spec


@functools.lru_cache(maxsize=512)
def _scratch_for(func: str, spec: Any) -> int:
    batch = _batch(func, spec)
    if batch is None:
        return 0
    try:
        e1 = _probe(func, spec, 1)
        e2 = _probe(func, spec, 2) if batch > 1 else e1
    except Exception:  # an op we cannot replay for real: no modelled scratch
        return 0
    return max(0, int(e1 + (e2 - e1) * (batch - 1)))


def _batch(func: str, spec: Any) -> int | None:
    first = spec[0]
    if isinstance(first, tuple) and first and first[0] == "T" and first[1]:
        return int(first[1][0])
    return None


def _real(spec: Any, batch: int | None) -> Any:
    if isinstance(spec, tuple) and spec and spec[0] == "T":
        _, shape, dtype, cl = spec
        if batch is not None:
            shape = (batch,) + tuple(shape[1:])
        t = torch.randn(shape, dtype=dtype) if dtype.is_floating_point else torch.zeros(shape, dtype=dtype)
        return t.contiguous(memory_format=torch.channels_last) if cl else t
    if isinstance(spec, tuple):
        return list(spec)
    return spec


def _probe(func: str, spec: Any, batch: int) -> int:
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    op = torch.ops.aten.convolution_backward.default if "backward" in func else torch.ops.aten.convolution.default
    if "backward" in func:
        args = [_real(spec[0], batch), _real(spec[1], batch), _real(spec[2], None)] + [
            _real(s, None) for s in spec[3:]]
    else:
        args = [_real(spec[0], batch), _real(spec[1], None),
                _real(spec[2], None) if spec[2] is not None else None] + [_real(s, None) for s in spec[3:]]
    with torch.no_grad():
        op(*args)  # warm up: oneDNN caches primitives and may allocate once
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with torch.profiler.record_function("vram_magic_probe"):
                result = op(*args)
        del result
    allocs: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    while stack:
        node = stack.pop()
        if node.typed[0] == _EventType.Allocation:
            allocs.append((node.start_time_ns, node.typed[1].alloc_size))
        stack.extend(node.children)
    allocs.sort()
    running = peak = 0
    for _, n in allocs:
        running += n
        peak = max(peak, running)
    return peak - running  # beyond what the op returned (still alive at the end of the range)
