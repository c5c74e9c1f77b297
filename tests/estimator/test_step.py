"""``vram_magic.estimate`` and ``%vram_estimate``: fake runs checked against real CPU steps and sizes worked
out by hand."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import vram_magic
from tests.support.zoo import train_steps
from vram_magic.estimator import EstimateError, find_gpu

# Linear(1024, 4096): 1024 * 4096 weights + 4096 biases
P = 1024 * 4096 + 4096
F32, B16 = 4 * P, 2 * P
STEP = 2 * 4  # Adam-style `step` counters: one fp32 scalar per parameter tensor (weight, bias)


@pytest.fixture
def linear():
    torch.manual_seed(0)
    return nn.Linear(1024, 4096), torch.randn(8, 1024)


@pytest.mark.parametrize(
    ("optimizer", "dtype", "params", "state"),
    [
        ("sgd", None, F32, 0),
        ("sgd-momentum", None, F32, F32),
        ("adam", None, F32, 2 * F32 + STEP),
        ("adamw", None, F32, 2 * F32 + STEP),
        ("adamw", "bf16", B16, 2 * B16 + STEP),
        ("adamw", "fp16", B16, 2 * B16 + STEP),
        ("adagrad", None, F32, F32 + STEP),
        ("rmsprop", "bf16", B16, B16 + STEP),
        # factored second moments: a row (4096) and a column (1024) for the weight, a vector for the bias
        ("adafactor", None, F32, (4096 + 1024 + 4096) * 4 + STEP),
        ("adafactor", "bf16", B16, (4096 + 1024 + 4096) * 2 + STEP),
    ],
)
def test_parameters_and_optimizer_state_bytes_by_hand(linear, optimizer, dtype, params, state):
    m, x = linear
    est = vram_magic.estimate(m, x, optimizer=optimizer, dtype=dtype, device="cpu")
    assert est.peak["parameters"] == params
    assert est.peak["optimizer_state"] == state
    assert est.parameters == P
    # the user's model is untouched: same tensors, fp32, no gradients, nothing moved
    assert m.weight.dtype == torch.float32 and m.weight.grad is None and m.weight.device.type == "cpu"


def test_optimizer_class_and_object(linear):
    m, x = linear
    by_class = vram_magic.estimate(m, x, optimizer=torch.optim.SGD, device="cpu")
    assert by_class.peak["optimizer_state"] == 0
    obj = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    by_object = vram_magic.estimate(m, x, optimizer=obj, device="cpu")
    assert by_object.peak["optimizer_state"] == F32
    assert obj.state == {} or all(not v for v in obj.state.values())


def test_cuda_model_rounds_drops_host_counters_and_adds_workspaces(linear):
    m, x = linear
    est = vram_magic.estimate(m, x, gpu="A100-80GB")
    # exp_avg and exp_avg_sq on the GPU (sizes already multiples of 512); `step` counters stay on the host
    assert est.peak["optimizer_state"] == 2 * F32
    other = est.peak.details("other")
    # two cuBLAS handles (forward thread, autograd thread) of PyTorch's default 8.125 MiB workspace
    assert other["cuBLAS workspaces (modelled)"] == 2 * (4096 * 1024 * 2 + 16 * 1024 * 8)
    # foreach AdamW (CUDA's default) holds a parameter-sized temporary at the peak
    assert other["optimizer temporaries"] == F32
    assert est.needed == est.reserved + 500 * 2**20 and est.reserved >= est.peak.total  # allocator simulated
    assert est.fits is True and est.headroom == find_gpu("a100-80gb").memory - est.needed
    assert "fits A100-80GB" in str(est)
    assert "CUDA context" in str(est) and "modelled" in est._repr_mimebundle_()["text/html"]


def test_matches_a_real_cpu_training_run_to_the_byte():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.GELU(), nn.Linear(2048, 10))
    x = torch.randn(32, 512)
    est = vram_magic.estimate(model, x, optimizer="adamw", device="cpu")
    opt = torch.optim.AdamW(model.parameters())
    with vram_magic.measure(namespace={"model": model, "x": x, "opt": opt}) as real:
        train_steps(model, x, 2, opt)
    assert est.peak.total == real.peak.total
    table = est.compare(real)
    assert table.loc["total", "error"] == 0
    assert list(table.index) == ["parameters", "gradients", "optimizer_state", "activations", "other", "total"]


def test_inference_matches_a_real_cpu_forward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 4096), nn.ReLU(), nn.Linear(4096, 256))
    x = torch.randn(64, 256)
    est = vram_magic.estimate(model, x, inference=True, device="cpu")
    with vram_magic.measure(namespace={"model": model, "x": x}) as real:
        with torch.inference_mode():
            y = model(x)
        del y
    assert est.peak.total == real.peak.total
    assert est.peak["gradients"] == est.peak["optimizer_state"] == 0
    # the two hidden activations of 64 x 4096 fp32 at the peak
    assert est.peak["activations"] >= 64 * 4096 * 4


def _profiler_peak(fn) -> int:
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.typed[0] == _EventType.Allocation:
            events.append((node.start_time_ns, node.typed[1].alloc_size, node.typed[1].total_allocated))
        stack.extend(node.children)
    events.sort()
    return max(t for _, _, t in events) - (events[0][2] - events[0][1])


def test_conv_net_within_two_percent_of_the_profilers_peak():
    """Convolution kernels' oneDNN scratch is invisible at dispatch level; the estimate measures it per layer."""

    def build():
        return nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3), nn.BatchNorm2d(64), nn.ReLU(),
                             nn.Conv2d(64, 64, 3, 1, 1), nn.BatchNorm2d(64), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))

    est = vram_magic.estimate(build, lambda: torch.randn(8, 3, 96, 96), device="cpu")

    def real():
        torch.manual_seed(0)
        model, x = build(), torch.randn(8, 3, 96, 96)
        train_steps(model, x, 2, torch.optim.AdamW(model.parameters()))

    measured = _profiler_peak(real)
    assert abs(est.peak.total - measured) / measured < 0.02


