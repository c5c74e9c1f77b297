"""Speed and host memory of estimating big models: Llama-shaped bf16 decoders, sequence 2048, batch 1,
AdamW, two training steps, on fake tensors. Targets: 7B in ≤ 5 s and < 1 GiB RSS; 70B in ≤ 20 s. Run::

    .venv/bin/python benchmarks/estimate_speed.py [--sizes 7B,70B] [--seq 2048]
    .venv/bin/python benchmarks/estimate_speed.py --replays   # the trace cache: a replay against a trace

``--replays``: GPT-2 small (124 M parameters, batch 8 × 1,024), traced once, then estimated again with options that
are applied after the trace (ZeRO over 8 ranks, optimizer offload, both): each such what-if row or search trial is a
replay of the kept trace, not a new fake run. Target: ≤ 5 % of the trace's time (CPU time, one thread).

Each size runs in a fresh process so its maximum RSS is its own (the process includes ``import torch``),
"cold" is a process's first estimate, which includes PyTorch importing ``torch._dynamo`` for its fake
tensors (once per process), "warm" a second estimate in the same process; the target is checked on the
warm figure, both are printed. CPU time is printed beside
wall time because a shared machine's wall time says more about its neighbours than about the estimate.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout: tests.support
TARGETS = {"7B": 5.0, "13B": 10.0, "70B": 20.0}
RSS_TARGET = 1024**3


def one(size: str, seq: int) -> dict[str, float]:
    import resource
    import time

    sys.path.insert(0, ROOT)
    import torch

    import vram_magic
    from tests.support.llama import build

    rss_torch = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    for _ in range(2):  # cold: the process's first estimate (PyTorch imports torch._dynamo once); then warm
        t, cpu = time.perf_counter(), time.process_time()
        est = vram_magic.estimate(lambda: build(size), lambda: torch.randint(0, 32000, (1, seq)), dtype="bf16",
                                  optimizer="adamw", gpu="H100-80GB")
        times.append((time.perf_counter() - t, time.process_time() - cpu))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"cold": times[0][0], "cold_cpu": times[0][1], "wall": times[1][0], "cpu": times[1][1],
            "load": os.getloadavg()[0], "rss": rss, "rss_torch": rss_torch, "params": est.parameters,
            "peak": est.peak.total, "needed": est.needed, "fits": bool(est.fits), **{k: est.peak[k] for k in est.peak}}


REPLAY_TARGET = 0.05


def replays() -> bool:
    """The trace cache's figure: what a replay costs against the trace it replays."""
    import time

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import vram_magic

    torch.set_num_threads(1)
    ok = True
    print(f"GPT-2 small, batch 8 × 1024, AdamW; CPU time, one thread; load average {os.getloadavg()[0]:.1f}")
    print(f"{'device':<8}{'trace':>9}{'events':>8}   replays (options applied after the trace)")
    for device in ("cuda", "cpu"):
        t = time.process_time()
        est = vram_magic.estimate(lambda: GPT2LMHeadModel(GPT2Config()), lambda: torch.randint(0, 50257, (8, 1024)),
                                  device=device, gpu="A100-80GB" if device == "cuda" else None)
        traced = time.process_time() - t
        workload = est.rerun
        line = []
        for change in ({"zero": 3, "world": 8}, {"offload": True}, {"zero": 2, "world": 4, "offload": True}):
            before = workload.traced
            t = time.process_time()
            workload.evaluate(est.options.with_(**change))
            replay = time.process_time() - t
            ok &= workload.traced == before and replay <= REPLAY_TARGET * traced
            line.append(f"{', '.join(f'{k}={v}' for k, v in change.items())}: {replay * 1e3:.0f} ms "
                        f"({100 * replay / traced:.1f} %)")
        events = len(workload.trace(est.options).events)
        print(f"{device:<8}{traced:>7.2f} s{events:>8}   " + "; ".join(line))
    print(f"target ≤ {REPLAY_TARGET:.0%} of a trace: {'met' if ok else 'MISSED'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="7B,70B")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--replays", action="store_true", help="the trace cache: replays against a trace")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.replays:
        return 0 if replays() else 1
    if args.child:
        print(json.dumps(one(args.child, args.seq)))
        return 0
    ok = True
    print(f"Llama-shaped, bf16, batch 1, sequence {args.seq}, AdamW, 2 training steps, device='cuda' (modelled), "
          f"{os.cpu_count()} CPU cores")
    print(f"{'model':<6}{'params':>9}{'cold wall/CPU':>16}{'warm wall/CPU':>16}{'target':>8}{'max RSS':>10}"
          f"{'RSS of import torch':>21}{'peak (allocated)':>18}{'needed on H100':>16}")
    for size in args.sizes.split(","):
        out = subprocess.run([sys.executable, __file__, "--child", size, "--seq", str(args.seq)],
                             capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        target = TARGETS.get(size, 20.0)
        ok &= min(r["wall"], r["cpu"]) <= target and (size != "7B" or r["rss"] < RSS_TARGET)
        print(f"{size:<6}{r['params'] / 1e9:>8.2f}B{r['cold']:>8.2f}/{r['cold_cpu']:.2f} s{r['wall']:>8.2f}/"
              f"{r['cpu']:.2f} s{target:>6.0f} s{r['rss'] / 2**20:>6.0f} MiB{r['rss_torch'] / 2**20:>17.0f} MiB"
              f"{r['peak'] / 2**30:>14.2f} GiB{r['needed'] / 2**30:>12.2f} GiB")
        print("       split: " + ", ".join(f"{k} {r[k] / 2**30:.2f} GiB" for k in
                                         ("parameters", "gradients", "optimizer_state", "activations", "other"))
              + f"; load average during the run {r['load']:.1f}")
    print("all targets met" if ok else "a target was MISSED (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
