"""The CUDA paths on a real GPU (skipped without one; ``benchmarks/gpu_check.py`` runs them and prints a table per
check). Each test names the check it settles; expected figures follow the caching allocator's rules
(``c10/cuda/CUDACachingAllocator.cpp``, see ``tests/engine/cuda/test_caching_allocator.py``). Tests that need a
process in which CUDA is not initialised yet, or another allocator backend, run their code in a fresh subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import vram_magic
from tests.support import ROOT as CHECKOUT
from vram_magic.engine.cuda import device as cuda

pytestmark = pytest.mark.cuda

KiB, MiB = 1024, 1024**2
ROOT = str(CHECKOUT)


def fresh(code: str, env: dict[str, str] | None = None, timeout: int = 120) -> dict:
    """Run ``code`` in a new Python process (CUDA not initialised); it prints one JSON line last."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                               **(env or {})})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _history_enabled() -> bool:
    return bool(torch._C._cuda_isHistoryEnabled())


def test_gpu_peak_in_block_sizes_without_touching_the_users_counter():
    torch.cuda.reset_peak_memory_stats()
    big = torch.empty(2**28, device="cuda")
    del big
    user_peak = torch.cuda.max_memory_allocated()
    with vram_magic.measure("cuda", namespace={}) as m:
        a = torch.empty(4 * MiB + 100, dtype=torch.uint8, device="cuda")  # block 4 MiB + 512 (split off a cached one)
        b = torch.empty(100, dtype=torch.uint8, device="cuda")  # 512
        del a, b
    assert torch.cuda.max_memory_allocated() == user_peak
    assert m.peak.total - m.before.total == 4 * MiB + 512 + 512
    assert not _history_enabled()  # ours, switched off again


def test_gpu_users_history_is_read_and_left_on():
    torch.cuda.memory._record_memory_history(enabled="all", max_entries=100_000)
    try:
        with vram_magic.measure("cuda", namespace={}) as m:
            a = torch.empty(12 * MiB, dtype=torch.uint8, device="cuda")
            del a
        assert _history_enabled()
        assert m.peak.total - m.before.total >= 12 * MiB
        assert not any("wrapped" in n or "keeps no trace" in n for n in m.notes), m.notes
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def test_gpu_state_only_recording_is_said():
    torch.cuda.memory._record_memory_history(enabled="state")  # keeps one trace entry
    try:
        with vram_magic.measure("cuda", namespace={}) as m:
            a = torch.empty(6 * MiB, dtype=torch.uint8, device="cuda")
            del a
        assert _history_enabled()
        assert any("keeps no trace" in n for n in m.notes), m.notes
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def test_gpu_wrapped_buffer_is_said():
    torch.cuda.memory._record_memory_history(enabled="all", max_entries=64)
    torch.cuda.reset_peak_memory_stats()  # the user's counter, in this test: so the counter rises in the cell
    try:
        with vram_magic.measure("cuda", namespace={}) as m:
            big = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
            del big
            for _ in range(200):
                torch.empty(1000, dtype=torch.uint8, device="cuda")
        assert any("wrapped" in n for n in m.notes), m.notes
        assert m.peak.total - m.before.total >= 64 * MiB  # exact from the counter, though the trace lost it
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def test_gpu_history_turned_on_inside_the_cell_is_left_on():
    try:
        with vram_magic.measure("cuda", namespace={}) as m:
            torch.cuda.memory._record_memory_history(enabled="all")
            a = torch.empty(MiB, device="cuda")
            del a
        assert _history_enabled()
        assert any("turned on memory-history recording itself" in n for n in m.notes), m.notes
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def test_gpu_oom_sizes_from_the_trace():
    got = fresh("""
        import json, torch, vram_magic
        MiB = 2**20
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(61 * MiB / total)
        hold = torch.empty(60 * MiB, dtype=torch.uint8, device="cuda")  # one 60 MiB segment, 1 MiB left
        out = {}
        for n in (100, 4 * MiB, 30 * MiB + 100):
            m = vram_magic.measure("cuda", namespace={})
            try:
                with m:
                    torch.empty(n, dtype=torch.uint8, device="cuda")
            except torch.OutOfMemoryError:
                pass
            out[str(n)] = m.report.oom.requested if m.report is not None and m.report.oom else None
        print(json.dumps(out))
    """)
    # under 1 MiB (a 2 MiB segment), 1-10 MiB (a 20 MiB segment), above (rounded to 2 MiB): the request itself
    assert got == {"100": 512, str(4 * MiB): 4 * MiB, str(30 * MiB + 100): 30 * MiB + 512}


