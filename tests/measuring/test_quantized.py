"""``%%vram`` / ``measure()`` on quantized models: every byte of a quantized weight is a parameter, named by its
format, worked out here by hand from the format's layout; frozen parameters are parameters too, and the report
says how many bytes train.

Layouts (docs/quantization.md): torch.ao's dynamic int8 ``Linear`` packs with fbgemm — one byte per weight, an
int32 column offset per output channel, an fp32 scale and an int32 zero point per tensor (per channel with a
per-channel qconfig); the fp32 bias is a tensor of its own. torchao's ``Int8Tensor``: int8 data, an fp32 scale and
an int8 zero point per row. bitsandbytes' NF4: half a byte per weight, an fp32 absmax per 64 weights and a
16-entry fp32 code book; with double quantization the absmax are 8-bit codes with an fp32 absmax per 256 of them,
an fp32 offset and a 256-entry fp32 code book. bitsandbytes' int8: one byte per weight and an fp32 scale per row.
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from torch import nn

import vram_magic
from tests.support import run

N, K = 1024, 1024  # Linear(1024, 1024): out, in
W = N * K


def _quiet(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn()


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(K, N), nn.ReLU(), nn.Linear(K, N))


def _measure(model: nn.Module, x: torch.Tensor, backend: str = "tracker") -> vram_magic.Measurement:
    with vram_magic.measure(namespace={"model": model, "x": x}, backend=backend) as m, torch.no_grad():
        y = model(x)
        del y
    return m


@pytest.fixture(autouse=True)
def _collect():
    yield
    gc.collect()


# --- torch.ao ----------------------------------------------------------------------------------------------
def test_torch_ao_dynamic_int8_packed_weights_are_parameters():
    model = _quiet(lambda: torch.ao.quantization.quantize_dynamic(mlp(), {nn.Linear}, dtype=torch.qint8))
    m = _measure(model, torch.randn(16, K))
    packed = W + 4 * N + 4 + 4  # int8 weights, int32 column offsets, one fp32 scale and one int32 zero point
    bias = 4 * N
    assert m.before.parameters == 2 * (packed + bias) == m.after.parameters
    details = m.after.details("parameters")
    assert details["model (frozen, int8 packed per tensor, torch.ao)"] == 2 * packed
    assert details["model (frozen)"] == 2 * bias  # the bias kept inside the packed object
    assert m.after.trainable == 0
    assert any("0 B trainable" in n and "int8 packed per tensor, torch.ao" in n for n in m.notes)


def test_torch_ao_per_channel_and_fp16_layouts():
    per_channel = _quiet(lambda: torch.ao.quantization.quantize_dynamic(
        mlp(), {nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig}))
    m = _measure(per_channel, torch.randn(4, K))
    assert m.after.details("parameters")["model (frozen, int8 packed per channel, torch.ao)"] == \
        2 * (W + 4 * N + 8 * N)  # a scale and a zero point per output channel
    fp16 = _quiet(lambda: torch.ao.quantization.quantize_dynamic(mlp(), {nn.Linear}, dtype=torch.float16))
    m = _measure(fp16, torch.randn(4, K))
    assert m.after.details("parameters")["model (frozen, fp16 packed, torch.ao)"] == 2 * 2 * W


def test_packed_weights_freed_in_a_cell_leave_the_parameters(shell):
    run(shell, "import torch, torch.nn as nn, warnings\nwarnings.simplefilter('ignore')\n"
               "q = torch.ao.quantization.quantize_dynamic(nn.Sequential(nn.Linear(1024, 1024)), {nn.Linear})")
    r = run(shell, "%%vram -o rep -q\ndel q")
    assert r.error_in_exec is None
    rep = shell.user_ns["rep"]
    assert rep.before.parameters == W + 4 * N + 8 + 4 * N
    assert rep.after.parameters == 0 and rep.delta.parameters == -(W + 4 * N + 8 + 4 * N)


def test_quantized_in_the_cell_counts_at_the_end(shell):
    run(shell, "import torch, torch.nn as nn, warnings\nwarnings.simplefilter('ignore')\n"
               "m = nn.Sequential(nn.Linear(1024, 1024))")
    r = run(shell, "%%vram -o rep -q\nq = torch.ao.quantization.quantize_dynamic(m, {nn.Linear})")
    assert r.error_in_exec is None
    rep = shell.user_ns["rep"]
    # the float model (4 MiB + 4 KiB) was there before; the packed copy is new
    assert rep.after.details("parameters")["q (frozen, int8 packed per tensor, torch.ao)"] == W + 4 * N + 8
    assert rep.after.parameters - rep.before.parameters == W + 4 * N + 8 + 4 * N
    assert rep.peak.total >= rep.after.total


def test_static_quantized_conv_counted_from_its_layout():
    from torch.ao.quantization import DeQuantStub, QuantStub

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant, self.conv, self.dequant = QuantStub(), nn.Conv2d(16, 32, 3), DeQuantStub()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.dequant(self.conv(self.quant(x)))

    def make() -> nn.Module:
        net = Net().eval()
        net.qconfig = torch.ao.quantization.get_default_qconfig("x86")
        prepared = torch.ao.quantization.prepare(net)
        prepared(torch.randn(2, 16, 8, 8))
        return torch.ao.quantization.convert(prepared)

    model = _quiet(make)
    m = _measure(model, torch.randn(2, 16, 8, 8))
    weights = 32 * 16 * 3 * 3
    # x86's default qconfig quantizes per output channel: a scale and a zero point per channel
    assert m.after.details("parameters")["model (frozen, int8 packed per channel, torch.ao)"] == \
        weights + 4 * 32 + 8 * 32


# --- torchao -------------------------------------------------------------------------------------------------
def test_torchao_int8_weight_only():
    try:
        import torchao.quantization as quantization
    except Exception as err:  # torchao 0.18 on an older PyTorch: AttributeError on import, not ImportError
        pytest.skip(f"torchao does not import here: {type(err).__name__}: {err}")
    model = mlp()
    _quiet(lambda: quantization.quantize_(model, quantization.Int8WeightOnlyConfig()))
    m = _measure(model, torch.randn(16, K))
    details = m.after.details("parameters")
    assert details["model (frozen, int8, torchao Int8Tensor)"] == 2 * (W + 4 * N + N)  # data, fp32 scale, int8 zp
    assert details["model"] == 2 * 4 * N  # the biases still train
    assert m.after.trainable == 2 * 4 * N


# --- bitsandbytes -------------------------------------------------------------------------------------------
def _bnb():
    return pytest.importorskip("bitsandbytes")


def _nf4_model(double: bool) -> nn.Module:
    bnb = _bnb()
    torch.manual_seed(0)
    layers = [bnb.nn.Linear4bit(K, N, compute_dtype=torch.float32, quant_type="nf4", compress_statistics=double)
              for _ in range(2)]
    return _quiet(lambda: nn.Sequential(layers[0], nn.ReLU(), layers[1]).to("cpu"))


def test_bitsandbytes_nf4_single_quantization():
    m = _measure(_nf4_model(False), torch.randn(4, K))
    blocks = W // 64
    details = m.after.details("parameters")
    assert details["model (frozen, nf4, bitsandbytes)"] == 2 * W // 2
    assert details["model (frozen, nf4 constants, bitsandbytes)"] == 2 * (4 * blocks + 16 * 4)  # absmax, code book
    assert details["model"] == 2 * 4 * N and m.after.trainable == 2 * 4 * N  # bitsandbytes' biases train


def test_bitsandbytes_nf4_double_quantization():
    m = _measure(_nf4_model(True), torch.randn(4, K))
    blocks = W // 64
    constants = blocks + 4 * (blocks // 256) + 4 + 16 * 4 + 256 * 4  # 8-bit absmax, their absmax, offset, 2 books
    assert m.after.details("parameters")["model (frozen, nf4 constants, bitsandbytes)"] == 2 * constants


def test_bitsandbytes_int8():
    bnb = _bnb()
    layer = _quiet(lambda: bnb.nn.Linear8bitLt(K, N, has_fp16_weights=False).to("cpu"))
    with vram_magic.measure(namespace={"model": layer}) as m:
        pass
    details = m.after.details("parameters")
    assert details["model (frozen, int8, bitsandbytes)"] == W
    assert details["model (frozen, int8 constants, bitsandbytes)"] == 4 * N  # SCB: an fp32 scale per row


# --- frozen parameters -----------------------------------------------------------------------------------------
def test_frozen_parameters_are_parameters_and_the_trainable_bytes_are_reported():
    model = mlp()
    model[0].requires_grad_(False)
    m = _measure(model, torch.randn(4, K))
    layer = 4 * (W + N)
    assert m.after.parameters == 2 * layer
    assert m.after.details("parameters") == {"model (frozen)": layer, "model": layer}
    assert m.after.trainable == layer
    assert any(n.startswith("parameters: 4.00 MiB trainable, 4.00 MiB frozen") for n in m.notes)


def test_a_fully_trainable_model_keeps_its_plain_labels_and_no_note():
    m = _measure(mlp(), torch.randn(4, K))
    assert m.after.details("parameters") == {"model": 2 * 4 * (W + N)}
    assert m.after.trainable == m.after.parameters
    assert not any(n.startswith("parameters:") for n in m.notes)
