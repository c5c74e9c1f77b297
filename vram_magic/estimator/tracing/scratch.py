"""Kernel scratch on the CPU that dispatch-level counting cannot see.

oneDNN (mkldnn) convolutions reorder their input, weight and gradients into blocked layouts inside the op,
in buffers from PyTorch's allocator that are gone again when the op returns: invisible to a dispatch mode,
visible to the allocator (and the profiler's memory timeline). How much depends on the layer and on the
algorithm oneDNN picks on this machine, so it is measured rather than guessed: each distinct convolution
of the step is run for real under the profiler, at the step's batch when its tensors take at most
``PROBE_BUDGET``, else at the two largest batches that do, extrapolated linearly in the batch (exact at
small batches, where oneDNN may pick other algorithms, is why two tiny batches are not enough).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ...engine.profiler.recorder import quiet_stderr


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


#: Real memory the probes may use: a layer whose tensors fit runs at the step's own batch (exact); a
#: bigger one runs at the two largest batches that fit, and its scratch is extrapolated linearly.
PROBE_BUDGET = 256 * 2**20


@functools.lru_cache(maxsize=512)
def _scratch_for(func: str, spec: Any) -> int:
    batch = _batch(func, spec)
    if batch is None:
        return 0
    per_sample = sum(_nbytes(s) // max(batch, 1) for s in spec[:2] if _is_tensor(s)) or 1
    largest = max(1, PROBE_BUDGET // (4 * per_sample))
    try:
        if batch <= largest:
            return max(0, _probe(func, spec, batch))
        b2 = largest
        b1 = max(1, b2 // 2)
        if b1 == b2:
            b2 = b1 + 1
        e1, e2 = _probe(func, spec, b1), _probe(func, spec, b2)
    except Exception:  # an op we cannot replay for real: no modelled scratch
        return 0
    return max(0, int(e2 + (e2 - e1) * (batch - b2) / (b2 - b1)))


def _is_tensor(spec: Any) -> bool:
    return isinstance(spec, tuple) and bool(spec) and spec[0] == "T"


def _nbytes(spec: Any) -> int:
    n = 1
    for d in spec[1]:
        n *= d
    return n * torch.empty((), dtype=spec[2]).element_size()


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
        if cl:  # NHWC strides even where size-1 dimensions leave ``contiguous(memory_format=...)`` a no-op
            n, c, h, w = shape
            return torch.zeros((n, h, w, c), dtype=dtype).permute(0, 3, 1, 2)
        return torch.zeros(shape, dtype=dtype)  # the values do not size the scratch; zeros are the cheapest to make
    if isinstance(spec, tuple):
        return list(spec)
    return spec


def _probe(func: str, spec: Any, batch: int) -> int:
    op = torch.ops.aten.convolution_backward.default if "backward" in func else torch.ops.aten.convolution.default
    if "backward" in func:
        args = [_real(spec[0], batch), _real(spec[1], batch), _real(spec[2], None)] + [
            _real(s, None) for s in spec[3:]]
    else:
        args = [_real(spec[0], batch), _real(spec[1], None),
                _real(spec[2], None) if spec[2] is not None else None] + [_real(s, None) for s in spec[3:]]
    return _probe_op(op, args)


def _extra(prof: Any) -> int:
    from ...engine.torch_private import profiler_event_type

    _EventType = profiler_event_type()

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


# --- oneDNN recurrent layers ----------------------------------------------------------------------------
# Dimension holding the batch in each tensor argument of mkldnn_rnn_layer and of its backward.
_RNN_BATCH_DIMS = {0: 1, 5: 0, 6: 0}
_RNN_BACKWARD_BATCH_DIMS = {0: 1, 5: 0, 6: 0, 7: 1, 8: 0, 9: 0, 10: 1, 11: 0, 12: 0}


def rnn_sizes(rnns: list[tuple[int, Any, Any, int]]) -> tuple[dict[int, int], dict[int, int]]:
    """``({workspace serial: bytes}, {event index: scratch bytes})`` for the oneDNN LSTM/GRU layers of a
    trace: fake kernels give the layer an empty workspace (the real one is kept for backward), and the
    kernels' scratch is invisible at dispatch level; both are measured on a real layer."""
    workspaces: dict[int, int] = {}
    spikes: dict[int, int] = {}
    forward_specs: dict[Any, Any] = {}
    for index, func, spec, serial in rnns:
        key = _freeze(spec)
        backward = "backward" in str(func)
        try:
            ws, extra = _rnn_probe(backward, key)
        except Exception:  # cannot replay this layer for real: leave it as traced
            continue
        if not backward:
            forward_specs[key] = ws
            if serial:
                workspaces[serial] = ws
        if extra:
            spikes[index] = spikes.get(index, 0) + extra
    return workspaces, spikes


