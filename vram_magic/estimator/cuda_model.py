"""What a CUDA device adds to the tensors a fake step traces. Every number here is a named, overridable
constant: pass ``cuda=CudaModel(context=...)`` to :func:`vram_magic.estimate` to use your own.

Traced (counted on fake tensors): every tensor the step creates, including the ``foreach`` optimizer's
temporaries, since the estimate builds the optimizer the way CUDA would.
Modelled (added here): the caching allocator's 512-byte rounding of each block, cuBLAS workspaces (one per
thread that runs matmuls: the forward thread and autograd's backward thread), a cuDNN workspace during each
convolution, the reserved-but-unused margin of the caching allocator, and the CUDA context, which lives
outside PyTorch's allocator (``nvidia-smi`` shows it, ``torch.cuda.memory_allocated`` does not).
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1024**2

BLOCK_ROUNDING = 512
#: cuBLAS workspace per handle: PyTorch's default ``:4096:2:16:8`` (8.125 MiB); 32 MiB on Hopper (sm90).
CUBLAS_WORKSPACE = 4096 * 1024 * 2 + 16 * 1024 * 8
CUBLAS_WORKSPACE_HOPPER = 4096 * 8 * 1024
#: cuDNN workspace while a convolution runs (the algorithms PyTorch picks usually stay well under this).
CUDNN_WORKSPACE = 64 * MiB
#: CUDA context, cuBLAS/cuDNN kernels and handles outside the caching allocator, with lazy module loading.
CUDA_CONTEXT = 500 * MiB
#: Reserved-but-unused share of the caching allocator at the peak (fragmentation, cached blocks).
RESERVED_MARGIN = 0.05


@dataclass(frozen=True)
class CudaModel:
    rounding: int = BLOCK_ROUNDING
    cublas_workspace: int | None = None  # None: by the GPU's architecture
    cudnn_workspace: int = CUDNN_WORKSPACE
    context: int = CUDA_CONTEXT
    reserved_margin: float = RESERVED_MARGIN

    def workspace(self, hopper: bool) -> int:
        if self.cublas_workspace is not None:
            return self.cublas_workspace
        return CUBLAS_WORKSPACE_HOPPER if hopper else CUBLAS_WORKSPACE

    def round(self, n: int) -> int:
        r = self.rounding
        return -(-n // r) * r if r > 1 else n

    def reserved(self, allocated_peak: int) -> int:
        return int(allocated_peak * (1.0 + self.reserved_margin))
