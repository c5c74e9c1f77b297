"""The live view's thread, on its own: its timing, when it stops, and what it publishes.

``test_live_kernel.py`` runs the same code in a real kernel; here a recording publisher stands for the
frontend, and ``status`` for a running measurement (the real one: a measured block in another thread).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import vram_magic
from vram_magic.core.units import format_bytes
from vram_magic.measuring.render.html import live_html
from vram_magic.measuring.render.text import live_text
from vram_magic.session.live import LiveView, polled_allocated, session_scale


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[float, dict, str, bool]] = []
        self.lock = threading.Lock()

    def __call__(self, bundle: dict, display_id: str, update: bool) -> None:
        with self.lock:
            self.calls.append((time.perf_counter(), bundle, display_id, update))

    def wait(self, n: int, deadline: float = 60.0) -> int:
        """Wait until ``n`` bundles were published (a loaded machine may take long); returns how many were."""
        end = time.monotonic() + deadline
        while len(self.calls) < n and time.monotonic() < end:
            time.sleep(0.01)
        return len(self.calls)


def test_updates_at_its_interval_after_its_delay_and_stops() -> None:
    rec = Recorder()
    count = iter(range(10**6))
    view = LiveView(lambda: next(count), lambda n: {"text/plain": str(n)}, delay=0.3, interval=0.1, publish=rec)
    t0 = time.perf_counter()
    view.start()
    rec.wait(8)
    view.stop()
    elapsed = time.perf_counter() - t0
    n = len(rec.calls)
    time.sleep(0.3)
    assert len(rec.calls) == n, "nothing is published after stop()"
    assert rec.calls[0][0] - t0 >= 0.29, "not before the delay"
    assert not rec.calls[0][3] and all(update for *_, update in rec.calls[1:]), "displayed once, then updated"
    assert len({did for _, _, did, _ in rec.calls}) == 1
    # never faster than its interval (how close to it a loaded machine gets is the benchmarks' business)
    assert 8 <= n <= (elapsed - 0.3) / 0.1 + 2, f"{n} updates in {elapsed - 0.3:.2f} s at 0.1 s intervals"
    view.finish({"text/plain": "final"})
    assert rec.calls[-1][1] == {"text/plain": "final"} and rec.calls[-1][3] is True


def test_a_cell_shorter_than_the_delay_shows_only_its_report() -> None:
    rec = Recorder()
    view = LiveView(lambda: 1, lambda n: {"text/plain": "live"}, delay=1.0, publish=rec).start()
    time.sleep(0.1)
    view.finish({"text/plain": "report"})
    assert [(b["text/plain"], update) for _, b, _, update in rec.calls] == [("report", False)]


def test_a_failing_render_never_reaches_the_cell() -> None:
    rec = Recorder()

    def render(_: object) -> dict:
        raise RuntimeError("render failed")

    view = LiveView(lambda: 1, render, delay=0.0, interval=0.05, publish=rec).start()
    time.sleep(0.2)
    view.finish({"text/plain": "report"})
    assert isinstance(view.error, RuntimeError)
    assert [b["text/plain"] for _, b, _, _ in rec.calls] == ["report"]


def test_status_of_a_measured_block_read_from_the_live_thread() -> None:
    """The real thing: a measured training loop while the view polls ``Measurement.status`` every 20 ms."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    x = torch.randn(64, 256)
    rec = Recorder()
    m = vram_magic.measure(namespace={"model": model, "x": x})
    with m:
        view = LiveView(m.status, lambda s: {"text/plain": live_text(s, cell=7),
                                             "text/html": live_html(s, cell=7, session_scale=None)},
                        delay=0.0, interval=0.02, publish=rec).start()
        for step in range(15):
            model(x).sum().backward()
            rec.wait(step + 1)  # a picture of each step
        view.stop()
    assert m.status() is None
    texts = [b["text/plain"] for _, b, _, _ in rec.calls]
    assert len(texts) >= 8
    assert all(t.startswith("%%vram cell 7 · cpu · running") for t in texts)
    # parameters were there from the start; what forward and backward made counts as activations meanwhile
    params = (256 * 512 + 512 + 512 * 256 + 256) * 4
    assert all(f"parameters {format_bytes(params)}" in t for t in texts), texts[:2]
    assert any("activations 0 B" not in t for t in texts)
    html = rec.calls[-1][1]["text/html"]
    assert "vram-live" in html and "vram-mark" in html  # the peak so far, marked on the bar


def test_session_scale_is_the_largest_total_on_that_device() -> None:
    from vram_magic.session.state import Session

    s = Session({})
    assert session_scale(s.history, "cpu") is None
    keep = torch.zeros(1000)
    s.namespace = {"keep": keep}
    s.start()
    s.finish()
    assert session_scale(s.history, "cpu") == 4000
    assert session_scale(s.history, "cuda:0") is None


def test_polling_never_touches_cuda_on_the_cpu_or_before_initialisation() -> None:
    assert polled_allocated("cpu") is None
    if not torch.cuda.is_initialized():
        assert polled_allocated("cuda:0") is None
        assert not torch.cuda.is_initialized()


def test_a_backend_that_knows_its_numbers_only_at_the_end() -> None:
    """The allocator backend: no numbers while running; on CUDA the view shows ``memory_allocated`` instead."""
    from vram_magic.measuring.live_status import LiveStatus

    status = LiveStatus(device="cuda:0", backend="allocator", elapsed=2.5, phase="")
    text = live_text(status, cell=3)
    assert text == "%%vram cell 3 · cuda:0 · running 2.5 s · numbers when the cell ends (allocator backend)"
    html = live_html(status, cell=3, capacity=16 * 2**30)
    assert "reports its numbers when the cell ends" in html and "vram-bar" not in html
    polled = live_text(status, cell=3, allocated=3 * 2**30)
    assert polled.endswith("allocated now 3.00 GiB")
    html = live_html(status, cell=3, capacity=16 * 2**30, allocated=3 * 2**30)
    assert 'class="vram-bar"' in html and "3.00\u00a0GiB" in html and "vram-limit" in html  # 3 of 16 GiB: ≥ 15 %


@pytest.mark.cuda
def test_live_status_of_a_cuda_block() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = torch.nn.Linear(1024, 1024, device="cuda")
    x = torch.randn(512, 1024, device="cuda")
    rec = Recorder()
    m = vram_magic.measure("cuda", namespace={"model": model, "x": x})
    with m:
        view = LiveView(m.status, lambda s: {"text/plain": live_text(s, cell=1, allocated=polled_allocated(s.device)
                                                                     if s.now is None else None)},
                        delay=0.0, interval=0.02, publish=rec).start()
        for _ in range(20):
            model(x).sum().backward()
            torch.cuda.synchronize()
            time.sleep(0.01)
        view.stop()
    texts = [b["text/plain"] for _, b, _, _ in rec.calls]
    assert len(texts) >= 5 and all("cuda:0 · running" in t for t in texts)
    assert all(("now " in t) or ("allocated now " in t) for t in texts)
