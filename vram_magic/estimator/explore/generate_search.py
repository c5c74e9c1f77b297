"""The longest prompt (``max_seq``) and the largest batch (``max_batch``) whose ``generate()`` fits a GPU or a
budget, with the same number of new tokens.

Each trial is a whole fake ``generate()`` (seconds for an 8B model), so the search fits a model instead of
bisecting: what the device needs grows linearly with the batch and linearly (flash and memory-efficient
attention) or quadratically (the math kernel, eager attention's scores) with the prompt. From the estimate
itself and one more run the fit predicts the answer; a run there and one at 1.1× it check it (fits at the
answer, not at 1.1×), and a miss re-fits through the nearest points, a few times at most.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ...units import format_bytes
from ..result import Estimate
from ..tracing.errors import EstimateError

#: the answer is checked this far above it (must not fit)
MARGIN = 1.1
#: at most this many fake runs besides the estimate itself
MAX_TRIALS = 8


def _runner(est: Estimate, key: str, progress: Callable[[str], None] | None) -> Callable[[int], int | None]:
    rerun = est.rerunnable()
    capacity, opts = est.capacity, est.options
    if capacity is None:
        raise ValueError("max_seq/max_batch need a capacity: estimate with gpu='A100-80GB' (or another known GPU) "
                         "or budget='24GiB'")
    assert opts is not None
    word = "prompt" if key == "seq" else "batch"
    seen: dict[int, int | None] = {}

    def needed(n: int) -> int | None:
        if n in seen:
            return seen[n]
        try:
            e = rerun.evaluate(opts.with_(**{key: n}))
            got: int | None = e.needed
        except (EstimateError, MemoryError):
            got = None
        seen[n] = got
        if progress is not None:
            verdict = "failed" if got is None else ("fits" if got <= capacity else "does not fit")
            progress(f"{word} {n}: {verdict}" + (f" (needs {format_bytes(got)})" if got is not None else ""))
        return got

    return needed


def _solve(points: list[tuple[int, int]], capacity: int, quadratic: bool) -> float | None:
    """``n`` where the curve through ``points`` (``(n, needed)``) reaches ``capacity``: a line (or a parabola)
    through the largest point that fits and the smallest that does not (the next nearest if one is missing)."""
    pts = sorted(set(points))
    if len(pts) < 2:
        return None
    below = [p for p in pts if p[1] <= capacity]
    above = [p for p in pts if p[1] > capacity]
    chosen = ([below[-1]] if below else []) + ([above[0]] if above else [])
    rest = sorted((p for p in pts if p not in chosen), key=lambda p: abs(p[1] - capacity))
    chosen += rest[: (3 if quadratic else 2) - len(chosen)]
    chosen.sort()
    if quadratic and len(chosen) >= 3:
        (x0, y0), (x1, y1), (x2, y2) = chosen[:3]
        d = (x0 - x1) * (x0 - x2) * (x1 - x2)
        if d:
            a = (x2 * (y1 - y0) + x1 * (y0 - y2) + x0 * (y2 - y1)) / d
            b = (x2 * x2 * (y0 - y1) + x1 * x1 * (y2 - y0) + x0 * x0 * (y1 - y2)) / d
            c = y0 - a * x0 * x0 - b * x0
            disc = b * b - 4 * a * (c - capacity)
            if abs(a) > 1e-12 and disc >= 0:
                good = [r for r in ((-b + sign * math.sqrt(disc)) / (2 * a) for sign in (1, -1)) if r > 0]
                if good:
                    return min(good) if a < 0 else max(good)
    (x0, y0), (x1, y1) = (chosen[0], chosen[-1]) if len(chosen) >= 2 else (pts[-2], pts[-1])
    if y1 == y0:
        return None
    return x0 + (capacity - y0) * (x1 - x0) / (y1 - y0)


def search(est: Estimate, key: str, start: int, *, quadratic: bool,
           progress: Callable[[str], None] | None = None) -> tuple[int, int]:
    """``(answer, fake runs)``: the largest ``n`` found to fit with ``MARGIN × n`` not fitting (0: not even 1)."""
    needed = _runner(est, key, progress)
    capacity = est.capacity
    assert capacity is not None
    points = [(start, est.needed)]
    fit, unfit = (start, None) if est.needed <= capacity else (0, start)
    # the first guess: the line through the estimate and what no prompt (no batch) needs — the weights and the
    # device's constants
    fixed = est.peak["parameters"] + (est.needed - est.peak.total if est.device == "cuda" else 0)
    slope = (est.needed - fixed) / max(start, 1)
    guess = int(start + (capacity - est.needed) / slope) if slope > 0 else 0
    probe = guess if fit and guess > start else (start * 2 if fit else max(min(guess, start - 1), start // 2, 1))
    runs = 0
    while runs < MAX_TRIALS:
        got = needed(probe)
        runs += 1
        if got is not None:
            points.append((probe, got))
        if got is not None and got <= capacity:
            fit = max(fit, probe)
        else:
            unfit = probe if unfit is None else min(unfit, probe)
        if unfit is not None and (unfit <= 1 or fit and unfit <= math.ceil(fit * MARGIN)):
            return fit, runs
        root = _solve(points, capacity, quadratic)
        if root is None or not math.isfinite(root):
            n = fit * 2 if unfit is None else (fit + unfit) // 2
        else:
            n = int(root)
        if fit and n < math.ceil(fit * MARGIN):  # the fit says the answer is near: check the margin above it
            n = math.ceil(fit * MARGIN)
        if unfit is not None:  # strictly inside the bracket, never hugging one end (regula falsi stalls)
            step = max(1, (unfit - fit) // 8)
            n = min(max(n, fit + step), unfit - step)
        probe = max(n, fit + 1, 1)
    return fit, runs


def longest_prompt(est: Estimate, progress: Callable[[str], None] | None = None) -> int:
    """The longest prompt (with the estimate's batch, beams and new tokens) whose generate() fits."""
    gen = est.generation
    if gen is None:
        raise ValueError("max_seq with generate= needs an estimate of generate()")
    quadratic = any(kernel == "math" for kernel, _ in gen.sdpa) or gen.kind != "transformers" or not gen.sdpa
    best, _ = search(est, "seq", gen.prompt, quadratic=quadratic, progress=progress)
    return best


def largest_batch(est: Estimate, progress: Callable[[str], None] | None = None) -> int:
    """The largest batch (with the estimate's prompt, beams and new tokens) whose generate() fits."""
    gen = est.generation
    if gen is None:
        raise ValueError("max_batch with generate= needs an estimate of generate()")
    best, _ = search(est, "batch", gen.batch, quadratic=False, progress=progress)
    return best


def with_search(est: Estimate, *, max_seq: bool, max_batch: bool, progress: Any = None) -> Estimate:
    if max_seq:
        est = replace(est, max_seq=longest_prompt(est, progress))
    if max_batch:
        est = replace(est, max_batch=largest_batch(est, progress))
    return est


__all__ = ["MARGIN", "largest_batch", "longest_prompt", "search", "with_search"]
