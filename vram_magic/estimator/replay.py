"""From a traced step to an :class:`Estimate`: replay the allocations with the target device's sizes,
find the peak, split it by category, and check it against the GPU."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ..breakdown import Breakdown
from ..trace import alive_after
from ..units import parse_size
from .layouts.zero import Sharding, sharding_for
from .options import Options, optimizer_name, short_dtype
from .result import Estimate, Strategy
from .step.trace import trace_step
from .target.attention import target_capability
from .target.cuda import CudaModel, allocator_layout
from .target.gpus import GPU, find_gpu
from .tracing.request import Request
from .tracing.traced import Trace


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


def replay(trace: Trace, sizes: dict[int, int], spikes: dict[int, int],
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


def alive_at(trace: Trace, index: int) -> set[int]:
    return alive_after(trace.initial, trace.events, index)


def rows_at(trace: Trace, sizes: dict[int, int], index: int) -> dict[tuple[str, str], int]:
    rows: dict[tuple[str, str], int] = {}
    for s in alive_at(trace, index):
        key = trace.owner.get(s, ("other", "temporaries"))
        rows[key] = rows.get(key, 0) + sizes[s]
    return rows


def evaluate(request: Request, opts: Options, target: Target, *, model_name: str = "") -> Estimate:
    trace = trace_step(request, opts, target_capability(opts.device, target.gpu))
    return from_trace(trace, opts, target, model_name=model_name or request.source.name)


@dataclass(frozen=True, eq=False)
class StepRerun:
    """What makes a step's estimate again with other options: the request (the model's source, held weakly when
    it is a module; the inputs as shapes; the loss) and the target. Kept beside an estimate's numbers
    (``Estimate.rerun``) for the what-if table and the batch and sequence searches."""

    request: Request
    target: Target

    def evaluate(self, opts: Options) -> Estimate:
        return replace(evaluate(self.request, opts, self.target), rerun=self)

    def what_if(self, est: Estimate) -> list[Strategy]:
        from .step.candidates import what_if

        return what_if(est)


#: the note every CUDA estimate carries
CUDA_NOTE = ("CUDA is modelled: tensors are traced on fake CPU tensors with the optimizer CUDA would use; PyTorch's "
             "caching allocator is simulated (block sizes, segments, reserved memory); cuBLAS and cuDNN workspaces "
             "and the CUDA context are modelled constants")


def from_trace(trace: Trace, opts: Options, target: Target, *, model_name: str = "") -> Estimate:
    """The traced step replayed with the sizes one rank of the target device holds: its peak by category,
    what the device needs and whether it fits."""
    cuda = opts.device == "cuda"
    sharding = sharding_for(opts.zero, opts.world, trace.unit_param_bytes, trace.param_bytes)
    sizes, state_bytes = rank_sizes(trace, opts, sharding)
    spikes, spike_label = kernel_scratch(trace, cuda, target.cuda, sizes)
    notes: list[str] = list(trace.notes)
    if opts.master_weights:
        notes.append(_master_note(opts, sharding))
    buffers = sharding.buffers(not opts.inference) if sharding is not None else {}
    # FSDP/ZeRO gather and reduce during the forward and backward of a step; none is alive in the update
    window = (trace.marks.get("step_start", 0), trace.marks.get("backward_end", len(trace.events)),
              sum(buffers.values()))
    gpu = cuda_side(trace, opts, target, sizes, spikes, window) if cuda else None
    if gpu is not None:
        sizes = gpu.sizes
        notes.extend(gpu.notes)
    rows, modelled = peak_rows(trace, sizes, (spikes, spike_label), window, buffers, gpu)
    peak = Breakdown.from_rows(rows)
    fwd_index = trace.marks.get("forward_end", len(trace.events))
    reserved = max(gpu.reserved, peak.total) if gpu is not None else peak.total
    context = gpu.context if gpu is not None else 0
    needed = reserved + context
    capacity = target.capacity
    if trace.problem:
        notes.append(trace.problem)
    if gpu is not None:
        notes.append(CUDA_NOTE)
    return Estimate(
        model=model_name,
        description=opts.describe(),
        device=opts.device,
        peak=peak,
        after_forward=Breakdown.from_rows(rows_at(trace, sizes, fwd_index)),
        top_modules=top_modules(trace, sizes, fwd_index),
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
        fits=None if capacity is None else needed <= capacity,
        partial=trace.problem is not None,
        problem=trace.problem,
        modelled=tuple(modelled.items()),
        notes=tuple(notes),
        wall_time=trace.wall,
        loss=trace.loss,
        model_states=model_states(trace, opts, sharding, state_bytes),
        options=opts,
    )


def rank_sizes(trace: Trace, opts: Options, sharding: Sharding | None) -> tuple[dict[int, int], int]:
    """Each storage's bytes on one rank of the device (Adam's ``step`` counters on the host with CUDA unless the
    optimizer is fused or capturable; the sharded share under ZeRO; optimizer state offloaded to the host), and
    the optimizer state's bytes before sharding and offload."""
    sizes = dict(trace.sizes)
    if opts.device == "cuda" and not trace.fused:
        for s in trace.host_scalars:
            sizes[s] = 0
    state_bytes = sum(sizes[s] for s, (cat, _) in trace.owner.items() if cat == "optimizer_state" and s in sizes)
    if sharding is not None or opts.offload:
        for s, (cat, label) in trace.owner.items():
            if opts.offload and (cat == "optimizer_state" or label == "optimizer temporaries"):
                sizes[s] = 0
            elif sharding is not None and sharding.divides(cat, label):
                sizes[s] = -(-sizes[s] // sharding.world)
    return sizes, state_bytes


def kernel_scratch(trace: Trace, cuda: bool, cm: CudaModel, sizes: dict[int, int]) -> tuple[dict[int, int], str]:
    """What kernels allocate and free inside one op (``{events applied: bytes}``) and what it is called: on CUDA
    the modelled cuDNN workspace of each convolution, on the CPU what oneDNN and the GEMMs were measured to use.
    The recurrent layers' workspaces (a proxy for cuDNN's reserve on CUDA) are set in ``sizes``."""
    rnn_spikes: dict[int, int] = {}
    if trace.rnns:
        from .tracing.scratch import rnn_sizes

        workspaces, rnn_spikes = rnn_sizes(trace.rnns)
        sizes.update(workspaces)
    if cuda:
        if trace.convs and cm.cudnn_workspace:
            return {i: cm.cudnn_workspace for i, _, _ in trace.convs}, "cuDNN workspace (modelled)"
        return {}, ""
    spikes: dict[int, int] = {}
    label = ""
    if trace.convs:
        from .tracing.scratch import conv_scratch

        spikes = conv_scratch(trace.convs)
        label = "kernel scratch (oneDNN convolutions measured per layer, GEMM operand copies)"
    extra = list(rnn_spikes.items()) + list(trace.copies)
    if trace.gemms:
        from .tracing.scratch import gemm_scratch

        extra += list(gemm_scratch(trace.gemms).items())
    for i, n in extra:
        spikes[i] = spikes.get(i, 0) + n
    if trace.rnns:
        label = label or "kernel scratch (oneDNN recurrent layers, measured)"
    if trace.copies:
        label = label or "kernel scratch (GEMM operand copies)"
    if trace.gemms:
        label = label or "kernel scratch (half-precision GEMMs measured per shape)"
    return spikes, label


@dataclass(frozen=True)
class CudaSide:
    """What the CUDA model makes of a traced step: each storage's block in the simulated caching allocator, the
    peak it reserves, the cuBLAS workspaces, the context, and the notes about them."""

    sizes: dict[int, int]
    reserved: int
    workspaces: int
    context: int
    notes: tuple[str, ...]


def cuda_side(trace: Trace, opts: Options, target: Target, sizes: dict[int, int], spikes: dict[int, int],
              window: tuple[int, int, int]) -> CudaSide:
    cm = target.cuda
    workspace, workspace_note = cm.workspace(target.gpu)
    handles = (1 if opts.inference else 2) if trace.uses_matmul else 0  # the forward's thread and autograd's
    layout = allocator_layout(trace.initial, trace.events, sizes, persistent=[workspace] * handles, spikes=spikes,
                              window=window, settings=cm.allocator)
    blocks = {s: layout.blocks.get(s, n) for s, n in sizes.items()}
    notes = (workspace_note,) if handles and target.gpu is None and workspace_note else ()
    if not cm.allocator.is_default or cm.allocator.unmodelled:
        notes += (cm.allocator.note("PyTorch's caching allocator is simulated"),)
    return CudaSide(blocks, layout.peak_reserved, workspace * handles, cm.context, notes)


def peak_rows(trace: Trace, sizes: dict[int, int], scratch: tuple[dict[int, int], str],
              window: tuple[int, int, int], buffers: dict[str, int],
              gpu: CudaSide | None) -> tuple[dict[tuple[str, str], int], dict[str, int]]:
    """``(rows, modelled)`` at the peak: ``(category, label) → bytes`` of what is alive with the modelled parts
    added (kernel scratch, cuBLAS workspaces, collective buffers), and the modelled parts by label."""
    spikes, spike_label = scratch
    index, _, spike = replay(trace, sizes, spikes, window)
    rows = rows_at(trace, sizes, index)
    modelled: dict[str, int] = {}
    in_window = window[0] <= index <= window[1]
    spike -= window[2] if in_window else 0
    if spike:
        rows[("other", spike_label)] = spike
        modelled[spike_label] = spike
    if gpu is not None and gpu.workspaces:
        rows[("other", "cuBLAS workspaces (modelled)")] = gpu.workspaces
        modelled["cuBLAS workspaces"] = gpu.workspaces
    if in_window:
        for label, n in buffers.items():
            if n:
                rows[("other", f"{label} (modelled)")] = n
                modelled[label] = n
    return rows, modelled


def top_modules(trace: Trace, sizes: dict[int, int], index: int) -> tuple[tuple[str, int], ...]:
    """The eight modules whose activations hold the most after ``index`` events (the end of the forward)."""
    top: dict[str, int] = {}
    for s in alive_at(trace, index):
        if trace.owner.get(s, ("",))[0] == "activations":
            name = trace.module.get(s) or "(outside modules)"
            top[name] = top.get(name, 0) + sizes[s]
    return tuple(sorted(top.items(), key=lambda kv: -kv[1])[:8])


def model_states(trace: Trace, opts: Options, sharding: Sharding | None, state_bytes: int) -> int:
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


def _master_note(opts: Options, sharding: Sharding | None) -> str:
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
