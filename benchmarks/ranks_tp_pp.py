"""Per-rank memory of tensor and pipeline parallelism, measured inside each rank of real gloo jobs on the CPU,
beside PyTorch's profiler in the same rank, and beside a per-rank estimate when one is given.

The jobs are :mod:`parallel_runs`'s (``tp-mlp``, ``tp-llama``, ``tp-llama-sp``, ``pp-gpipe``, ``pp-1f1b``: two AdamW
steps each) on 2 and 4 ranks; ``--stages`` runs its decoders cut into pipeline stages instead (``stages-*``,
``tp-pp-*``: tests/support/decoder_pipelines.py), which are not profiled. Each rank's peak is split by category as
``vram_magic.measure()`` inside the rank splits it; "profiler" is the highest CPU memory PyTorch's profiler saw in
the same rank running the same steps on a fresh copy of the job (its rise above where it started, added to the
measurement's ``before``). Run::

    .venv/bin/python benchmarks/ranks_tp_pp.py [--world 2,4] [--cases tp-mlp,pp-1f1b | --stages] [--markdown]
        [--repeats N] [--pp-batch ROWS] [--estimate]

``--pp-batch ROWS`` gives the pipeline jobs another batch (default 256 rows, 4 micro-batches). ``--repeats N`` runs
every job N times and prints the profiler's lowest and highest peak: on gloo a collective's
buffers are let go of by gloo's worker thread, sometimes after the caller went on, so real peaks vary by a few
buffers from run to run.

``--estimate`` fills the estimate's columns with ``vram_magic.estimate(..., tp=, pp=, ...)``'s per-rank peaks
(:func:`estimated`). Another estimate goes in them through :func:`table`'s ``estimate``: a callable
``estimate(case, world, rank)`` returning that rank's estimated peak by category (a mapping of the five categories
to bytes, such as an estimate's ``.ranks[rank].peak``) or ``None``; :func:`parallel_runs.off` says which categories
are further than 1 % from the measured ones.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: tests.support

from tests.support import parallel_runs as pr  # noqa: E402

Estimate = Callable[[pr.Case, int, int], "Mapping[str, int] | None"]
SHORT = {"parameters": "params", "gradients": "grads", "optimizer_state": "optim", "activations": "activ",
         "other": "other"}


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def table(runs: Mapping[int, Mapping[str, Sequence[dict[str, Any]]]], estimate: Estimate | None = None,
          spread: Mapping[tuple[int, str, int], tuple[int, int]] | None = None) -> list[list[str]]:
    """Rows of the table (a header first): per world, case and rank, the measured peak by category (MiB), its
    total in bytes, the profiler's (``spread``: its lowest and highest over repeats, keyed by (world, case, rank)),
    and, with ``estimate``, the estimated total and the error of each category and of the total."""
    head = ["case", "ranks", "rank", *[SHORT[c] for c in pr.CATEGORIES], "peak (B)", "profiler (B)", "Δ profiler",
            "estimate (B)", "error by category", "error"]
    rows = [head]
    for world, by_case in runs.items():
        for name, ranks in by_case.items():
            case = pr.CASES[name]
            for f in ranks:
                peak = f["peak"]
                total = sum(peak[c] for c in pr.CATEGORIES)
                before = sum(f["before"][c] for c in pr.CATEGORIES)
                rise = f.get("profiler_rise")
                low, high = (spread or {}).get((world, name, f["rank"]), (rise, rise))
                if low is None:  # not profiled
                    profiled = delta = "—"
                else:
                    profiled = f"{before + low:,}" if low == high else f"{before + low:,} – {before + high:,}"
                    lo, hi = (100 * (before + n - total) / total for n in (low, high))
                    delta = f"{lo:+.2f} %" if low == high else f"{lo:+.2f} … {hi:+.2f} %"
                est = estimate(case, world, f["rank"]) if estimate is not None else None
                if est is not None:
                    err = pr.errors(f, est)
                    by_cat = " ".join(f"{SHORT[c]} {100 * err[c]:+.1f}%" for c in pr.CATEGORIES)
                    cols = [f"{sum(int(est[c]) for c in pr.CATEGORIES):,}", by_cat, f"{100 * err['total']:+.2f} %"]
                else:
                    cols = ["—", "—", "—"]
                rows.append([name, str(world), str(f["rank"]), *[_mib(peak[c]) for c in pr.CATEGORIES], f"{total:,}",
                             profiled, delta, *cols])
    return rows


def other_at_peak(runs: Mapping[int, Mapping[str, Sequence[dict[str, Any]]]]) -> list[str]:
    """What "other" and "activations" hold at each rank's peak, and the most each tensor-parallel or pipeline
    buffer held at once during the steps."""
    lines = []
    for world, by_case in runs.items():
        for name, ranks in by_case.items():
            for f in ranks:
                parts = []
                for c in ("activations", "other"):
                    items = sorted(f["peak_details"][c].items(), key=lambda kv: -kv[1])
                    parts.append(f"{c}: " + ", ".join(f"{k} {_mib(v)}" for k, v in items if v >= 1024))
                named = {k: v for c in ("activations", "other") for k, v in f["highest"][c].items()
                         if ("tensor-parallel" in k or "pipeline" in k or "gloo" in k)}
                most = ", ".join(f"{k} {_mib(v)}" for k, v in sorted(named.items(), key=lambda kv: -kv[1]))
                lines.append(f"{name} × {world} rank {f['rank']} at the peak — {'; '.join(parts)}"
                             + (f"\n    most at once: {most}" if most else ""))
    return lines


def _print(rows: list[list[str]], markdown: bool) -> None:
    if markdown:
        print("| " + " | ".join(rows[0]) + " |")
        print("|" + "---|" * len(rows[0]))
        for row in rows[1:]:
            print("| " + " | ".join(row) + " |")
        return
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


_ESTIMATES: dict[tuple[str, int], Any] = {}


def estimated(case: pr.Case, world: int, rank: int) -> Mapping[str, int]:
    """Rank ``rank``'s peak by category as ``vram_magic.estimate`` gives it for the job (``device="cpu"``: gloo's
    staging buffers counted), the estimate made once per job. A pipeline's last rank also holds the job's target
    (``schedule.step(target=...)``), which the estimate is not told of: its bytes are added to that rank's "other"."""
    import torch

    import vram_magic

    key = (case.name, world)
    if key not in _ESTIMATES:
        if case.kind in ("stages", "tp-pp"):
            from tests.support import decoder_pipelines

            _ESTIMATES[key] = decoder_pipelines.estimate(case, world)
        elif case.kind == "tp" and case.model == "mlp":
            _ESTIMATES[key] = vram_magic.estimate(pr.mlp, torch.randn(pr.TP_BATCH, pr.WIDTH), device="cpu", tp=world,
                                                  parallelize_plan=pr.mlp_plan(), loss_fn=lambda out: out.sum())
        elif case.kind == "tp":
            top, layer = pr.llama_plan(case.sequence_parallel)
            plan = dict(top)
            for i in range(pr.LLAMA["num_hidden_layers"]):
                plan.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
            inputs = {"input_ids": torch.randint(0, pr.LLAMA["vocab_size"], (pr.LLAMA_BATCH, pr.LLAMA_SEQ)),
                      "position_ids": torch.arange(pr.LLAMA_SEQ).unsqueeze(0)}
            _ESTIMATES[key] = vram_magic.estimate(lambda: pr.llama(world), inputs, device="cpu", tp=world,
                                                  parallelize_plan=plan,
                                                  loss_fn=lambda out: out.logits.float().sum())
        else:
            _ESTIMATES[key] = vram_magic.estimate(
                lambda: torch.nn.Sequential(*[pr.block() for _ in range(pr.PP_BLOCKS)]),
                torch.randn(pr.PP_BATCH, pr.WIDTH), device="cpu", pp=world, micro_batches=case.micro_batches,
                schedule=case.schedule, loss_fn=lambda out: out.sum())
    peak = dict(_ESTIMATES[key].ranks[rank].peak)
    if case.kind == "pp" and rank == world - 1:
        peak["other"] += pr.PP_BATCH * pr.WIDTH * 4  # the target (fp32)
    return peak


