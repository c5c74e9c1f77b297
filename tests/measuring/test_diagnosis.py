"""Out-of-memory under a budget, advice, timeline and snapshot export — on CPU, in a real shell."""

from __future__ import annotations

import json
import pickle
import sys

import pytest
import torch
from IPython.utils.capture import capture_output

from tests.support import run, run_ok
from vram_magic import Breakdown, CellReport, DeviceStats
from vram_magic.measuring.advice import advise
from vram_magic.measuring.snapshot import replay

MiB = 1024**2
F32 = 4

MAKE = """import torch
keep = torch.zeros(4 * 2**20 // 4)  # 4 MiB, held by a global
def make(n):
    big = torch.empty(n, dtype=torch.uint8)
    more = torch.empty(n, dtype=torch.uint8)
    return big, more
"""


def test_budget_oom_report_advice_and_release(shell):
    make_cell = run_ok(shell, MAKE).execution_count
    result = run(shell, "%%vram --budget 48MiB -q -o r\nout = make(30 * 2**20)")
    assert isinstance(result.error_in_exec, torch.OutOfMemoryError)
    assert "tried to allocate 30.0 MiB" in str(result.error_in_exec)
    r = shell.user_ns["r"]
    assert r.oom and r.oom.requested == 30 * MiB and r.oom.capacity == 48 * MiB
    assert r.oom.live.total == 34 * MiB  # `keep` and `big` were alive when `more` was asked for
    assert dict(r.oom.holders) == {"big in make()": 30 * MiB, "keep": 4 * MiB}
    assert any("big" in a.title and a.saving == 30 * MiB for a in r.advice)
    # nothing the failed cell allocated stays alive: `big` lived in a frame of the traceback
    assert r.after.total == r.before.total == 4 * MiB
    assert shell.run_line_magic("vram", "").breakdown.total == 4 * MiB
    # the traceback ends at the user's line, like a real CUDA OOM
    tb = sys.last_traceback
    while tb.tb_next is not None:
        tb = tb.tb_next
    assert tb.tb_frame.f_code.co_name == "make"
    assert "out of memory" in str(r).lower()
    # where: the innermost line of the user's code, in the cell that defined `make`
    assert r.oom.site[0] == (f"<cell {make_cell}>", 5, "make")
    assert f"at cell {make_cell}:5 in make" in str(r)


def test_oom_holders_are_variables(shell):
    run_ok(shell, "import torch\nnet = torch.nn.Sequential(torch.nn.Linear(256, 4096), torch.nn.ReLU(), "
                  "torch.nn.Linear(4096, 4096))\nxb = torch.randn(512, 256)")
    result = run(shell, "%%vram -q -o r --budget 80MiB\nout = net(xb)")  # 68.5 MiB before it, 8 MiB a layer
    assert isinstance(result.error_in_exec, torch.OutOfMemoryError)
    r = shell.user_ns["r"]
    holders = dict(r.oom.holders)
    assert "forward intermediates" not in holders and "unattributed" not in holders
    assert holders["xb"] == 512 * 256 * F32
    assert r.oom.phase == "forward"
    assert all("forward intermediates" not in a.title for a in r.advice)


def test_session_budget_applies_to_following_cells(shell):
    run_ok(shell, MAKE)
    run_ok(shell, "%vram budget 8MiB")
    result = run(shell, "%%vram -q -o r\nx = torch.empty(5 * 2**20, dtype=torch.uint8)")
    assert isinstance(result.error_in_exec, torch.OutOfMemoryError)
    assert shell.user_ns["r"].capacity == 8 * MiB
    run_ok(shell, "%vram budget off")
    run_ok(shell, "%%vram -q -o r\nx = torch.empty(5 * 2**20, dtype=torch.uint8)")
    assert shell.user_ns["r"].after.total == 9 * MiB


TRAIN = """import torch
model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(256, 512)
"""
P = (512 * 2048 + 2048 + 2048 * 512 + 512) * F32


def test_healthy_cells_get_no_advice(shell):
    run_ok(shell, TRAIN)
    run_ok(shell, "%%vram -q -o r\nloss = model(x).square().mean()\nloss.backward()\nopt.step()\n"
                  "opt.zero_grad(set_to_none=True)\nloss = loss.item()")
    assert shell.user_ns["r"].advice == ()
    run_ok(shell, "%%vram -q -o r\nwith torch.no_grad():\n    y = model(x)\ndel y")
    assert shell.user_ns["r"].advice == ()


def test_advice_graph_held_by_a_variable(shell):
    run_ok(shell, TRAIN)
    run_ok(shell, "%%vram -q -o r\nloss = model(x).square().mean()")
    (a,) = shell.user_ns["r"].advice
    assert a.kind == "graph" and a.concerns == "loss" and "`del loss`" in a.detail
    assert a.saving == shell.user_ns["r"].after.activations > 0


