"""``python -m vram_magic run``: a script runs as ``python script.py`` runs it, and an out-of-memory error leaves
its report (JSON, text, HTML and a PyTorch memory snapshot) and the script's own exit status; under ``torchrun``
each rank leaves its own."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

import vram_magic
from tests.support import ROOT

MiB = 1 << 20
SCRIPT = """
import sys
import torch

weights = torch.zeros(1024, 1024)  # 4 MiB


def step():
    acts = torch.ones(2048, 1024)  # 8 MiB
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                                 "14.75 GiB of which 1.06 GiB is free.")


if __name__ == "__main__":
    print("argv", sys.argv, "file", __file__ == {path!r})
    if sys.argv[1:] == ["--exit", "3"]:
        sys.exit(3)
    if sys.argv[1:] != ["--ok"]:
        step()
"""


def _run(tmp_path, *args, env=None):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT.format(path=str(script))))
    return subprocess.run([sys.executable, "-m", "vram_magic", "run", "--out", str(tmp_path / "out"), str(script),
                           *args], capture_output=True, text=True, timeout=180, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_the_script_runs_as_python_runs_it_and_keeps_its_status(tmp_path):
    ok = _run(tmp_path, "--ok")
    assert ok.returncode == 0, ok.stderr
    assert f"argv [{str(tmp_path / 'train.py')!r}, '--ok'] file True" in ok.stdout
    assert _run(tmp_path, "--exit", "3").returncode == 3
    assert not (tmp_path / "out").exists()  # nothing ran out of memory: nothing written


def test_an_out_of_memory_error_leaves_its_report_and_the_traceback_starts_at_the_script(tmp_path):
    done = _run(tmp_path)
    assert done.returncode == 1
    names = sorted(os.listdir(tmp_path / "out"))
    stems = {n.rsplit(".", 1)[0] for n in names}
    assert len(stems) == 1 and {n.rsplit(".", 1)[1] for n in names} == {"json", "txt", "html", "pickle"}
    with open(tmp_path / "out" / f"{stems.pop()}.json") as f:
        data = json.load(f)
    assert data["alive"]["other"] == 12 * MiB and data["where"] == "train.py"  # weights, and the failed frame's local
    assert ["other", "acts in step()", 8 * MiB] in data["alive"]["detail"]
    # the traceback is the script's: no frame of the runner, runpy or the package
    tb = done.stderr[done.stderr.index("Traceback"):]
    assert "train.py" in tb and "vram_magic" not in tb and "runpy" not in tb
    assert tb.strip().endswith("1.06 GiB is free.")
    reports = vram_magic.read_oom(str(tmp_path / "out"))
    assert len(reports) == 1 and reports[0].alive.total == 12 * MiB and reports[0].requested == 2 * 1024**3
    assert "12.0 MiB alive, 2.00 GiB asked" in str(reports)
    snap = pickle.loads((tmp_path / "out" / names[[n.endswith(".pickle") for n in names].index(True)]).read_bytes())
    blocks = {b["label"]: b["size"] for s in snap["segments"] for b in s["blocks"]}
    assert blocks["acts in step()"] == 8 * MiB and blocks["weights"] == 4 * MiB
    assert [e["action"] for e in snap["device_traces"][0]] == ["oom", "snapshot"]


def test_bad_input_says_what_to_type():
    done = subprocess.run([sys.executable, "-m", "vram_magic", "run", "no-such-script.py"], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2 and "no script 'no-such-script.py'" in done.stderr and "usage:" in done.stderr
    with pytest.raises(FileNotFoundError, match="writes one report per rank"):
        vram_magic.read_oom("/nonexistent-folder")


RANKS = """
import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
held = torch.zeros((rank + 1) * 1024, 1024)  # rank r holds (r + 1) * 4 MiB
dist.barrier()
raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
                             "14.75 GiB of which 3.06 MiB is free.")
"""


@pytest.mark.slow
def test_two_gloo_ranks_under_torchrun_leave_one_report_each(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    # torchrun stops the other ranks once one fails: it looks every 5 s here, so both have written their report
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "--monitor-interval=5", "-m", "vram_magic", "run", "--out", str(tmp_path / "out"),
                           str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert done.returncode != 0
    reports = vram_magic.read_oom(str(tmp_path / "out"))
    assert [r.rank for r in reports] == [0, 1], done.stderr[-2000:]
    assert [r.alive.total for r in reports] == [4 * MiB, 8 * MiB]
    assert all(r.where == f"ranks.py (rank {r.rank})" for r in reports)
    text = str(reports)
    assert "rank 0" in text and "rank 1" in text and "8.00 MiB alive" in text
