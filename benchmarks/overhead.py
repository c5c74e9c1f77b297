"""What measuring costs, side by side in one run (these machines are noisy: compare ratios, not times).

    python benchmarks/overhead.py [--rounds N] [--parts 1,3]

Every variant runs once per round, in the same order, and each is compared with the plain run *of its own
round*: the figure printed is the median over rounds of those paired ratios (or differences), so a slow
stretch of the machine hits both sides of a pair. Wall time and this process's CPU time are both shown; for
``measure()`` the step inside the block is also timed alone, which splits the cost into per-op tracking and
the fixed work at the start and end of a block (scans, trace, report).

1. A CPU training step of a 6 x Linear(1024, 1024) MLP, batch 128: unmeasured, under an empty Python
   dispatch mode, inside ``vram_magic.measure()`` (default backend, with and without allocation sites) and with
   the allocator backend. Targets: measured <= x1.10; the tracker over the empty dispatch mode <= x1.05.
2. An empty ``%%vram`` cell with 300 modules in the namespace, against the same cell without the magic.
   Target: at most 5 ms more.
3. A loop of small ops in one measured block: 500 AdamW steps of a tiny MLP. Target: <= x1.5.
4. An optimizer-step cell: ``opt.step()`` alone, AdamW over 60 parameter tensors. Target: <= x1.5; the tracker
   over an empty dispatch mode <= x1.05.
5. The tracker's own cost on tiny ops: 200 AdamW steps of part 3's MLP in one block, against the same loop under an
   empty dispatch mode (CPU time is the steadier figure). Target: <= x1.05.
6. The out-of-memory black box armed (``%load_ext vram_magic``) on part 5's loop run as an unmeasured notebook cell,
   against the same cell without vram_magic. Target: within 2 %.
"""

from __future__ import annotations

import argparse
import inspect
import operator
import os
import statistics
import time
from collections.abc import Callable

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


def _rounds(variants: dict[str, Callable[[], object]], rounds: int) -> tuple[dict, dict]:
    """Wall and CPU seconds of each variant, one run of each per round, in the same order every round."""
    for fn in variants.values():  # warm up
        fn()
        fn()
    wall: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return wall, cpu


def _paired(xs: list[float], base: list[float], op: Callable[[float, float], float]) -> float:
    return statistics.median(op(x, b) for x, b in zip(xs, base))


def mlp_step_ratios(rounds: int = 80) -> dict[str, float]:
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

    inside: list[float] = []  # the step alone, inside the measured block (without its start and end)

    def measured() -> None:
        with vram_magic.measure(namespace=ns):
            t0 = time.perf_counter()
            step()
            inside.append(time.perf_counter() - t0)

    def measured_no_sites() -> None:
        with vram_magic.measure(namespace=ns, record_sites=False):
            step()

    def measured_allocator() -> None:
        with vram_magic.measure(namespace=ns, backend="allocator"):
            step()

    variants = {"plain": plain, "empty dispatch mode": empty_mode,
                "empty dispatch mode, no dynamo wrapper": empty_mode_bare, "measure()": measured,
                "measure(record_sites=False)": measured_no_sites, "measure(backend='allocator')": measured_allocator}
    wall, cpu = _rounds(variants, rounds)
    ratio = operator.truediv
    out = {"plain step, wall median (ms)": statistics.median(wall["plain"]) * 1000,
           "plain step, CPU median (ms)": statistics.median(cpu["plain"]) * 1000}
    for name in variants:
        if name != "plain":
            out[f"{name}: wall ratio"] = _paired(wall[name], wall["plain"], ratio)
            out[f"{name}: CPU-time ratio"] = _paired(cpu[name], cpu["plain"], ratio)
    out["measure() / empty dispatch mode: wall ratio"] = _paired(wall["measure()"], wall["empty dispatch mode"],
                                                                 ratio)
    out["measure() / empty mode without dynamo wrapper (the tracker's own cost)"] = _paired(
        wall["measure()"], wall["empty dispatch mode, no dynamo wrapper"], ratio)
    inside = inside[-rounds:]  # not the warm-up runs
    out["tracker over an empty dispatch mode: wall ratio"] = _paired(
        wall["measure()"], wall["empty dispatch mode, no dynamo wrapper"], ratio)
    out["tracker over an empty dispatch mode: CPU-time ratio"] = _paired(
        cpu["measure()"], cpu["empty dispatch mode, no dynamo wrapper"], ratio)
    out["measure(), the step inside the block: wall ratio"] = _paired(inside, wall["plain"], ratio)
    out["measure(), its start and end (ms)"] = _paired(wall["measure()"], inside, operator.sub) * 1000
    return out


