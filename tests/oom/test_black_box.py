"""The out-of-memory black box in a real IPython shell (and a real kernel): every out-of-memory error explained
under its traceback, in cells nobody measured, with what was alive by category right to the byte.

The cells raise ``torch.OutOfMemoryError`` themselves, as CUDA's allocator does on a GPU (its message's wording);
what was alive is hand-computed: ``nn.Linear(1024, 1024)`` holds 1024 * 1024 * 4 + 1024 * 4 bytes of parameters,
``torch.zeros(1024, 1024)`` 4 MiB, a local ``torch.ones(2048, 1024)`` 8 MiB.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from IPython.utils.capture import capture_output

import vram_magic
from tests.support import run

MiB = 1 << 20
LINEAR = 1024 * 1024 * 4 + 1024 * 4
MESSAGE = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 14.75 GiB of which "
           "1.06 GiB is free.")

SETUP = f"""
import torch
from torch import nn
model = nn.Linear(1024, 1024)
w = torch.zeros(1024, 1024)
kept = []
def step():
    big = torch.ones(2048, 1024)
    kept.append(big.untyped_storage())
    raise torch.OutOfMemoryError({MESSAGE!r})
"""


@pytest.fixture
def shown(shell):
    """What the black box displays, in order (the display itself is IPython's: checked in a real kernel below)."""
    out: list = []
    shell._vram_magic_extension.black_box.show = out.append
    run(shell, SETUP)
    return out


def test_an_unmeasured_cell_that_runs_out_of_memory_is_explained(shell, shown):
    result = run(shell, "step()")
    assert isinstance(result.error_in_exec, torch.OutOfMemoryError)  # the cell's own error, as it was
    (report,) = shown
    assert report is vram_magic.last_oom()
    assert report.where == f"cell {result.execution_count}" and report.cell == result.execution_count
    assert report.alive.parameters == LINEAR
    assert report.alive.other == 4 * MiB + 8 * MiB  # w, and the failed frame's local
    assert report.alive.total == LINEAR + 12 * MiB
    assert report.holders()[:2] == [("big in step()", 8 * MiB), ("model", LINEAR)]
    assert report.requested == 2 * 1024**3  # a request above 10 MiB: the message's size is the request's
    assert report.capacity == int(14.75 * 1024**3)  # read from the message where no device can be asked
    text = str(report)
    assert "out of memory in cell" in text and "big in step() 8.00 MiB" in text
    assert "a request of 2.00 GiB failed" in text


def test_the_failed_frames_are_released_and_the_history_has_a_row(shell, shown):
    run(shell, "step()")
    storage = shell.user_ns["kept"].pop()
    ref = weakref.ref(storage)
    del storage
    gc.collect()
    assert ref() is None  # the local of the failed call is freed, as a measured cell frees it
    frame = run(shell, "%vram history").result
    row = frame[frame["oom"]].iloc[-1]
    assert row["parameters"] == LINEAR and row["total"] == LINEAR + 12 * MiB


def test_off_silences_it_and_on_arms_it_again(shell, shown):
    run(shell, "%vram oom off")
    run(shell, "step()")
    assert shown == []
    run(shell, "%config VramMagics.oom = True")
    run(shell, "step()")
    assert len(shown) == 1


def test_an_error_raised_from_an_out_of_memory_error_is_explained_and_others_are_not(shell, shown):
    run(shell, "try:\n    step()\nexcept torch.OutOfMemoryError as e:\n    raise ValueError('the step failed') from e")
    assert len(shown) == 1 and shown[0].error.startswith("OutOfMemoryError: CUDA out of memory")
    run(shell, "1 / 0")
    run(shell, "raise RuntimeError('CUDA error: device-side assert triggered')")
    assert len(shown) == 1
    run(shell, "raise RuntimeError('CUDA out of memory. Tried to allocate 20.00 MiB')")  # older releases' error
    assert len(shown) == 2 and shown[1].requested is None and "segment" in shown[1].request


def test_a_cell_inside_another_is_shown_when_the_outer_one_ends(shell, shown):
    with capture_output():
        run(shell, "%%capture captured\nstep()")
    assert len(shown) == 1  # not swallowed by the capture: shown once the outer cell ended
    captured = shell.user_ns["captured"]
    assert "OutOfMemoryError" in captured.stdout and "out of memory in cell" not in captured.stdout
    assert not captured.outputs


def test_a_measured_cell_is_not_explained_twice_and_its_traceback_ends_at_the_users_line(shell, shown):
    with capture_output() as cap:
        result = run(shell, "%%vram --budget 50MiB -q -o r\nx = torch.ones(16 << 20)\n")
    assert isinstance(result.error_in_exec, torch.OutOfMemoryError)
    assert shown == []  # the measured cell's report shows it
    report = vram_magic.last_oom()
    assert report.cell == result.execution_count and report.requested == 64 * MiB
    assert report.alive.parameters == LINEAR
    # the traceback a user sees: their line, and no frame of vram_magic between it and the error
    assert "x = torch.ones(16 << 20)" in cap.stdout and "vram_magic" not in cap.stdout
    assert "tried to allocate 64.0 MiB" in cap.stdout


def test_unloading_removes_its_hooks(shell):
    box = shell._vram_magic_extension.black_box
    assert box._post in shell.events.callbacks["post_run_cell"]
    run(shell, "%unload_ext vram_magic")
    assert box._post not in shell.events.callbacks["post_run_cell"]
    assert box._pre not in shell.events.callbacks["pre_run_cell"]
    run(shell, "%load_ext vram_magic")


@pytest.mark.slow
def test_in_a_real_kernel_the_report_follows_the_traceback():
    from tests.support.kernel import Kernel

    k = Kernel()
    try:
        assert k.run("%load_ext vram_magic\n" + SETUP)["reply"]["status"] == "ok"
        out = k.run("step()")
        assert out["reply"]["status"] == "error" and out["reply"]["ename"] == "OutOfMemoryError"
        kinds = [m["msg_type"] for m in out["messages"] if m["msg_type"] in ("error", "display_data")]
        assert kinds == ["error", "display_data"]  # the report under the traceback
        (shown,) = [m["content"]["data"] for m in out["messages"] if m["msg_type"] == "display_data"]
        assert "out of memory in cell" in shown["text/plain"] and "vram-oom-report" in shown["text/html"]
        assert k.value("__import__('vram_magic').last_oom().alive.total") == LINEAR + 12 * MiB
        assert k.value("kept[-1] is None or len(kept)") == 1
    finally:
        k.close()
