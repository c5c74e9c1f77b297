"""The largest batch and the longest sequence (a step's) or prompt (``generate()``'s) that fit a GPU or a budget.

Two ways, each trial an estimate made again (a replay when only what is applied after the trace changes, a new trace
otherwise):

* :func:`search_max`: doubling from the estimate's size, then bisection to within 3 % (a step: its trials are cheap
  enough, and what it needs is not always smooth in the size);
* :func:`fitted_max`: each trial of ``generate()`` is a whole fake loop (seconds for an 8B model), so a model is fitted
  instead of bisecting: what the device needs grows linearly with the batch and linearly (flash and memory-efficient
  attention) or quadratically (the math kernel, eager attention's scores) with the prompt. From the estimate itself
  and one more run the fit predicts the answer; a run there and one at :data:`MARGIN` × it check it (fits at the
  answer, not above), and a miss re-fits through the nearest points, :data:`MAX_TRIALS` runs at most.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ...core.units import format_bytes
from ..result import Estimate
from ..tracing.errors import EstimateError

#: the answer is checked this far above it (must not fit)
MARGIN = 1.1
#: at most this many fake runs besides the estimate itself
MAX_TRIALS = 8


def search_max(fits: Callable[[int], bool], start: int, limit: int = 1 << 20,
               progress: Callable[[str], None] | None = None) -> tuple[int, int]:
    """Largest ``n`` with ``fits(n)`` (to within 3 %): doubling from ``start``, then bisection.
    ``(n, trials)``; 0 if even 1 does not fit."""
    trials = 0

    def test(n: int) -> bool:
        nonlocal trials
        trials += 1
        ok = fits(n)
        if progress is not None:
            progress(f"{n}: {'fits' if ok else 'does not fit'}")
        return ok

    lo, hi = 0, None
    n = max(start, 1)
    if test(n):
        lo = n
        while n < limit:
            n = min(n * 2, limit)
            if test(n):
                lo = n
            else:
                hi = n
                break
        if hi is None:
            return lo, trials
    else:
        hi = n
        n = n // 2
        while n >= 1:
            if test(n):
                lo = n
                break
            hi = n
            n //= 2
        if lo == 0:
            return 0, trials
    while hi - lo > max(1, lo // 32):  # within 3 %: each trial is a full fake run
        mid = (lo + hi) // 2
        if test(mid):
            lo = mid
        else:
            hi = mid
    return lo, trials


def bisected(est: Estimate, key: str, progress: Callable[[str], None] | None = None) -> int:
    """The largest batch (``key="batch"``) or sequence length (``"seq"``, the inputs' dimension 1) whose estimate fits
    ``est``'s capacity, by :func:`search_max`."""
    workload = est.rerunnable()
    if est.capacity is None:
        raise ValueError("a capacity is needed: estimate with gpu='…' or budget='…'")
    start = est.batch if key == "batch" else est.seq
    if start is None:
        raise ValueError(f"the inputs have no dimension {0 if key == 'batch' else 1} to grow")
    opts = est.options
    assert opts is not None

    def fits(n: int) -> bool:
        try:
            e = workload.evaluate(opts.with_(**{key: n}))
        except EstimateError:
            return False
        # a partial estimate's needed is a lower bound: the largest size whose lower bound fits is an upper bound
        return bool(e.fits) if not e.partial else e.capacity is not None and e.needed <= e.capacity

    best, _ = search_max(fits, start, progress=progress)
    return best


def _needed(est: Estimate, key: str, progress: Callable[[str], None] | None) -> Callable[[int], int | None]:
    workload = est.rerunnable()
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
            e = workload.evaluate(opts.with_(**{key: n}))
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


def fitted_max(est: Estimate, key: str, start: int, *, quadratic: bool,
               progress: Callable[[str], None] | None = None) -> tuple[int, int]:
    """``(answer, fake runs)``: the largest ``n`` found to fit with ``MARGIN × n`` not fitting (0: not even 1)."""
    needed = _needed(est, key, progress)
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