def empty_cell_overhead(modules: int = 300, rounds: int = 80) -> dict[str, float]:
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    sh = InteractiveShell.instance(colors="nocolor")
    sh.run_cell("%load_ext vram_magic")
    sh.run_cell(f"import torch\nmods = None\nfor i in range({modules}):\n"
                "    globals()[f'm{i}'] = torch.nn.Linear(16, 16)")
    cells = {"plain": "pass", "%%vram -q": "%%vram -q\npass", "%%vram (displayed)": "%%vram\npass"}
    with capture_output():
        wall, cpu = _rounds({name: (lambda src=src: sh.run_cell(src)) for name, src in cells.items()}, rounds)
    out = {}
    extra = operator.sub
    for name in cells:
        if name != "plain":
            out[f"{name}: extra wall (ms)"] = _paired(wall[name], wall["plain"], extra) * 1000
            out[f"{name}: extra CPU time (ms)"] = _paired(cpu[name], cpu["plain"], extra) * 1000
    return out


def _tiny_mlp() -> tuple[dict[str, object], Callable[[int], None]]:
    """Part 3's model and data, and ``loop(steps)``: that many AdamW steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.AdamW(model.parameters())
    x, y = torch.randn(32, 256), torch.randint(0, 10, (32,))

    def loop(steps: int) -> None:
        for _ in range(steps):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    return {"model": model, "opt": opt, "x": x, "y": y}, loop


def small_op_loop(steps: int = 500, rounds: int = 3) -> dict[str, float]:
    """Many small ops in one measured block: a 256-wide MLP trained for ``steps`` AdamW steps (the per-op cost
    dominates when kernels are tiny)."""
    ns, run = _tiny_mlp()

    def loop() -> None:
        run(steps)

    def measured() -> None:
        with vram_magic.measure(namespace=ns):
            loop()

    def measured_no_sites() -> None:
        with vram_magic.measure(namespace=ns, record_sites=False):
            loop()

    def measured_allocator() -> None:
        with vram_magic.measure(namespace=ns, backend="allocator"):
            loop()

    def empty_mode() -> None:
        with EmptyModeNoDynamoWrapper():
            loop()

    variants = {"plain": loop, "empty dispatch mode, no dynamo wrapper": empty_mode, "measure()": measured,
                "measure(record_sites=False)": measured_no_sites, "measure(backend='allocator')": measured_allocator}
    wall, _ = _rounds(variants, rounds)
    out = {"plain loop, wall median (s)": statistics.median(wall["plain"])}
    for name in variants:
        if name != "plain":
            out[f"{name}: wall ratio"] = _paired(wall[name], wall["plain"], operator.truediv)
    out["tracker over an empty dispatch mode: wall ratio"] = _paired(
        wall["measure()"], wall["empty dispatch mode, no dynamo wrapper"], operator.truediv)
    return out


def tracker_on_tiny_ops(steps: int = 200, rounds: int = 15) -> dict[str, float]:
    """The tracker's own cost where every op is tiny: ``steps`` AdamW steps of part 3's MLP in one measured block,
    paired with the same loop under an empty dispatch mode (without PyTorch's dynamo wrapper, as the tracker
    runs). Where the time goes: the same block with ``record_sites=False`` (no user frames named), and with the
    tracker's per-output bookkeeping switched off (``StorageCounts.see_new``: nothing new is counted, so nothing
    freed is either; every other part of the tracker runs), where this version of the tracker has it."""
    ns, run = _tiny_mlp()

    def empty_mode() -> None:
        with EmptyModeNoDynamoWrapper():
            run(steps)

    def measured(**options: object) -> None:
        with vram_magic.measure(namespace=ns, **options):
            run(steps)

    variants: dict[str, Callable[[], object]] = {
        "empty dispatch mode, no dynamo wrapper": empty_mode, "measure()": measured,
        "measure(record_sites=False)": lambda: measured(record_sites=False)}
    if _measures_host():  # the host's memory sampled beside (a thread)
        variants["measure(host=False)"] = lambda: measured(host=False)
    counts = _storage_counts()
    if counts is not None:
        name = "see_new" if hasattr(counts, "see_new") else "_see_new"  # its name before the tracker's parts

        def uncounted() -> None:
            see_new = getattr(counts, name)
            setattr(counts, name, lambda self, t, depth=2: None)
            try:
                measured()
            finally:
                setattr(counts, name, see_new)

        variants["measure(), new outputs not counted"] = uncounted
    wall, cpu = _rounds(variants, rounds)
    base = "empty dispatch mode, no dynamo wrapper"
    out = {"empty dispatch mode, CPU median (s)": statistics.median(cpu[base]),
           "tracker over an empty dispatch mode: wall ratio": _paired(wall["measure()"], wall[base], operator.truediv),
           "tracker over an empty dispatch mode: CPU-time ratio": _paired(cpu["measure()"], cpu[base],
                                                                          operator.truediv)}
    for name in variants:
        if name not in (base, "measure()"):
            out[f"{name}: CPU-time ratio"] = _paired(cpu[name], cpu[base], operator.truediv)
    return out


def _measures_host() -> bool:
    """Whether this version's ``measure()`` takes ``host=`` (it passes its options on to ``Measurement``)."""
    try:
        from vram_magic.measuring.measurement import Measurement
    except ImportError:  # a version before the measuring side had its folder
        return False
    return "host" in inspect.signature(Measurement.__init__).parameters


