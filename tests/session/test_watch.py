"""``%vram watch``: readings, the rule that it never initialises CUDA or creates a context, and the command.

The CUDA reading goes through ``torch.cuda``'s own functions; on this CPU-only machine a stand-in with the same
functions records which were called, so the rule is checked call by call. The ``cuda``-marked tests run the
same reading on a real GPU. ``test_live_kernel.py`` watches a real kernel while another cell runs.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from IPython.core.error import UsageError

from tests.support import run
from vram_magic.session.monitor import (
    WATCH_USAGE,
    Sample,
    Watch,
    cpu_sampler,
    cuda_reading,
    parse_watch,
    process_rss,
    watch_device,
)
from vram_magic.session.monitor_html import watch_html, watch_text
from vram_magic.session.state import Session


class FakeCuda:
    """``torch.cuda``'s functions that a reading may call; any other call fails the test."""

    def __init__(self, initialized: bool) -> None:
        self.initialized = initialized
        self.calls: list[str] = []

    def is_initialized(self) -> bool:
        self.calls.append("is_initialized")
        return self.initialized

    def memory_allocated(self, index: int) -> int:
        self.calls.append(f"memory_allocated({index})")
        return 3 * 2**30

    def memory_reserved(self, index: int) -> int:
        self.calls.append(f"memory_reserved({index})")
        return 4 * 2**30

    def mem_get_info(self, index: int) -> tuple[int, int]:
        self.calls.append(f"mem_get_info({index})")
        return 10 * 2**30, 16 * 2**30

    def __getattr__(self, name: str) -> None:
        raise AssertionError(f"the watch called torch.cuda.{name}")


def test_cuda_not_initialised_is_left_alone() -> None:
    cuda = FakeCuda(initialized=False)
    s = cuda_reading(0, cuda, context=lambda i: pytest.fail("asked for a context before CUDA is initialised"))
    assert cuda.calls == ["is_initialized"]
    assert s.values == {"allocated": None, "reserved": None, "device used": None}
    assert "not initialised" in s.note


def test_no_context_is_created_on_a_device_without_one() -> None:
    cuda = FakeCuda(initialized=True)
    s = cuda_reading(1, cuda, context=lambda i: False)
    assert "mem_get_info(1)" not in cuda.calls
    assert s.values == {"allocated": 3 * 2**30, "reserved": 4 * 2**30, "device used": None}
    assert "no CUDA context on cuda:1" in s.note


def test_device_wide_use_on_a_device_with_a_context() -> None:
    cuda = FakeCuda(initialized=True)
    s = cuda_reading(0, cuda, context=lambda i: True)
    assert cuda.calls == ["is_initialized", "memory_allocated(0)", "memory_reserved(0)", "mem_get_info(0)"]
    assert s.values == {"allocated": 3 * 2**30, "reserved": 4 * 2**30, "device used": 6 * 2**30}
    assert s.total == 16 * 2**30 and not s.note
    html = watch_html("cuda:0", [s], 0.5, s.t - 3)
    assert "6.00\u00a0GiB" in html and "of 16.0\u00a0GiB" in html
    assert watch_text("cuda:0", [s], 0.5).splitlines()[1] == (
        "  allocated 3.00 GiB · reserved 4.00 GiB · device used 6.00 GiB (of 16.0 GiB)")


def test_choosing_the_device_does_not_initialise_cuda() -> None:
    code = ("import torch\nfrom vram_magic.session.monitor import watch_device\nprint(watch_device(None), "
            "torch.cuda.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[1] == "False"
    assert out[0] == ("cuda:0" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="not supported"):
        watch_device("meta")


def test_cpu_reading_counts_known_tensors_and_rss() -> None:
    session = Session({})
    t = torch.zeros(2**20)
    session.namespace = {"t": t}
    session.start()
    session.finish()  # the registry now knows t
    s = cpu_sampler(session.registry)()
    assert s.values["tracked tensors"] == 4 * 2**20
    rss = process_rss()
    assert rss is not None and rss > 4 * 2**20
    assert abs(s.values["process RSS"] - rss) < 64 * 2**20


def test_monitor_redraws_and_stops_with_a_stopped_picture() -> None:
    calls = []
    n = iter(range(10**6))

    def sampler() -> Sample:
        return Sample(float(next(n)), {"tracked tensors": 2**20, "process RSS": 2**28})

    w = Watch("cpu", sampler, interval=0.05, publish=lambda b, d, u: calls.append((b, u))).start()
    import time

    end = time.monotonic() + 60  # six pictures, however loaded the machine is
    while len(calls) < 6 and time.monotonic() < end:
        time.sleep(0.01)
    w.stop()
    assert not w.running and len(calls) >= 6
    assert "stopped" in calls[-1][0]["text/plain"] and calls[-1][1] is True
    html = calls[-1][0]["text/html"]
    assert html.count('class="vram-watch-chart"') == 2  # one chart per series, each on its own scale


def test_watch_needs_a_notebook(shell) -> None:
    result = run(shell, "%vram watch")
    assert isinstance(result.error_in_exec, UsageError) and "needs a notebook" in str(result.error_in_exec)
    result = run(shell, "%vram watch cpu --interval nope")
    assert isinstance(result.error_in_exec, UsageError)
    assert "no monitor is running" in _stdout(shell, "%vram watch off")


def test_reading_the_command() -> None:
    assert parse_watch([], 0.5) == (None, 0.5)
    assert parse_watch(["cpu"], 0.5) == ("cpu", 0.5)
    assert parse_watch(["cuda:1", "--interval", "2"], 0.5) == ("cuda:1", 2.0)
    assert parse_watch(["-i", "0.05", "cpu"], 0.5) == ("cpu", 0.05)
    for words in (["cpu", "cuda"], ["--interval"], ["--interval", "x"], ["--fast"], ["cpu", "--interval", "0.01"]):
        with pytest.raises(ValueError) as err:
            parse_watch(words, 0.5)
        assert "usage: %vram watch" in str(err.value) or "between 0.05 and 3600" in str(err.value)
    assert str(pytest.raises(ValueError, parse_watch, ["--fast"], 0.5).value) == WATCH_USAGE


def test_the_session_keeps_the_monitor_and_stops_it_on_close() -> None:
    calls = []
    session = Session({})
    session.watch = Watch("cpu", cpu_sampler(session.registry), interval=0.05,
                          publish=lambda b, d, u: calls.append(b)).start()
    assert session.watch.running and calls  # the first picture is published by start()
    watch = session.watch
    session.close()
    assert session.watch is None and not watch.running
    assert "stopped" in calls[-1]["text/plain"]


def _stdout(shell, source: str) -> str:
    from IPython.utils.capture import capture_output

    with capture_output() as cap:
        run(shell, source)
    return cap.stdout


@pytest.mark.cuda
def test_real_gpu_reading_after_the_user_initialised_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    code = ("import torch\nfrom vram_magic.session.monitor import cuda_reading\n"
            "before = cuda_reading(0, torch.cuda)\n"
            "assert not torch.cuda.is_initialized(), 'the watch initialised CUDA'\n"
            "x = torch.ones(2**28, device='cuda:0')\ns = cuda_reading(0, torch.cuda)\n"
            "assert before.values['allocated'] is None\nassert s.values['allocated'] >= 2**30\n"
            "assert s.values['device used'] >= s.values['reserved'] >= s.values['allocated']\nprint('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr
