"""What ``%vram_estimate`` and ``python -m vram_magic estimate`` accept as inputs (the same), what they say
when an option cannot be read, and how an estimate says what went wrong inside a model."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from IPython.core.error import UsageError
from torch import nn

import vram_magic
from vram_magic.estimator import EstimateError

TOY = textwrap.dedent("""
    import torch
    import torch.nn as nn

    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(100, 32)
            self.out = nn.Linear(32, 8)

        def forward(self, input_ids, attention_mask=None):
            return self.out(self.emb(input_ids))

    def build_model():
        return Tagger()

    def make_batch():
        return {"input_ids": torch.randint(0, 100, (4, 16)), "attention_mask": torch.ones(4, 16, dtype=torch.long)}
""")
ROW = 32 * 100 * 4 + (32 * 8 + 8) * 4  # embedding + linear, fp32


@pytest.fixture
def toy(tmp_path, monkeypatch):
    (tmp_path / "toy_inputs.py").write_text(TOY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    sys.modules.pop("toy_inputs", None)
    return tmp_path


def _magics(shell):
    return shell.magics_manager.registry["VramMagics"]


def test_unquoted_expression_suggests_quoting(shell):
    shell.run_cell("import torch, torch.nn as nn\nm = nn.Embedding(8000, 16)")
    with pytest.raises(UsageError, match="must be quoted") as err:
        _magics(shell).vram_estimate("m --input {'input': torch.randint(0, 8000, (8, 128))} --device cpu")
    assert "--input \"" in str(err.value)
    with pytest.raises(UsageError, match="quoted"):
        _magics(shell).vram_estimate("m --input 'torch.randint(0, 8000, (8, 128)) --device cpu")


def test_magic_and_command_line_accept_the_same_inputs(shell, toy):
    import json

    shell.run_cell("import torch")
    forms = {  # module:attribute for the model and the inputs, and an expression using torch
        "reference": ["toy_inputs:build_model", "--input", "toy_inputs:make_batch", "--device", "cpu"],
        "expression": ["toy_inputs:build_model", "--input", "{'input_ids': torch.randint(0, 100, (4, 16))}",
                       "--device", "cpu"],
    }
    for name, args in forms.items():
        line = " ".join(f'"{a}"' if " " in a else a for a in args)
        r = shell.run_cell(f"%vram_estimate {line} -o est -q")
        assert r.error_in_exec is None, name
        in_magic = shell.user_ns["est"]
        done = subprocess.run([sys.executable, "-m", "vram_magic", "estimate", *args, "--json"], cwd=toy,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        on_command_line = json.loads(done.stdout)
        assert in_magic.peak["parameters"] == on_command_line["peak"]["parameters"] == ROW
        assert in_magic.peak.total == on_command_line["peak_total"], name
        assert in_magic.loss == on_command_line["loss"] and in_magic.loss.startswith("stand-in output.sum()")


def test_command_line_parse_error_suggests_quoting(toy):
    split = ["torch.randint(0,", "100,", "(4, 16))"]  # what a shell passes for an unquoted expression
    done = subprocess.run([sys.executable, "-m", "vram_magic", "estimate", "toy_inputs:build_model", "--input", *split],
                          cwd=toy, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "must be quoted" in done.stderr


def test_batch_encoding_in_the_namespace(shell):
    if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 6):
        pytest.skip("transformers 5 needs PyTorch 2.6 or later")
    transformers = pytest.importorskip("transformers")
    shell.user_ns["transformers"] = transformers
    shell.run_cell(
        "import torch, torch.nn as nn\n"
        "model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100,"
        " n_positions=64))\n"
        "batch = transformers.BatchEncoding({'input_ids': torch.randint(0, 100, (2, 16)),"
        " 'attention_mask': torch.ones(2, 16, dtype=torch.long)})")
    r = shell.run_cell("%vram_estimate model --input batch --device cpu -o est -q")
    assert r.error_in_exec is None
    assert shell.user_ns["est"].loss.startswith("stand-in output.logits.sum()")
    r = shell.run_cell("%vram_estimate model --input batch --device cpu --loss 'lambda out: out.logits.mean()' "
                       "-o est -q")
    assert r.error_in_exec is None and shell.user_ns["est"].loss == "loss_fn (given)"


# --- errors inside the model ----------------------------------------------------------------------------------
def test_wrong_input_shape_blames_the_inputs_and_names_op_module_and_shapes():
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    with pytest.raises(EstimateError) as err:
        vram_magic.estimate(m, torch.randn(2, 12), device="cpu")
    text = str(err.value)
    assert "module '0'" in text and "aten." in text and "(2, 12) float32" in text and "forward pass" in text
    assert "inputs" in text and "(2, 12)" in text


def test_a_bug_inside_the_model_does_not_blame_the_inputs():
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(16, 32)
            self.b = nn.Linear(16, 4)  # should take 32

        def forward(self, x):
            return self.b(self.a(x))

    with pytest.raises(EstimateError) as err:
        vram_magic.estimate(Broken(), torch.randn(2, 16), device="cpu")
    text = str(err.value)
    assert "module 'b'" in text and "(2, 32) float32" in text
    assert "input" not in text.split(":", 1)[0] and "check their shapes" not in text


def test_inputs_that_do_not_fit_the_forward_signature():
    m = nn.Linear(4, 4)
    with pytest.raises(EstimateError, match="do not match the model's forward"):
        vram_magic.estimate(m, {"inputs": torch.randn(2, 4)}, device="cpu")


# --- a chain of pointwise ops -----------------------------------------------------------------------------------
class PointwiseLayer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return x + F.gelu(h) * torch.sigmoid(h) + torch.tanh(h) * 0.5 - h.pow(2) * 0.01


def test_pointwise_chain_matches_measure_and_the_profiler():
    """Each temporary of the chain is freed as soon as the next op has read it: the estimate holds no
    activation-sized tensor more than the real step (byte-exact against measure(), within 0.5 % of the
    profiler)."""
    from torch.profiler import ProfilerActivity, profile

    from tests.support.zoo import profiled_cpu_peak, train_steps

    def build():
        return nn.Sequential(*[PointwiseLayer(256) for _ in range(4)])

    torch.manual_seed(0)
    model, x = build(), torch.randn(1024, 256)
    est = vram_magic.estimate(model, x, device="cpu")

    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    with vram_magic.measure(namespace={"model": model, "x": x, "opt": opt}) as real:
        train_steps(model, x, 2, opt)
    assert est.peak.total == real.peak.total
    torch.manual_seed(0)
    model, x = build(), torch.randn(1024, 256)
    base = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), x])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        train_steps(model, x, 2, torch.optim.AdamW(model.parameters(), foreach=False))
    profiled = base + profiled_cpu_peak(prof)
    assert abs(est.peak.total - profiled) / profiled < 0.005, (est.peak.total, profiled)


def test_magic_help_prints_the_options(shell, capsys):
    r = shell.run_cell("%vram_estimate --help")
    assert r.error_in_exec is None
    out = capsys.readouterr().out
    assert "%vram_estimate [--input EXPR]" in out and "--master-weights" in out and "--loss" in out


def test_a_builder_that_raises_is_named_for_a_step_and_for_generate():
    """A builder's own exception is said plainly, the same for a training step and for generate()."""
    def broken() -> nn.Module:
        raise RuntimeError("no such checkpoint")

    ids = torch.zeros(1, 8, dtype=torch.long)
    for kwargs in ({}, {"generate": 4}):
        with pytest.raises(EstimateError, match="building the model raised RuntimeError: no such checkpoint"):
            vram_magic.estimate(broken, ids, device="cpu", **kwargs)
