"""What data in the namespace costs each measured cell, side by side in one run (a real InteractiveShell).

    python benchmarks/namespace.py [--rounds N]

For each case an empty ``%%vram -q`` cell runs against a plain ``pass`` cell, once each per round in the same
order, and the median of the paired differences is printed (this machine's speed drifts; pairing cancels most
of it). The same is done with nothing in the namespace, so each case reads as ``extra`` over that. The cases:

1. a list of 1,000,000 file paths (str);
2. a 60,000-sample dataset as a list of ``(tensor 28 x 28, label)`` tuples;
3. a dict of 100,000 small tensors (256 floats each: 97.7 MiB);
4. 300 ``nn.Linear(16, 16)`` modules (README's performance table). Target for 1-3: <= 20 ms per cell over the
   empty namespace; for 4: <= 5 ms over the plain cell.

Also printed: the first measured cell after the data appears (it reads the data in full, once) and the two
namespace scans of a cell timed alone (the rest of a cell's cost grows with the number of live storages:
the tracker's starting point and the report's split are worked out per storage).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import torch

from vram_magic.engine.scan.attribution import scan_namespace

CASES = {
    "1,000,000 paths (str)": "paths = [f'/data/images/{i:07d}.jpg' for i in range(1_000_000)]",
    "60,000 (tensor, label) samples": "dataset = [(torch.randn(28, 28), i % 10) for i in range(60_000)]",
    "dict of 100,000 small tensors": "tensors = {i: torch.ones(256) for i in range(100_000)}",
    "300 nn.Linear(16, 16) modules": "for i in range(300):\n    globals()[f'm{i}'] = torch.nn.Linear(16, 16)",
}
NAMES = {"1,000,000 paths (str)": ["paths"], "60,000 (tensor, label) samples": ["dataset"],
         "dict of 100,000 small tensors": ["tensors"], "300 nn.Linear(16, 16) modules": [f"m{i}" for i in range(300)]}


def _paired(shell, rounds: int) -> tuple[float, float, float]:
    """Medians (ms) of ``%%vram -q`` minus ``pass`` (wall and this process's CPU time), and of the two scans of a
    cell timed alone (wall)."""
    registry = shell.magics_manager.registry["VramMagics"].session.registry
    wall, cpu, scans = [], [], []
    for _ in range(rounds):
        t0, c0 = time.perf_counter(), time.process_time()
        shell.run_cell("pass")
        t1, c1 = time.perf_counter(), time.process_time()
        shell.run_cell("%%vram -q\npass")
        t2, c2 = time.perf_counter(), time.process_time()
        scan_namespace(shell.user_ns, registry)
        scan_namespace(shell.user_ns, registry)
        t3 = time.perf_counter()
        wall.append((t2 - t1) - (t1 - t0))
        cpu.append((c2 - c1) - (c1 - c0))
        scans.append(t3 - t2)
    return tuple(statistics.median(x) * 1000 for x in (wall, cpu, scans))  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="rounds of each case (default 15)")
    rounds = parser.parse_args().rounds
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    shell = InteractiveShell.instance(colors="nocolor")
    shell.run_cell("%load_ext vram_magic")
    shell.run_cell("import torch")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, load average "
          f"{load:.1f}, {rounds} rounds; ms per cell, medians of paired differences")
    with capture_output():
        shell.run_cell("%%vram -q\npass")
        base, base_cpu, base_scans = _paired(shell, rounds)
    print(f"   {'':<32} {'%%vram -q over pass':>19} {'CPU':>7} {'its 2 scans':>12} {'over empty':>11} "
          f"{'CPU':>7} {'first cell':>11}")
    print(f"   {'empty namespace':<32} {base:19.2f} {base_cpu:7.2f} {base_scans:12.2f}")
    for case, source in CASES.items():
        with capture_output():
            shell.run_cell(source)
            t0 = time.perf_counter()
            shell.run_cell("%%vram -q\npass")
            first = (time.perf_counter() - t0) * 1000
            cell, cell_cpu, scans = _paired(shell, rounds)
            shell.run_cell("del " + ", ".join(NAMES[case]))
            gc.collect()
        print(f"   {case:<32} {cell:19.2f} {cell_cpu:7.2f} {scans:12.2f} {cell - base:11.2f} "
              f"{cell_cpu - base_cpu:7.2f} {first:11.0f}")


if __name__ == "__main__":
    main()
