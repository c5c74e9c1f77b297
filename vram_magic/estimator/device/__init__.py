"""The device an estimate is made for: a catalogued GPU (``gpus.py``) or a budget, and what CUDA adds to the traced
tensors: the caching allocator, workspaces and context (``cuda_model.py``), SDPA's kernels (``sdpa.py``) and CUDA's
autocast lists (``autocast.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...core.units import parse_size
from .cuda_model import CudaModel
from .gpus import GPU, find_gpu


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
