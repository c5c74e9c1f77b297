"""What a CUDA device adds to the tensors a fake step traces. Pass ``cuda=CudaModel(context=...)`` to
:func:`vram_magic.estimate` to use your own constants.

Traced (counted on fake tensors): every tensor the step creates, including the ``foreach`` optimizer's
temporaries, since the estimate builds the optimizer the way CUDA would.

Simulated (``vram_magic.engine.cuda.caching_allocator``): PyTorch's caching allocator, rule for rule — 512-byte blocks,
the small pool's 2 MiB segments, 20 MiB segments for requests of 1–10 MiB and larger ones rounded up to 2 MiB,
splitting, unsplit remainders, best-fit reuse of cached blocks. The step's allocations replayed through it give
each tensor its block size (what ``memory_allocated`` counts) and the peak of what the allocator reserves
(``max_memory_reserved``), in place of a flat margin.

Modelled (constants): cuBLAS workspaces, one per thread that runs matmuls (the forward thread and autograd's
backward thread), whose size PyTorch chooses by the GPU (``aten/src/ATen/cuda/CublasHandlePool.cpp``: 32 MiB on
compute capability 9.x, 10.x, 11.x and 12.x, else ``:4096:2:16:8`` = 8.125 MiB; hipBLASLt on ROCm: 32 MiB, 128 MiB on
MI300-class gfx94x); a cuDNN workspace during each convolution (an upper bound: cuDNN's choice depends on the
algorithm); and the CUDA context, which lives outside PyTorch's allocator (``nvidia-smi`` shows it,
``torch.cuda.memory_allocated`` does not).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ...engine.cuda.alloc_conf import DEFAULT_SETTINGS, AllocatorSettings, parse_alloc_conf, settings_from_env
from ...engine.cuda.caching_allocator import CachingAllocator

if TYPE_CHECKING:
    from .gpus import GPU

MiB = 1024**2

#: cuBLAS workspace per handle: PyTorch's default ``:4096:2:16:8`` (8.125 MiB)
CUBLAS_WORKSPACE = 4096 * 1024 * 2 + 16 * 1024 * 8
#: ... and 32 MiB (``:4096:8``) on compute capability 9.x (Hopper), 10.x, 11.x and 12.x (Blackwell)
CUBLAS_WORKSPACE_LARGE = 4096 * 8 * 1024
CUBLAS_LARGE_MAJORS = (9, 10, 11, 12)
#: hipBLASLt's workspace on ROCm: 32 MiB, 128 MiB on gfx94x/gfx95x (MI300 class)
HIPBLAS_WORKSPACE, HIPBLAS_WORKSPACE_MI300 = 32 * MiB, 128 * MiB
#: cuDNN workspace while a convolution runs (an upper bound; the algorithms PyTorch picks usually stay under it).
CUDNN_WORKSPACE = 64 * MiB
#: CUDA context, cuBLAS/cuDNN kernels and handles outside the caching allocator, with lazy module loading.
CUDA_CONTEXT = 500 * MiB


def cublas_workspace(gpu: GPU | None) -> tuple[int, str]:
    """The cuBLAS workspace one handle allocates on ``gpu`` and why; with no GPU named, PyTorch's default for
    every GPU before Hopper (what Colab's T4 and the A100 use)."""
    if gpu is None:
        return CUBLAS_WORKSPACE, ("8.125 MiB per cuBLAS handle assumed (PyTorch's default before compute capability "
                                  "9.0; 32 MiB on Hopper and Blackwell): pass gpu= to choose by the GPU")
    if gpu.capability is None:
        size = HIPBLAS_WORKSPACE_MI300 if gpu.arch == "cdna3" else HIPBLAS_WORKSPACE
        return size, f"hipBLASLt workspace of {size // MiB} MiB per handle on {gpu.name}"
    major, minor = gpu.capability
    if major in CUBLAS_LARGE_MAJORS:
        return CUBLAS_WORKSPACE_LARGE, f"32 MiB per cuBLAS handle on {gpu.name} (compute capability {major}.{minor})"
    return CUBLAS_WORKSPACE, f"8.125 MiB per cuBLAS handle on {gpu.name} (compute capability {major}.{minor})"


@dataclass(frozen=True)
class AllocatorLayout:
    """A step replayed through the caching allocator: ``blocks`` (serial → block size), and the peaks of
    what it allocated and reserved."""

    blocks: dict[int, int]
    peak_allocated: int
    peak_reserved: int


def allocator_layout(initial: Iterable[int], events: Sequence[int], sizes: Mapping[int, int], *,
                     persistent: Iterable[int] = (), spikes: Mapping[int, int] | None = None,
                     window: tuple[int, int, int] = (0, -1, 0),
                     settings: AllocatorSettings = DEFAULT_SETTINGS) -> AllocatorLayout:
    """Replay a traced step (``initial`` serials alive at the start, then ``events``: +serial allocated,
    -serial freed) through :class:`CachingAllocator`. ``persistent``: sizes allocated once after the initial
    storages and kept (the cuBLAS workspaces, made by the first matmul). ``spikes``: bytes allocated and freed
    right after that many events (kernel workspaces); ``window = (first, last, bytes)``: bytes alive while
    ``first <= events applied <= last`` (collective buffers); ``settings``: the allocator's configuration."""
    a = CachingAllocator(settings=settings)
    handles: dict[int, int] = {}
    blocks: dict[int, int] = {}

    def alloc(serial: int) -> None:
        h = a.malloc(sizes[serial])
        handles[serial] = h
        blocks[serial] = a.block_size(h)

    for s in initial:
        alloc(s)
    for n in persistent:
        a.malloc(n)
    spikes = spikes or {}
    lo, hi, extra = window
    held = a.malloc(extra) if extra and lo == 0 <= hi else 0
    for k, ev in enumerate(events, 1):
        if ev > 0:
            alloc(ev)
        else:
            a.free(handles.pop(-ev, 0))
        if extra and k == lo:
            held = a.malloc(extra)
        n = spikes.get(k, 0)
        if n:
            a.free(a.malloc(n))
        if extra and k == hi:
            a.free(held)
            held = 0
    return AllocatorLayout(blocks, a.peak_allocated, a.peak_reserved)


@dataclass(frozen=True)
class CudaModel:
    cublas_workspace: int | None = None  # None: chosen by the GPU (see cublas_workspace)
    cudnn_workspace: int = CUDNN_WORKSPACE
    context: int = CUDA_CONTEXT
    allocator: AllocatorSettings = DEFAULT_SETTINGS  # PYTORCH_CUDA_ALLOC_CONF's block-size settings

    def workspace(self, gpu: GPU | None) -> tuple[int, str]:
        """Bytes of one cuBLAS handle's workspace, and a note saying where the figure comes from."""
        if self.cublas_workspace is not None:
            return self.cublas_workspace, ""
        return cublas_workspace(gpu)


def with_allocator(cuda: CudaModel | None, alloc_conf: Any = None) -> CudaModel | None:
    """``cuda`` (a :class:`CudaModel`, or ``None`` for the default one) with the caching allocator's settings:
    ``alloc_conf`` in ``PYTORCH_CUDA_ALLOC_CONF``'s syntax (``"expandable_segments:True"``) or as
    ``AllocatorSettings``; ``None``: the model's own if it has any, else what ``PYTORCH_CUDA_ALLOC_CONF`` (or
    ``PYTORCH_ALLOC_CONF``) says in this process, as PyTorch would read it on a GPU here."""
    if cuda is not None and not isinstance(cuda, CudaModel):
        return cuda  # make_target says what is wrong with it
    if alloc_conf is None:
        if cuda is not None and not cuda.allocator.is_default:
            return cuda
        settings = settings_from_env()
        if settings.is_default and not settings.unmodelled:
            return cuda
    elif isinstance(alloc_conf, AllocatorSettings):
        settings = alloc_conf
    elif isinstance(alloc_conf, str):
        settings = parse_alloc_conf(alloc_conf, source="alloc_conf=")
    else:
        raise TypeError(f"alloc_conf takes PYTORCH_CUDA_ALLOC_CONF's syntax, e.g. 'expandable_segments:True', not "
                        f"{type(alloc_conf).__name__}")
    base = cuda if isinstance(cuda, CudaModel) else CudaModel()
    return replace(base, allocator=settings)


__all__ = ["CUBLAS_WORKSPACE", "CUBLAS_WORKSPACE_LARGE", "CUDA_CONTEXT", "CUDNN_WORKSPACE", "AllocatorLayout",
           "CudaModel", "allocator_layout", "cublas_workspace", "with_allocator"]


@dataclass(frozen=True)
class CudaAllocation:
    """What the CUDA model makes of a traced step: each storage's block in the simulated caching allocator, the
    peak it reserves, the cuBLAS workspaces, the context, and the notes about them."""

    sizes: dict[int, int]
    reserved: int
    workspaces: int
    context: int
    notes: tuple[str, ...]


def cuda_allocation(trace: Any, inference: bool, cuda: CudaModel, gpu: GPU | None, sizes: dict[int, int],
                    spikes: dict[int, int], window: tuple[int, int, int]) -> CudaAllocation:
    """The traced step (``trace``: initial storages, events, whether it multiplies matrices) replayed through the
    caching allocator with one rank's ``sizes``, the kernels' ``spikes`` and the collectives' ``window``."""
    workspace, workspace_note = cuda.workspace(gpu)
    handles = (1 if inference else 2) if trace.uses_matmul else 0  # the forward's thread and autograd's
    layout = allocator_layout(trace.initial, trace.events, sizes, persistent=[workspace] * handles, spikes=spikes,
                              window=window, settings=cuda.allocator)
    blocks = {s: layout.blocks.get(s, n) for s, n in sizes.items()}
    notes: tuple[str, ...] = (workspace_note,) if handles and gpu is None and workspace_note else ()
    if not cuda.allocator.is_default or cuda.allocator.unmodelled:
        notes += (cuda.allocator.note("PyTorch's caching allocator is simulated"),)
    return CudaAllocation(blocks, layout.peak_reserved, workspace * handles, cuda.context, notes)
