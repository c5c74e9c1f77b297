"""The live view and ``%vram watch`` in a real kernel, read from the messages a frontend receives.

A kernel (ipykernel, the Python running the tests) runs cells sent over jupyter_client; every iopub message
is kept with the kernel's own timestamp. A frontend shows a ``display_data`` with a ``display_id`` and
replaces it on each ``update_display_data`` with that id, so these messages are what the user sees update.
``ci/notebooks.sh`` runs this file again with ipywidgets 7.7 (Colab's) in the kernel.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

jupyter_client = pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")

pytestmark = pytest.mark.slow

from tests.support.kernel import Kernel  # noqa: E402


@pytest.fixture(scope="module")
def kernel() -> Iterator[Kernel]:
    k = Kernel()
    try:
        setup = k.run("%load_ext vram_magic\nimport time, torch\ntorch.manual_seed(0)\n"
                      "model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),\n"
                      "                            torch.nn.Linear(512, 256))\n"
                      "opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)\nx = torch.randn(64, 256)\n"
                      + WAITING)
        assert setup["reply"]["status"] == "ok", setup
        yield k
    finally:
        k.close()


# In the kernel: how many pictures the running live view (or monitor) has published, and a wait for more of them.
# The cells under test wait for these events (deadline: a minute) instead of sleeping for a time that a loaded
# machine may not honour.
WAITING = """
import threading as _threading
def _view(name="vram-live"):
    return next((t.live_view for t in _threading.enumerate() if t.name == name and hasattr(t, "live_view")), None)
def _updates(name="vram-live"):
    v = _view(name)
    return v.updates if v is not None else 0
def _wait_updates(n, name="vram-live", step=None, deadline=60.0):
    end = time.monotonic() + deadline
    while _updates(name) < n and time.monotonic() < end:
        step() if step is not None else time.sleep(0.02)
    return _updates(name)
"""


def displays(messages: list[dict[str, Any]], parent: str | None = None) -> list[tuple[float, str, str, dict[str, Any]]]:
    """``(kernel time, msg_type, display_id, data)`` of every display message (of the request ``parent`` only, if
    given: a display from an earlier cell's thread may arrive while this one runs)."""
    out = []
    for m in messages:
        if parent is not None and m["parent_header"].get("msg_id") != parent:
            continue
        if m["msg_type"] in ("display_data", "update_display_data"):
            did = m["content"].get("transient", {}).get("display_id", "")
            t = m["header"]["date"].timestamp()
            out.append((t, m["msg_type"], did, m["content"]["data"]))
    return out


def _bytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


# a training loop that runs until the live view has published {updates} pictures
TRAIN_UNTIL = ("%%vram -o {name}\ndef _step():\n    global loss\n    loss = model(x).pow(2).mean()\n"
               "    loss.backward()\n    opt.step()\n    opt.zero_grad(set_to_none=True)\n    time.sleep(0.05)\n"
               "_wait_updates({updates}, step=_step)\ndel loss")
# a training loop of {steps} steps; each waits for one more picture of the live view where there is one
TRAIN_STEPS = ("%%vram -o {name}\nfor step in range({steps}):\n    seen = _updates()\n"
               "    loss = model(x).pow(2).mean()\n    loss.backward()\n    opt.step()\n"
               "    opt.zero_grad(set_to_none=True)\n"
               "    if _view() is not None:\n        _wait_updates(seen + 1)\ndel loss, seen")


def test_live_view_updates_then_is_replaced_by_the_report(kernel: Kernel) -> None:
    out = kernel.run(TRAIN_UNTIL.format(name="r_live", updates=6))
    assert out["reply"]["status"] == "ok"
    shown = displays(out["messages"], out["msg_id"])
    ids = {d for _, _, d, _ in shown}
    assert len(ids) == 1, f"one display, updated in place: {ids}"
    live = [(t, data) for t, _, _, data in shown if "vram-live" in data.get("text/html", "")]
    final = shown[-1]
    # it appeared after the delay and kept updating while the cell ran (how often: benchmarks, not tests)
    assert shown[0][1] == "display_data" and all(kind == "update_display_data" for _, kind, _, _ in shown[1:])
    assert len(live) >= 6, f"{len(live)} live updates"
    assert live[0][1]["text/plain"].startswith("%%vram cell") and "running" in live[0][1]["text/plain"]
    elapsed = [float(d["text/plain"].split("running ")[1].split(" s")[0]) for _, d in live]
    assert elapsed == sorted(elapsed) and elapsed[0] >= 0.9, elapsed  # shown after about a second, in order
    # the same display now holds the final, static report: no widget, no live markup
    assert final[1] == "update_display_data"
    assert "vram-report" in final[3]["text/html"] and "vram-live" not in final[3]["text/html"]
    assert set(final[3]) == {"text/plain", "text/html"}
    assert final[3]["text/plain"].startswith("%%vram cell")
    assert kernel.value("[t.name for t in __import__('threading').enumerate() if t.name == 'vram-live']") == []


def test_a_short_cell_shows_only_its_report(kernel: Kernel) -> None:
    out = kernel.run("%%vram\ny = model(x)")
    shown = displays(out["messages"], out["msg_id"])
    assert len(shown) == 1 and shown[0][1] == "display_data"
    assert "vram-live" not in shown[0][3]["text/html"] and "vram-report" in shown[0][3]["text/html"]


def test_live_view_ends_cleanly_on_an_exception(kernel: Kernel) -> None:
    out = kernel.run("%%vram -o r_err\ny = model(x)\n_wait_updates(1)\nraise ValueError('stop here')")
    assert out["reply"]["status"] == "error" and out["reply"]["ename"] == "ValueError"
    shown = displays(out["messages"], out["msg_id"])
    assert any("vram-live" in d["text/html"] for _, _, _, d in shown), "the live view appeared"
    final = shown[-1][3]
    assert shown[-1][1] == "update_display_data" and "vram-live" not in final["text/html"]
    assert "ValueError: stop here" in final["text/plain"]
    # the traceback starts at the cell's code, without IPython's run_cell_magic line
    tb = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(out["reply"]["traceback"]))
    assert "run_cell_magic" not in tb and "raise ValueError" in tb
    assert kernel.value("[t.name for t in __import__('threading').enumerate() if t.name == 'vram-live']") == []
    assert kernel.value("r_err.error") == "ValueError: stop here"


