"""``estimate(..., quantize=..., lora=...)`` and ``%vram_estimate --quantize/--lora``: each format's bytes worked
out by hand from its layout, LoRA's adapters, gradients and AdamW state by hand, the what-if rows, the options'
errors, and the classic figures of a 7B Llama-shaped QLoRA fine-tune (batch 1, sequence 512, rank 16).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import vram_magic
from vram_magic.estimator.fake.quantize import FORMATS

OUT, IN = 4096, 1024  # Linear(1024, 4096)
W = OUT * IN


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 512))


# --- layouts ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt, data, constants", [
    ("int8", W, 4 * OUT),  # a byte per weight, an fp32 scale per row
    ("int4", W // 2, (IN // 128) * OUT * 2 * 2),  # 4 bits, a bf16 scale and zero point per group of 128
    ("nf4", W // 2, 4 * (W // 64) + 16 * 4),  # 4 bits, an fp32 absmax per 64, the code book
    ("nf4-dq", W // 2, (W // 64) + 4 * (W // 64 // 256) + 4 + 16 * 4 + 256 * 4),  # 8-bit absmax, their absmax, ...
])
def test_format_layouts_by_hand(fmt, data, constants):
    assert FORMATS[fmt].layer_bytes(OUT, IN) == data + constants
    est = vram_magic.estimate(nn.Linear(IN, OUT), torch.randn(2, IN), inference=True, device="cpu", quantize=fmt)
    details = est.peak.details("parameters")
    assert details[f"parameters (frozen, {fmt})"] == data
    assert details[f"parameters (frozen, {fmt} constants)"] == constants
    assert details["parameters (frozen)"] == 4 * OUT  # the bias, kept in the model's dtype
    assert est.parameters == W + OUT  # weights counted as weights, not as packed bytes
    assert f"{fmt} weights" in est.description and any(n.startswith("quantized: 1 linear layers") for n in est.notes)


def test_the_head_and_embeddings_stay_as_they_are():
    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(1000, 256)
            self.body = nn.Linear(256, 256)
            self.head = nn.Linear(256, 1000)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(self.embed(ids)))

    est = vram_magic.estimate(LM(), torch.randint(0, 1000, (2, 16)), inference=True, device="cpu", quantize="nf4")
    details = est.peak.details("parameters")
    assert details["parameters (frozen, nf4)"] == 256 * 256 // 2
    assert details["parameters"] == 4 * (1000 * 256 + 256 * 1000 + 1000)  # embedding and head untouched
    assert "the output head and embeddings" in " ".join(est.notes)


# --- LoRA ----------------------------------------------------------------------------------------------------
def test_lora_adapters_gradients_and_adamw_state_by_hand():
    r = 8
    adapters = 4 * r * ((1024 + 1024) + (1024 + 512))  # fp32 A (r × in) and B (out × r) on both layers
    base = 4 * (1024 * 1024 + 1024 + 512 * 1024 + 512)
    est = vram_magic.estimate(mlp(), torch.randn(8, 1024), device="cpu", lora=r)
    details = est.peak.details("parameters")
    assert details["parameters (LoRA adapters)"] == adapters
    assert details["parameters (frozen)"] == base
    steps = 4 * 4  # AdamW's fp32 step counter per adapter tensor (on the CPU)
    assert est.model_states == base + adapters + adapters + 2 * adapters + steps
    assert "LoRA r=8" in est.description


def test_qlora_is_nf4_weights_with_fp32_adapters_by_hand():
    r = 8
    nf4 = FORMATS["nf4"].layer_bytes(1024, 1024) + FORMATS["nf4"].layer_bytes(512, 1024)
    biases = 4 * (1024 + 512)
    adapters = 4 * r * ((1024 + 1024) + (1024 + 512))  # PEFT puts fp32 adapters on a quantized base
    est = vram_magic.estimate(mlp(), torch.randn(8, 1024), device="cpu", quantize="nf4", lora=r)
    assert est.peak["parameters"] == nf4 + biases + adapters
    assert est.model_states == nf4 + biases + adapters + adapters + 2 * adapters + 4 * 4
    dense = vram_magic.estimate(mlp(), torch.randn(8, 1024), device="cpu")
    assert est.model_states < dense.model_states / 5


def test_lora_with_bf16_weights_makes_bf16_adapters():
    est = vram_magic.estimate(mlp(), torch.randn(8, 1024), device="cpu", dtype="bf16", lora=4)
    assert est.peak.details("parameters")["parameters (LoRA adapters)"] == 2 * 4 * ((1024 + 1024) + (1024 + 512))


# --- what-if rows and options -----------------------------------------------------------------------------------
def test_what_if_rows_for_training_and_inference():
    est = vram_magic.estimate(mlp(), torch.randn(8, 1024), device="cpu", what_if=True)
    rows = {s.name: s for s in est.strategies}
    assert {"LoRA r=16", "QLoRA: nf4 + LoRA r=16"} <= set(rows)
    assert rows["QLoRA: nf4 + LoRA r=16"].needed < rows["LoRA r=16"].needed < est.needed
    assert not [s for s in est.strategies if s.note.startswith("could not run")]
    inference = vram_magic.estimate(mlp(), torch.randn(8, 1024), device="cpu", inference=True, what_if=True)
    rows = {s.name: s for s in inference.strategies}
    assert rows["nf4 weights"].needed < rows["int8 weights"].needed < inference.needed
    qlora = vram_magic.estimate(mlp(), torch.randn(8, 1024), device="cpu", quantize="nf4", lora=8, what_if=True)
    names = [s.name for s in qlora.strategies]
    assert "nf4 with double quantization" in names and "LoRA r=16" not in names


def test_rows_that_do_not_apply_are_left_out():
    conv = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU())
    est = vram_magic.estimate(conv, torch.randn(2, 3, 16, 16), device="cpu", what_if=True)
    assert not [s for s in est.strategies if "LoRA" in s.name or "nf4" in s.name]
    with pytest.raises(ValueError, match="no linear layers"):
        vram_magic.estimate(conv, torch.randn(2, 3, 16, 16), device="cpu", lora=8)


@pytest.mark.parametrize("kwargs, match", [
    ({"quantize": "int3"}, "int8, int4, nf4, nf4-dq"),
    ({"lora": 0}, "rank"),
    ({"lora": "sixteen"}, "rank"),
])
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        vram_magic.estimate(mlp(), torch.randn(8, 1024), device="cpu", **kwargs)


def test_magic_options(shell):
    shell.run_cell("import torch, torch.nn as nn\nm = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 64))")
    r = shell.run_cell("%vram_estimate m --input 'torch.randn(8, 1024)' --device cpu --quantize nf4 --lora 8 -o est -q")
    assert r.error_in_exec is None
    est = shell.user_ns["est"]
    assert (est.options.quantize, est.options.lora) == ("nf4", 8)
    r = shell.run_cell("%vram_estimate m --input 'torch.randn(8, 1024)' --quantize int3")
    assert "int8, int4, nf4, nf4-dq" in str(r.error_in_exec)


def test_command_line_options(capsys):
    from vram_magic.estimator.cli.estimate_cmd import main, parser

    args = parser().parse_args(["m", "--quantize", "nf4", "--lora", "16"])
    assert (args.quantize, args.lora) == ("nf4", 16)
    assert main(["torch.nn:Identity", "--input", "torch.randn(4, 4)", "--quantize", "int3"]) == 2
    assert "int8, int4, nf4, nf4-dq" in capsys.readouterr().err


# --- models already quantized ------------------------------------------------------------------------------------
def test_static_quantization_stops_naming_the_module_and_op_and_what_to_do():
    from torch.ao.quantization import DeQuantStub, QuantStub

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant, self.fc, self.dequant = QuantStub(), nn.Linear(64, 64), DeQuantStub()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.dequant(self.fc(self.quant(x)))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net = Net().eval()
        net.qconfig = torch.ao.quantization.get_default_qconfig("x86")
        prepared = torch.ao.quantization.prepare(net)
        prepared(torch.randn(4, 64))
        model = torch.ao.quantization.convert(prepared)
    with pytest.raises(ValueError) as err:
        vram_magic.estimate(model, torch.randn(4, 64), inference=True, device="cpu")
    text = str(err.value)
    assert "module 'fc'" in text and "quantized::linear" in text and "quantize='int8'" in text
    assert "input" not in text.split("(")[0]  # the inputs are not blamed


def test_a_dynamically_quantized_lstm_stops_naming_its_op():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm, self.fc = nn.LSTM(32, 32), nn.Linear(32, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.lstm(x)[0])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torch.ao.quantization.quantize_dynamic(Net(), {nn.LSTM, nn.Linear})
    with pytest.raises(ValueError, match=r"module 'lstm' .* runs quantized::quantized_lstm on packed weights"):
        vram_magic.estimate(model, torch.randn(5, 2, 32), inference=True, device="cpu")


def test_dynamic_quantization_estimates_as_it_is():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torch.ao.quantization.quantize_dynamic(mlp(), {nn.Linear})
    est = vram_magic.estimate(model, torch.randn(4, 1024), inference=True, device="cpu")
    packed = (1024 * 1024 + 4 * 1024 + 8) + (512 * 1024 + 4 * 512 + 8)
    assert est.peak.details("parameters")["parameters (frozen, int8 packed per tensor, torch.ao)"] == packed
    assert est.parameters == 1024 * 1024 + 512 * 1024 + 1024 + 512


# --- the classic figures: a 7B Llama-shaped QLoRA fine-tune ---------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(nn.Module):
    def __init__(self, width: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(width), RMSNorm(width)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(width, hidden, bias=False), nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(b, t, self.heads, c // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """Llama-shaped (rotary embeddings left out), with an untied head and the model's own loss."""

    def __init__(self, vocab: int = 32000, width: int = 4096, layers: int = 32, heads: int = 32,
                 hidden: int = 11008) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return {"loss": F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())}


