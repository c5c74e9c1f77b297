"""Per-rank memory of FSDP2 and DDP, measured inside each rank, and the estimate's error per rank.

Two gloo processes on the CPU train the same model two steps (forward, sum, backward, AdamW step, zero_grad),
once under DDP and once with FSDP2 (``fully_shard`` per block, then the root). Each rank is measured the way
``%%vram --ranks`` measures it (:class:`vram_magic.ranks.launch.LaunchedRanks`: from joining the job to
``destroy_process_group``, the rank's code unchanged); the estimate is ``vram_magic.estimate(..., device="cpu")``
with ``fsdp=True, world=2`` for FSDP2, and unsharded for DDP (every DDP rank holds the whole model). Run::

    .venv/bin/python benchmarks/ranks_fsdp_ddp.py [--markdown] [--world N]

FSDP2 runs on the CPU from PyTorch 2.7 on (2.5's needs CUDA streams, 2.6's CPU stream stub lacks
``record_event``); with an older PyTorch only DDP is measured.

``--mixed`` measures FSDP2 as large runs configure it instead: a transformers Llama under ``fully_shard`` with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, the same with ``reduce_dtype=bf16``, with
``CPUOffloadPolicy`` and with torchao's float8 linears (tests/support/fsdp_jobs.py, launched by
tests/support/parallel_runs.py), against ``vram_magic.estimate(..., zero=3, world=2, param_dtype="bf16",
device="cpu")`` per rank and per category::

    .venv/bin/python benchmarks/ranks_fsdp_ddp.py --mixed [--markdown]
"""

from __future__ import annotations

import os
import socket
import sys

import torch
from torch import nn

WORLD = 2
BATCH = 64
WIDTH = 512
BLOCKS = 4
STEPS = 2
FSDP2_ON_CPU = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 7)


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
                                    for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def rank_main(index: int, strategy: str, port: int, world: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index, world_size=world)
    torch.manual_seed(0)
    if strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        with torch.device("meta"):
            model = Stack()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        model.to_empty(device="cpu")
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.reset_parameters()
    else:
        model = nn.parallel.DistributedDataParallel(Stack())
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(BATCH, WIDTH)
    for _ in range(STEPS):
        loss = model(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(strategy: str, world: int = WORLD):
    import torch.multiprocessing as mp

    from vram_magic.ranks.launch import LaunchedRanks

    with LaunchedRanks(title=f"{strategy} × {world}") as launched:
        mp.start_processes(rank_main, args=(strategy, _port(), world), nprocs=world, start_method="spawn")
    return launched.reports


def mixed(markdown: bool) -> int:
    """FSDP2's mixed-precision and offload policies on 2 gloo ranks against the estimate, per rank and category."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: tests.support
    from tests.support import fsdp_jobs
    from tests.support import parallel_runs as pr

    names = tuple(fsdp_jobs.VARIANTS)
    runs = pr.run(WORLD, names)
    print(f"model: transformers Llama {fsdp_jobs.LLAMA}, batch {fsdp_jobs.BATCH} × {fsdp_jobs.SEQ} tokens, AdamW, "
          f"{pr.STEPS} steps, {WORLD} gloo processes on the CPU, torch {torch.__version__}")
    head = ["case", "rank", *[f"{c.replace('_', ' ')} real / estimate" for c in pr.CATEGORIES], "peak real",
            "estimate", "error", "worst category"]
    rows = []
    for name in names:
        est = fsdp_jobs.estimate(name, WORLD)
        for f in runs[name]:
            err = pr.errors(f, est.peak)
            total = sum(f["peak"].values())
            worst = max(pr.CATEGORIES, key=lambda c: abs(err[c]))
            rows.append([name, str(f["rank"]), *[f"{f['peak'][c]:,} / {est.peak[c]:,}" for c in pr.CATEGORIES],
                         f"{total:,} B", f"{est.peak.total:,} B", f"{100 * err['total']:+.2f} %",
                         f"{worst} {100 * err[worst]:+.2f} %"])
    if markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
    for row in rows:
        print(("| " + " | ".join(row) + " |") if markdown else "  ".join(row))
    return 0


def main() -> int:
    import vram_magic
    from vram_magic import format_bytes

    markdown = "--markdown" in sys.argv
    if "--mixed" in sys.argv:
        return mixed(markdown)
    world = int(sys.argv[sys.argv.index("--world") + 1]) if "--world" in sys.argv else WORLD
    x = torch.randn(BATCH, WIDTH)
    estimates = {"ddp": vram_magic.estimate(Stack, x, device="cpu", steps=STEPS),
                 "fsdp": vram_magic.estimate(Stack, x, device="cpu", steps=STEPS, fsdp=True, world=world)}
    params = sum(p.numel() for p in Stack().parameters())
    print(f"model: {params / 1e6:.2f} M parameters (fp32), {BLOCKS} blocks + input and head layers, AdamW, "
          f"{STEPS} steps, batch {BATCH} per rank, {world} gloo processes on the CPU, torch {torch.__version__}")
    cats = ("parameters", "gradients", "optimizer_state", "activations", "other")
    head = ["strategy", "rank", *[c.replace("_", " ") + " (peak)" for c in cats], "peak", "estimate", "error"]
    rows = []
    strategies = ("ddp", "fsdp") if FSDP2_ON_CPU else ("ddp",)
    if not FSDP2_ON_CPU:
        print(f"FSDP2 not measured: it runs on the CPU from PyTorch 2.7 on (this is {torch.__version__})")
    for strategy in strategies:
        reports = measure(strategy, world).with_estimate(estimates[strategy])
        if not markdown:
            print(reports)
        for r in reports:
            if r.report is None:
                rows.append([strategy, str(r.rank), "no report: " + str(r.error)])
                continue
            est = estimates[strategy].peak.total
            err = 100.0 * (est - r.peak.total) / r.peak.total
            rows.append(["DDP" if strategy == "ddp" else "FSDP2", str(r.rank),
                         *[format_bytes(r.peak[c]) for c in cats], format_bytes(r.peak.total), format_bytes(est),
                         f"{err:+.1f} %"])
        for r in reports:
            if r.report is not None:
                print(f"{strategy} rank {r.rank}: peak {r.peak.total:,} B, estimate "
                      f"{estimates[strategy].peak.total:,} B; after the steps: "
                      + ", ".join(f"{c} {r.after[c]:,} B" for c in cats))
        other = {label: n for label, n in reports[0].peak.details("other").items() if n}
        print(f"{strategy} rank 0 'other' at the peak: " +
              ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(other.items(), key=lambda kv: -kv[1])))
    if markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
    for row in rows:
        print(("| " + " | ".join(row) + " |") if markdown else "  ".join(f"{c:>12}" for c in row))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
