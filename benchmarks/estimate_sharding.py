"""Per-rank memory of FSDP2 (``torch.distributed.fsdp.fully_shard``): ``vram_magic.estimate(fsdp=True,
world=2, device="cpu")`` against a real two-process run with the gloo backend on the CPU, whose per-rank
peak comes from the profiler's memory timeline. Also prints ZeRO-1/2 per-rank estimates for the same model
(no real counterpart here). The real run is repeated (default 3 times): when gloo's reduce-scatter
finishes relative to the next unit's backward moves the real peak by one unit's gradients. Run::

    .venv/bin/python benchmarks/estimate_sharding.py [REPEATS]
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: tests.support
from tests.support.zoo import profiled_cpu_peak, train_steps  # noqa: E402

WORLD = 2
BATCH = 32


class Stack(nn.Module):
    def __init__(self, d: int = 1024, layers: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(256, d)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(layers))
        self.head = nn.Linear(d, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def _rank(rank: int, init: str, path: str) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.profiler import ProfilerActivity, profile

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    torch.manual_seed(rank)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.device("meta"):
            model = Stack()
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        model.to_empty(device="cpu")
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.reset_parameters()
        x = torch.randn(BATCH, 256)
        train_steps(model, x, 2)
    with open(f"{path}.{rank}", "w") as f:
        f.write(str(profiled_cpu_peak(prof)))
    dist.destroy_process_group()


def main() -> int:
    import vram_magic

    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    real: list[int] = []  # per rank and repeat: the gloo collectives' timing moves the peak by a buffer
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            init = f"file://{tmp}/rendezvous"
            mp.spawn(_rank, args=(init, f"{tmp}/peak"), nprocs=WORLD, join=True)
            real += [int(open(f"{tmp}/peak.{r}").read()) for r in range(WORLD)]
    x = torch.randn(BATCH, 256)
    base = vram_magic.estimate(Stack, x, device="cpu")
    print(f"model: {base.parameters / 1e6:.1f} M parameters (fp32), 8 FSDP units + root, AdamW, 2 steps, batch {BATCH} "
          f"per rank, world {WORLD}, gloo on CPU")
    print(f"{'configuration':<28}{'per-rank peak':>15}{'real (profiler)':>18}{'error':>9}")
    print(f"{'unsharded (1 process)':<28}{base.peak.total / 2**20:>11.1f} MiB")
    est = vram_magic.estimate(Stack, x, device="cpu", fsdp=True, world=WORLD)
    worst = 0.0
    for i, got in enumerate(real):
        err = 100.0 * (est.peak.total - got) / got
        worst = max(worst, abs(err))
        label = f"FSDP2 × {WORLD}, run {i // WORLD + 1} rank {i % WORLD}"
        print(f"{label:<28}{est.peak.total / 2**20:>11.1f} MiB{got / 2**20:>14.1f} MiB{err:>+8.2f}%")
    for stage in (1, 2):
        e = vram_magic.estimate(Stack, x, device="cpu", zero=stage, world=WORLD)
        print(f"{f'ZeRO-{stage} × {WORLD} (estimate only)':<28}{e.peak.total / 2**20:>11.1f} MiB")
    print("estimate's split at the FSDP peak: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in
                                                          est.peak.as_dict().items()))
    print("modelled collective buffers: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in est.modelled))
    print(f"worst per-rank error: {worst:.2f} %")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