def test_tied_weights_counted_once_and_builder_runs_on_fake_tensors():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50_000, 1024)
            self.head = nn.Linear(1024, 50_000, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, t):
            return self.head(self.emb(t))

    est = vram_magic.estimate(Tied, torch.zeros(2, 16, dtype=torch.long), dtype="bf16", device="cpu")
    assert est.peak["parameters"] == 50_000 * 1024 * 2
    assert est.parameters == 50_000 * 1024


def test_huge_builder_costs_no_memory():
    # 20 GB of fp32 weights: only possible on fake tensors
    est = vram_magic.estimate(lambda: nn.Linear(70_000, 70_000), torch.randn(4, 70_000), optimizer="sgd",
                              inference=True, device="cpu")
    assert est.peak["parameters"] == (70_000 * 70_000 + 70_000) * 4


def test_checkpointing_accumulation_and_amp_change_the_numbers():
    def build():
        return nn.Sequential(*[nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(8)])

    x = torch.randn(256, 256)
    base = vram_magic.estimate(build, x, optimizer="sgd", device="cpu")
    ckpt = vram_magic.estimate(build, x, optimizer="sgd", device="cpu", checkpointing=True)
    acc = vram_magic.estimate(build, x, optimizer="sgd", device="cpu", accumulate=4)
    amp = vram_magic.estimate(build, x, optimizer="sgd", device="cpu", amp="bf16")
    assert ckpt.after_forward["activations"] < base.after_forward["activations"] / 4
    assert ckpt.total_flops > base.total_flops  # the recomputed forward
    assert acc.micro_batch == 64 and acc.after_forward["activations"] < base.after_forward["activations"] / 3
    assert acc.total_flops == pytest.approx(base.total_flops, rel=0.01)
    assert amp.after_forward["activations"] < base.after_forward["activations"]


def test_sharding_divides_per_rank(linear):
    m, x = linear
    base = vram_magic.estimate(m, x, device="cpu")
    z1 = vram_magic.estimate(m, x, device="cpu", zero=1, world=4)
    z3 = vram_magic.estimate(m, x, device="cpu", fsdp=True, world=4)
    assert z1.peak["parameters"] == F32 and z1.peak["optimizer_state"] < base.peak["optimizer_state"] / 3
    assert z3.peak["parameters"] == F32 // 4
    assert any("all-gather" in label for label, _ in z3.modelled)