def _storage_counts() -> type | None:
    try:
        from vram_magic.engine.tracker.counts import StorageCounts
    except ImportError:  # a version of the tracker before its counts were a part of their own
        return None
    return StorageCounts


def optimizer_step_cell(rounds: int = 40) -> dict[str, float]:
    """``opt.step()`` alone: AdamW (PyTorch's CPU default, one parameter at a time) over 30 Linear(256, 256),
    60 parameter tensors — many small per-parameter ops."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(30)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(32, 256)).sum().backward()
    opt.step()
    ns = {"model": model, "opt": opt}

    def step() -> None:
        opt.step()

    def empty_mode() -> None:
        with EmptyModeNoDynamoWrapper():
            step()

    def measured(backend: str = "auto") -> None:
        with vram_magic.measure(namespace=ns, backend=backend):
            step()

    variants = {"plain": step, "empty dispatch mode, no dynamo wrapper": empty_mode, "measure()": measured,
                "measure(backend='allocator')": lambda: measured("allocator")}
    wall, cpu = _rounds(variants, rounds)
    out = {"plain step, wall median (ms)": statistics.median(wall["plain"]) * 1000}
    for name in variants:
        if name != "plain":
            out[f"{name}: wall ratio"] = _paired(wall[name], wall["plain"], operator.truediv)
    base = "empty dispatch mode, no dynamo wrapper"
    out["tracker over an empty dispatch mode: wall ratio"] = _paired(wall["measure()"], wall[base], operator.truediv)
    out["tracker over an empty dispatch mode: CPU-time ratio"] = _paired(cpu["measure()"], cpu[base],
                                                                         operator.truediv)
    return out


def armed_black_box(steps: int = 200, rounds: int = 15) -> dict[str, float]:
    """The out-of-memory black box costs nothing per op: part 5's loop run as a notebook cell in a real IPython shell,
    with ``%load_ext vram_magic`` (the black box armed, the cell not measured) and without the extension, one run of
    each per round (loaded and unloaded between them, outside the timing)."""
    from IPython.core.interactiveshell import InteractiveShell

    ns, run = _tiny_mlp()
    sh = InteractiveShell.instance()
    sh.user_ns.update(ns, run=run, steps=steps)

    def cell() -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        result = sh.run_cell("run(steps)")
        assert result.success, result.error_in_exec
        return time.perf_counter() - t0, time.process_time() - c0

    walls: dict[str, list[float]] = {"without": [], "armed": []}
    cpus: dict[str, list[float]] = {"without": [], "armed": []}
    for i in range(rounds + 2):  # two rounds of warm-up
        for name in ("without", "armed"):
            sh.run_cell("%load_ext vram_magic" if name == "armed" else "%unload_ext vram_magic")
            wall, cpu = cell()
            if i >= 2:
                walls[name].append(wall)
                cpus[name].append(cpu)
    sh.run_cell("%unload_ext vram_magic")
    return {"without vram_magic, wall median (s)": statistics.median(walls["without"]),
            "armed black box: wall ratio": _paired(walls["armed"], walls["without"], operator.truediv),
            "armed black box: CPU-time ratio": _paired(cpus["armed"], cpus["without"], operator.truediv)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=80, help="runs of each variant (default 80)")
    parser.add_argument("--parts", default="1,2,3,4,5,6", help="which parts to run, comma-separated (default all)")
    parser.add_argument("--loop-rounds", type=int, default=3, help="paired runs of part 3's loop (default 3)")
    parser.add_argument("--tiny-rounds", type=int, default=15, help="paired runs of part 5's loop (default 15)")
    args = parser.parse_args()
    rounds, parts = args.rounds, {p.strip() for p in args.parts.split(",")}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {rounds} rounds, load average {load:.1f}")
    if "1" in parts:
        _part1(rounds)
    if "2" in parts:
        print("2. empty cell, 300 modules in the namespace: median of paired differences")
        for k, v in empty_cell_overhead(rounds=rounds).items():
            print(f"   {k:<52} {v:8.2f}")
    if "3" in parts:
        print(f"3. 500 AdamW steps of a 256-wide MLP in one block (small ops): median of {args.loop_rounds} paired "
              "ratios")
        for k, v in small_op_loop(rounds=args.loop_rounds).items():
            print(f"   {k:<52} {v:8.3f}")
    if "4" in parts:
        print("4. opt.step() alone, AdamW over 60 parameter tensors: median of paired ratios")
        for k, v in optimizer_step_cell(max(rounds // 2, 10)).items():
            print(f"   {k:<52} {v:8.3f}")
    if "5" in parts:
        print(f"5. 200 AdamW steps of part 3's MLP in one block, against an empty dispatch mode: median of "
              f"{args.tiny_rounds} paired ratios")
        for k, v in tracker_on_tiny_ops(rounds=args.tiny_rounds).items():
            print(f"   {k:<52} {v:8.3f}")
    if "6" in parts:
        print(f"6. part 5's loop as a notebook cell, with the out-of-memory black box armed and without vram_magic: "
              f"median of {args.tiny_rounds} paired ratios")
        for k, v in armed_black_box(rounds=args.tiny_rounds).items():
            print(f"   {k:<52} {v:8.3f}")


def _part1(rounds: int) -> None:
    print("1. MLP training step (6 x Linear(1024, 1024), batch 128, SGD momentum): median of paired ratios")
    for k, v in mlp_step_ratios(rounds).items():
        print(f"   {k:<52} {v:8.3f}")


if __name__ == "__main__":
    main()
