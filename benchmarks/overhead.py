"""What measuring costs, side by side in one run (these machines are noisy: compare ratios, not times).

    python benchmarks/overhead.py

Wall time and this process's CPU time are both printed: on a loaded machine the CPU-time ratio is the steadier.

1. A CPU training step of a 6 x Linear(1024, 1024) MLP, batch 128: unmeasured, under an empty Python
   dispatch mode, inside ``vram_magic.measure()`` with and without allocation sites. Target: measured <= x1.10.
2. An empty ``%%vram`` cell with 300 modules in the namespace, against the same cell without the magic.
   Target: at most 5 ms more.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import vram_magic


class EmptyMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class EmptyModeNoDynamoWrapper(EmptyMode):
    """As the tracker does: no per-op wrapper that keeps torch.compile out of __torch_dispatch__."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def mlp_step_ratios(repeats: int = 40) -> dict[str, float]:
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x = torch.randn(128, 1024)
    ns = {"model": model, "opt": opt, "x": x}

    def step() -> None:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def plain() -> None:
        step()

    def empty_mode() -> None:
        with EmptyMode():
            step()

    def empty_mode_bare() -> None:
        with EmptyModeNoDynamoWrapper():
            step()

    def measured() -> None:
        with vram_magic.measure(namespace=ns):
            step()

    def measured_no_sites() -> None:
        with vram_magic.measure(namespace=ns, record_sites=False):
            step()

    variants = {"plain": plain, "empty dispatch mode": empty_mode,
                "empty dispatch mode, no dynamo wrapper": empty_mode_bare, "measure()": measured,
                "measure(record_sites=False)": measured_no_sites}
    for fn in variants.values():  # warm up
        fn()
        fn()
    wall: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for name, fn in variants.items():  # interleaved, so drift hits all alike
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    out = {"plain step, wall median (ms)": statistics.median(wall["plain"]) * 1000,
           "plain step, CPU median (ms)": statistics.median(cpu["plain"]) * 1000}
    for name in variants:
        if name != "plain":
            out[f"{name}: wall ratio"] = statistics.median(wall[name]) / statistics.median(wall["plain"])
            out[f"{name}: CPU-time ratio"] = statistics.median(cpu[name]) / statistics.median(cpu["plain"])
    return out


def empty_cell_overhead(modules: int = 300, repeats: int = 60) -> dict[str, float]:
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    sh = InteractiveShell.instance(colors="nocolor")
    sh.run_cell("%load_ext vram_magic")
    sh.run_cell(f"import torch\nmods = None\nfor i in range({modules}):\n"
                "    globals()[f'm{i}'] = torch.nn.Linear(16, 16)")
    cells = {"plain": "pass", "%%vram -q": "%%vram -q\npass", "%%vram (displayed)": "%%vram\npass"}
    wall: dict[str, list[float]] = {k: [] for k in cells}
    cpu: dict[str, list[float]] = {k: [] for k in cells}
    with capture_output():
        for src in cells.values():
            sh.run_cell(src)
        for _ in range(repeats):
            for name, src in cells.items():
                t0, c0 = time.perf_counter(), time.process_time()
                sh.run_cell(src)
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    out = {}
    for name in cells:
        if name != "plain":
            base_wall, base_cpu = statistics.median(wall["plain"]), statistics.median(cpu["plain"])
            out[f"{name}: extra wall (ms)"] = (statistics.median(wall[name]) - base_wall) * 1000
            out[f"{name}: extra CPU time (ms)"] = (statistics.median(cpu[name]) - base_cpu) * 1000
    return out


def main() -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("1. MLP training step (6 x Linear(1024, 1024), batch 128, SGD momentum), median of 40, interleaved")
    for k, v in mlp_step_ratios().items():
        print(f"   {k:<46} {v:8.3f}")
    print("2. empty cell, 300 modules in the namespace, median of 60, interleaved")
    for k, v in empty_cell_overhead().items():
        print(f"   {k:<46} {v:8.2f}")


if __name__ == "__main__":
    main()
