"""What one device achieves, as the time model uses it: a matmul's FLOP rate by dtype and size, the bandwidth of
memory-bound ops, and the fixed cost each op adds. For a GPU from its catalogue figures and named efficiency factors;
for the CPU from the profile measured on this machine (``target.cpu``).

The efficiency factors, with where they come from:

* matmuls on tensor cores reach 65 % of the dense peak on Ampere and 75 % on Hopper, fp32 on CUDA cores 55 % and
  50 % (PyTorch's ``torch/distributed/_tools/runest_utils.py`` tables; other GPUs take Ampere's factors, as that file
  does for a GPU it does not know). The best-shaped GEMMs do better (stas00/ml-engineering's measured "maximum
  achievable matmul": 87 % on an A100, 80 % on an H100); a step's GEMMs are not all best-shaped.
* memory-bound ops reach 80 % of the memory's peak bandwidth (llm-analysis calls 90 % an aggressive target).
* an op costs at least 5 µs on a GPU: eager PyTorch's launch and dispatch, measured at about 7 µs for small
  pointwise ops (flagos-ai/FlagGems#4812) and 5–7 µs for tiny ops with autograd (pytorch/pytorch#41383); a GPU whose
  kernels are shorter than that waits for the host.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..target.cpu import CpuProfile
from ..target.gpus import GPU
from ..tracing.oplog import DTYPES

#: fraction of the dense peak a step's matmuls reach, by architecture: (tensor cores in half precision, fp32)
MATMUL_EFFICIENCY = {"hopper": (0.75, 0.5), "ampere": (0.65, 0.55)}
DEFAULT_MATMUL_EFFICIENCY = MATMUL_EFFICIENCY["ampere"]
#: fraction of the memory bandwidth memory-bound ops reach
MEMORY_EFFICIENCY = 0.8
#: seconds each op costs at least on a GPU (launch and eager dispatch on the host)
GPU_OP_OVERHEAD = 5e-6


@dataclass(frozen=True)
class Rates:
    """A device as the time model sees it: ``matmul(dtype, flops)`` FLOP/s, ``bandwidth`` bytes/s for memory-bound ops,
    ``per_op`` seconds each op adds (a CPU's dispatch) and ``floor`` seconds an op takes at least (a GPU waiting for the
    host), with a sentence saying what was assumed."""

    name: str
    matmul: Callable[[str, float], float]
    bandwidth: float
    per_op: float
    floor: float
    assumptions: str


def gpu_rates(gpu: GPU, *, tf32: bool = False) -> Rates:
    """``gpu``'s rates from its catalogue figures; fp32 matmuls on the CUDA cores unless ``tf32`` (PyTorch's default:
    ``torch.backends.cuda.matmul.allow_tf32 = False``)."""
    half_eff, fp32_eff = MATMUL_EFFICIENCY.get(gpu.arch, DEFAULT_MATMUL_EFFICIENCY)
    fp32_peak = gpu.peak("tf32") if tf32 and gpu.peak("tf32") else gpu.peak("fp32")
    peaks = {"fp32": (fp32_peak or 1e12) * (half_eff if tf32 else fp32_eff)}
    for name in ("bf16", "fp16"):
        peak = gpu.peak(name)
        # a GPU without bf16 runs it emulated at best: as fast as fp32 on its CUDA cores
        peaks[name] = peak * half_eff if peak else peaks["fp32"]
    peaks["other"] = peaks["fp32"]

    def matmul(dtype: str, flops: float) -> float:
        return peaks.get(dtype, peaks["fp32"])

    used = ", ".join(f"{d} {peaks[d] / 1e12:.0f}" for d in DTYPES if d != "other")
    text = (f"{gpu.name}: matmuls at {half_eff:.0%} of the dense tensor-core peak and {fp32_eff:.0%} of fp32's "
            f"(TFLOP/s reached: {used}{'; fp32 as TF32' if tf32 else ''}), memory-bound ops at {MEMORY_EFFICIENCY:.0%} "
            f"of {gpu.bandwidth / 1e9:.0f} GB/s, at least {GPU_OP_OVERHEAD * 1e6:.0f} µs an op")
    return Rates(gpu.name, matmul, gpu.bandwidth * MEMORY_EFFICIENCY, 0.0, GPU_OP_OVERHEAD, text)


def cpu_rates(profile: CpuProfile) -> Rates:
    """This CPU's rates as measured: matmuls at the rate timed for their dtype and size, memory-bound ops at the
    bandwidth of a large copy, each op its dispatch cost on top."""
    return Rates("CPU", profile.matmul_rate, profile.bandwidth, profile.op_overhead, 0.0, profile.describe())