def test_live_view_ends_cleanly_on_keyboard_interrupt(kernel: Kernel) -> None:
    def live_seen(messages: list[dict[str, Any]]) -> bool:
        return any("vram-live" in d.get("text/html", "") for _, _, _, d in displays(messages))

    out = kernel.run("%%vram -o r_int\nfor _ in range(10**6):\n    y = model(x)\n    time.sleep(0.05)",
                     interrupt_when=live_seen)
    assert out["reply"]["status"] == "error" and out["reply"]["ename"] == "KeyboardInterrupt"
    shown = displays(out["messages"], out["msg_id"])
    assert any("vram-live" in d["text/html"] for _, _, _, d in shown)
    assert shown[-1][1] == "update_display_data" and "vram-live" not in shown[-1][3]["text/html"]
    assert "KeyboardInterrupt" in shown[-1][3]["text/plain"]
    assert kernel.value("[t.name for t in __import__('threading').enumerate() if t.name == 'vram-live']") == []
    assert kernel.value("r_int.error").startswith("KeyboardInterrupt")


def test_measured_numbers_are_the_same_with_and_without_the_live_view(kernel: Kernel) -> None:
    """The same training loop, measured three times from the same state: with the live view redrawn every
    20 ms from the first moment, without it, and with it again. Every breakdown (split and detail rows) of
    the three reports is identical."""
    kernel.run("def _split(r):\n"
               "    return {k: {**getattr(r, k).as_dict(), 'detail': sorted(map(list, getattr(r, k).detail))}\n"
               "            for k in ('before', 'after', 'peak')}")
    results = []
    for i, (delay, interval) in enumerate(((0.0, 0.02), (-1.0, 0.25), (0.0, 0.02))):
        kernel.run(f"%config VramMagics.live = {delay}\n%config VramMagics.live_interval = {interval}")
        kernel.run("opt.zero_grad(set_to_none=True)\nopt.state.clear()\ntorch.manual_seed(0)")
        out = kernel.run(TRAIN_STEPS.format(name=f"r_same{i}", steps=12))
        assert out["reply"]["status"] == "ok"
        shown = displays(out["messages"], out["msg_id"])
        updates = [d for _, _, _, d in shown if "vram-live" in d.get("text/html", "")]
        if delay >= 0:
            assert len(updates) >= 10, f"the live view ran ({len(updates)} updates)"
        else:
            assert updates == []
        results.append(kernel.value(f"_split(r_same{i})"))
    kernel.run("%config VramMagics.live = 1.0\n%config VramMagics.live_interval = 0.25")
    assert results[0] == results[1] == results[2]
    assert results[0]["peak"]["optimizer_state"] > 0 and results[0]["peak"]["activations"] > 0


