"""``%%vram --ranks`` in a real IPython shell, on cells that start real gloo ranks: forked and spawned
``torch.multiprocessing`` processes, ``torchrun`` on a ``!`` line, ``accelerate.notebook_launcher``; and
``python -m vram_magic ranks``. The rank code knows nothing of vram_magic; the figures are worked out by hand.

The job: ``Linear(64, 64)`` twice (DDP, or each ``fully_shard``-ed, then the root), AdamW, one training step,
then ``destroy_process_group`` — where each rank's measurement ends, with the job's variables alive.
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import run, run_ok

WIDTH = 64
LAYERS = 2
F32 = 4

JOB = textwrap.dedent('''
    import os
    import sys

    import torch
    import torch.distributed as dist


    def train(index=0, world=None, port=None, strategy="fsdp", fail_rank=-1, fail_after=False, sleep_rank=-1):
        torch.set_num_threads(1)
        if world is None:  # torchrun: the environment says who we are
            dist.init_process_group("gloo")
        else:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index, world_size=world)
        rank = dist.get_rank()
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
        if strategy == "fsdp":
            try:
                from torch.distributed.fsdp import fully_shard
            except ImportError:  # PyTorch before 2.6
                from torch.distributed._composable.fsdp import fully_shard

            for layer in model:
                fully_shard(layer)
            fully_shard(model)
        else:
            model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(4, WIDTH)
        if rank == fail_rank and not fail_after:
            raise ValueError(f"rank {rank} gives up")
        loss = model(x).sum()
        loss.backward()
        opt.step()
        if rank == fail_rank:
            raise ValueError(f"rank {rank} gives up after its step")
        if rank == sleep_rank:
            import time

            time.sleep(120)  # until the launcher stops it
        dist.destroy_process_group()


    def accelerate_train():
        from accelerate import Accelerator

        acc = Accelerator(cpu=True)
        model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = acc.prepare(model, opt)
        loss = model(torch.randn(4, WIDTH)).sum()
        acc.backward(loss)
        opt.step()
        dist.destroy_process_group()


    if __name__ == "__main__":
        train(strategy=sys.argv[1] if len(sys.argv) > 1 else "fsdp")
''').replace("WIDTH", str(WIDTH)).replace("LAYERS", str(LAYERS))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def expected(strategy: str, world: int, rank: int) -> dict[str, int]:
    """After the step: parameters, gradients and AdamW state each rank holds (see test_ranks_gather.py)."""
    n_params = 2 * LAYERS
    if strategy == "ddp":
        full = LAYERS * (WIDTH * WIDTH + WIDTH) * F32
        return {"parameters": full, "gradients": full, "optimizer_state": 2 * full + 4 * n_params}
    chunk = math.ceil(WIDTH / world)
    own = max(min(chunk, WIDTH - rank * chunk), 0)
    held = LAYERS * (chunk * WIDTH + chunk) * F32
    return {"parameters": held, "gradients": held, "optimizer_state": 2 * LAYERS * (own * WIDTH + own) * F32
            + 4 * n_params}


@pytest.fixture
def job(tmp_path: Path):
    """The job as an importable module (spawned children import it by name, torchrun runs it as a script)."""
    (tmp_path / "rankjob.py").write_text(JOB)
    sys.path.insert(0, str(tmp_path))
    yield tmp_path / "rankjob.py"
    sys.path.remove(str(tmp_path))
    sys.modules.pop("rankjob", None)


def _check(reports, strategy: str, world: int) -> None:
    assert [r.rank for r in reports] == list(range(world))
    for r in reports:
        assert r.status == "complete" and r.error is None, (r.rank, r.status, r.error)
        assert r.ended == "destroy_process_group"
        want = expected(strategy, world, r.rank)
        assert {c: r.after[c] for c in want} == want, f"rank {r.rank}"
        assert r.before.total == 0  # the model is built after the rank joined the job
        assert r.peak.total >= r.after.total


@pytest.mark.parametrize("method,strategy", [("fork", "fsdp"), ("spawn", "ddp")])
def test_a_cell_that_starts_ranks_shows_one_bar_per_rank(shell, job, method: str, strategy: str, capsys) -> None:
    run_ok(shell, "import torch.multiprocessing as mp\nfrom rankjob import train")
    capsys.readouterr()
    run_ok(shell, f"%%vram --ranks -o per_rank\n"
                  f"mp.start_processes(train, args=(2, {_port()}, {strategy!r}), nprocs=2, start_method={method!r})")
    shown = capsys.readouterr().out
    reports = shell.user_ns["per_rank"]
    _check(reports, strategy, 2)
    assert reports.launcher == f"{'forked' if method == 'fork' else 'spawned'} processes (torch.multiprocessing)"
    assert shown.startswith("%%vram cell")
    for rank in (0, 1):
        for moment in ("before", "after", "peak"):
            assert f"rank {rank}   {moment:<7}|" in shown
    assert "imbalance:" in shown
    html = reports._repr_mimebundle_()["text/html"]
    assert html.count('class="vram-bar"') == 6  # before, after and peak of each rank, on one scale
    assert len(set(__import__("re").findall(r'data-scale="(\d+)"', html))) == 1
    if strategy == "ddp":  # DDP's gradient bucket, made by its C++ reducer inside the rank, is "other"
        assert reports[0].after["other"] >= expected("ddp", 2, 0)["gradients"]


def test_torchrun_on_a_shell_line(shell, job) -> None:
    run_ok(shell, f"%%vram --ranks -q -o per_rank\n"
                  f"!{sys.executable} -m torch.distributed.run --nproc-per-node 2 --master-port {_port()} {job} fsdp")
    reports = shell.user_ns["per_rank"]
    _check(reports, "fsdp", 2)
    assert reports.launcher == "torchrun"


def test_a_rank_that_raises_is_named_with_its_error(shell, job) -> None:
    run_ok(shell, "import torch.multiprocessing as mp\nfrom rankjob import train")
    result = run(shell, f"%%vram --ranks -q -o per_rank\n"
                        f"mp.start_processes(train, args=(2, {_port()}, 'ddp', 1), nprocs=2, start_method='fork')")
    assert type(result.error_in_exec).__name__ == "ProcessRaisedException"  # the cell raises as without --ranks
    reports = shell.user_ns["per_rank"]
    assert [r.rank for r in reports] == [0, 1]
    assert reports[1].error == "ValueError: rank 1 gives up"
    assert reports[1].report is not None and reports[1].ended == "exit"


def test_a_rank_stopped_by_the_launcher_writes_what_it_measured(shell, job) -> None:
    run_ok(shell, "import torch.multiprocessing as mp\nfrom rankjob import train")
    result = run(shell, f"%%vram --ranks -q -o per_rank\n"
                        f"mp.start_processes(train, args=(2, {_port()}, 'ddp', 1, True, 0), nprocs=2, "
                        f"start_method='fork')")
    assert type(result.error_in_exec).__name__ == "ProcessRaisedException"
    stopped, failed = shell.user_ns["per_rank"]
    assert failed.error == "ValueError: rank 1 gives up after its step" and failed.ended == "exit"
    # rank 0 was sleeping when torch.multiprocessing terminated it (SIGTERM): what it measured until then
    assert stopped.status == "partial" and stopped.ended == "SIGTERM" and stopped.error is None
    want = expected("ddp", 2, 0)
    assert {c: stopped.after[c] for c in want} == want


def test_the_estimate_beside_each_rank(shell, job) -> None:
    run_ok(shell, f"import torch\nimport torch.multiprocessing as mp\nfrom rankjob import train\n"
                  f"def build():\n    return torch.nn.Sequential(*[torch.nn.Linear({WIDTH}, {WIDTH}) for _ in "
                  f"range({LAYERS})])")
    run_ok(shell, f"%vram_estimate build --input 'torch.randn(4, {WIDTH})' --device cpu --fsdp --world 2 -q -o est")
    run_ok(shell, f"%%vram --ranks --estimate est -q -o per_rank\n"
                  f"mp.start_processes(train, args=(2, {_port()}, 'fsdp'), nprocs=2, start_method='fork')")
    reports = shell.user_ns["per_rank"]
    est = shell.user_ns["est"]
    assert reports.estimate is est
    table = reports.compare()
    assert list(table.index) == [0, 1]
    assert (table["estimate"] == est.peak.total).all()
    assert table.loc[0, "error"] == est.peak.total - reports[0].peak.total
    html = reports._repr_mimebundle_()["text/html"]
    assert html.count('class="vram-mark"') == 2 and "vram-ranks-compare" in html


def test_options_that_do_not_go_with_ranks(shell) -> None:
    for line, words in [("%%vram --ranks --budget 1GiB", "--budget"), ("%%vram --estimate est", "go with --ranks"),
                        ("%%vram --ranks --estimate nothing_here", "no variable"),
                        ("%%vram --ranks -o 1x", "variable name")]:
        result = run(shell, f"{line}\npass")
        assert type(result.error_in_exec).__name__ == "UsageError", line
        assert words in str(result.error_in_exec)


def test_a_cell_that_starts_no_rank_says_so(shell, capsys) -> None:
    run_ok(shell, "%%vram --ranks -o per_rank\nx = 1")
    assert len(shell.user_ns["per_rank"]) == 0
    assert "no process started here joined a torch.distributed job" in capsys.readouterr().out
    assert "VRAM_MAGIC_RANKS" not in os.environ and "vram_magic" not in os.environ.get("PYTHONPATH", "")


def test_accelerate_notebook_launcher(shell, job) -> None:
    pytest.importorskip("accelerate")
    run_ok(shell, "from accelerate import notebook_launcher\nfrom rankjob import accelerate_train")
    run_ok(shell, f"%%vram --ranks -q -o per_rank\n"
                  f"notebook_launcher(accelerate_train, num_processes=2, use_port='{_port()}')")
    reports = shell.user_ns["per_rank"]
    _check(reports, "ddp", 2)
    assert reports.launcher.startswith("torch elastic, forked")


def test_command_line(job, tmp_path: Path) -> None:
    out = tmp_path / "reports"
    cmd = [sys.executable, "-m", "vram_magic", "ranks", "run", "-o", str(out), "--", sys.executable, "-m",
           "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_port()), str(job), "ddp"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "rank 0   peak   |" in done.stdout and "rank 1   peak   |" in done.stdout
    shown = subprocess.run([sys.executable, "-m", "vram_magic", "ranks", str(out), "--world", "3"],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0
    assert "rank 2: no report" in shown.stdout
    from vram_magic.ranks import RankReports

    _check(RankReports.load(out), "ddp", 2)