def test_advice_gradients_alive_during_inference(shell):
    run_ok(shell, TRAIN)
    run_ok(shell, "model(x).sum().backward()")
    run_ok(shell, "%%vram -q -o r\nwith torch.no_grad():\n    y = model(x)")
    kinds = {a.kind: a for a in shell.user_ns["r"].advice}
    assert kinds["gradients"].saving == P
    assert "zero_grad(set_to_none=True)" in kinds["gradients"].detail
    # a forward with grad enabled is a training step in progress: no such advice
    run_ok(shell, "%%vram -q -o r\nloss = model(x).sum()")
    assert "gradients" not in {a.kind for a in shell.user_ns["r"].advice}


def test_advice_output_cache(shell):
    run_ok(shell, TRAIN)
    run_ok(shell, "model(torch.randn(1024, 512)).detach()")  # the result stays in Out and `_N`
    cell = shell.execution_count - 1
    run_ok(shell, "%%vram -q -o r\nz = 1")
    (a,) = shell.user_ns["r"].advice
    assert a.kind == "output-cache" and a.concerns == f"_{cell}" and a.saving == 1024 * 512 * F32


def test_advice_under_pressure_activations_and_optimizer(shell):
    run_ok(shell, TRAIN.replace("torch.optim.SGD(model.parameters(), lr=0.1)", "torch.optim.Adam(model.parameters())"))
    # activations dominate the peak of a forward+backward with a big batch, near a tight budget
    run_ok(shell, "xb = torch.randn(4096, 512)")
    run_ok(shell, "%%vram -q -o r0\nmodel(xb).square().mean().backward()")
    assert shell.user_ns["r0"].advice == ()  # no capacity given: no pressure, no advice
    budget = int(shell.user_ns["r0"].peak.total / 0.9)  # the same step on a device just 10 % larger
    run_ok(shell, "model.zero_grad(set_to_none=True)")
    run_ok(shell, f"%%vram -q -o r --budget {budget}\nmodel(xb).square().mean().backward()")
    r = shell.user_ns["r"]
    act = {a.kind: a for a in r.advice}
    assert {"checkpointing", "amp", "batch"} <= set(act)
    assert act["amp"].saving == r.peak.activations // 2 and r.peak.activations > 0.3 * r.peak.total
    # the peak is in backward: activations saved by the forward (the loss's square, computed outside the model after
    # its forward, among them) plus the gradients flowing back
    assert set(r.peak.details("activations")) == {"forward intermediates", "loss (outside modules)",
                                                  "activation gradients (backward)"}
    # optimizer state dominates after Adam's step, near a tight budget
    run_ok(shell, "%%vram -q -o r --budget 56MiB\nopt.step()\nopt.zero_grad(set_to_none=True)")
    r = shell.user_ns["r"]
    assert r.after.optimizer_state == 2 * P + 4 * F32
    assert r.peak.total >= 0.8 * 56 * MiB  # close to the budget: the pressure advice applies
    (opt,) = [a for a in r.advice if a.kind == "optimizer"]
    assert opt.saving == r.peak.optimizer_state // 2 and opt.concerns == "opt"


def test_advice_fragmentation_from_allocator_stats():
    b = Breakdown(parameters=1024**3)
    report = CellReport(device="cuda:0", before=b, after=b, peak=b, delta=Breakdown(),
                        stats=DeviceStats("cuda:0", allocated=1024**3, reserved=3 * 1024**3))
    (a,) = advise(report)
    assert a.kind == "fragmentation" and a.saving == 2 * 1024**3 and "expandable_segments" in a.detail
    report = CellReport(device="cuda:0", before=b, after=b, peak=b, delta=Breakdown(),
                        stats=DeviceStats("cuda:0", allocated=1024**3, reserved=1024**3 + 64 * MiB))
    assert advise(report) == []


GRAPH = """%%vram -q -o r
h = torch.nn.functional.linear(x, w)
a = h.relu()
loss = a.sum()
"""


def _graph_cell(shell):
    run_ok(shell, "import torch\nx = torch.randn(128, 256)\nw = torch.randn(1024, 256, requires_grad=True)")
    run_ok(shell, GRAPH)
    return shell.user_ns["r"]


def test_timeline_peak_equals_report_peak(shell):
    r = _graph_cell(shell)
    # h (128x1024) and a (128x1024) both alive at the end: the peak is the end, 2 x 512 KiB + the loss
    assert r.peak.total - r.before.total == 2 * 128 * 1024 * F32 + F32
    series = r.trace.totals()
    totals = [sum(series[c][i] for c in series) for i in range(len(series["other"]))]
    assert max(totals) == r.peak.total
    assert totals[r.trace.peak_index] == r.peak.total
    fig = r.timeline()
    from matplotlib.figure import Figure

    assert isinstance(fig, Figure)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert any(t.startswith("peak 1.00 MiB") or "peak" in t for t in texts)
    assert fig._repr_png_()[:8] == b"\x89PNG\r\n\x1a\n"