def test_data_dependent_op_gives_a_partial_estimate_naming_op_and_module():
    class Picky(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.gate = Gate()

        def forward(self, x):
            return self.gate(self.lin(x))

    class Gate(nn.Module):
        def forward(self, x):
            return x[x > 0]

    est = vram_magic.estimate(Picky(), torch.randn(4, 16), device="cpu")
    assert est.partial
    assert "aten.index" in est.problem and "'gate'" in est.problem
    assert "PARTIAL" in str(est)


def test_model_errors_name_the_module():
    m = nn.Sequential(nn.Linear(16, 32), nn.Linear(16, 4))
    with pytest.raises(EstimateError, match="'1'"):
        vram_magic.estimate(m, torch.randn(2, 16), device="cpu")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"optimizer": "lion"}, ValueError, "sgd-momentum"),
        ({"optimizer": 3}, TypeError, "optimizer must be"),
        ({"dtype": "int8"}, ValueError, "bf16, fp16, fp32"),
        ({"amp": "fp32"}, ValueError, "bf16 or fp16"),
        ({"zero": 4, "world": 2}, ValueError, "1, 2 or 3"),
        ({"zero": 2}, ValueError, "world"),
        ({"accumulate": 0}, ValueError, "accumulate"),
        ({"gpu": "GTX-9999"}, ValueError, "A100-80GB"),
        ({"budget": "lots"}, ValueError, "GiB"),
        ({"max_batch": True}, ValueError, "capacity"),
        ({"device": "tpu"}, ValueError, "'cuda'"),
        ({"inference": True, "accumulate": 2}, ValueError, "training"),
    ],
)
def test_bad_arguments(linear, kwargs, error, match):
    m, x = linear
    with pytest.raises(error, match=match):
        vram_magic.estimate(m, x, **kwargs)


def test_bad_model_and_inputs():
    with pytest.raises(TypeError, match="nn.Module"):
        vram_magic.estimate(42, torch.randn(2))
    with pytest.raises(TypeError, match="inputs must be"):
        vram_magic.estimate(nn.Linear(2, 2), "x")
    with pytest.raises(TypeError, match="no arguments"):
        vram_magic.estimate(lambda n: nn.Linear(n, n), torch.randn(2, 2))


def test_max_batch_and_what_if():
    m = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))
    seen = []
    est = vram_magic.estimate(m, torch.randn(32, 256), device="cpu", budget="20MiB", max_batch=True,
                              what_if=True, progress=seen.append)
    assert seen and est.max_batch is not None and est.max_batch > 32
    at_max = vram_magic.estimate(m, torch.randn(est.max_batch, 256), device="cpu", budget="20MiB")
    too_big = vram_magic.estimate(m, torch.randn(int(est.max_batch * 1.05) + 1, 256), device="cpu", budget="20MiB")
    assert at_max.fits and not too_big.fits
    frame = est.what_if()
    assert frame.index[0].startswith("baseline")
    assert frame.loc["optimizer state offloaded", "saving"] > 0
    assert frame.loc["activation checkpointing", "compute ×"] >= 1.0
    assert frame.loc["accumulate 2 micro-batches", "steps ×"] == 2


def test_max_sequence_length():
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(1000, 64)
            self.mix = nn.Linear(64, 64)

        def forward(self, t):
            h = self.emb(t)
            w = torch.softmax(h @ h.transpose(1, 2), -1)  # seq x seq: memory grows with the square
            return self.mix(w @ h)

    est = vram_magic.estimate(Attn(), torch.zeros(2, 128, dtype=torch.long), device="cpu", budget="64MiB",
                              max_seq=True)
    assert est.max_seq is not None and est.max_seq > 128
    longer = vram_magic.estimate(Attn(), torch.zeros(2, int(est.max_seq * 1.05) + 1, dtype=torch.long),
                                 device="cpu", budget="64MiB")
    assert not longer.fits


def test_estimate_is_a_plain_function_beside_its_package():
    import types

    import vram_magic.estimator as pkg

    assert isinstance(vram_magic.estimate, types.FunctionType) and isinstance(pkg, types.ModuleType)
    # one function, written once: the package hands on the estimator's own (PEP 562)
    assert vram_magic.estimate is pkg.estimate and vram_magic.plan is pkg.plan
    assert vram_magic.estimate.__module__ == "vram_magic.estimator"
    assert {"estimate", "plan"} <= set(dir(vram_magic))


def test_estimate_shows_its_parameters_and_their_documentation():
    import inspect


    sig = inspect.signature(vram_magic.estimate)
    assert list(sig.parameters)[:3] == ["model", "inputs", "optimizer"]
    assert {"loss_fn", "dtype", "device", "gpu", "budget", "what_if", "max_batch", "generate"} <= set(sig.parameters)
    assert sig.parameters["optimizer"].default == "adamw" and sig.parameters["device"].default == "cuda"
    doc = inspect.getdoc(vram_magic.estimate)
    assert [name for name in sig.parameters if f"``{name}" not in doc] == []
    # what help() and IPython's Shift-Tab show
    import pydoc

    text = pydoc.render_doc(vram_magic.estimate, renderer=pydoc.plaintext)
    assert "estimate(model: 'Any', inputs: 'Any', *, optimizer: 'Any' = 'adamw'" in text
    assert "fit verdict" in text


