"""``vram_magic.measure()`` in every rank of a real ``torch.distributed`` job (gloo, CPU processes), gathered on
rank 0 with ``vram_magic.gather()``; every figure is worked out by hand from the shapes.

The model: ``width`` → ``width`` Linear blocks, each ``fully_shard``-ed (FSDP2), and a root with a Linear head
of its own; or the same model under DDP. FSDP2 splits every parameter along dim 0 into ``world`` chunks of
``ceil(rows / world)`` rows (``torch.chunk``), and each rank allocates a chunk that size — the last rank's
shard is padded. The gradients of a unit arrive in one reduce-scatter output of the unit's padded shards;
AdamW's ``exp_avg``/``exp_avg_sq`` are ``zeros_like`` the unpadded shard, plus a 4-byte ``step`` per parameter.
"""

from __future__ import annotations

import datetime
import json
import math
import multiprocessing as mp
import socket
import sys
import time
from pathlib import Path

import pytest
import torch

WIDTH = 64
BLOCKS = 2
BATCH = 4
F32 = 4
JOIN_S = 120
# FSDP2 on the CPU: PyTorch 2.5's FSDP2 raises "FSDP requires CUDA for streams" without CUDA; 2.6 makes CPU streams
# of the CPU's stub, which lacks record_event (AttributeError in the first all-gather); 2.7 has it.
FSDP2_ON_CPU = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 7)
NEEDS_FSDP2_ON_CPU = f"FSDP2 (fully_shard) runs on the CPU from PyTorch 2.7 on; this is {torch.__version__}"


# --- the rank's side (runs in the child processes) -------------------------------------------------
def _model(strategy: str):
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(BLOCKS))
            self.head = nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            for b in self.blocks:
                x = torch.relu(b(x))
            return self.head(x)

    torch.manual_seed(0)
    model = Net()
    if strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard  # on the CPU: PyTorch 2.7 and later

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    else:
        model = nn.parallel.DistributedDataParallel(model)
    return model


def _rank_main(rank: int, world: int, port: int, out: str, strategy: str, fail: str, via: str) -> None:
    import torch
    import torch.distributed as dist

    import vram_magic

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    try:
        model = _model(strategy)
        if strategy == "zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(BATCH, WIDTH)
        if fail == "before-gather" and rank == world - 1:
            raise ValueError(f"rank {rank} fails before it measures or gathers")
        m = None
        try:
            with vram_magic.measure() as m:
                if fail == "in-step" and rank == world - 1:
                    raise ValueError(f"rank {rank} fails inside its step")
                loss = model(x).sum()
                loss.backward()
                opt.step()
                del loss
        except Exception:  # recorded in the report (the step's error is this test's subject)
            pass
        finally:
            reports = vram_magic.gather(m, timeout=5 if fail == "before-gather" else 60, via=via)
        if rank == 0:
            assert reports is not None
            reports.save(out)
        else:
            assert reports is None
        if not fail:  # one more forward and backward alone: its peak is in FSDP's collectives, not the update
            with vram_magic.measure() as fb:
                loss = model(x).sum()
                loss.backward()
                del loss
            again = vram_magic.gather(fb, via=via)
            if rank == 0:
                again.save(Path(out, "forward-backward"))
        if rank == 0:
            Path(out, "done").write_text(json.dumps({"type": type(reports).__name__, "len": len(reports)}))
    finally:
        dist.destroy_process_group()


