"""Kernel scratch on the CPU: the default backend's peak against PyTorch's profiler, and what recording it costs.

    python benchmarks/scratch.py [--threads N] [--find]

For a torch.ao int8 MLP's forward and one AdamW training step of each model of ``tests/support/zoo.py`` (after a first
step,
so optimizer state exists): the peak above what was alive before, from PyTorch's profiler on the same step
unmeasured, from ``vram_magic.measure()`` (the tracker, default) and from ``measure(backend="allocator")``, and the
measured step's wall time over the unmeasured one's (median of three pairs).

``--find`` lists, instead, the ops whose CPU kernels allocate inside themselves in those runs (every op timed
under a dispatch mode against the profiler's memory events): how ``vram_magic/engine/tracker/scratch_ops.py`` was made.
"""

from __future__ import annotations

import argparse
import bisect
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: tests.support
import vram_magic
from tests.support.zoo import ZOO, profiled_cpu_peak, train_steps


def _int8() -> tuple[Callable[[], None], dict]:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torch.ao.quantization.quantize_dynamic(
            nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024)), {nn.Linear}, dtype=torch.qint8)
    x = torch.randn(64, 1024)

    def forward() -> None:
        with torch.no_grad():
            model(x)

    return forward, {"model": model, "x": x}


def _step(name: str) -> tuple[Callable[[], None], dict]:
    build, inputs = ZOO[name]
    torch.manual_seed(0)
    model, x = build(), inputs()
    opt = torch.optim.AdamW(model.parameters())
    return (lambda: train_steps(model, x, 1, opt)), {"model": model, "x": x, "opt": opt}


CASES: dict[str, Callable[[], tuple[Callable[[], None], dict]]] = {
    "torch.ao int8 MLP, forward (batch 64)": _int8,
    **{f"{name}, training step": (lambda n=name: _step(n)) for name in ZOO},
}


def compare(run: Callable[[], None], ns: dict) -> dict[str, float]:
    run()  # optimizer state, oneDNN's caches
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    real = profiled_cpu_peak(prof)
    out: dict[str, float] = {"profiler": real}
    for backend in ("auto", "allocator"):
        with vram_magic.measure(namespace=ns, backend=backend) as m:
            run()
        out[backend] = m.peak.total - m.before.total
    plain, measured = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        run()
        t1 = time.perf_counter()
        with vram_magic.measure(namespace=ns):
            run()
        plain.append(t1 - t0)
        measured.append(time.perf_counter() - t1)
    out["ratio"] = statistics.median(m / p for m, p in zip(measured, plain))
    return out


class _Timed(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, int, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = time.time_ns()
        out = func(*args, **(kwargs or {}))
        self.calls.append((t0, time.time_ns(), func.name()))
        return out


def find(run: Callable[[], None]) -> dict[str, int]:
    """op name -> the most one call allocated inside itself beyond what it returned."""
    from torch._C._profiler import _EventType

    run()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, _Timed() as timed:
        run()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    events.sort()
    times = [t for t, _ in events]
    found: dict[str, int] = {}
    for t0, t1, name in timed.calls:
        running = high = 0
        for _, n in events[bisect.bisect_left(times, t0):bisect.bisect_right(times, t1)]:
            running += n
            high = max(high, running)
        if high > running:
            found[name] = max(found.get(name, 0), high - running)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: PyTorch's)")
    parser.add_argument("--find", action="store_true", help="list the ops that allocate inside themselves")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.find:
        for name, make in CASES.items():
            run, _ = make()
            ops = ", ".join(f"{op} {n:,} B" for op, n in sorted(find(run).items(), key=lambda kv: -kv[1]))
            print(f"{name}: {ops}")
        return
    print(f"{'':42} {'profiler':>12} {'measure()':>18} {'allocator':>18} {'time x':>7}")
    for name, make in CASES.items():
        run, ns = make()
        r = compare(run, ns)
        cells = "".join(f" {int(r[k]):>11,} {100 * (r[k] / r['profiler'] - 1):+5.1f} %" for k in ("auto", "allocator"))
        print(f"{name:42} {int(r['profiler']):>12,}{cells} {r['ratio']:>7.2f}")


if __name__ == "__main__":
    main()
