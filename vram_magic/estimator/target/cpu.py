"""The CPU as a device to time steps on: what this machine's PyTorch achieves, measured once per process.

A time prediction for ``device="cpu"`` needs the figures of the CPU it runs on, which no catalogue holds: matmul
throughput differs by dtype by an order of magnitude or more (bf16 and fp16 GEMMs are fast only where the CPU has
AVX-512's bf16/fp16 instructions or AMX; elsewhere oneDNN converts), and with the thread count. So the profile
times, at the thread count PyTorch uses now:

* square matmuls per dtype at a few sizes (their FLOP rate grows with size: small GEMMs do not fill the cores);
* a large copy (the memory bandwidth a tensor that does not fit the caches gets) and an elementwise op on a tensor
  that fits them;
* a tiny op (what dispatching one op costs, whatever it computes).

It takes about a second, and :func:`cpu_profile` keeps it for the process (per thread count).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

#: square sizes timed per dtype: fp32 up to 1024; the half types stop at 256 (on a CPU without their instructions a
#: 512³ bf16 GEMM takes about half a second)
SIZES = {"fp32": (64, 256, 1024), "bf16": (64, 256), "fp16": (64, 256)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class CpuProfile:
    """What this CPU achieved: matmul FLOP/s per dtype at each size timed (``(FLOPs of the GEMM, FLOP/s)``, smallest
    first), bytes/s of a large copy and of an elementwise op within the caches, seconds per dispatched op."""

    threads: int
    matmul: dict[str, tuple[tuple[float, float], ...]]
    bandwidth: float
    cached_bandwidth: float
    op_overhead: float
    seconds: float = 0.0

    def matmul_rate(self, dtype: str, flops: float) -> float:
        """FLOP/s of a GEMM of ``flops`` in ``dtype``: interpolated between the sizes timed on a log-log scale, the
        largest size's rate beyond them, and below the smallest falling as small GEMMs do (dispatch dominates)."""
        points = self.matmul.get(dtype) or self.matmul["fp32"]
        f0, r0 = points[0]
        if flops <= f0:
            return r0 * max(flops / f0, 1e-3) ** 0.5
        for (fa, ra), (fb, rb) in zip(points, points[1:]):
            if flops <= fb:
                w = (math.log(flops) - math.log(fa)) / (math.log(fb) - math.log(fa))
                return math.exp(math.log(ra) * (1 - w) + math.log(rb) * w)
        return points[-1][1]

    def describe(self) -> str:
        rates = ", ".join(f"{d} {self.matmul[d][-1][1] / 1e9:.1f}" for d in self.matmul)
        threads = f"{self.threads} thread{'s' if self.threads != 1 else ''}"
        return (f"this CPU, {threads} (measured in {self.seconds:.1f} s): matmul GFLOP/s {rates}; memory "
                f"{self.bandwidth / 1e9:.1f} GB/s ({self.cached_bandwidth / 1e9:.1f} within the caches); "
                f"{self.op_overhead * 1e6:.1f} µs per op")


def _best(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` timed calls (after one untimed): the others were slowed by something else."""
    fn()
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_cpu() -> CpuProfile:
    """Time this CPU now (about a second); see the module's documentation."""
    t0 = time.perf_counter()
    with torch.no_grad():
        matmul: dict[str, tuple[tuple[float, float], ...]] = {}
        for name, sizes in SIZES.items():
            points = []
            for n in sizes:
                a = torch.randn(n, n).to(DTYPES[name])
                b = torch.randn(n, n).to(DTYPES[name])
                flops = 2.0 * n**3
                seconds = _best(lambda a=a, b=b: torch.mm(a, b), 3 if n <= 256 else 2)
                points.append((flops, flops / seconds))
            matmul[name] = tuple(points)
        big = torch.empty(64 << 20, dtype=torch.uint8)
        out = torch.empty_like(big)
        copy = _best(lambda: out.copy_(big), 3)
        small = torch.ones(1 << 18)  # 1 MiB: within a core's caches
        added = torch.empty_like(small)
        add = _best(lambda: torch.add(small, small, out=added), 5)
        one = torch.ones(1)
        reps = 200
        tiny = _best(lambda: [torch.add(one, one) for _ in range(reps)], 3) / reps
    return CpuProfile(torch.get_num_threads(), matmul, 2 * big.numel() / copy, 3 * small.numel() * 4 / add, tiny,
                      time.perf_counter() - t0)


_PROFILES: dict[int, CpuProfile] = {}


def cpu_profile() -> CpuProfile:
    """This process's profile at the current thread count, measured on first use."""
    threads = torch.get_num_threads()
    if threads not in _PROFILES:
        _PROFILES[threads] = measure_cpu()
    return _PROFILES[threads]
