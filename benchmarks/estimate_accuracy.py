"""Accuracy of ``vram_magic.estimate(device="cpu")`` against the real peak of the same CPU steps.

The real peak comes from PyTorch's profiler memory timeline, which records every allocator event (kernel
scratch included); the dispatch-level reading of ``vram_magic.measure()`` is printed beside it to show
what counting at the dispatcher alone would miss. Run::

    .venv/bin/python benchmarks/estimate_accuracy.py [--models MLP,U-Net] [--steps 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: tests.support

import vram_magic  # noqa: E402
from tests.support.zoo import ZOO, profiled_cpu_peak, train_steps  # noqa: E402

TARGET = 2.0  # per cent


def profiler_peak(build, make_inputs, steps: int, seed: int = 0) -> int:
    """Peak bytes of everything allocated while building the model and inputs and running the steps."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(seed)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = build()
        x = make_inputs()
        train_steps(model, x, steps)
        del model, x
    return profiled_cpu_peak(prof)


def dispatch_peak(build, make_inputs, steps: int, seed: int = 0) -> int:
    torch.manual_seed(seed)
    model = build()
    x = make_inputs()
    with vram_magic.measure(namespace={"model": model, "x": x}) as m:
        train_steps(model, x, steps)
    return m.peak.total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(ZOO))
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args(argv)
    names = [n.strip() for n in args.models.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; AdamW, {args.steps} training steps, fp32, "
          "device='cpu'; target: within ±2 % of the profiler's peak")
    print(f"{'model':<20}{'params':>9}{'profiler peak':>15}{'estimate':>12}{'error':>9}"
          f"{'dispatch-level':>16}{'error':>9}{'est. time':>11}")
    worst = 0.0
    for name in names:
        build, make_inputs = ZOO[name]
        t = time.perf_counter()
        est = vram_magic.estimate(build, make_inputs, device="cpu", steps=args.steps)
        est_time = time.perf_counter() - t
        real = profiler_peak(build, make_inputs, args.steps)
        disp = dispatch_peak(build, make_inputs, args.steps)
        err = 100.0 * (est.peak.total - real) / real
        derr = 100.0 * (disp - real) / real
        worst = max(worst, abs(err))
        print(f"{name:<20}{est.parameters / 1e6:>8.2f}M{real / 2**20:>12.2f} MiB{est.peak.total / 2**20:>8.2f} MiB"
              f"{err:>+8.2f}%{disp / 2**20:>12.2f} MiB{derr:>+8.2f}%{est_time:>9.2f} s")
    print(f"worst |error|: {worst:.2f} % ({'meets' if worst <= TARGET else 'MISSES'} the {TARGET:g} % target)")
    return 0 if worst <= TARGET else 1


if __name__ == "__main__":
    raise SystemExit(main())