def test_7b_qlora_rank_16_batch_1_sequence_512_the_classic_figures():
    linear = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    assert linear == 6_476_005_376  # "6.48 B" linear weights
    nf4 = linear // 2 + 4 * (linear // 64) + 224 * 16 * 4  # 0.5 B per weight + an fp32 absmax per 64 + code books
    assert 3.4e9 <= nf4 <= 3.7e9  # single quantization: 3.64 GB
    nf4_dq = sum(FORMATS["nf4-dq"].layer_bytes(o, i) for o, i in [(4096, 4096)] * 4 * 32 + [(11008, 4096)] * 64
                 + [(4096, 11008)] * 32)
    assert 3.33e9 <= nf4_dq <= 3.35e9  # double quantization: 3.34 GB
    embeddings_and_head = 2 * 32000 * 4096 * 2
    assert embeddings_and_head == 524_288_000  # "≈ 0.5 GB more" in bf16
    norms = (2 * 32 + 1) * 4096 * 2
    adapters = 32 * 16 * (4 * (4096 + 4096) + 3 * (4096 + 11008)) * 4  # rank 16 on all 7 projections, fp32

    batch = (torch.zeros(1, 512, dtype=torch.long), torch.zeros(1, 512, dtype=torch.long))
    est = vram_magic.estimate(Llama, batch, dtype="bf16", quantize="nf4", lora=16, gpu="T4")
    params = nf4 + embeddings_and_head + norms + adapters
    assert est.model_states == params + adapters + 2 * adapters  # weights, adapter gradients, AdamW's two moments
    assert est.fits and est.needed < 15 * 2**30
    assert est.parameters == 6_738_415_616 + adapters // 4  # the base's 6.74 B and the adapters' 40 M

    bf16 = vram_magic.estimate(Llama, batch, dtype="bf16", inference=True, gpu="T4")
    assert bf16.model_states == 2 * 6_738_415_616  # 13.5 GB of weights in bf16
    assert bf16.model_states > 3 * (nf4 + embeddings_and_head)
