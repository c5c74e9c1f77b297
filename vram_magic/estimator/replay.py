"""From a trace to one rank's peak on the target device: the traced allocations replayed with the sizes the rank
holds (the layout's share, the caching allocator's blocks on CUDA), the kernels' scratch and the collectives' buffers
added where they are alive, the peak found and split by category, and what the device needs.

Nothing here traces: every option applied after the trace (the layout, offload, the GPU, the budget) is a replay of
the same trace, which is what makes the what-if rows, the searches and the planner cheap."""

from __future__ import annotations

from dataclasses import dataclass

from ..core.breakdown import Breakdown
from ..core.events import alive_after, event_deltas, peak_of
from ..core.units import format_bytes
from .device import Target
from .device.cuda_model import CudaAllocation, CudaModel, cuda_allocation
from .device.gpus import GPU
from .layouts import layout_for
from .options import Options
from .tracing.traced import FakeRun

#: the note every CUDA estimate carries
CUDA_NOTE = ("CUDA is modelled: tensors are traced on fake CPU tensors with the optimizer CUDA would use; PyTorch's "
             "caching allocator is simulated (block sizes, segments, reserved memory); cuBLAS and cuDNN workspaces "
             "and the CUDA context are modelled constants")


@dataclass(frozen=True)
class Replayed:
    """One rank's numbers of a replayed trace: the peak by category, what was alive after the forward, the largest
    activations, what the device reserves and needs, what was modelled rather than traced, and the notes."""

    peak: Breakdown
    after_forward: Breakdown
    top_modules: tuple[tuple[str, int], ...]
    reserved: int
    context: int
    needed: int
    capacity: int | None
    modelled: tuple[tuple[str, int], ...]
    notes: tuple[str, ...]
    model_states: int
    host: int = 0  # what the host keeps for the rank (offloaded state; with FSDP2's CPUOffloadPolicy also the shards)
    pinned: int = 0  # the part of ``host`` in pinned memory

    @property
    def fits(self) -> bool | None:
        return None if self.capacity is None else self.needed <= self.capacity


def capacity_note(gpu: GPU) -> str:
    """Where a catalogued GPU's capacity comes from: what CUDA lets PyTorch allocate, not nvidia-smi's total."""
    smi = f"; nvidia-smi shows {format_bytes(gpu.reported)}" if gpu.reported and gpu.reported != gpu.memory else ""
    return (f"capacity: what CUDA lets PyTorch allocate on a {gpu.name}, {format_bytes(gpu.memory)} "
            f"({gpu.source}){smi}")


def replay(trace: FakeRun, sizes: dict[int, int], spikes: dict[int, int],
           window: tuple[int, int, int] = (0, -1, 0)) -> tuple[int, int, int]:
    """``(peak index, peak bytes, scratch bytes in that peak)``; index = number of events applied.
    ``window = (first, last, bytes)``: bytes alive from event index ``first`` to ``last`` (collective buffers)."""
    lo, hi, extra = window
    alive = dict(spikes)
    if extra:
        for i in range(max(lo, 1), min(hi, len(trace.events)) + 1):
            alive[i] = alive.get(i, 0) + extra
    start = sum(sizes[s] for s in trace.initial)
    top = peak_of(event_deltas(trace.events, sizes), start, spikes=alive)
    return top.index, top.level, alive.get(top.index, 0)


def alive_at(trace: FakeRun, index: int) -> set[int]:
    return alive_after(trace.initial, trace.events, index)


def rows_at(trace: FakeRun, sizes: dict[int, int], index: int) -> dict[tuple[str, str], int]:
    rows: dict[tuple[str, str], int] = {}
    for s in alive_at(trace, index):
        key = trace.owner.get(s, ("other", "temporaries"))
        rows[key] = rows.get(key, 0) + sizes[s]
    return rows


def from_trace(trace: FakeRun, opts: Options, target: Target) -> Replayed:
    """The trace replayed with the sizes one rank of the target device holds: its peak by category, what the device
    needs and whether it fits."""
    cuda = opts.device == "cuda"
    layout = layout_for(opts, trace)
    sizes, state_bytes = layout.rank_sizes(trace, opts)
    spikes, spike_label = kernel_scratch(trace, cuda, target.cuda, sizes)
    notes: list[str] = list(trace.notes)
    notes.extend(layout.notes(opts))
    buffers = layout.buffers(not opts.inference)
    window = (*layout.window(trace), sum(buffers.values()))
    gpu = cuda_allocation(trace, opts.inference, target.cuda, target.gpu, sizes, spikes, window) if cuda else None
    if gpu is not None:
        sizes = gpu.sizes
        notes.extend(gpu.notes)
    rows, modelled = peak_rows(trace, sizes, (spikes, spike_label), window, buffers, gpu)
    peak = Breakdown.from_rows(rows)
    fwd_index = trace.marks.get("forward_end", len(trace.events))
    reserved = max(gpu.reserved, peak.total) if gpu is not None else peak.total
    context = gpu.context if gpu is not None else 0
    if trace.problem:
        notes.append(trace.problem)
    if gpu is not None:
        notes.append(CUDA_NOTE)
    if target.gpu is not None and target.budget is None:
        notes.append(capacity_note(target.gpu))
    return Replayed(
        peak=peak,
        after_forward=Breakdown.from_rows(rows_at(trace, sizes, fwd_index)),
        top_modules=top_modules(trace, sizes, fwd_index),
        reserved=reserved,
        context=context,
        needed=reserved + context,
        capacity=target.capacity,
        modelled=tuple(modelled.items()),
        notes=tuple(notes),
        model_states=layout.model_states(trace, opts, state_bytes),
        **host_of(layout, trace, opts),
    )


def host_of(layout: object, trace: FakeRun, opts: Options) -> dict[str, int]:
    """``{"host", "pinned"}``: what the layout keeps on the host for the rank, where it says (offload)."""
    of = getattr(layout, "host_bytes", None)
    if of is None:
        return {}
    host, pinned = of(trace, opts)
    return {"host": host, "pinned": pinned}


def kernel_scratch(trace: FakeRun, cuda: bool, cm: CudaModel, sizes: dict[int, int]) -> tuple[dict[int, int], str]:
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


def peak_rows(trace: FakeRun, sizes: dict[int, int], scratch: tuple[dict[int, int], str],
              window: tuple[int, int, int], buffers: dict[str, int],
              gpu: CudaAllocation | None) -> tuple[dict[tuple[str, str], int], dict[str, int]]:
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


def top_modules(trace: FakeRun, sizes: dict[int, int], index: int) -> tuple[tuple[str, int], ...]:
    """The eight modules whose activations hold the most after ``index`` events (the end of the forward)."""
    top: dict[str, int] = {}
    for s in alive_at(trace, index):
        if trace.owner.get(s, ("",))[0] == "activations":
            name = trace.module.get(s) or "(outside modules)"
            top[name] = top.get(name, 0) + sizes[s]
    return tuple(sorted(top.items(), key=lambda kv: -kv[1])[:8])
