"""From a traced step to an :class:`Estimate`: replay the allocations with the target device's sizes,
find the peak, split it by category, and check it against the GPU."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..report import Breakdown
from ..trace import alive_after
from ..units import parse_size
from .cuda_model import CudaModel, allocator_layout
from .gpus import GPU, find_gpu
from .options import Options
from .result import Estimate
from .run import Request, StepTrace, trace_step
from .sharding import sharding_for


@dataclass(frozen=True)
class Target:
    """Where the step should run: a catalogued GPU or a budget, and the CUDA model's constants."""

    gpu: GPU | None = None
    budget: int | None = None
    cuda: CudaModel = CudaModel()

    @property
    def capacity(self) -> int | None:
        if self.budget is not None:
            return self.budget
        return self.gpu.memory if self.gpu is not None else None


def make_target(gpu: Any = None, budget: Any = None, cuda: CudaModel | None = None) -> Target:
    g = gpu if isinstance(gpu, GPU) or gpu is None else find_gpu(gpu)
    b = parse_size(budget) if budget is not None else None
    if cuda is not None and not isinstance(cuda, CudaModel):
        raise TypeError(f"cuda must be a CudaModel (vram_magic.estimator.CudaModel(context=...)), not "
                        f"{type(cuda).__name__}")
    return Target(g, b, cuda or CudaModel())


def replay(trace: StepTrace, sizes: dict[int, int], spikes: dict[int, int],
           window: tuple[int, int, int] = (0, -1, 0)) -> tuple[int, int, int]:
    """``(peak index, peak bytes, scratch bytes in that peak)``; index = number of events applied.
    ``window = (first, last, bytes)``: bytes alive from event index ``first`` to ``last`` (collective buffers)."""
    current = sum(sizes[s] for s in trace.initial)
    best, best_index, best_spike = current, 0, 0
    lo, hi, extra = window
    for i, ev in enumerate(trace.events):
        if ev > 0:
            current += sizes[ev]
        else:
            current -= sizes[-ev]
        spike = spikes.get(i + 1, 0) + (extra if lo <= i + 1 <= hi else 0)
        if current + spike > best:
            best, best_index, best_spike = current + spike, i + 1, spike
    return best_index, best, best_spike


def alive_at(trace: StepTrace, index: int) -> set[int]:
    return alive_after(trace.initial, trace.events, index)


def rows_at(trace: StepTrace, sizes: dict[int, int], index: int) -> dict[tuple[str, str], int]:
    rows: dict[tuple[str, str], int] = {}
    for s in alive_at(trace, index):
        key = trace.owner.get(s, ("other", "temporaries"))
        rows[key] = rows.get(key, 0) + sizes[s]
    return rows


def evaluate(request: Request, opts: Options, target: Target, *, model_name: str = "") -> Estimate:
    trace = trace_step(request, opts)
    return from_trace(trace, opts, target, model_name=model_name or request.source.name)


