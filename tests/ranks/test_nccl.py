"""Per-rank memory on CUDA with NCCL (skipped without a GPU; ``benchmarks/gpu_check.py`` runs them): each rank
measures its own GPU, ``gather`` travels through the rendezvous store (no GPU memory of its own), and the figures
are the CUDA caching allocator's blocks (512-byte multiples) of each rank's shards."""

from __future__ import annotations

import math
import multiprocessing as mp
import socket
import sys
from pathlib import Path

import pytest
import torch

WIDTH = 64
LAYERS = 2
F32 = 4
pytestmark = pytest.mark.cuda


def _block(n: int) -> int:
    return -(-n // 512) * 512


def _rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # PyTorch before 2.6
        from torch.distributed._composable.fsdp import fully_shard

    import vram_magic

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]).cuda()
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, WIDTH, device="cuda")
    with vram_magic.measure() as m:
        loss = model(x).sum()
        loss.backward()
        opt.step()
        del loss
    reports = vram_magic.gather(m, timeout=60)
    if rank == 0:
        reports.save(out)
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, tmp_path: Path):
    ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
    out = str(tmp_path / "ranks")
    port = _port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive and all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    from vram_magic.ranks import RankReports

    return RankReports.load(out)


@pytest.fixture(autouse=True)
def _main_module_for_multiprocessing(monkeypatch):
    monkeypatch.setattr(sys.modules["__main__"], "__spec__", getattr(sys.modules["__main__"], "__spec__", None),
                        raising=False)


def _expected(world: int, rank: int) -> dict[str, int]:
    chunk = math.ceil(WIDTH / world)
    own = max(min(chunk, WIDTH - rank * chunk), 0)
    # parameters: one padded shard per parameter; gradients: one reduce-scatter output per unit (weight + bias)
    params = LAYERS * (_block(chunk * WIDTH * F32) + _block(chunk * F32))
    grads = LAYERS * _block((chunk * WIDTH + chunk) * F32)
    state = LAYERS * 2 * (_block(own * WIDTH * F32) + _block(own * F32))  # exp_avg, exp_avg_sq on the GPU
    return {"parameters": params, "gradients": grads, "optimizer_state": state}  # `step` stays on the host


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_nccl_rank_measures_its_gpu(tmp_path: Path) -> None:
    reports = _launch(1, tmp_path)
    (r,) = reports
    assert r.backend == "nccl" and r.device.startswith("cuda") and r.status == "complete"
    want = _expected(1, 0)
    assert {c: r.after[c] for c in want} == want


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_nccl_ranks_hold_half_each(tmp_path: Path) -> None:
    reports = _launch(2, tmp_path)
    assert [r.rank for r in reports] == [0, 1]
    for r in reports:
        want = _expected(2, r.rank)
        assert {c: r.after[c] for c in want} == want, r.rank
        assert r.device == f"cuda:{r.rank}"
