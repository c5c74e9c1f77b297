"""A catalogue of common accelerators: memory as the driver reports it (``nvidia-smi``'s total, in MiB),
the architecture, and peak dense bf16/fp16 tensor throughput for the compute column of the what-ifs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MiB = 1024**2


@dataclass(frozen=True)
class GPU:
    name: str
    memory: int  # bytes, what nvidia-smi / rocm-smi report as total
    arch: str  # "turing", "ampere", "ada", "hopper", "cdna3", ...
    tflops_bf16: float  # dense peak, for rough time ratios only
    aliases: tuple[str, ...] = ()
    capability: tuple[int, int] | None = None  # CUDA compute capability; None for AMD GPUs

    @property
    def hopper(self) -> bool:
        return self.arch == "hopper"

    @property
    def rocm(self) -> bool:
        return self.capability is None


GPUS: tuple[GPU, ...] = (
    GPU("T4", 15360 * MiB, "turing", 65.0, ("t4-16gb", "tesla-t4"), capability=(7, 5)),
    GPU("V100-16GB", 16384 * MiB, "volta", 125.0, ("v100",), capability=(7, 0)),
    GPU("V100-32GB", 32768 * MiB, "volta", 125.0, capability=(7, 0)),
    GPU("P100", 16384 * MiB, "pascal", 18.7, capability=(6, 0)),
    GPU("L4", 23034 * MiB, "ada", 121.0, capability=(8, 9)),
    GPU("A10", 23028 * MiB, "ampere", 125.0, ("a10g", "a10-24gb"), capability=(8, 6)),
    GPU("RTX-3090", 24576 * MiB, "ampere", 71.0, ("3090", "rtx3090", "geforce-rtx-3090"), capability=(8, 6)),
    GPU("RTX-4090", 24564 * MiB, "ada", 165.0, ("4090", "rtx4090", "geforce-rtx-4090"), capability=(8, 9)),
    GPU("RTX-A6000", 49140 * MiB, "ampere", 155.0, ("a6000",), capability=(8, 6)),
    GPU("L40S", 46068 * MiB, "ada", 362.0, ("l40s-48gb",), capability=(8, 9)),
    GPU("A100-40GB", 40960 * MiB, "ampere", 312.0, ("a100-40", "a100-sxm4-40gb", "a100"), capability=(8, 0)),
    GPU("A100-80GB", 81920 * MiB, "ampere", 312.0, ("a100-80", "a100-sxm4-80gb"), capability=(8, 0)),
    GPU("H100-80GB", 81559 * MiB, "hopper", 989.0, ("h100", "h100-sxm", "h100-pcie"), capability=(9, 0)),
    GPU("H200", 143771 * MiB, "hopper", 989.0, ("h200-141gb",), capability=(9, 0)),
    GPU("MI250X", 131072 * MiB, "cdna2", 383.0, ("mi250",)),
    GPU("MI300X", 196608 * MiB, "cdna3", 1307.0, ("mi300",)),
)


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-").replace("nvidia-", "")


def find_gpu(name: str) -> GPU:
    """``find_gpu("a100-80gb")``; case, spaces and an ``NVIDIA`` prefix do not matter."""
    if not isinstance(name, str):
        raise TypeError(f"gpu must be a name such as 'A100-80GB', not {type(name).__name__}")
    key = _key(name)
    for gpu in GPUS:
        if key == _key(gpu.name) or key in gpu.aliases:
            return gpu
    raise ValueError(f"unknown GPU {name!r}; known: {', '.join(g.name for g in GPUS)} (or give budget='24GiB')")