def test_gpu_budget_puts_the_users_fraction_back():
    if not hasattr(torch.cuda, "get_per_process_memory_fraction"):
        pytest.skip("PyTorch < 2.6: --budget is enforced on live tensors only")
    torch.cuda.empty_cache()  # this test's own cache: cached blocks would be reused without the limit
    before = torch.cuda.get_per_process_memory_fraction()
    for backend in ("tracker", "allocator"):
        m = vram_magic.measure("cuda", namespace={}, budget="64MiB", backend=backend)
        with pytest.raises(torch.OutOfMemoryError):
            with m:
                torch.empty(128 * MiB, dtype=torch.uint8, device="cuda")
        assert torch.cuda.get_per_process_memory_fraction() == before
        assert m.report.oom.requested == 128 * MiB, (backend, m.report.oom)
    big = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")  # no limit left behind
    del big


def test_gpu_cuda_malloc_async():
    got = fresh("""
        import json, torch, vram_magic
        from vram_magic.session.state import Session
        torch.zeros(1, device="cuda")  # CUDA initialised before the cell: the cell runs the backend's own path
        s = Session({})
        s.start("cuda")
        x = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
        del x
        r = s.finish()
        print(json.dumps({"backend": torch.cuda.get_allocator_backend(), "notes": list(r.notes),
                          "rise": r.peak.total - r.before.total}))
    """, env={"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"})
    assert got["backend"] == "cudaMallocAsync"
    assert any("keeps no allocation history" in n for n in got["notes"]), got["notes"]
    assert got["rise"] >= 64 * MiB


def test_gpu_looking_creates_no_context():
    got = fresh("""
        import json, torch
        from IPython.core.interactiveshell import InteractiveShell
        sh = InteractiveShell.instance()
        sh.run_cell("%load_ext vram_magic")
        sh.run_cell("%vram")
        sh.run_cell("%vram all")
        sh.run_cell("%%vram -q -o r\\nx = sum(range(10))")
        import vram_magic
        with vram_magic.measure(namespace={}):
            y = [1] * 10
        print(json.dumps({"initialised": torch.cuda.is_initialized(), "notes": list(sh.user_ns["r"].notes)}))
    """)
    assert got["initialised"] is False
    assert any("not initialised" in n for n in got["notes"])


def test_gpu_first_context_counts_as_the_cells():
    got = fresh("""
        import json, torch, vram_magic
        with vram_magic.measure(namespace={}) as m:
            t = torch.zeros(1, device="cuda")
        print(json.dumps({"peak": m.peak.total, "after": m.after.total, "notes": list(m.notes)}))
    """)
    assert got["peak"] == 512 and got["after"] == 512
    assert any("initialised by this cell" in n for n in got["notes"]), got["notes"]
    assert any("created the CUDA context on cuda:0" in n for n in got["notes"]), got["notes"]


def test_gpu_second_device():
    if torch.cuda.device_count() < 2:
        pytest.skip("one GPU here")
    with vram_magic.measure(namespace={}) as m:
        with torch.cuda.device(1):
            t = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
    assert any("also used cuda:1" in n for n in m.notes), m.notes
    del t


def test_gpu_before_is_reconciled_with_the_allocator():
    a = torch.randn(64, 64, device="cuda")
    _ = a @ a  # cuBLAS makes its workspace: allocator memory no variable holds
    torch.cuda.synchronize()
    with vram_magic.measure("cuda", namespace={"a": a}) as m:
        t = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
    block = torch.cuda.memory_allocated() - m.before.total  # 4 MiB, or a cached block up to 1 MiB larger
    assert 4 * MiB <= block <= 5 * MiB
    assert m.delta.total == block  # the workspace is in before, not in the cell's change
    assert m.after.total == torch.cuda.memory_allocated()
    assert m.before.details("other")["allocator: workspaces, rounding and untracked"] >= 8 * MiB
    del t