def test_importing_the_package_or_reading_the_help_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys, inspect, vram_magic\n"
            "print(sorted(m for m in ('vram_magic.estimator', 'torch') if m in sys.modules))\n"
            "inspect.signature(vram_magic.estimate); help(vram_magic.estimate); help(vram_magic.plan)\n"
            "print(sorted(m for m in ('vram_magic.estimator', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # importing the package imports neither; reading estimate()'s signature and help imports the estimator's front
    # door, which imports no torch
    assert out.stdout.strip().splitlines()[0] == "[]"
    assert out.stdout.strip().splitlines()[-1] == "['vram_magic.estimator']"


# --- the magic ---------------------------------------------------------------------------------------------
def test_magic_stores_the_estimate(shell):
    shell.run_cell("import torch, torch.nn as nn\nm = nn.Linear(1024, 4096)")
    result = shell.run_cell("%vram_estimate m --input 'torch.randn(8, 1024)' --device cpu -o est -q")
    assert result.error_in_exec is None
    est = shell.user_ns["est"]
    assert est.peak["parameters"] == F32 and est.peak["optimizer_state"] == 2 * F32 + STEP
    assert result.result is None


def test_magic_shape_gpu_and_options(shell):
    shell.run_cell("import torch, torch.nn as nn\nm = nn.Linear(1024, 4096)\n"
                   "opt = torch.optim.SGD(m.parameters(), lr=0.1)")
    r = shell.run_cell("%vram_estimate m --shape 1024 --batch 8 --optimizer opt --dtype bf16 --gpu T4 -o est")
    assert r.error_in_exec is None
    est = shell.user_ns["est"]
    assert est.peak["parameters"] == B16 and est.peak["optimizer_state"] == 0 and est.gpu == "T4"
    assert est.fits is True


def test_magic_max_batch_shows_progress(shell, capsys):
    shell.run_cell("import torch, torch.nn as nn\nm = nn.Linear(256, 256)")
    r = shell.run_cell("%vram_estimate m --shape 256 --batch 4 --device cpu --budget 4MiB --max-batch -o est")
    assert r.error_in_exec is None
    assert shell.user_ns["est"].max_batch > 4
    assert "max-batch: trying" in capsys.readouterr().out


def test_magic_max_seq_progress_names_the_search(shell, capsys):
    shell.run_cell("import torch, torch.nn as nn\nm = nn.Linear(256, 256)")
    r = shell.run_cell("%vram_estimate m --input 'torch.randn(2, 16, 256)' --device cpu --budget 4MiB --max-seq -o est")
    assert r.error_in_exec is None
    assert shell.user_ns["est"].max_seq > 16
    out = capsys.readouterr().out
    assert "max-seq: trying" in out and "max-batch" not in out


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("m --shape 16 --batch 2 --optimizer lion", "lion"),
        ("m --shape 16", "--batch"),
        ("m", "--input"),
        ("nothing --shape 16 --batch 2", "nothing"),
        ("m --input 'torch.randn(2, 16' ", "Python"),
        ("m --shape 16 --batch 2 --gpu nope", "known"),
        ("m --shape 16 --batch 2 -o 3x", "variable name"),
    ],
)
def test_magic_usage_errors(shell, line, match):
    from IPython.core.error import UsageError

    shell.run_cell("import torch, torch.nn as nn\nm = nn.Linear(16, 16)")
    magics = shell.magics_manager.registry["VramMagics"]
    with pytest.raises(UsageError, match=match):
        magics.vram_estimate(line)


# --- the command line --------------------------------------------------------------------------------------
def test_command_line(tmp_path):
    (tmp_path / "toy_models.py").write_text(textwrap.dedent("""
        import torch.nn as nn

        def build_model():
            return nn.Linear(1024, 4096)
    """))
    cmd = [sys.executable, "-m", "vram_magic", "estimate", "toy_models:build_model", "--shape", "1024", "--batch",
           "8", "--device", "cpu", "--json"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    import json

    data = json.loads(done.stdout)
    assert data["peak"]["parameters"] == F32 and data["peak"]["optimizer_state"] == 2 * F32 + STEP
    bad = subprocess.run(cmd[:4] + ["toy_models:nope", "--shape", "4", "--batch", "1"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no attribute" in bad.stderr
    tight = subprocess.run(cmd[:-1] + ["--budget", "10MiB"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=120)
    assert tight.returncode == 1 and "does NOT fit" in tight.stdout
