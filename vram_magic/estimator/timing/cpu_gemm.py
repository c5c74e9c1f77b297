"""A CPU's matmul time as a function of its shape, fitted to a few GEMMs timed on this machine.

A GEMM of ``(m, k) @ (k, n)`` takes ``t0 + α·m·n + γ·(m·k + k·n) + (β(n) + δ·log₂(k / 256)⁺)·m·n·k`` seconds: a fixed
cost, the result's elements written, the operands packed or streamed, and the multiply-adds, whose cost per FLOP
``β`` depends on ``n`` (piecewise linear in log₂ n between :data:`KNOTS`) and grows with the length ``k`` of the
columns read. That last term is what a CPU without native half-precision
instructions needs: PyTorch's fallback kernels for bf16 and fp16 (``aten/src/ATen/native/cpu/BlasKernel.cpp``) compute
dot products along strided columns whose stride is the row length ``n`` of the right operand, and rows of a power-of-two
length map onto few cache sets (on an AVX2 CPU, bf16 ``(16, 256) @ (256, n)`` in row-major order ran 1.4 GFLOP/s at
``n = 64`` and 0.5 at ``n = 2048``; the same product with the right operand transposed, 2.4 and 5.5). Each dtype and
layout (``oplog.LAYOUTS``) gets its own fit; a batched matmul is ``batch`` of them after one fixed cost.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: the row lengths ``n`` between which the cost per FLOP is interpolated
KNOTS = (64, 256, 1024, 2048)
#: the inner dimension beyond which each doubling adds its own cost per FLOP (bf16 ``(512, k) @ (k, 256)`` in
#: row-major order ran 0.25 GFLOP/s at k = 2048, twice the time a fit on n alone gave)
LONG = 256


def _hats(n: float) -> list[float]:
    """Weights of ``n`` on :data:`KNOTS` (linear in log₂ n, clamped at the ends)."""
    x = math.log2(max(n, 1.0))
    ks = [math.log2(v) for v in KNOTS]
    w = [0.0] * len(ks)
    if x <= ks[0]:
        w[0] = 1.0
    elif x >= ks[-1]:
        w[-1] = 1.0
    else:
        for i in range(len(ks) - 1):
            if ks[i] <= x <= ks[i + 1]:
                f = (x - ks[i]) / (ks[i + 1] - ks[i])
                w[i], w[i + 1] = 1.0 - f, f
                break
    return w


def features(m: float, n: float, k: float) -> list[float]:
    """The terms of the model for one ``(m, k) @ (k, n)``: ``1, m·n, m·k + k·n, m·n·k`` spread over the knots, and
    ``m·n·k·log₂(k / 256)`` beyond k = 256 (a column of the right operand longer than the caches hold)."""
    mnk = m * n * k
    return [1.0, m * n, m * k + k * n, *(mnk * h for h in _hats(n)), mnk * math.log2(max(k, LONG) / LONG)]


@dataclass(frozen=True)
class GemmFit:
    """The fitted coefficients (seconds per term of :func:`features`) and the fit's worst relative error on the
    GEMMs it was fitted to."""

    coef: tuple[float, ...]
    worst: float = 0.0

    def seconds(self, m: float, n: float, k: float, batch: float = 1.0) -> float:
        c = self.coef
        body = sum(ci * fi for ci, fi in zip(c[1:], features(m, n, k)[1:]))
        return c[0] + batch * body

    def rate(self, m: float, n: float, k: float) -> float:
        """FLOP/s of one ``(m, k) @ (k, n)``."""
        return 2.0 * m * n * k / self.seconds(m, n, k)


def nonnegative_fit(rows: Sequence[Sequence[float]], times: Sequence[float]) -> list[float]:
    """Least squares of ``rows · x ≈ times`` in relative error, with ``x ≥ 0`` (an active set: a term fitted negative
    is dropped and the rest fitted again)."""
    a = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor(times, dtype=torch.float64)
    w = 1.0 / y
    a, y = a * w[:, None], y * w
    active = list(range(a.shape[1]))
    while active:
        sol = torch.linalg.lstsq(a[:, active], y[:, None]).solution[:, 0].tolist()
        if all(v >= 0 for v in sol):
            out = [0.0] * a.shape[1]
            for i, v in zip(active, sol):
                out[i] = v
            return out
        active = [i for i, v in zip(active, sol) if v > 0]
    return [0.0] * a.shape[1]


def fit_gemm(points: Sequence[tuple[int, int, int, float]]) -> GemmFit:
    """The model fitted to ``(m, n, k, seconds)`` measured."""
    coef = nonnegative_fit([features(m, n, k) for m, n, k, _ in points], [t for *_, t in points])
    fit = GemmFit(tuple(coef))
    worst = max(abs(fit.seconds(m, n, k) / t - 1) for m, n, k, t in points)
    return GemmFit(tuple(coef), worst)


__all__ = ["KNOTS", "LONG", "GemmFit", "features", "fit_gemm", "nonnegative_fit"]
