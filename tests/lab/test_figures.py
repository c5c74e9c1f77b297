"""The kernel's figures file, written by a real IPython shell with the extension loaded, and read back as the
server reads it."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from typing import get_type_hints

from tests.support import ROOT, run_ok
from vram_magic.lab.figures import FiguresReader, kernel_id_from, start_figures
from vram_magic.lab.schema import FORMAT, Figures, Gpu, KernelsReply, LastCell, fields, problems

LINEAR = 4096 * 1024 * 4 + 4096 * 4  # nn.Linear(1024, 4096) in float32: weight and bias


def _read(path):
    """The file, which must be what the schema says it is."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    assert problems(data, Figures) == []
    return data


def _figures(pid, kernel_id=None, time=1.0, **fields):
    return {"format": FORMAT, "pid": pid, "kernel_id": kernel_id, "notebook": None, "time": time, "devices": [],
            "last_cell": None, "measured_cells": 0, **fields}


def test_no_file_outside_a_kernel(shell):
    # a terminal IPython (or this test's shell) has no connection file: nothing is written anywhere
    assert shell._vram_magic_extension.figures is None
    assert start_figures(shell, shell._vram_magic_extension.session) is None


def test_a_measured_cell_and_the_cells_after_it(shell, tmp_path):
    session = shell._vram_magic_extension.session
    writer = start_figures(shell, session, folder=str(tmp_path))
    try:
        path = writer.path
        assert os.path.basename(path) == f"{os.getpid()}.json"
        first = _read(path)  # written at once, before any cell
        assert first["format"] == FORMAT == 2 and first["pid"] == os.getpid() and first["last_cell"] is None
        assert first["devices"] == [] and first["measured_cells"] == 0
        run_ok(shell, "%%vram -q\nimport torch\nlin = torch.nn.Linear(1024, 4096)")
        after = _read(path)
        cell = after["last_cell"]
        assert list(cell) == list(fields(LastCell))
        assert cell["after"]["parameters"] == LINEAR and sum(cell["after"].values()) == LINEAR  # the total
        assert cell["peak"]["parameters"] == LINEAR and cell["device"] == "cpu"
        assert cell["error"] is None and cell["oom"] is None and "detail" not in cell["after"]
        assert after["measured_cells"] == 1
        # an unmeasured cell that changes no figure leaves the file as it is (no write per cell for nothing)
        mtime = os.stat(path).st_mtime_ns
        run_ok(shell, "y = 1")
        assert os.stat(path).st_mtime_ns == mtime and _read(path) == after
        # a cell that fails is still reported
        shell.run_cell("%%vram -q\nz = torch.zeros(256)\nraise ValueError('no')", store_history=True)
        failed = _read(path)["last_cell"]
        assert "ValueError" in failed["error"] and failed["oom"] is None
        assert failed["after"]["other"] == 256 * 4 and failed["after"]["parameters"] == LINEAR
        # a cell out of memory under a 1 MiB budget: the payload's OOM part, its 4 MiB request
        shell.run_cell("%%vram -q --budget 1MiB\nbig = torch.ones(2**20)", store_history=True)
        oom = _read(path)["last_cell"]["oom"]
        assert oom is not None and oom["requested"] == 4 * 2**20 and oom["capacity"] == 2**20
    finally:
        writer.stop()
    assert not os.path.exists(path)
    assert writer._after_cell not in shell.events.callbacks["post_run_cell"]
    assert session.on_report == []


def test_auto_mode_writes_the_cell_it_just_measured(shell, tmp_path):
    # %vram auto measures in a post_run_cell callback registered after the writer's: the report reaches the
    # file through the session, not one cell late
    writer = start_figures(shell, shell._vram_magic_extension.session, folder=str(tmp_path))
    try:
        run_ok(shell, "%vram auto on")
        run_ok(shell, "import torch\nw = torch.ones(1000, 1000)")
        cell = _read(writer.path)["last_cell"]
        assert cell is not None and cell["after"]["other"] == 4_000_000
    finally:
        run_ok(shell, "%vram auto off")
        writer.stop()


def test_unloading_the_extension_removes_the_file(shell, tmp_path):
    magics = shell._vram_magic_extension
    magics.figures = start_figures(shell, magics.session, folder=str(tmp_path))
    path = magics.figures.path
    assert os.path.exists(path)
    run_ok(shell, "%unload_ext vram_magic")
    assert not os.path.exists(path)
    run_ok(shell, "%load_ext vram_magic")  # the fixture unloads it again


