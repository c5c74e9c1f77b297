"""The checks that need a CUDA GPU, in one short script (prints everything; exits 0 without CUDA).

    python benchmarks/gpu_check.py

1. the CUDA-only tests (pytest -m "not slow" on the test files, which skip without CUDA here);
2. per-cell overhead of %%vram on CUDA, with and without the allocator history (--no-trace);
3. the cell peak from the allocator's history against the allocator's own peak counter, and proof that the
   user's max_memory_allocated is left untouched.
4. ``vram_magic.estimate(device="cuda")`` against ``torch.cuda.max_memory_allocated`` for the model zoo
   (target within 5 %), one process per model.
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


def estimate_vs_cuda(target: float = 5.0) -> None:
    """``vram_magic.estimate(device="cuda")`` against ``torch.cuda.max_memory_allocated`` of the same two AdamW
    steps, for each model of ``benchmarks/zoo.py``; each model runs in its own process so the cuBLAS
    workspaces and the caching allocator start fresh, as the estimate assumes."""
    if not torch.cuda.is_available():
        print("== estimate vs CUDA: no CUDA GPU here, skipped")
        return
    from zoo import ZOO

    print(f"== estimate (device='cuda') vs torch.cuda.max_memory_allocated, AdamW, 2 steps; target ±{target:g} %")
    print(f"   {'model':<20}{'measured':>14}{'estimate':>14}{'error':>9}{'reserved':>13}{'est. reserved':>15}")
    worst = 0.0
    for name in ZOO:
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--estimate-one", name],
                              capture_output=True, text=True)
        if done.returncode != 0:
            print(f"   {name:<20} failed: {done.stderr.strip().splitlines()[-1:] or done.returncode}")
            continue
        real, est, reserved, est_reserved = (int(v) for v in done.stdout.split())
        err = 100.0 * (est - real) / real
        worst = max(worst, abs(err))
        print(f"   {name:<20}{real / 2**20:>10.1f} MiB{est / 2**20:>10.1f} MiB{err:>+8.2f}%"
              f"{reserved / 2**20:>9.1f} MiB{est_reserved / 2**20:>11.1f} MiB")
    print(f"   worst |error| {worst:.2f} % ({'meets' if worst <= target else 'MISSES'} the {target:g} % target)")


def _estimate_one(name: str) -> None:
    from zoo import ZOO, train_steps

    import vram_magic

    build, make_inputs = ZOO[name]
    est = vram_magic.estimate(build, make_inputs, device="cuda")
    torch.manual_seed(0)
    torch.cuda.reset_peak_memory_stats()  # our own process: nobody else's peak counter to spoil
    base = torch.cuda.memory_allocated()
    with torch.device("cuda"):
        model = build()
    x = make_inputs().cuda()
    train_steps(model, x, 2)
    torch.cuda.synchronize()
    real = torch.cuda.max_memory_allocated() - base
    print(real, est.peak.total, torch.cuda.max_memory_reserved(), est.reserved)


def main() -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if len(sys.argv) == 3 and sys.argv[1] == "--estimate-one":
        _estimate_one(sys.argv[2])
        return 0
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
