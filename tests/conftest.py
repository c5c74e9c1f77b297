from __future__ import annotations

import gc

import pytest
import torch


@pytest.fixture
def shell():
    """A real IPython shell with the extension loaded; cleaned up (and unloaded) after the test."""
    from IPython.core.interactiveshell import InteractiveShell

    sh = InteractiveShell.instance(colors="nocolor")
    sh.run_cell("%load_ext vram_magic", store_history=True)
    yield sh
    sh.run_cell("%unload_ext vram_magic")
    sh.reset(new_session=True)
    InteractiveShell.clear_instance()
    gc.collect()


def run(sh, source: str):
    """Run a cell like a notebook does; return the ExecutionResult."""
    return sh.run_cell(source, store_history=True)


def run_ok(sh, source: str):
    result = run(sh, source)
    if result.error_before_exec is not None:
        raise result.error_before_exec
    if result.error_in_exec is not None:
        raise result.error_in_exec
    return result


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.cuda`` tests skip without a CUDA GPU. Tests guarded by ``skipif(... reason="needs a CUDA
    GPU")`` count as cuda tests too, so ``pytest -m cuda`` (benchmarks/gpu_check.py) runs every GPU test."""
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    available = torch.cuda.is_available()
    for item in items:
        if any("CUDA" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.cuda)
        if not available and item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def profiled_step_peak(prof) -> int:
    """The highest CPU memory in a profile (``profile_memory=True``) above what was allocated when it began."""
    from torch._C._profiler import _EventType

    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.typed[0] == _EventType.Allocation and node.typed[1].device.type == "cpu":
            events.append((node.start_time_ns, node.typed[1].alloc_size, node.typed[1].total_allocated))
        stack.extend(node.children)
    events.sort()
    return max(t for _, _, t in events) - (events[0][2] - events[0][1])


def two_steps(model, x, opt, steps: int = 2) -> None:
    """The training steps tests compare with estimates: forward, sum, backward, optimizer step, zero_grad."""
    for _ in range(steps):
        out = model(x)
        loss = out.sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del out, loss