def main(argv: Sequence[str] = sys.argv[1:], estimate: Estimate | None = None) -> int:
    import torch

    args = list(argv)

    def option(name: str, default: str) -> str:
        return args[args.index(name) + 1] if name in args else default

    worlds = [int(w) for w in option("--world", "2,4").split(",")]
    kinds = ("stages", "tp-pp") if "--stages" in args else ("tp", "pp")
    names = option("--cases", ",".join(n for n, c in pr.CASES.items() if c.kind in kinds)).split(",")
    repeats = int(option("--repeats", "1"))
    if "--pp-batch" in args:  # the launcher and its ranks read it from the environment
        os.environ["VRAM_PP_BATCH"] = option("--pp-batch", str(pr.PP_BATCH))
        pr.PP_BATCH = int(os.environ["VRAM_PP_BATCH"])
    runs: dict[int, dict[str, list[dict[str, Any]]]] = {}
    spread: dict[tuple[int, str, int], tuple[int, int]] = {}
    started = time.perf_counter()
    for world in worlds:
        fitting = [n for n in names if pr.CASES[n].fits(world)]
        for _ in range(repeats):
            got = pr.run(world, fitting)
            runs.setdefault(world, got)
            for name, ranks in got.items():
                for f in ranks:
                    key = (world, name, f["rank"])
                    if "profiler_rise" not in f:
                        continue
                    low, high = spread.get(key, (f["profiler_rise"], f["profiler_rise"]))
                    spread[key] = (min(low, f["profiler_rise"]), max(high, f["profiler_rise"]))
    wall = time.perf_counter() - started
    print(f"torch {torch.__version__}, gloo on the CPU, {os.cpu_count()} CPUs, one thread a rank; "
          f"{repeats} run(s) of each job, {wall:.0f} s in all")
    for world in worlds:
        for name in names:
            if pr.CASES[name].fits(world):
                print(f"  {name} × {world}: {pr.CASES[name].describe(world)}")
    if "--estimate" in args and estimate is None:
        estimate = estimated
    _print(table(runs, estimate, spread), "--markdown" in args)
    print()
    for line in other_at_peak(runs):
        print(line)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