def test_watch_keeps_updating_while_other_cells_run(kernel: Kernel) -> None:
    start = kernel.run("%vram watch cpu --interval 0.2")
    shown = displays(start["messages"])
    assert shown and "vram-watch" in shown[0][3]["text/html"]
    watch_id = shown[0][2]
    # another cell runs: it waits for a redraw of the monitor, fills 128 MiB, then waits for two more redraws; the
    # monitor is redrawn from its thread meanwhile, the RSS it shows following the tensor
    other = kernel.run("_wait_updates(_updates('vram-watch') + 1, 'vram-watch')\nbig = torch.ones(32 * 2**20)\n"
                       "_wait_updates(_updates('vram-watch') + 2, 'vram-watch')\ndel big")
    during = [(t, d) for t, kind, did, d in displays(other["messages"]) if did == watch_id]
    assert len(during) >= 3, f"{len(during)} redraws of the monitor during the cell"
    rss = [_bytes(re.search(r"process RSS ([\d.]+ \w+)", d["text/plain"]).group(1)) for _, d in during]
    assert max(rss) - rss[0] >= 100 * 2**20, f"process RSS followed the 128 MiB tensor: {rss}"
    stop = kernel.run("%vram watch off")
    final = [d for _, kind, did, d in displays(stop["messages"]) if did == watch_id]
    assert final and "stopped" in final[-1]["text/plain"]
    time.sleep(0.6)
    later = kernel.run("1 + 1")
    assert not [d for _, _, did, d in displays(later["messages"]) if did == watch_id], "no redraw once stopped"


def test_opt_in_widget_view_carries_the_static_report_too(kernel: Kernel) -> None:
    """``VramMagics.widget = True`` puts an ipywidgets view in front of the report (for ipywidgets 7 and 8,
    whichever the kernel has); the static HTML and text are in the same bundle."""
    kernel.run("%config VramMagics.widget = True")
    try:
        out = kernel.run("%%vram\ny = model(x)")
    finally:
        kernel.run("%config VramMagics.widget = False")
    shown = displays(out["messages"], out["msg_id"])
    assert len(shown) == 1
    data = shown[0][3]
    view = data["application/vnd.jupyter.widget-view+json"]
    opened = [m for m in out["messages"] if m["msg_type"] == "comm_open"]
    assert view["model_id"] in {m["content"]["comm_id"] for m in opened}
    assert "vram-report" in data["text/html"] and data["text/plain"].startswith("%%vram cell")


def test_auto_mode_shows_the_live_view_too(kernel: Kernel) -> None:
    kernel.run("%vram auto on")
    try:
        out = kernel.run("def _forward():\n    global y\n    y = model(x)\n    time.sleep(0.05)\n"
                         "_wait_updates(3, step=_forward)")  # the live view appears after a second
    finally:
        kernel.run("%vram auto off")
    shown = displays(out["messages"], out["msg_id"])
    live = [d for _, _, _, d in shown if "vram-live" in d["text/html"]]
    assert len(live) >= 3 and len({did for _, _, did, _ in shown}) == 1
    assert shown[-1][1] == "update_display_data" and "vram-live" not in shown[-1][3]["text/html"]


def test_allocator_cell_shows_the_users_stderr_and_not_the_profilers_line() -> None:
    """ipykernel forwards descriptor 2 to the cell's output: c10's "Memory block of unknown size" line (written on
    the first and every thousandth free of a block made before the recording) must not reach it; the cell's own
    writes to descriptor 2 must. The control cell, the same with the filter switched off, shows the line."""
    k = Kernel(forward_fds=True)
    try:
        def stderr_of(cell: str) -> str:
            out = k.run(cell)
            assert out["reply"]["status"] == "ok", out["reply"]
            return "".join(m["content"]["text"] for m in out["messages"]
                           if m["msg_type"] == "stream" and m["content"]["name"] == "stderr")

        cell = ("old = [torch.empty(16) for _ in range(1001)]\ny = x = torch.randn(8, 8)\n"
                "%%vram -q --backend allocator\ndel old\nos.write(2, b'from the cell\\n')\ny = x @ x")
        setup, measured = cell.split("%%vram")
        assert stderr_of("%load_ext vram_magic\nimport os, torch") == ""
        for _ in range(2):
            stderr_of(setup)
            stderr = stderr_of("%%vram" + measured)
            assert "from the cell" in stderr
            assert "Memory block of unknown size" not in stderr
        # the control: without the filter, the same cell shows it
        stderr_of("import vram_magic.engine.profiler.recorder as a\nclass Off:\n    def start(self): return self\n"
                  "    def stop(self): pass\na.StderrFilter = Off")
        stderr_of(setup)
        stderr = stderr_of("%%vram" + measured)
        assert "from the cell" in stderr and "Memory block of unknown size" in stderr
    finally:
        k.close()
