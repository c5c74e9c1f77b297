"""Autocast and SDPA on a GPU, modelled on fake CPU tensors: ``scaled_dot_product_attention`` is on autocast's
lower-precision list for CUDA (``KERNEL_CUDA(scaled_dot_product_attention, lower_precision_fp)`` in
``aten/src/ATen/autocast_mode.cpp``; the CPU's list has it too), so its floating-point arguments are cast to the
autocast dtype before the kernel is chosen. A transformers Llama with fp32 weights under bf16 autocast computes its
rotary embedding in fp32 (``q * cos`` with fp32 ``cos``), and only that cast lets a fused kernel take it."""

from __future__ import annotations

import torch
from torch.nn import functional as F

import vram_magic
from vram_magic.estimator.device.sdpa import CudaAttention, CudaKernelMode
from vram_magic.estimator.torch_private import FakeTensorMode

A100 = (8, 0)


def _sdpa(autocast: bool) -> tuple[CudaAttention, torch.Tensor]:
    model = CudaAttention(A100)
    with FakeTensorMode():
        q = torch.empty(2, 8, 256, 64, requires_grad=True)  # fp32, as the rotary embedding leaves them
        k = torch.empty(2, 2, 256, 64, requires_grad=True)
        v = torch.empty(2, 2, 256, 64, dtype=torch.bfloat16, requires_grad=True)  # v_proj's output: bf16
        with CudaKernelMode(model), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return model, out


def test_autocast_casts_the_inputs_before_the_kernel_is_chosen():
    model, out = _sdpa(autocast=True)
    assert model.kernels == {"flash": 1} and out.dtype == torch.bfloat16  # flash takes GQA in half precision
    model, out = _sdpa(autocast=False)
    assert model.kernels == {"math": 1}  # fp32 with GQA: no fused kernel on an A100


def test_llama_under_bf16_autocast_runs_flash_attention_on_an_a100():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    ids = torch.randint(0, 1000, (2, 512))
    amp = vram_magic.estimate(lambda: LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}, amp="bf16",
                              gpu="A100-80GB")
    pure = vram_magic.estimate(lambda: LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}, dtype="bf16",
                               gpu="A100-80GB")
    assert any("flash × 2" in n for n in amp.notes), amp.notes
    # no 2 × 8 × 512 × 512 scores per layer: the activations are those of the pure bf16 step and the fp32 copies
    # autocast keeps (below the math kernel's by far)
    assert amp.peak["activations"] < 2 * pure.peak["activations"]
