"""Estimates of quantized models against real CPU runs of the same models: within 2 % of the measured peak.

The measured peak is ``vram_magic.measure(backend="allocator")``: PyTorch's profiler sees every allocation of the
CPU allocator, including what quantized kernels allocate inside one op (bitsandbytes dequantizes a 4-bit weight
inside ``gemm_4bit``, torch.ao's ``linear_dynamic`` accumulates in an int32 buffer of the output's shape); the scan
adds torch.ao's packed weights, which live outside PyTorch's allocator. Formats run here: torch.ao dynamic int8
and torchao int8 weight-only inference; bitsandbytes NF4 inference (after the first forward, which on a CPU with
AVX512-BF16 repacks the weights) and QLoRA training (PEFT's LoRA on bitsandbytes 4-bit layers, single and double
quantization), estimated both as the model is and from the float model with ``quantize=``/``lora=``; PEFT's LoRA
on a float model against ``lora=``. bitsandbytes' CUDA kernels are not run here (no GPU).
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from torch import nn

import vram_magic
from vram_magic.engine.scan.registry import LiveStorages
from vram_magic.measuring.measurement import Measurement

TARGET = 0.02


def measured(namespace: dict) -> Measurement:
    """A measurement that knows only what this test made: its own registry (pytest's log capture may keep an
    earlier test's tensors alive, which the process-wide registry would count as "other")."""
    return Measurement("cpu", namespace=namespace, registry=LiveStorages(), backend="allocator")


NEW_TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 6)
needs_transformers = pytest.mark.skipif(not NEW_TORCH, reason="transformers 5 and PEFT need PyTorch 2.6 or later")


def torchao_quantization():
    """torchao's quantization API, or a skip where it does not import (torchao 0.18 needs a recent PyTorch)."""
    try:
        import torchao.quantization as quantization
    except Exception as err:  # an older PyTorch: AttributeError on import, not ImportError
        pytest.skip(f"torchao does not import here: {type(err).__name__}: {err}")
    return quantization


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    gc.collect()


def mlp() -> nn.Sequential:
    torch.manual_seed(0)  # widths that change from layer to layer: buffers sized by the input or by the output differ
    return nn.Sequential(nn.Linear(1024, 2048), nn.GELU(), nn.Linear(2048, 1024), nn.ReLU(), nn.Linear(1024, 256))


def _inference(model: nn.Module, x: torch.Tensor) -> tuple[int, int, vram_magic.Estimate]:
    with measured({"model": model, "x": x}) as m, torch.no_grad():
        y = model(x)
        del y
    est = vram_magic.estimate(model, x, inference=True, device="cpu")
    assert est.peak.parameters == m.peak.parameters  # the quantized weights, byte for byte
    return m.peak.total, est.peak.total, est


def _close(measured: int, estimated: int) -> None:
    assert abs(estimated - measured) <= TARGET * measured, (estimated, measured, estimated / measured - 1)


@pytest.mark.parametrize("batch", [16, 200])
def test_torch_ao_dynamic_int8_inference(batch):
    model = torch.ao.quantization.quantize_dynamic(mlp(), {nn.Linear}, dtype=torch.qint8)
    measured, estimated, est = _inference(model, torch.randn(batch, 1024))
    _close(measured, estimated)
    assert "int8 packed per tensor, torch.ao" in " ".join(est.peak.details("parameters"))


def test_torchao_int8_weight_only_inference():
    # fp32: half-precision CPU GEMMs add oneDNN scratch whose size varies from run to run (docs/estimate.md)
    quantization = torchao_quantization()
    model = mlp()
    quantization.quantize_(model, quantization.Int8WeightOnlyConfig())
    measured, estimated, _ = _inference(model, torch.randn(32, 1024))
    _close(measured, estimated)


def test_bitsandbytes_nf4_inference():
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    model = nn.Sequential(*[bnb.nn.Linear4bit(1024, 1024, compute_dtype=torch.float32, quant_type="nf4")
                            for _ in range(3)]).to("cpu").eval()
    x = torch.randn(16, 1024)
    with torch.no_grad():
        model(x)  # the first forward may repack the weights for the CPU's kernel; the next ones run as measured
    measured, estimated, _ = _inference(model, x)
    _close(measured, estimated)


# --- training: LoRA and QLoRA on a small Llama ----------------------------------------------------------------
def _llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, vocab_size=1000,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _to_nf4(model: nn.Module, double: bool) -> nn.Module:
    """The linear layers but the head as bitsandbytes 4-bit layers, as transformers' 4-bit loading makes them."""
    bnb = pytest.importorskip("bitsandbytes")
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if isinstance(child, nn.Linear) and child is not model.lm_head:
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=torch.float32, quant_type="nf4", compress_statistics=double)
                q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4",
                                             compress_statistics=double)
                parent._modules[name] = q
    return model.to("cpu")


def _train_measured(model: nn.Module, batch: dict) -> int:
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, foreach=False)
    with measured({"model": model, "opt": opt, "batch": batch}) as m:
        for _ in range(2):
            out = model(**batch)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del out
    return m.peak.total


@needs_transformers
@pytest.mark.parametrize("double", [False, True], ids=["nf4", "nf4-dq"])
def test_qlora_training_as_it_is_and_from_the_float_model(double):
    peft = pytest.importorskip("peft")
    ids = torch.randint(0, 1000, (2, 64))
    batch = {"input_ids": ids, "labels": ids}
    model = peft.get_peft_model(_to_nf4(_llama(), double), peft.LoraConfig(r=8, target_modules="all-linear"))
    measured = _train_measured(model, batch)
    as_it_is = vram_magic.estimate(model, batch, device="cpu")
    _close(measured, as_it_is.peak.total)
    fmt = "nf4-dq" if double else "nf4"
    scratch = vram_magic.estimate(_llama(), batch, device="cpu", quantize=fmt, lora=8)
    _close(measured, scratch.peak.total)
    assert scratch.peak.parameters == as_it_is.peak.parameters  # the same layout, worked out from scratch


@needs_transformers
def test_lora_training_against_peft():
    peft = pytest.importorskip("peft")
    ids = torch.randint(0, 1000, (2, 64))
    batch = {"input_ids": ids, "labels": ids}
    model = peft.get_peft_model(_llama(), peft.LoraConfig(r=8, target_modules="all-linear"))
    measured = _train_measured(model, batch)
    est = vram_magic.estimate(_llama(), batch, device="cpu", lora=8)
    _close(measured, est.peak.total)
    assert est.peak.details("parameters")["parameters (LoRA adapters)"] == 4 * 2 * 8 * (
        4 * (256 + 256) + 3 * (256 + 512))  # fp32 adapters on 7 projections × 2 layers
