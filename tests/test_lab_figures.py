"""The kernel's figures file, written by a real IPython shell with the extension loaded, and read back as the
server reads it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import run_ok

from vram_magic.lab.figures import FiguresReader, kernel_id_from, start_figures

LINEAR = 4096 * 1024 * 4 + 4096 * 4  # nn.Linear(1024, 4096) in float32: weight and bias


def _read(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


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
        assert first["format"] == 1 and first["pid"] == os.getpid() and first["last_cell"] is None
        assert first["devices"] == [] and first["measured_cells"] == 0
        run_ok(shell, "%%vram -q\nimport torch\nlin = torch.nn.Linear(1024, 4096)")
        after = _read(path)
        cell = after["last_cell"]
        assert cell["after"]["parameters"] == LINEAR and cell["total"] == LINEAR
        assert cell["peak"]["parameters"] == LINEAR and cell["device"] == "cpu" and not cell["failed"]
        assert after["measured_cells"] == 1
        # an unmeasured cell that changes no figure leaves the file as it is (no write per cell for nothing)
        mtime = os.stat(path).st_mtime_ns
        run_ok(shell, "y = 1")
        assert os.stat(path).st_mtime_ns == mtime and _read(path) == after
        # a cell that fails is still reported
        shell.run_cell("%%vram -q\nz = torch.zeros(256)\nraise ValueError('no')", store_history=True)
        failed = _read(path)["last_cell"]
        assert failed["failed"] and failed["after"]["other"] == 256 * 4 and failed["after"]["parameters"] == LINEAR
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
        data = {"format": 1, "time": 1.0, **fields}
        (tmp_path / name).write_text(json.dumps(data))

    dead = subprocess.Popen(["true"])
    dead.wait()
    write("100.json", pid=100, kernel_id="k-a", time=5.0)
    write(f"{dead.pid}.json", pid=dead.pid, kernel_id="k-gone")
    write(f"{os.getpid()}.json", pid=os.getpid(), kernel_id=None)
    (tmp_path / "7.json").write_text('{"format": 1, "pid"')  # half written by someone else: ignored
    write("8.json", pid=8, format=99)  # another format: ignored
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
                                                                 "8.json"])
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
