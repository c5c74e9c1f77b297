"""Compiled models under %%vram: what each backend reports for a warmed-up inductor training step on the CPU,
against PyTorch's profiler of the same step unmeasured.

    python benchmarks/compiled.py

For each model of ``tests/support/zoo.py`` named below, one process: build, ``torch.compile`` (inductor), two warm-up
steps,
then the same step (forward, sum, backward, AdamW, zero_grad) (1) under the profiler alone, (2) in a
``%%vram`` cell (auto: the allocator backend), (3) in a ``%%vram --backend tracker`` cell (the dispatch-level
tracker, under which compiled code runs eagerly). Figures are the peak above what was alive before the step.
"""

from __future__ import annotations

import os
import subprocess
import sys

MODELS = ("Transformer (tied)", "ViT", "MLP")


def one(name: str) -> None:
    import torch
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    from tests.support.zoo import ZOO, profiled_cpu_peak, train_steps

    torch.manual_seed(0)
    build, make_inputs = ZOO[name]
    model, x = build(), make_inputs()
    opt = torch.optim.AdamW(model.parameters())
    compiled = torch.compile(model)
    train_steps(compiled, x, 2, opt)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        train_steps(compiled, x, 1, opt)
    profiled = profiled_cpu_peak(prof)
    sh = InteractiveShell.instance()
    sh.user_ns.update(compiled=compiled, x=x, opt=opt, train_steps=train_steps)
    with capture_output():
        sh.run_cell("%load_ext vram_magic")
        sh.run_cell("%%vram -q -o auto\ntrain_steps(compiled, x, 1, opt)")
        sh.run_cell("%%vram -q -o tracked --backend tracker\ntrain_steps(compiled, x, 1, opt)")
    auto, tracked = sh.user_ns["auto"], sh.user_ns["tracked"]
    print(profiled, auto.peak.total - auto.before.total, auto.backend,
          tracked.peak.total - tracked.before.total, tracked.backend)


def main() -> int:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: tests.support
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        one(sys.argv[2])
        return 0
    import torch

    print(f"torch {torch.__version__}, inductor on the CPU, {torch.get_num_threads()} threads")
    print(f"{'model':<20}{'profiler':>12}{'%%vram (auto)':>22}{'%%vram --backend tracker':>30}")
    for name in MODELS:
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", name], capture_output=True,
                              text=True, cwd=os.path.dirname(os.path.abspath(__file__)))
        if done.returncode != 0:
            print(f"{name:<20} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
            continue
        profiled, auto, auto_backend, tracked, tracked_backend = done.stdout.split()[-5:]
        p, a, t = int(profiled), int(auto), int(tracked)
        print(f"{name:<20}{p / 2**20:>8.1f} MiB{a / 2**20:>9.1f} MiB {100 * (a - p) / p:+6.1f} % {auto_backend:<9}"
              f"{t / 2**20:>9.1f} MiB {100 * (t - p) / p:+6.1f} % {tracked_backend}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