def test_the_reader_parses_once_matches_by_id_or_pid_and_removes_stale_files(tmp_path):
    def write(name, **fields):
        (tmp_path / name).write_text(json.dumps(_figures(**fields)))

    dead = subprocess.Popen(["true"])
    dead.wait()
    write("100.json", pid=100, kernel_id="k-a", time=5.0)
    write(f"{dead.pid}.json", pid=dead.pid, kernel_id="k-gone")
    write(f"{os.getpid()}.json", pid=os.getpid(), kernel_id=None)
    (tmp_path / "7.json").write_text('{"format": 2, "pid"')  # half written by someone else: ignored
    write("8.json", pid=8, format=1)  # another format (the one before last_cell was the rank payload's): ignored
    # this format, not its shape (a field missing, one of another type): ignored
    (tmp_path / "9.json").write_text(json.dumps({k: v for k, v in _figures(9).items() if k != "devices"}))
    write("10.json", pid=10, measured_cells="3")
    reader = FiguresReader(str(tmp_path))
    files = reader.read()
    assert sorted(f["pid"] for f in files) == sorted([100, dead.pid, os.getpid()])
    again = reader.read()
    assert all(any(a is b for b in files) for a in again)  # unchanged files are not parsed again
    assert reader.match(files, "k-a", (None,))["pid"] == 100
    assert reader.match(files, "k-b", (os.getpid(),))["pid"] == os.getpid()
    assert reader.match(files, "k-b", (12345,)) is None
    reader.remove_stale(files, {"k-a"}, lambda pid: pid == os.getpid())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["100.json", f"{os.getpid()}.json", "7.json",
                                                                 "8.json", "9.json", "10.json"])
    assert sorted(f["pid"] for f in reader.read()) == sorted([100, os.getpid()])


def test_kernel_id_from_the_connection_file():
    assert kernel_id_from("/run/jupyter/kernel-2f1c9e0a-77b4.json") == "2f1c9e0a-77b4"
    assert kernel_id_from("/tmp/tmpabc.json") is None


def test_the_magics_need_no_jupyter_server():
    # VS Code, Colab, plain IPython: no jupyter_server, no JupyterLab; loading and measuring work, no file
    code = ("import sys\n"
            "for m in ('jupyter_server', 'jupyterlab', 'notebook', 'tornado', 'pynvml'): sys.modules[m] = None\n"
            "from IPython.core.interactiveshell import InteractiveShell\n"
            "sh = InteractiveShell.instance()\n"
            "r = sh.run_cell('%load_ext vram_magic')\n"
            "r = sh.run_cell('%%vram -q -o rep\\nimport torch\\nt = torch.ones(1000)')\n"
            "import vram_magic.lab, vram_magic.lab.figures\n"
            "print(r.success, sh.user_ns['rep'].after.other, sh._vram_magic_extension.figures)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "4000", "None"], out.stdout + out.stderr


def test_problems_says_what_does_not_match_the_schema():
    good = _figures(1, devices=[{"device": "cuda:0", "uuid": "", "allocated": 0, "reserved": 2**21, "total": 2**34}])
    assert problems(good, Figures) == []
    assert problems({**good, "pid": True}, Figures) == [".pid: True is not int"]  # a bool is no number here
    assert problems({**good, "extra": 1}, Figures) == [".extra: not in the schema"]
    assert problems({k: v for k, v in good.items() if k != "time"}, Figures) == [".time: missing"]
    bad_device = {**good, "devices": [{**good["devices"][0], "reserved": None}]}
    assert problems(bad_device, Figures) == [".devices[0].reserved: None is not int"]
    cell = {"cell": 3, "device": "cpu", "after": {"other": 4}, "peak": {"other": "4"}, "wall_time": 0, "error": None,
            "oom": None}
    assert problems({**good, "last_cell": cell}, Figures) == [".last_cell.peak.other: '4' is not int"]
    assert problems({**cell, "peak": {"other": 4}}, LastCell) == []
    assert problems([], KernelsReply) == ["the value: list, not an object"]
    assert problems("nvml", get_type_hints(Gpu)["source"]) == []  # a Literal
    assert problems({"index": 0, "device": None, "name": None, "used": 1, "total": None, "allocated": None,
                     "source": "cuda"}, Gpu) == [".source: 'cuda' is none of ('nvml', 'vram_magic')"]


def test_the_front_ends_types_are_generated_from_the_schema():
    # labextension/src/schema.ts is what scripts/lab_types.py makes of vram_magic/lab/schema.py: a field added,
    # renamed or retyped on one side and not the other fails here
    spec = importlib.util.spec_from_file_location("lab_types", ROOT / "scripts" / "lab_types.py")
    lab_types = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lab_types)
    generated = lab_types.render()
    assert (ROOT / "labextension" / "src" / "schema.ts").read_text() == generated, "run python scripts/lab_types.py"
    for name in fields(KernelsReply):
        assert f"\n  {name}: " in generated
    assert "  last_cell: ILastCell | null;" in generated and "  oom: ICellOom | null;" in generated
    assert "  history: [number, number | null, number][];" in generated
    assert "export const ROUTE = ['vram-magic', 'kernels'];" in generated
    # the front end takes its types and route from there, none of them written again by hand
    sources = {p.name: p.read_text() for p in (ROOT / "labextension" / "src").glob("*.ts") if p.name != "schema.ts"}
    declared = re.findall(r"^export (?:interface|type) (I\w+)|^export const (ROUTE|FORMAT)\b", generated, re.M)
    assert len(declared) == 12  # FORMAT, ROUTE and the ten types
    for name in (a or b for a, b in declared):
        assert [n for n, text in sources.items() if re.search(rf"(interface|type|const) {name}\b", text)] == []
    assert all("from './schema'" in sources[n] for n in ("model.ts", "panel.ts", "status.ts"))