def from_trace(trace: StepTrace, opts: Options, target: Target, *, model_name: str = "") -> Estimate:
    cuda = opts.device == "cuda"
    cm = target.cuda
    sizes = dict(trace.sizes)
    modelled: dict[str, int] = {}
    notes: list[str] = list(trace.notes)
    if cuda:
        if not trace.fused:
            for s in trace.host_scalars:  # Adam's `step` counters live on the host unless fused/capturable
                sizes[s] = 0
    state_bytes = sum(sizes[s] for s, (cat, _) in trace.owner.items() if cat == "optimizer_state" and s in sizes)
    sharding = sharding_for(opts.zero, opts.world, trace.unit_param_bytes, trace.param_bytes)
    if sharding is not None or opts.offload:
        for s, (cat, label) in trace.owner.items():
            if opts.offload and (cat == "optimizer_state" or label == "optimizer temporaries"):
                sizes[s] = 0
            elif sharding is not None and sharding.divides(cat, label):
                sizes[s] = -(-sizes[s] // sharding.world)
    spikes: dict[int, int] = {}
    spike_label = ""
    if cuda:
        if trace.convs and cm.cudnn_workspace:
            spikes = {i: cm.cudnn_workspace for i, _, _ in trace.convs}
            spike_label = "cuDNN workspace (modelled)"
    elif trace.convs:
        from .scratch import conv_scratch

        spikes = conv_scratch(trace.convs)
        spike_label = "kernel scratch (oneDNN convolutions measured per layer, GEMM operand copies)"
    if trace.rnns:  # oneDNN LSTM/GRU layers: the real workspace (a proxy for cuDNN's reserve on CUDA)
        from .scratch import rnn_sizes

        workspaces, rnn_spikes = rnn_sizes(trace.rnns)
        for s, n in workspaces.items():
            sizes[s] = n
        if not cuda:
            for i, n in rnn_spikes.items():
                spikes[i] = spikes.get(i, 0) + n
            spike_label = spike_label or "kernel scratch (oneDNN recurrent layers, measured)"
    if not cuda:
        for i, n in trace.copies:
            spikes[i] = spikes.get(i, 0) + n
        if trace.copies and not spike_label:
            spike_label = "kernel scratch (GEMM operand copies)"
        if trace.gemms:
            from .scratch import gemm_scratch

            for i, n in gemm_scratch(trace.gemms).items():
                spikes[i] = spikes.get(i, 0) + n
            spike_label = spike_label or "kernel scratch (half-precision GEMMs measured per shape)"
    states = model_states(trace, opts, sharding, state_bytes)
    if opts.master_weights:
        notes.append(_master_note(opts, sharding))
    buffers = sharding.buffers(not opts.inference) if sharding is not None else {}
    # FSDP/ZeRO gather and reduce during the forward and backward of a step; none is alive in the update
    window = (trace.marks.get("step_start", 0), trace.marks.get("backward_end", len(trace.events)),
              sum(buffers.values()))
    layout = None
    workspace, workspace_note = cm.workspace(target.gpu) if cuda else (0, "")
    handles = (1 if opts.inference else 2) if cuda and trace.uses_matmul else 0
    if cuda:  # the caching allocator, simulated: block sizes, segments, what it reserves
        layout = allocator_layout(trace.initial, trace.events, sizes, persistent=[workspace] * handles,
                                  spikes=spikes, window=window)
        sizes = {s: layout.blocks.get(s, n) for s, n in sizes.items()}
    index, _, spike = replay(trace, sizes, spikes, window)
    rows = rows_at(trace, sizes, index)
    in_window = window[0] <= index <= window[1]
    spike -= window[2] if in_window else 0
    if spike:
        rows[("other", spike_label)] = spike
        modelled[spike_label] = spike
    if handles:
        ws = workspace * handles
        rows[("other", "cuBLAS workspaces (modelled)")] = ws
        modelled["cuBLAS workspaces"] = ws
        if target.gpu is None and workspace_note:
            notes.append(workspace_note)
    if in_window:
        for label, n in buffers.items():
            if n:
                rows[("other", f"{label} (modelled)")] = n
                modelled[label] = n
    peak = Breakdown.from_rows(rows)
    fwd_index = trace.marks.get("forward_end", len(trace.events))
    after_forward = Breakdown.from_rows(rows_at(trace, sizes, fwd_index))
    top: dict[str, int] = {}
    for s in alive_at(trace, fwd_index):
        if trace.owner.get(s, ("",))[0] == "activations":
            name = trace.module.get(s) or "(outside modules)"
            top[name] = top.get(name, 0) + sizes[s]
    top_modules = tuple(sorted(top.items(), key=lambda kv: -kv[1])[:8])
    reserved = max(layout.peak_reserved, peak.total) if layout is not None else peak.total
    context = cm.context if cuda else 0
    needed = reserved + context
    capacity = target.capacity
    fits = None if capacity is None else needed <= capacity
    if trace.problem:
        notes.append(trace.problem)
    if cuda:
        notes.append("CUDA is modelled: tensors are traced on fake CPU tensors with the optimizer CUDA would use; "
                     "PyTorch's caching allocator is simulated (block sizes, segments, reserved memory); cuBLAS and "
                     "cuDNN workspaces and the CUDA context are modelled constants")
    return Estimate(
        model=model_name,
        description=opts.describe(),
        device=opts.device,
        peak=peak,
        after_forward=after_forward,
        top_modules=top_modules,
        flops=dict(trace.flops),
        batch=trace.batch,
        seq=trace.seq,
        micro_batch=trace.micro_batch,
        parameters=trace.param_count,
        gpu=target.gpu.name if target.gpu is not None else None,
        capacity=capacity,
        reserved=reserved,
        context=context,
        needed=needed,
        fits=fits,
        partial=trace.problem is not None,
        problem=trace.problem,
        modelled=tuple(modelled.items()),
        notes=tuple(notes),
        wall_time=trace.wall,
        loss=trace.loss,
        model_states=states,
        options=opts,
    )


def model_states(trace: StepTrace, opts: Options, sharding: Any, state_bytes: int) -> int:
    """Bytes of parameters, gradients and optimizer state one rank holds for the whole step (the ZeRO paper's
    *model states*), whatever is alive at the peak."""
    if opts.inference:
        return trace.param_bytes
    stage = sharding.stage if sharding is not None else 0
    world = sharding.world if sharding is not None else 1
    params = -(-trace.param_bytes // world) if stage >= 3 else trace.param_bytes
    grads = -(-trace.grad_bytes // world) if stage >= 2 else trace.grad_bytes
    state = 0 if opts.offload else (-(-state_bytes // world) if stage >= 1 else state_bytes)
    return params + grads + state


def _master_note(opts: Options, sharding: Any) -> str:
    from .options import optimizer_name, short_dtype

    half = short_dtype(opts.dtype)
    text = (f"mixed precision with fp32 master weights: {half} weights and gradients in the model, an fp32 copy of "
            f"the weights and the {optimizer_name(opts.optimizer)} state in the optimizer (with Adam 2 + 2 + 12 "
            "bytes per parameter, the ZeRO paper's scheme); gradients are cast to fp32 for the update")
    if sharding is not None:
        what = {1: "the optimizer's fp32 copy and state", 2: "the optimizer's fp32 copy and state and the gradients",
                3: "the optimizer's fp32 copy and state, the gradients and the weights"}[sharding.stage]
        text += f"; ZeRO-{sharding.stage} shards {what} across {sharding.world} ranks"
    return text


def search_max(fits: Callable[[int], bool], start: int, limit: int = 1 << 20,
               progress: Callable[[str], None] | None = None) -> tuple[int, int]:
    """Largest ``n`` with ``fits(n)`` (to within 3 %): doubling from ``start``, then bisection.
    ``(n, trials)``; 0 if even 1 does not fit."""
    trials = 0

    def test(n: int) -> bool:
        nonlocal trials
        trials += 1
        ok = fits(n)
        if progress is not None:
            progress(f"{n}: {'fits' if ok else 'does not fit'}")
        return ok

    lo, hi = 0, None
    n = max(start, 1)
    if test(n):
        lo = n
        while n < limit:
            n = min(n * 2, limit)
            if test(n):
                lo = n
            else:
                hi = n
                break
        if hi is None:
            return lo, trials
    else:
        hi = n
        n = n // 2
        while n >= 1:
            if test(n):
                lo = n
                break
            hi = n
            n //= 2
        if lo == 0:
            return 0, trials
    while hi - lo > max(1, lo // 32):  # within 3 %: each trial is a full fake run
        mid = (lo + hi) // 2
        if test(mid):
            lo = mid
        else:
            hi = mid
    return lo, trials
