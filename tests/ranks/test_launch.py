"""``%%vram --ranks`` in a real IPython shell, on cells that start real gloo ranks: forked and spawned
``torch.multiprocessing`` processes, ``torchrun`` on a ``!`` line, ``accelerate.notebook_launcher``; and
``python -m vram_magic ranks``. The rank code knows nothing of vram_magic; the figures are worked out by hand.

The job: ``Linear(64, 64)`` twice (DDP, or each ``fully_shard``-ed, then the root), AdamW, one training step,
then ``destroy_process_group`` — where each rank's measurement ends, with the job's variables alive.

Cells that fork their ranks run in a fresh kernel (:func:`fresh_kernel`: a new IPython shell in a process that has
never run backward), as they do in a notebook. This test process has: once a process has run a backward pass
with an accelerator in sight — on recent CUDA builds of PyTorch the stand-in CUDA device of fake tensors counts,
and the estimator's tests step on those — PyTorch refuses autograd in every process forked from it afterwards.
What a kernel in that state says is tested on purpose (``test_ranks_forked_after_an_estimate``).
"""

from __future__ import annotations

import contextlib
import io
import math
import multiprocessing
import os
import socket
import subprocess
import sys
import textwrap
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support import run, run_ok

WIDTH = 64
LAYERS = 2
F32 = 4
KERNEL_S = 300  # a fresh kernel's cells, at most

# FSDP2 on the CPU: PyTorch 2.5's FSDP2 raises "FSDP requires CUDA for streams" without CUDA; 2.6 makes CPU streams
# of the CPU's stub, which lacks record_event (AttributeError in the first all-gather); 2.7 has it.
FSDP2_ON_CPU = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 7)
NEEDS_FSDP2_ON_CPU = f"FSDP2 (fully_shard) runs on the CPU from PyTorch 2.7 on; this is {torch.__version__}"
# what a job that would use FSDP2 uses where it cannot: DDP (the launcher is what such a test is about)
SHARDED = "fsdp" if FSDP2_ON_CPU else "ddp"

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
            from torch.distributed.fsdp import fully_shard  # on the CPU: PyTorch 2.7 and later

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
        del model, opt, loss
        collect()


    def collect():
        """What a job that leaves its DDP model to the interpreter's exit does not: collect it first. PyTorch's DDP
        reducer, collected while a spawned or torchrun'd interpreter shuts down, now and then aborts the rank
        ("terminate called without an active exception", SIGABRT): this job without any measuring, two spawned DDP
        ranks, failed 13 of 60 runs on torch 2.15 and 6 of 40 on 2.13, and 0 of 60 with this. Each rank's
        measurement has ended at destroy_process_group, before this."""
        import gc

        gc.collect()


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
        del model, opt, loss
        collect()


    if __name__ == "__main__":
        train(strategy=sys.argv[1] if len(sys.argv) > 1 else "fsdp")
