"""Compiled models under %%vram: they run the compiled graphs (inductor on the CPU) as they do unmeasured, with
no recompile or warning caused by measuring, and the reported peak is the compiled step's, as PyTorch's
profiler sees it unmeasured."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.support import run_ok

pytestmark = pytest.mark.slow  # inductor compiles C++ on the CPU: seconds per model


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test starts from TorchDynamo's empty caches (its compiled graphs and counters are per process)."""
    yield
    torch._dynamo.reset()

SETUP = """
import torch
from torch._inductor.compile_fx import compile_fx

calls = {"compiled": 0}


def counting_inductor(gm, example_inputs):
    # inductor itself, with a counter on the compiled graph's calls: it goes up only when compiled code runs
    compiled = compile_fx(gm, example_inputs)

    def run(*args):
        calls["compiled"] += 1
        return compiled(*args)

    return run


class Block(torch.nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


torch.manual_seed(0)
model = torch.nn.Sequential(Block(), Block())
opt = torch.optim.AdamW(model.parameters())
x = torch.randn(16, 128, 64)


def step(m):
    loss = m(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
"""


def _profiled_peak(sh, code: str) -> tuple[int, set[str]]:
    """The profiler's own view of ``code`` run unmeasured: the highest bytes above the start, and the names of
    the recorded regions."""
    run_ok(sh, "from torch.profiler import profile, ProfilerActivity\n"
               "with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as _prof:\n"
               f"    {code}\n"
               "_events = _prof.profiler.kineto_results.events()\n"
               "_names = {e.name() for e in _events}\n"
               "_mem = sorted((e.start_ns(), e.nbytes()) for e in _events if e.name() == '[memory]' "
               "and e.device_type() == torch.autograd.DeviceType.CPU)\n"
               "_running = _top = 0\n"
               "for _, _n in _mem:\n"
               "    _running += _n\n"
               "    _top = max(_top, _running)\n")
    return sh.user_ns["_top"], sh.user_ns["_names"]


def _dynamo_counts() -> dict[str, dict[str, int]]:
    from torch._dynamo.utils import counters

    return {k: dict(v) for k, v in counters.items()}


def test_compiled_models_are_measured_as_they_run_compiled(shell):
    """One shell for every case (dynamo keys its caches on the shell's ``__main__``): a warmed-up compiled model
    stepped in a measured cell; a first call inside a measured cell; the tracker forced."""
    run_ok(shell, SETUP)
    _warm_model_measured(shell)
    _first_call_inside_a_measured_cell(shell)
    _tracker_forced(shell)


def _warm_model_measured(shell):
    run_ok(shell, "cm = torch.compile(model, backend=counting_inductor)\nstep(cm)\nstep(cm)")  # compiled, warm
    peak, names = _profiled_peak(shell, "step(cm)")
    assert any("CompiledFunction" in n for n in names)  # the compiled region ran under the profiler
    counts = _dynamo_counts()
    before_calls = shell.user_ns["calls"]["compiled"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_ok(shell, "%%vram -q -o r\nstep(cm)")
    r = shell.user_ns["r"]
    # the compiled graphs ran inside the measured cell (one forward call; the backward runs inside it too)
    assert shell.user_ns["calls"]["compiled"] == before_calls + 1
    assert _dynamo_counts() == counts  # nothing recompiled, no graph break, no new frame
    assert not [w for w in caught if "hook" in str(w.message) or "recompile" in str(w.message)]
    assert r.backend == "allocator" and any("cm is a compiled module" in n for n in r.notes)
    assert any("compiled code ran" in n for n in r.notes)
    # the reported peak is the compiled step's, as the profiler saw it unmeasured (within 2 %)
    measured = r.peak.total - r.before.total
    assert abs(measured - peak) <= 0.02 * peak, (measured, peak)
    # parameters, gradients and optimizer state are known exactly; the rest of the peak is the step's
    params = sum(p.numel() * 4 for p in shell.user_ns["model"].parameters())
    tensors = len(list(shell.user_ns["model"].parameters()))  # 12: AdamW keeps a 4-byte step count for each
    assert r.peak.parameters == params and r.after.optimizer_state == 2 * params + tensors * 4
    assert r.after.gradients == 0 and 0 <= r.peak.gradients <= params  # freed by zero_grad in the cell
    assert r.peak.activations > 0 and torch._C._len_torch_dispatch_stack() == 0


def _first_call_inside_a_measured_cell(shell):
    run_ok(shell, "model2 = torch.nn.Sequential(Block(), Block())\nopt = torch.optim.AdamW(model2.parameters())\n"
                  "calls['compiled'] = 0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_ok(shell, "%%vram -q -o r\ncm2 = torch.compile(model2, backend=counting_inductor)\nstep(cm2)")
    assert not [w for w in caught if "hook" in str(w.message)]
    r = shell.user_ns["r"]
    assert r.backend == "allocator" and "calls compile" in " ".join(r.notes)
    assert shell.user_ns["calls"]["compiled"] == 1
    # later, unmeasured: the same compiled graphs, no recompile, the compiled region in the profile
    counts = _dynamo_counts()
    _, names = _profiled_peak(shell, "step(cm2)")
    assert any("CompiledFunction" in n for n in names)
    assert shell.user_ns["calls"]["compiled"] == 2 and _dynamo_counts() == counts


def _tracker_forced(shell):
    run_ok(shell, "%%vram -q -o r --backend tracker\nstep(cm2)")
    r = shell.user_ns["r"]
    assert r.backend == "tracker" and torch._C._len_torch_dispatch_stack() == 0
    run_ok(shell, "%%vram -q -o r2\nstep(cm2)")  # auto again: the allocator
    assert shell.user_ns["r2"].backend == "allocator"


def test_a_forced_tracker_leaves_compiled_models_compiled(shell):
    """Under the tracker compiled code runs eagerly (TorchDynamo's force_eager stance): nothing is compiled or
    cached there, so the model compiled before the cell and one compiled after it run their compiled graphs
    again (without the stance TorchDynamo marked nn.Module's code to run eagerly for the rest of the session)."""
    if not hasattr(torch.compiler, "set_stance"):
        pytest.skip("torch.compiler.set_stance is PyTorch 2.6 on")
    run_ok(shell, "import torch\ncalls = {'n': 0}\n"
                  "def counting(gm, example_inputs):\n"
                  "    def run(*args):\n        calls['n'] += 1\n        return gm.forward(*args)\n    return run\n"
                  "x = torch.randn(4, 8)\n"
                  "c1 = torch.compile(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), backend=counting)\n"
                  "c1(x)")
    assert shell.user_ns["calls"]["n"] == 1
    run_ok(shell, "%%vram -q -o r --backend tracker\ny = c1(x)")
    r = shell.user_ns["r"]
    assert r.backend == "tracker" and shell.user_ns["calls"]["n"] == 1  # eagerly, measured
    assert r.peak.activations >= 4 * 8 * 4
    run_ok(shell, "c2 = torch.compile(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()), backend=counting)\n"
                  "c2(x)\nc1(x)")
    assert shell.user_ns["calls"]["n"] == 3
    from torch._dynamo.eval_frame import _stance  # (no public getter)

    assert _stance.stance == "default"  # put back after the cell