def _scaled(spec: Any, dims: dict[int, int], batch: int) -> list[Any]:
    out = []
    for i, s in enumerate(spec):
        if i in dims and _is_tensor(s):
            shape = list(s[1])
            shape[dims[i]] = batch
            s = ("T", tuple(shape), s[2], s[3])
        out.append(_real(s, None) if _is_tensor(s) or s is None else (list(s) if isinstance(s, tuple) else s))
    return out


@functools.lru_cache(maxsize=256)
def _rnn_probe(backward: bool, spec: Any) -> tuple[int, int]:
    """``(workspace bytes, scratch bytes)`` of one layer at the step's batch (extrapolated when big)."""
    batch = int(spec[0][1][1])
    per_sample = max(1, _nbytes(spec[0]) // max(batch, 1))
    largest = max(1, PROBE_BUDGET // (8 * per_sample))
    if batch <= largest:
        return _rnn_once(backward, spec, batch)
    b2 = max(2, largest)
    b1 = b2 // 2
    (w1, e1), (w2, e2) = _rnn_once(backward, spec, b1), _rnn_once(backward, spec, b2)
    scale = (batch - b2) / (b2 - b1)
    return int(w2 + (w2 - w1) * scale), max(0, int(e2 + (e2 - e1) * scale))


def _rnn_once(backward: bool, spec: Any, batch: int) -> tuple[int, int]:
    from torch.profiler import ProfilerActivity, profile

    fwd = torch.ops.aten.mkldnn_rnn_layer.default
    if backward:
        # the forward that made this layer's workspace: same input, weights, states and options
        fspec = (spec[0], spec[1], spec[2], spec[3], spec[4], spec[5], spec[6], spec[13], spec[20], spec[14],
                 spec[15], spec[16], spec[17], spec[19], spec[21], spec[18])
        fargs = _scaled(fspec, _RNN_BATCH_DIMS, batch)
        args = _scaled(spec, _RNN_BACKWARD_BATCH_DIMS, batch)
        outs = fwd(*fargs)  # (not under no_grad: the kernel then skips its workspace)
        args[22] = outs[3]
        op = torch.ops.aten.mkldnn_rnn_layer_backward.default
    else:
        args = _scaled(spec, _RNN_BATCH_DIMS, batch)
        op = fwd
    op(*args)  # no tensor here requires grad, so no graph is recorded
    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.profiler.record_function("vram_magic_probe"):
            result = op(*args)
    workspace = 0 if backward else int(result[3].untyped_storage().nbytes())
    del result
    return workspace, _extra(prof)


# --- half-precision GEMMs ---------------------------------------------------------------------------------
def gemm_scratch(gemms: list[tuple[int, Any, Any]]) -> dict[int, int]:
    """``{event index: scratch bytes}`` for the bf16/fp16 GEMMs of a trace: oneDNN packs their operands in
    buffers of its own (sized by shapes, strides and threads), measured on one real GEMM per distinct spec."""
    out: dict[int, int] = {}
    for index, func, spec in gemms:
        extra = _gemm_scratch_for(str(func), _freeze(spec))
        if extra > 0:
            out[index] = max(out.get(index, 0), extra)
    return out


#: A GEMM with more than twice this many rows is probed at this many rows and at twice as many: where the two agree,
#: oneDNN's packing scratch has stopped growing with the rows, and that is the GEMM's figure; where they differ, the
#: GEMM is probed whole. The scratch is sized by the columns, the inner dimension, the layout and the threads, and stops
#: growing with the rows early (bf16 on AVX-512 BF16, one thread: the same bytes from 256 to 4,096 rows; on AVX2, two
#: threads: from 512-1,024 rows), while a probe's time grows with the rows: on CPUs without bf16 or fp16 GEMMs, where
#: a large probe takes seconds to minutes, this keeps a plan's probes to a fraction of their cost.
GEMM_ROWS_CAP = 256

_GEMM_OPS = {"aten.mm.default": torch.ops.aten.mm.default, "aten.addmm.default": torch.ops.aten.addmm.default,
             "aten.bmm.default": torch.ops.aten.bmm.default}
#: where the rows of the product are: (argument, dimension) of the left operand
_GEMM_ROWS = {"aten.mm.default": (0, 0), "aten.addmm.default": (1, 0), "aten.bmm.default": (0, 1)}


@functools.lru_cache(maxsize=1024)
def _gemm_scratch_for(func: str, spec: Any) -> int:
    op = _GEMM_OPS.get(func)
    if op is None:
        return 0
    arg, dim = _GEMM_ROWS[func]
    try:
        if spec[arg][1][dim] > 2 * GEMM_ROWS_CAP:
            small, large = (_gemm_probe(op, _with_rows(func, spec, r)) for r in (GEMM_ROWS_CAP, 2 * GEMM_ROWS_CAP))
            if small is not None and small == large:
                return max(0, large)
        whole = _gemm_probe(op, spec)
    except Exception:  # an argument we cannot rebuild: no modelled scratch
        return 0
    return max(0, whole or 0)


def _gemm_probe(op: Any, spec: Any) -> int | None:
    """The scratch of one real GEMM of ``spec``'s shapes and strides; None where its operands would take more than
    ``PROBE_BUDGET`` (too big to run here: not measured)."""
    if sum(_strided_bytes(s) for s in spec if _is_strided(s)) > PROBE_BUDGET:
        return None
    return _probe_op(op, [_strided(s) if _is_strided(s) else s for s in spec])


def _is_strided(spec: Any) -> bool:
    """Whether an argument's spec is a tensor's ``("S", shape, stride, dtype)`` (tracer.strided_spec)."""
    return isinstance(spec, tuple) and bool(spec) and spec[0] == "S"


def _with_rows(func: str, spec: Any, rows: int) -> tuple[Any, ...]:
    """``spec`` with the product's rows cut to ``rows``: the left operand (and an ``addmm`` bias that has them), each
    in the same layout (a stride that stepped over all the rows now steps over ``rows``)."""
    arg, dim = _GEMM_ROWS[func]
    out = list(spec)
    out[arg] = _cut(spec[arg], dim, rows)
    if func == "aten.addmm.default":
        bias = spec[0]
        if _is_strided(bias) and len(bias[1]) == 2 and bias[1][0] == spec[arg][1][dim]:
            out[0] = _cut(bias, 0, rows)
    return tuple(out)


def _cut(spec: Any, dim: int, rows: int) -> tuple[Any, ...]:
    _, shape, stride, dtype = spec
    old = shape[dim]
    span = old * stride[dim]
    new_shape = tuple(rows if i == dim else n for i, n in enumerate(shape))
    new_stride = tuple(st // old * rows if i != dim and stride[dim] and st == span else st
                       for i, st in enumerate(stride))
    return ("S", new_shape, new_stride, dtype)


def _strided_bytes(spec: Any) -> int:
    _, shape, stride, dtype = spec
    extent = 1 + sum((n - 1) * st for n, st in zip(shape, stride) if n > 0)
    return extent * torch.empty((), dtype=dtype).element_size()


def _strided(spec: Any) -> torch.Tensor:
    _, shape, stride, dtype = spec
    # zeros: the values do not size oneDNN's packing buffers, and filling with random numbers took most of a probe's
    # time (bf16 normal_ on the CPU: 0.75 s of a small GPT-2's plan)
    return torch.empty_strided(shape, stride, dtype=dtype).zero_()


def _probe_op(op: Any, args: list[Any]) -> int:
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        op(*args)  # warm up: oneDNN caches primitives and may allocate once
        with quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with torch.profiler.record_function("vram_magic_probe"):
                result = op(*args)
        del result
    return _extra(prof)
