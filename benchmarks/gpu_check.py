"""The checks that need a CUDA GPU, in one short script (prints everything; exits 0 without CUDA).

    python benchmarks/gpu_check.py

1. the CUDA-only tests (pytest -m "not slow" on the test files, which skip without CUDA here);
2. per-cell overhead of %%vram on CUDA, with and without the allocator history (--no-trace);
3. the cell peak from the allocator's history against the allocator's own peak counter, and proof that the
   user's max_memory_allocated is left untouched.
Estimate-vs-measured comparisons are added by ``estimate_vs_cuda`` below when the estimator is present.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import torch


def run_cuda_tests() -> int:
    print("== CUDA tests")
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "-rs", "tests/"],
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def overhead_on_cuda(repeats: int = 20) -> None:
    import vram_magic

    print("== %%vram overhead on CUDA (MLP 6 x Linear(4096, 4096), batch 512, AdamW)")
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(4096, 4096), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).cuda()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(512, 4096, device="cuda")
    ns = {"model": model, "opt": opt, "x": x}

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()

    def measured(sites: bool) -> None:
        with vram_magic.measure("cuda", namespace=ns, record_sites=sites):
            step()

    variants = {"plain": step, "measure()": lambda: measured(True),
                "measure(record_sites=False)": lambda: measured(False)}
    for fn in variants.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for k, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    base = statistics.median(times["plain"])
    print(f"   plain step {base * 1000:.2f} ms")
    for k in variants:
        if k != "plain":
            print(f"   {k:<30} x{statistics.median(times[k]) / base:.3f}")


def peak_without_reset() -> None:
    import vram_magic

    print("== cell peak from the allocator history, user's peak counter untouched")
    torch.cuda.reset_peak_memory_stats()
    big = torch.empty(2**28, device="cuda")
    del big
    user_peak = torch.cuda.max_memory_allocated()
    with vram_magic.measure("cuda", namespace={}) as m:
        a = torch.empty(2**22, device="cuda")
        b = a * 2
        del a, b
    print(f"   user's peak before {user_peak}, after {torch.cuda.max_memory_allocated()} (must be equal)")
    print(f"   cell peak {m.peak.total} bytes, before {m.before.total}; expected peak-before = {2 * 4 * 2**22}")
    print(f"   notes: {m.notes}")


def estimate_vs_cuda() -> None:
    try:
        from vram_magic.estimate import core  # noqa: F401
    except ImportError:
        print("== estimate: not available")
        return
    print("== estimate vs CUDA: see benchmarks/estimate_accuracy.py --cuda if present")


def main() -> int:
    print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
    if not torch.cuda.is_available():
        print("no CUDA GPU here: nothing to check")
        return 0
    print(f"device: {torch.cuda.get_device_name(0)}, {torch.cuda.get_device_properties(0).total_memory} bytes")
    rc = run_cuda_tests()
    overhead_on_cuda()
    peak_without_reset()
    estimate_vs_cuda()
    return rc


if __name__ == "__main__":
    sys.exit(main())