# --- the test's side -----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context():
    """Children forked from a server that imported torch once: a fresh interpreter per rank costs seconds each."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "vram_magic"])
    return ctx


@pytest.fixture(autouse=True)
def _main_module_for_multiprocessing(monkeypatch):
    """An IPython shell made by an earlier test leaves a ``__main__`` without ``__spec__``, which multiprocessing
    reads when it starts a process."""
    monkeypatch.setattr(sys.modules["__main__"], "__spec__", getattr(sys.modules["__main__"], "__spec__", None),
                        raising=False)


def _run(world: int, strategy: str, tmp_path: Path, fail: str = "", via: str = "store") -> tuple[dict, list]:
    ctx = _context()
    port = _free_port()
    out = str(tmp_path / "ranks")
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, out, strategy, fail, via)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + JOIN_S
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0.1))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    assert not hung, f"ranks {hung} did not finish within {JOIN_S} s"
    from vram_magic.ranks import RankReports

    done = json.loads(Path(out, "done").read_text())
    return done, RankReports.load(out)  # type: ignore[return-value]


def _forward_backward(tmp_path: Path):
    from vram_magic.ranks import RankReports

    return RankReports.load(tmp_path / "ranks" / "forward-backward")


def _shard_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """(padded rows every rank allocates, rows of this rank's own shard)"""
    chunk = math.ceil(rows / world)
    return chunk, max(min(chunk, rows - rank * chunk), 0)


def _zero_partition(world: int) -> list[list[int]]:
    """ZeroRedundancyOptimizer's partition, by hand: parameters largest first (weights, then biases, each in
    model order), each to the rank holding the fewest elements so far (the first such rank on a tie)."""
    numels = sorted([WIDTH * WIDTH, WIDTH] * (BLOCKS + 1), reverse=True)
    owned: list[list[int]] = [[] for _ in range(world)]
    for n in numels:
        sizes = [sum(o) for o in owned]
        owned[sizes.index(min(sizes))].append(n)
    return owned


def _expected(strategy: str, world: int, rank: int) -> dict[str, int]:
    linears = BLOCKS + 1
    n_params = 2 * linears  # weight and bias of each Linear
    if strategy == "zero1":  # DDP's full replica; AdamW's two moments and step for this rank's partition only
        full = linears * (WIDTH * WIDTH + WIDTH) * F32
        mine = _zero_partition(world)[rank]
        return {"parameters": full, "gradients": full, "optimizer_state": 2 * sum(mine) * F32 + 4 * len(mine)}
    if strategy == "ddp":
        full = linears * (WIDTH * WIDTH + WIDTH) * F32
        return {"parameters": full, "gradients": full, "optimizer_state": 2 * full + 4 * n_params}
    padded, own = _shard_rows(WIDTH, world, rank)
    held = linears * (padded * WIDTH + padded) * F32  # weight rows × WIDTH, bias rows
    shard = linears * (own * WIDTH + own) * F32
    return {"parameters": held, "gradients": held, "optimizer_state": 2 * shard + 4 * n_params}


_FSDP = pytest.mark.skipif(not FSDP2_ON_CPU, reason=NEEDS_FSDP2_ON_CPU)


@pytest.mark.parametrize("world,strategy,via", [pytest.param(2, "fsdp", "store", marks=_FSDP),
                                               pytest.param(3, "fsdp", "store", marks=_FSDP),
                                               (2, "ddp", "collective"), (3, "ddp", "store"), (2, "zero1", "store")])
def test_each_rank_measures_what_it_holds(world: int, strategy: str, via: str, tmp_path: Path) -> None:
    done, reports = _run(world, strategy, tmp_path, via=via)
    assert done == {"type": "RankReports", "len": world}
    assert [r.rank for r in reports] == list(range(world))
    assert all(r.world == world and r.status == "complete" and r.error is None for r in reports)
    assert len({r.pid for r in reports}) == world
    for r in reports:
        want = _expected(strategy, world, r.rank)
        after = r.after
        assert after is not None
        got = {c: after[c] for c in want}
        assert got == want, f"rank {r.rank}: {got} != {want}"
        assert r.before["parameters"] == want["parameters"]
        assert r.before["gradients"] == 0 and r.before["optimizer_state"] == 0
        assert r.peak.total >= after.total
        assert r.backend == "gloo" and r.device == "cpu"
        if strategy == "fsdp":  # named as sharded
            assert any(label.endswith("(sharded)") for label in after.details("parameters"))
            assert any(label.endswith("(sharded)") for label in after.details("optimizer_state"))
            assert not any(label.startswith("FSDP") for label in after.details())  # FSDP's buffers: freed by the end
    again = _forward_backward(tmp_path)
    assert [r.rank for r in again] == list(range(world))
    for r in again:
        other = r.peak.details("other")
        if strategy == "fsdp":  # FSDP's collective buffers, named, at the peak of a forward and backward
            assert {"FSDP all-gather buffers", "FSDP unsharded parameters (all-gathered)"} <= set(other), other
        else:
            assert not any(label.startswith("FSDP") for label in other)
    if strategy == "zero1":  # the partition is named as such
        assert all(set(r.after.details("optimizer_state")) == {"opt (ZeRO partition)"} for r in reports)
        assert _zero_partition(2) == [[WIDTH * WIDTH] * 2, [WIDTH * WIDTH] + [WIDTH] * 3]
    if strategy == "fsdp" and world == 3:
        # the last rank's shard is the short one: less optimizer state, the same padded parameters
        assert reports[2].after["optimizer_state"] < reports[0].after["optimizer_state"]
        assert reports[2].after["parameters"] == reports[0].after["parameters"]


def test_a_rank_that_raises_inside_its_step_is_reported_with_its_error(tmp_path: Path) -> None:
    done, reports = _run(3, "ddp", tmp_path, fail="in-step")
    assert [r.rank for r in reports] == [0, 1, 2]
    bad = reports[2]
    assert bad.error == "ValueError: rank 2 fails inside its step"
    assert bad.report is not None  # measured until it raised
    for r in reports[:2]:
        # the others' backward waited in an allreduce the failed rank never joined: they report that error
        assert r.report is not None and r.error is not None and "ValueError" not in r.error
    assert set(reports.errors) == {0, 1, 2}


def test_a_rank_that_never_gathers_does_not_hang_the_others(tmp_path: Path) -> None:
    started = time.monotonic()
    done, reports = _run(2, "ddp", tmp_path, fail="before-gather")
    assert time.monotonic() - started < JOIN_S
    assert done["len"] == 2
    assert reports[0].report is not None
    missing = reports[1]
    assert missing.report is None and missing.status == "missing"
    assert "no report within 5 s" in (missing.error or "")