def test_gpu_record_stream_frees_count_when_requested():
    side = torch.cuda.Stream()
    with vram_magic.measure("cuda", namespace={}) as m:
        x = torch.empty(2 * MiB, dtype=torch.uint8, device="cuda")
        with torch.cuda.stream(side):
            x.add_(1)
        x.record_stream(side)
        del x  # free requested now, completed once the side stream is done
    assert m.after.total == torch.cuda.memory_allocated()
    assert cuda.device_stats("cuda:0").allocated == torch.cuda.memory_allocated()


def test_gpu_out_of_memory_cell_reads_the_allocator_after_releasing_its_frames():
    def step():
        held = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")  # what the failed frame holds  # noqa: F841
        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")  # 1 PiB: no device has it

    torch.cuda.synchronize()
    m = vram_magic.measure("cuda", namespace={})
    with pytest.raises(torch.OutOfMemoryError):
        with m:
            step()
    assert m.report.oom
    assert m.after.total == torch.cuda.memory_allocated()  # read after the frame's 256 MiB was freed
    assert m.after.total - m.before.total < MiB and m.peak.total - m.before.total >= 256 * MiB


def test_gpu_peak_reset_inside_the_cell_keeps_the_cells_peak():
    with vram_magic.measure("cuda", namespace={}) as m:  # warm up, reset, timed step: a benchmark's cell
        warm = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        del warm
        torch.cuda.reset_peak_memory_stats()  # this test's own counter: the cell is the user here
        step = torch.empty(MiB, dtype=torch.uint8, device="cuda")
        del step
    assert m.peak.total - m.before.total >= 64 * MiB, m.notes
    assert any("reset the allocator's peak counter" in n for n in m.notes), m.notes


def test_gpu_budget_keeps_the_current_device():
    if torch.cuda.device_count() < 2:
        pytest.skip("one GPU here: --budget on cuda:1 needs two")
    if not hasattr(torch.cuda, "get_per_process_memory_fraction"):
        pytest.skip("PyTorch < 2.6: --budget is enforced on live tensors only")
    torch.cuda.set_device(0)
    with vram_magic.measure("cuda:1", namespace={}, budget="1GiB"):
        assert torch.cuda.current_device() == 0
        t = torch.empty(MiB, dtype=torch.uint8, device="cuda:1")
    assert torch.cuda.current_device() == 0
    del t


def test_gpu_budget_leaves_the_allocator_alone_under_a_gc_threshold():
    got = fresh("""
        import json, torch, vram_magic
        torch.zeros(1, device="cuda")
        if not hasattr(torch.cuda, "get_per_process_memory_fraction"):
            print(json.dumps({"skip": True})); raise SystemExit
        with vram_magic.measure("cuda", namespace={}, budget="64MiB", backend="tracker") as m:
            pass
        print(json.dumps({"fraction": torch.cuda.get_per_process_memory_fraction(), "notes": list(m.notes)}))
    """, env={"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6"})
    if got.get("skip"):
        pytest.skip("PyTorch < 2.6")
    assert got["fraction"] == 1.0
    assert any("garbage_collection_threshold:0.6" in n for n in got["notes"]), got["notes"]


def test_gpu_nothing_that_looks_calls_is_available():
    got = fresh("""
        import json, os, torch, traceback
        calls = []
        real = torch.cuda.is_available
        def counted():
            if os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") != "1":  # the NVML check runs no cuInit
                calls.append("".join(traceback.format_stack(limit=8)))
            return real()
        torch.cuda.is_available = counted
        from IPython.core.interactiveshell import InteractiveShell
        sh = InteractiveShell.instance()
        for cell in ("%load_ext vram_magic", "%vram", "%vram all", "%%vram -q -o r\\nx = sum(range(10))",
                     "%%vram -q\\ny = [x] * 3"):
            sh.run_cell(cell)
        import vram_magic
        with vram_magic.measure(namespace={}):
            z = [1] * 10
        vram_magic.estimate(torch.nn.Linear(64, 64), torch.randn(4, 64))
        print(json.dumps({"calls": calls, "initialised": torch.cuda.is_initialized()}))
    """)
    assert got["calls"] == [], got["calls"][0]
    assert got["initialised"] is False