def test_snapshot_export_loads_and_replays(shell, tmp_path):
    r = _graph_cell(shell)
    path = tmp_path / "cell.pickle"
    run_ok(shell, f"%vram save {path}")
    snap = pickle.loads(path.read_bytes())
    assert set(snap) >= {"segments", "device_traces"}
    allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
    assert [e["size"] for e in allocs] == [128 * 1024 * F32, 128 * 1024 * F32, F32]
    # frames point at the cell's own lines: line 2 (linear), 3 (relu), 4 (sum) of the %%vram cell
    cell_lines = [e["frames"][0]["line"] for e in allocs]
    assert cell_lines == [1, 2, 3]  # the cell body starts after the %%vram line
    assert {e["frames"][0]["filename"] for e in allocs} == {f"<cell {r.cell}>"}
    assert r.peak_sites(1)[0][0] == f"cell {r.cell}:1"
    assert {e["category"] for e in allocs} == {"activations"}  # h, a and loss are forward outputs
    start, peak, _ = replay(snap)
    assert start == r.before.total and peak == r.peak.total


def test_no_trace_records_no_sites(shell):
    run_ok(shell, "import torch\nx = torch.randn(128, 256)\nw = torch.randn(1024, 256, requires_grad=True)")
    run_ok(shell, GRAPH.replace("-o r", "-o r --no-trace"))
    r = shell.user_ns["r"]
    assert all(not b.site for b in r.trace.blocks.values())
    assert r.peak_sites() == []


def test_timeline_flag_shows_an_image(shell):
    run_ok(shell, "import torch\nx = torch.randn(128, 256)\nw = torch.randn(1024, 256, requires_grad=True)")
    with capture_output() as out:
        run_ok(shell, GRAPH.replace("-q -o r", "--timeline"))
    assert any("image/png" in o.data for o in out.outputs)
    assert any("text/plain" in o.data and "%%vram cell" in o.data["text/plain"] for o in out.outputs)


def test_history_export_csv_and_json(shell, tmp_path):
    _graph_cell(shell)
    run_ok(shell, "%%vram -q\ndel loss")
    run_ok(shell, f"%vram export {tmp_path / 'h.csv'}")
    run_ok(shell, f"%vram export {tmp_path / 'h.json'}")
    lines = (tmp_path / "h.csv").read_text().splitlines()
    assert lines[0].startswith("cell,device,parameters,gradients,optimizer_state,activations,other,total,peak")
    rows = json.loads((tmp_path / "h.json").read_text())
    assert len(rows) == 2 and rows[1]["delta"] == -(128 * 1024 * F32 + F32) - 0 or rows[1]["delta"] < 0
    result = run(shell, f"%vram export {tmp_path / 'h.txt'}")
    assert "end it in .csv or .json" in str(result.error_in_exec)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_cell_peak_without_resetting_the_users_counter(shell):
    run_ok(shell, "import torch\ntorch.cuda.reset_peak_memory_stats()\nbig = torch.empty(2**28, device='cuda')\n"
                  "del big\nuser_peak = torch.cuda.max_memory_allocated()")
    run_ok(shell, "%%vram -q -o r --device cuda\nt = torch.empty(2**20, device='cuda')\nu = t * 2\ndel u")
    r = shell.user_ns["r"]
    assert torch.cuda.max_memory_allocated() == shell.user_ns["user_peak"]  # untouched
    assert r.peak.total - r.before.total >= 2 * 2**20 * 4
    assert r.stats is not None and r.stats.reserved >= r.stats.allocated


def test_advice_groups_graphs_held_by_one_container(shell):
    run_ok(shell, TRAIN)
    run_ok(shell, "%%vram -q -o r\nlosses = [model(x).sum() for _ in range(3)]")
    r = shell.user_ns["r"]
    (a,) = r.advice
    assert a.kind == "graph" and a.concerns == "losses" and "3 tensors" in a.title
    assert a.saving == r.after.activations == r.delta.activations


def test_requested_size_read_from_a_cuda_oom_message():
    from vram_magic.engine.cuda.device import requested_bytes

    msg = ("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.11 GiB of which "
           "3.94 MiB is free.")
    assert requested_bytes(msg) is None  # a 20 MiB segment serves requests of 1-10 MiB: see
                                         # tests/engine/cuda/test_oom_message.py
    assert requested_bytes("Tried to allocate 1.50 GiB") == int(1.5 * 1024**3)
    assert requested_bytes("something else") is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_budget_limits_the_allocator_and_restores_the_fraction(shell):
    if not hasattr(torch.cuda, "get_per_process_memory_fraction"):  # PyTorch < 2.6
        pytest.skip("--budget is enforced on live tensors only before PyTorch 2.6")
    before = torch.cuda.get_per_process_memory_fraction()
    result = run(shell, "%%vram -q -o r --device cuda --budget 64MiB\nimport torch\n"
                        "big = torch.empty(128 * 2**20, dtype=torch.uint8, device='cuda')")
    assert isinstance(result.error_in_exec, torch.OutOfMemoryError)
    assert shell.user_ns["r"].oom.requested == 128 * MiB
    assert torch.cuda.get_per_process_memory_fraction() == before
