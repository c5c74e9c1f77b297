"""How long each tutorial notebook takes to run top to bottom on this machine: the Binder target is 90 s.

Each notebook runs headless in a fresh kernel (nbclient), on a copy in a temporary folder. Printed per
notebook: wall time, the kernel's CPU time (user + system, from the finished kernel process's rusage: load on
the machine stretches the wall time, not the CPU time), and the load average when it started. Binder gives a
notebook about one to two cores, so a notebook whose kernel CPU time is under 90 s meets the target on an idle
Binder; its wall time here meets it only when this machine is quiet.

    .venv/bin/python benchmarks/notebooks.py              # all of them
    .venv/bin/python benchmarks/notebooks.py 07 08        # the notebooks whose names start so
"""

from __future__ import annotations

import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import nbclient
import nbformat

TARGET_S = 90.0
NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(path: Path) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / path.name
        shutil.copy(path, work)
        nb = nbformat.read(work, as_version=4)
        client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=600,
                                         resources={"metadata": {"path": tmp}})
        cpu0, wall0 = children_cpu(), time.perf_counter()
        client.execute()  # starts the kernel, runs every cell, shuts the kernel down and waits for it
        return time.perf_counter() - wall0, children_cpu() - cpu0


def main(prefixes: list[str]) -> int:
    paths = sorted(p for p in NOTEBOOKS.glob("*.ipynb") if not prefixes or p.name.startswith(tuple(prefixes)))
    print(f"{os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; "
          f"target {TARGET_S:.0f} s a notebook (Binder)")
    print(f"{'notebook':42} {'wall':>8} {'kernel CPU':>11} {'load avg':>9}")
    over = []
    for path in paths:
        load = os.getloadavg()[0]
        wall, cpu = run(path)
        mark = "" if cpu < TARGET_S else "  over the target"
        if cpu >= TARGET_S:
            over.append(path.name)
        print(f"{path.stem:42} {wall:7.1f}s {cpu:10.1f}s {load:9.1f}{mark}", flush=True)
    print("every kernel within the target" if not over else f"kernel CPU over {TARGET_S:.0f} s: {', '.join(over)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