ALLOCATOR_STEPS = """
    import json, torch
    from vram_magic.engine.cuda.alloc_conf import settings_from_env
    from vram_magic.engine.cuda.caching_allocator import CachingAllocator
    MiB = 2**20
    # bytes to allocate, or -k to free what step k allocated
    steps = [4 * MiB, 19 * MiB + MiB // 2, -1, 11 * MiB, 100, 30 * MiB + 100, -4, 5 * MiB + 1, 60 * MiB, -9,
             30 * MiB, 8 * MiB, 100 * 1024, -6, -11, 45 * MiB]
    real, model, live, handles = [], [], {}, {}
    sim = CachingAllocator(settings=settings_from_env())
    for i, n in enumerate(steps, 1):
        if n > 0:
            live[i] = torch.empty(n, dtype=torch.uint8, device="cuda")
            handles[i] = sim.malloc(n)
        else:
            del live[-n]
            sim.free(handles.pop(-n))
        real.append((torch.cuda.memory_allocated(), torch.cuda.memory_reserved()))
        model.append((sim.allocated, sim.reserved))
    print(json.dumps({"real": real, "model": model}))
"""


@pytest.mark.parametrize("conf", ["", "expandable_segments:True", "max_split_size_mb:20",
                                  "roundup_power2_divisions:4", "roundup_power2_divisions:[4:8,>:2]"])
def test_gpu_allocator_model_matches_under_each_setting(conf):
    got = fresh(ALLOCATOR_STEPS, env={"PYTORCH_CUDA_ALLOC_CONF": conf})
    assert got["model"] == got["real"], list(zip(got["model"], got["real"]))


def test_gpu_expandable_segments_in_a_measured_cell_and_the_estimate():
    got = fresh("""
        import json, torch, vram_magic
        MiB = 2**20
        torch.zeros(1, device="cuda")
        with vram_magic.measure("cuda", namespace={}) as m:
            t = torch.empty(19 * MiB + MiB // 2, dtype=torch.uint8, device="cuda")
            del t
        from vram_magic.estimator.device.gpus import GPU, find_gpu
        name = torch.cuda.get_device_name(0)
        try:
            gpu = find_gpu(name)
        except ValueError:
            p = torch.cuda.get_device_properties(0)
            gpu = GPU(name, int(p.total_memory), "detected", capability=(p.major, p.minor))
        torch.manual_seed(0)
        model, x = torch.nn.Linear(1000, 5000), torch.randn(8, 1000)
        est = vram_magic.estimate(model, x, gpu=gpu)
        torch.cuda.synchronize(); torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model, x = model.cuda(), x.cuda()
        opt = torch.optim.AdamW(model.parameters())
        for _ in range(2):
            model(x).sum().backward(); opt.step(); opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        print(json.dumps({"rise": m.peak.total - m.before.total, "notes": list(m.notes), "est": est.peak.total,
                          "real": torch.cuda.max_memory_allocated() - base, "est_notes": list(est.notes)}))
    """, env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert got["rise"] == 19 * MiB + MiB // 2, got["notes"]  # the default rules would say 20 MiB
    assert any("expandable_segments:True" in n for n in got["notes"]), got["notes"]
    assert any("expandable_segments:True (from PYTORCH_CUDA_ALLOC_CONF)" in n for n in got["est_notes"])
    assert abs(got["est"] - got["real"]) <= 0.05 * got["real"], got


def test_gpu_skip_actions_recording_is_said():
    try:
        torch.cuda.memory._record_memory_history(enabled="all", skip_actions=["free_requested"])
    except TypeError:
        pytest.skip("this PyTorch has no skip_actions (2.6 on)")
    try:
        with vram_magic.measure("cuda", namespace={}) as m:
            a = torch.empty(12 * MiB, dtype=torch.uint8, device="cuda")
            del a
        assert any("skip_actions" in n for n in m.notes), m.notes
        assert not any("wrapped" in n for n in m.notes), m.notes
        assert m.peak.total - m.before.total >= 12 * MiB
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
