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

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...engine.phases import Phase
from ..device.gpus import GPU
from ..tracing.oplog import ATTENTION, CONV, DTYPES, KINDS, LAYOUTS, MATMUL, POINTWISE, VIEW
from .cpu_profile import CpuProfile

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
    host), with a sentence saying what was assumed. ``op_time``, where a device has its own rules (the CPU), times one
    op from its whole row of the op log (``OpLog.rows_full``) in place of those figures."""

    name: str
    matmul: Callable[[str, float], float]
    bandwidth: float
    per_op: float
    floor: float
    assumptions: str
    op_time: Callable[..., float] | None = None


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
    """This CPU's rates as measured (``cpu_profile.py``), each op timed by :func:`cpu_op_time`."""
    return Rates("CPU", profile.matmul_rate, profile.bandwidth, profile.op_overhead, 0.0, profile.describe(),
                 cpu_op_time(profile))


_BACKWARD = int(Phase.BACKWARD)


#: keys a block of the CPU's flash attention covers (torch 2.13's ``kvSplitSize``, ``FlashAttentionKernel.cpp``)
CPU_ATTENTION_KEY_BLOCK = 512


def cpu_attention_work(keys: int, causal: bool) -> float:
    """The work the CPU's flash attention does over the FLOPs counted for it (a causal mask's counted as half): it
    computes whole blocks of :data:`CPU_ATTENTION_KEY_BLOCK` keys, so under a causal mask each query computes every
    block up to the one holding the diagonal, (n + 1) / 2n of the n blocks on average, all of them when the keys fit
    one block (measured, causal over full time: 1.0 at 128-512 tokens, 0.76 at 1,024, 0.62 at 2,048; this rule: 1, 0.75,
    0.625)."""
    if not causal:
        return 1.0
    blocks = max(1, -(-keys // CPU_ATTENTION_KEY_BLOCK))
    return (blocks + 1) / blocks  # (n + 1) / 2n of the full work, over the half counted


def cpu_op_time(profile: CpuProfile) -> Callable[..., float]:
    """One op's seconds on this CPU, from its row of the op log, plus what each op of a step costs beyond its work:

    * a matmul of known shape by the fitted model of its dtype and layout (``cpu_gemm.py``); else at the rate
      of a square one of its FLOPs;
    * a convolution or the flash attention by its FLOPs at the rate timed for its dtype and direction (the backward
      stage's, unless checkpointing recomputes a forward there), a convolution's at its size (between the sizes
      timed), plus its fixed cost;
    * any other op by its bytes: those moved at the seconds per byte timed for its size, those of results allocated at
      the extra a result not in the caches costs; at least its elements at the seconds per element of its kind
      (random numbers, transcendental functions, activations, softmax, normalisations) and its dtype's conversion;
    * a view or an allocation: nothing but the cost per op."""
    overhead = profile.op_overhead
    element = {KINDS.index(k): v for k, v in profile.element.items()}
    convert = {DTYPES.index(k): v for k, v in profile.convert.items()}
    fallback = profile.gemm_fit("fp32", "NT")

    def op_time(stage: int, kind: int, dtype: int, again: int, flops: float, nbytes: float, fresh: float,
                elements: float, shape: Any) -> float:
        if kind == VIEW:
            return overhead
        name = DTYPES[dtype]
        if kind == MATMUL:
            if shape is None:
                return overhead + (flops / fallback.rate(512, 512, 512) if flops else 0.0)
            batch, m, n, k, layout = shape
            return overhead + profile.gemm_fit(name, LAYOUTS[layout]).seconds(m, n, k, batch)
        if kind in (CONV, ATTENTION) and flops:
            forward = stage != _BACKWARD or bool(again)
            if kind == CONV:  # a backward's FLOPs are twice its forward's
                return overhead + flops / profile.conv_rate(name, forward, flops if forward else flops / 2) + \
                    profile.conv_fixed
            if shape is None:
                return overhead + flops / profile.attention_rate(name, forward, None)
            _, queries, keys, _, causal = shape
            return overhead + flops * cpu_attention_work(keys, bool(causal)) / profile.attention_rate(
                name, forward, math.sqrt(queries * keys))
        moved, allocated = profile.per_byte(nbytes)
        seconds = nbytes * moved + fresh * allocated
        per_element = (element.get(kind, 0.0) if kind != POINTWISE else 0.0) + convert.get(dtype, 0.0)
        return overhead + max(seconds, elements * per_element)

    return op_time