''').replace("WIDTH", str(WIDTH)).replace("LAYERS", str(LAYERS))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def expected(strategy: str, world: int, rank: int) -> dict[str, int]:
    """After the step: parameters, gradients and AdamW state each rank holds (see test_gather.py)."""
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


@pytest.fixture(autouse=True)
def _main_module_for_multiprocessing(monkeypatch):
    """An IPython shell made by an earlier test leaves a ``__main__`` without ``__spec__``, which multiprocessing
    reads when it starts a process."""
    monkeypatch.setattr(sys.modules["__main__"], "__spec__", getattr(sys.modules["__main__"], "__spec__", None),
                        raising=False)


def _portable(value: Any) -> Any:
    """What a kernel's variable is worth to the test: a ``RankReports`` as it is, without its estimate (the
    estimate's peak, the view and the comparison table beside it), an estimate as its peak."""
    from vram_magic.ranks import RankReports

    if isinstance(value, RankReports):
        est = value.estimate
        return {"reports": replace(value, estimate=None), "html": value._repr_mimebundle_()["text/html"],
                "text": str(value), "compare": value.compare() if est is not None else None,
                "estimate_peak": est.peak.total if est is not None else None}
    if hasattr(getattr(value, "peak", None), "total"):
        return {"estimate_peak": value.peak.total}
    return value


def _kernel_main(cells: list[str], keep: tuple[str, ...], conn: Any) -> None:
    """A new IPython shell runs ``cells`` one after the other, as a notebook's kernel does; what each printed
    and raised, and the variables ``keep`` names, go back through ``conn``."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    out: dict[str, Any] = {"cells": [], "ns": {}}
    try:
        config = Config()
        config.HistoryManager.hist_file = ":memory:"
        shell = InteractiveShell.instance(colors="nocolor", config=config)
        shell.run_cell("%load_ext vram_magic", store_history=True)
        for cell in cells:
            stdout, stderr = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                result = shell.run_cell(cell, store_history=True)
            error = result.error_before_exec or result.error_in_exec
            out["cells"].append({"out": stdout.getvalue(), "err": stderr.getvalue(),
                                 "raised": type(error).__name__ if error is not None else None,
                                 "message": str(error) if error is not None else ""})
        out["ns"] = {name: _portable(shell.user_ns.get(name)) for name in keep}
    except BaseException:
        out["crash"] = traceback.format_exc()
    conn.send(out)
    conn.close()


def fresh_kernel(cells: list[str], keep: tuple[str, ...] = ("per_rank",)) -> dict[str, Any]:
    """Run ``cells`` in a fresh kernel: a process forked from multiprocessing's fork server, a new interpreter
    that imported torch and vram_magic and never ran backward. ``{"cells": [{out, err, raised, message}, …],
    "ns": {name: value}}``."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "vram_magic"])
    receive, send = ctx.Pipe(duplex=False)
    kernel = ctx.Process(target=_kernel_main, args=(cells, keep, send))
    kernel.start()
    send.close()
    try:
        assert receive.poll(KERNEL_S), f"the kernel did not finish its cells within {KERNEL_S} s"
        out = receive.recv()
    finally:
        kernel.join(30)
        if kernel.is_alive():
            kernel.kill()
            kernel.join(5)
    assert "crash" not in out, out.get("crash")
    return out


def _check(reports, strategy: str, world: int) -> None:
    assert [r.rank for r in reports] == list(range(world))
    for r in reports:
        assert r.status == "complete" and r.error is None, (r.rank, r.status, r.error)
        assert r.ended == "destroy_process_group"
        want = expected(strategy, world, r.rank)
        assert {c: r.after[c] for c in want} == want, f"rank {r.rank}"
        assert r.before.total == 0  # the model is built after the rank joined the job
        assert r.peak.total >= r.after.total


def _launch(method: str, strategy: str, *args: Any) -> str:
    return (f"mp.start_processes(train, args=(2, {_port()}, {strategy!r}{''.join(', ' + repr(a) for a in args)}), "
            f"nprocs=2, start_method={method!r})")


SETUP = "import torch.multiprocessing as mp\nfrom rankjob import train"


@pytest.mark.parametrize("method,strategy", [
    pytest.param("fork", "fsdp", marks=pytest.mark.skipif(not FSDP2_ON_CPU, reason=NEEDS_FSDP2_ON_CPU)),
    ("spawn", "ddp")])
def test_a_cell_that_starts_ranks_shows_one_bar_per_rank(job, method: str, strategy: str) -> None:
    kernel = fresh_kernel([SETUP, f"%%vram --ranks -o per_rank\n{_launch(method, strategy)}"])
    cell = kernel["cells"][1]
    assert cell["raised"] is None, cell
    shown = cell["out"]
    got = kernel["ns"]["per_rank"]
    reports = got["reports"]
    _check(reports, strategy, 2)
    assert reports.launcher == f"{'forked' if method == 'fork' else 'spawned'} processes (torch.multiprocessing)"
    assert shown.startswith("%%vram cell")
    for rank in (0, 1):
        for moment in ("before", "after", "peak"):
            assert f"rank {rank}   {moment:<7}|" in shown
    assert "imbalance:" in shown
    assert "vram_magic:" not in cell["err"]  # a fresh kernel's forks run backward: nothing to say
    html = got["html"]
    assert html.count('class="vram-bar"') == 6  # before, after and peak of each rank, on one scale
    assert len(set(__import__("re").findall(r'data-scale="(\d+)"', html))) == 1
    if strategy == "ddp":  # DDP's gradient bucket, made by its C++ reducer inside the rank, is "other"
        assert reports[0].after["other"] >= expected("ddp", 2, 0)["gradients"]


def test_torchrun_on_a_shell_line(shell, job) -> None:
    run_ok(shell, f"%%vram --ranks -q -o per_rank\n"
                  f"!{sys.executable} -m torch.distributed.run --nproc-per-node 2 --master-port {_port()} {job} "
                  f"{SHARDED}")
    reports = shell.user_ns["per_rank"]
    _check(reports, SHARDED, 2)
    assert reports.launcher == "torchrun"


def test_a_rank_that_raises_is_named_with_its_error(job) -> None:
    kernel = fresh_kernel([SETUP, f"%%vram --ranks -q -o per_rank\n{_launch('fork', 'ddp', 1)}"])
    # the cell raises as without --ranks
    assert kernel["cells"][1]["raised"] == "ProcessRaisedException"
    reports = kernel["ns"]["per_rank"]["reports"]
    assert [r.rank for r in reports] == [0, 1]
    assert reports[1].error == "ValueError: rank 1 gives up"
    assert reports[1].report is not None and reports[1].ended == "exit"


def test_a_rank_stopped_by_the_launcher_writes_what_it_measured(job) -> None:
    kernel = fresh_kernel([SETUP, f"%%vram --ranks -q -o per_rank\n{_launch('fork', 'ddp', 1, True, 0)}"])
    assert kernel["cells"][1]["raised"] == "ProcessRaisedException"
    stopped, failed = kernel["ns"]["per_rank"]["reports"]
    assert failed.error == "ValueError: rank 1 gives up after its step" and failed.ended == "exit"
    # rank 0 was sleeping when torch.multiprocessing terminated it (SIGTERM): what it measured until then
    assert stopped.status == "partial" and stopped.ended == "SIGTERM" and stopped.error is None
    want = expected("ddp", 2, 0)
    assert {c: stopped.after[c] for c in want} == want


BUILD = (f"import torch\ndef build():\n    return torch.nn.Sequential(*[torch.nn.Linear({WIDTH}, {WIDTH}) "
         f"for _ in range({LAYERS})])")
ESTIMATE = (f"%vram_estimate build --input 'torch.randn(4, {WIDTH})' --device cpu"
            f"{' --fsdp --world 2' if FSDP2_ON_CPU else ''} -q -o est")


def _check_estimate_beside(got: dict[str, Any]) -> None:
    reports, est_peak, table = got["reports"], got["estimate_peak"], got["compare"]
    assert est_peak is not None
    assert list(table.index) == [0, 1]
    assert (table["estimate"] == est_peak).all()
    assert table.loc[0, "error"] == est_peak - reports[0].peak.total
    assert got["html"].count('class="vram-mark"') == 2 and "vram-ranks-compare" in got["html"]


def test_the_estimate_beside_each_rank(job) -> None:
    """``--estimate`` names an estimate made before the cell; spawned ranks are new interpreters, whatever the
    kernel ran before."""
    kernel = fresh_kernel([SETUP, BUILD, ESTIMATE, f"%%vram --ranks --estimate est -q -o per_rank\n"
                                                   f"{_launch('spawn', SHARDED)}"])
    assert [c["raised"] for c in kernel["cells"]] == [None] * 4, kernel["cells"]
    _check(kernel["ns"]["per_rank"]["reports"], SHARDED, 2)
    _check_estimate_beside(kernel["ns"]["per_rank"])


def test_an_estimate_made_after_forked_ranks_is_attached_to_them(job) -> None:
    """The order that works with forked ranks on every build (notebook 06's): the ranks first, then the estimate,
    attached with ``with_estimate``."""
    kernel = fresh_kernel([SETUP, BUILD, f"%%vram --ranks -q -o per_rank\n{_launch('fork', SHARDED)}", ESTIMATE,
                           "per_rank = per_rank.with_estimate(est)\nper_rank"])
    assert [c["raised"] for c in kernel["cells"]] == [None] * 5, kernel["cells"]
    assert kernel["cells"][4]["out"].count("estimate") >= 2  # the view, displayed with the estimate beside
    _check(kernel["ns"]["per_rank"]["reports"], SHARDED, 2)
    _check_estimate_beside(kernel["ns"]["per_rank"])


FORK_PROBE = textwrap.dedent("""
    import os as _os
    _pid = _os.fork()
    if _pid == 0:
        try:
            _x = torch.ones(1, requires_grad=True)
            (_x * 2).sum().backward()
            _os._exit(0)
        except RuntimeError:
            _os._exit(3)
    forks_refused = _os.waitstatus_to_exitcode(_os.waitpid(_pid, 0)[1]) == 3
""")


def test_ranks_forked_after_an_estimate(job) -> None:
    """The estimate's step runs backward in the kernel. Where that keeps forked processes from running backward
    (a GPU, or a recent CUDA build without one), the cell says what to do as it forks, the ranks fail with
    PyTorch's error, and the view says it again; elsewhere the ranks are measured, the estimate beside them."""
    cell = f"%%vram --ranks --estimate est -o per_rank\n{_launch('fork', SHARDED)}"
    kernel = fresh_kernel([SETUP, BUILD, ESTIMATE, FORK_PROBE, cell], keep=("per_rank", "forks_refused"))
    assert [c["raised"] for c in kernel["cells"][:4]] == [None] * 4, kernel["cells"]
    ranks_cell = kernel["cells"][4]
    got = kernel["ns"]["per_rank"]
    reports = got["reports"]
    if not kernel["ns"]["forks_refused"]:  # a CPU build, or an older CUDA build on a machine without a GPU
        assert ranks_cell["raised"] is None, ranks_cell
        assert "vram_magic:" not in ranks_cell["err"]
        _check(reports, SHARDED, 2)
        _check_estimate_beside(got)
        return
    from vram_magic.ranks.forks import PYTORCH_MESSAGE

    advice = "Restart the kernel and run this cell first, with -o per_rank; then make the estimate and attach it: " \
             "per_rank.with_estimate(est)"
    # before the ranks start: the first fork says what to do, once
    assert ranks_cell["err"].count("vram_magic: ranks forked from this kernel cannot run backward") == 1
    assert "--estimate est was made before this cell" in ranks_cell["err"] and advice in ranks_cell["err"]
    assert 'start_method="spawn"' in ranks_cell["err"] and "torchrun" in ranks_cell["err"]
    # the cell raises what the launcher raised, and every rank is listed with PyTorch's error
    assert ranks_cell["raised"] == "ProcessRaisedException" and PYTORCH_MESSAGE in ranks_cell["message"]
    assert [r.rank for r in reports] == [0, 1]
    assert all(PYTORCH_MESSAGE in (r.error or "") for r in reports), [r.error for r in reports]
    # the view says it again, under the ranks
    assert any(advice in note for note in reports.notes)
    assert "note: ranks forked from this kernel cannot run backward" in got["text"]
    assert "vram-note" in got["html"]


def test_a_kernel_whose_forks_cannot_run_backward_says_so_when_a_cell_forks(shell, monkeypatch, capsys) -> None:
    """On every build: the notice comes at the first fork of a ``--ranks`` cell, once, and not for a ``!`` line
    (a shell whose child runs a program at once) nor outside such a cell."""
    from vram_magic.ranks import forks

    monkeypatch.setattr(forks, "_refused_for_good", True)  # as after a backward with a GPU in sight
    notice = "vram_magic: ranks forked from this kernel cannot run backward"
    run_ok(shell, "%%vram --ranks -q\n!echo a shell line")
    assert notice not in capsys.readouterr().err
    run_ok(shell, "import multiprocessing as m\nctx = m.get_context('fork')")
    run_ok(shell, "%%vram --ranks -q -o per_rank\nfor _ in range(2):\n    p = ctx.Process(target=int)\n"
                  "    p.start()\n    p.join()")
    assert capsys.readouterr().err.count(notice) == 1
    assert not shell.user_ns["per_rank"].notes[1:]  # nothing failed for it: only the note that no rank joined
    run_ok(shell, "p = ctx.Process(target=int)\np.start()\np.join()")
    assert notice not in capsys.readouterr().err


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


def test_accelerate_notebook_launcher(job) -> None:
    pytest.importorskip("accelerate")
    kernel = fresh_kernel(["from accelerate import notebook_launcher\nfrom rankjob import accelerate_train",
                           f"%%vram --ranks -q -o per_rank\n"
                           f"notebook_launcher(accelerate_train, num_processes=2, use_port='{_port()}')"])
    assert [c["raised"] for c in kernel["cells"]] == [None, None], kernel["cells"]
    reports = kernel["ns"]["per_rank"]["reports"]
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
