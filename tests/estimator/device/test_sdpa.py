"""SDPA, dropout and RMSNorm as a GPU runs them, modelled on fake CPU tensors (vram_magic/estimator/device/sdpa.py).

The kernel choice follows ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` (the installed release's rules,
and those of the releases that differ); the shapes of what each kernel returns and what autograd saves are PyTorch's
own meta functions (``torch/_meta_registrations.py``); the backward kernels' own buffers are ``mha_bwd`` in
``flash_attn/flash_api.cpp`` and ``_efficient_attention_backward`` in ``attention_backward.cu``."""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import vram_magic
from vram_magic.estimator.device.sdpa import CudaAttention, CudaKernelMode, rules_for, sdpa_kernel
from vram_magic.estimator.fake.request import Request
from vram_magic.estimator.options import make_options
from vram_magic.estimator.step.trace import trace_step
from vram_magic.estimator.torch_private import FakeTensorMode

A100, T4, H100, RTX4090 = (8, 0), (7, 5), (9, 0), (8, 9)


def _qkv(dtype=torch.float32, b=2, h=4, lq=128, lk=None, d=64, kv_heads=None, grad=False):
    lk = lq if lk is None else lk
    q = torch.empty(b, h, lq, d, dtype=dtype, requires_grad=grad)
    k = torch.empty(b, kv_heads or h, lk, d, dtype=dtype, requires_grad=grad)
    v = torch.empty(b, kv_heads or h, lk, d, dtype=dtype, requires_grad=grad)
    return q, k, v


# --- the kernel choice, release by release -----------------------------------------------------------------
def test_kernel_choice_of_the_installed_release():
    r = rules_for("2.13.0")
    assert sdpa_kernel(*_qkv(torch.float32), None, False, A100, rules=r) == "efficient"  # flash: half only
    assert sdpa_kernel(*_qkv(torch.bfloat16), None, False, A100, dropout=0.1, rules=r) == "flash"  # dropout taken
    assert sdpa_kernel(*_qkv(torch.float32), None, False, A100, dropout=0.1, rules=r) == "efficient"
    mask = torch.ones(128, 128, dtype=torch.bool)
    assert sdpa_kernel(*_qkv(torch.bfloat16), mask, False, A100, rules=r) == "efficient"  # flash takes no mask
    # flash refuses is_causal with unequal query and key lengths (its causal mask is bottom-right aligned)
    assert sdpa_kernel(*_qkv(torch.float16, lq=1, lk=128), None, False, A100, causal=True, rules=r) == "efficient"
    assert sdpa_kernel(*_qkv(torch.float16, lq=1, lk=128), None, False, A100, rules=r) == "flash"
    # sm86/89: no flash backward for head dims in (192, 224]
    q, k, v = _qkv(torch.float16, d=200)
    assert sdpa_kernel(q, k, v, None, False, RTX4090, grad=True, rules=r) == "efficient"
    assert sdpa_kernel(q, k, v, None, False, RTX4090, grad=False, rules=r) == "flash"
    # T4: no flash before 8.0, no bf16 in memory-efficient attention, which refuses GQA up to 2.15
    assert sdpa_kernel(*_qkv(torch.float16), None, False, T4, rules=r) == "efficient"
    assert sdpa_kernel(*_qkv(torch.bfloat16), None, False, T4, rules=r) == "math"
    assert sdpa_kernel(*_qkv(torch.float16, kv_heads=2), None, True, T4, rules=r) == "math"
    assert sdpa_kernel(*_qkv(torch.float16, kv_heads=2), None, True, A100, rules=r) == "flash"
    # head dims: memory-efficient needs multiples of 8 in half precision on sm80 (4 in fp32), 1 for fp32 before 7.0
    assert sdpa_kernel(*_qkv(torch.float16, d=36), None, False, T4, rules=r) == "math"
    assert sdpa_kernel(*_qkv(torch.float32, d=36), None, False, A100, rules=r) == "efficient"
    assert sdpa_kernel(*_qkv(torch.float32, d=37), None, False, (6, 0), rules=r) == "efficient"
    assert sdpa_kernel(*_qkv(torch.float32, d=37), None, False, A100, rules=r) == "math"
    # sm90 on 2.11-2.15 (cuDNN > 9.15.0 in their wheels): cuDNN attention first, masks and GQA included
    assert sdpa_kernel(*_qkv(torch.bfloat16), None, False, H100, rules=r) == "cudnn"
    assert sdpa_kernel(*_qkv(torch.bfloat16), mask, False, H100, rules=r) == "cudnn"
    assert sdpa_kernel(*_qkv(torch.bfloat16, kv_heads=2), mask, True, H100, rules=r) == "cudnn"
    assert sdpa_kernel(*_qkv(torch.bfloat16, kv_heads=2), mask, True, A100, rules=r) == "math"  # neither fused one
    assert sdpa_kernel(*_qkv(torch.bfloat16, d=160), None, False, H100, rules=r) == "cudnn"  # 256 on sm90
    assert sdpa_kernel(*_qkv(torch.bfloat16, d=160), None, False, (10, 0), rules=r) == "flash"  # 128 elsewhere
    assert sdpa_kernel(*_qkv(torch.float32), None, False, H100, rules=r) == "efficient"  # cuDNN: half only


def test_kernel_choice_differs_by_release():
    old, mid, new = rules_for("2.5.1"), rules_for("2.9.1"), rules_for("2.16.0")
    assert sdpa_kernel(*_qkv(torch.bfloat16), None, False, H100, rules=old) == "flash"  # cuDNN after math in 2.5
    assert sdpa_kernel(*_qkv(torch.bfloat16), None, False, H100, rules=mid) == "cudnn"
    assert sdpa_kernel(*_qkv(torch.bfloat16), None, False, (10, 3), rules=mid) == "flash"  # sm103 from 2.11
    assert sdpa_kernel(*_qkv(torch.bfloat16), None, False, (12, 0), rules=old) == "math"  # fused up to sm90 in 2.5
    # after 2.15 (main): memory-efficient attention takes GQA; cuDNN wants a dropout in sixteenths
    assert sdpa_kernel(*_qkv(torch.float16, kv_heads=2), None, True, T4, rules=new) == "efficient"
    assert sdpa_kernel(*_qkv(torch.bfloat16), None, False, H100, dropout=0.1, rules=new) == "flash"
    assert sdpa_kernel(*_qkv(torch.bfloat16), None, False, H100, dropout=0.125, rules=new) == "cudnn"


# --- what each kernel returns, saves and allocates in its backward -------------------------------------------
def _saved(fn, *tensors):
    """(shape, dtype) of every tensor autograd saves while ``fn`` runs (fake tensors)."""
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*tensors)
    return out, saved


def test_memory_efficient_attention_saves_no_scores_or_mask_with_dropout():
    with FakeTensorMode():
        q, k, v = _qkv(torch.float32, b=2, h=4, lq=100, d=64, grad=True)
        model = CudaAttention(A100)
        out, saved = _saved(lambda a, b, c: model(a, b, c, None, 0.1, True), q, k, v)
        cpu_out, cpu_saved = _saved(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, None, 0.1, True), q, k, v)
    assert model.kernels == {"efficient": 1} and tuple(out.shape) == (2, 4, 100, 64)
    shapes = {s for s, _ in saved}
    assert (2, 4, 128) in shapes  # the log-sum-exp, queries padded to a multiple of 32, fp32
    assert not any(len(s) == 4 and s[-1] == s[-2] == 100 for s in shapes)  # no L x L scores, no dropout mask
    assert any(len(s) == 4 and s[-2:] == (100, 100) for s, _ in cpu_saved)  # the CPU's math kernel keeps them


def test_flash_backward_allocates_its_accumulators():
    """``mha_bwd``: ``softmax_d`` fp32 (B, H, L rounded to 128) and the fp32 ``dq`` accumulator (B, L rounded to
    128, H, head dim rounded to 32), freed when the op returns; the grads are the meta function's."""
    model = CudaAttention(A100)
    op = torch.ops.aten._scaled_dot_product_flash_attention_backward.default
    q = torch.empty(8, 12, 1000, 80, dtype=torch.bfloat16)
    k = torch.empty(8, 4, 1000, 80, dtype=torch.bfloat16)
    scratch = model.backward_scratch(op, (q, q, k))
    assert scratch == [((8, 12, 1024), torch.float32), ((8, 1024, 12, 96), torch.float32),
                       ((8, 1000, 12, 80), torch.bfloat16), ((8, 1000, 12, 80), torch.bfloat16)]  # GQA: dk, dv expanded
    op = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default
    q32 = torch.empty(2, 4, 100, 64)
    assert model.backward_scratch(op, (q32, q32, q32)) == [((2, 4, 100), torch.float32), ((2, 4, 100, 64),
                                                                                           torch.float32)]


def test_a_training_trace_holds_the_backward_scratch():
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(64, 192)

        def forward(self, x):
            q, k, v = self.qkv(x).view(3, 200, 3, 4, 16).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)

    opts = make_options(dtype=torch.bfloat16, steps=1, optimizer="sgd")
    model = Attn()  # a request holds its module weakly
    trace = trace_step(Request(model, torch.randn(3, 200, 64)), opts, (A100, True))
    dq_accum, softmax_d = 3 * 256 * 4 * 32 * 4, 3 * 4 * 256 * 4  # fp32; 200 queries rounded to 256, head dim to 32
    assert {dq_accum, softmax_d} <= set(trace.sizes.values())
    assert any("flash × 1" in n for n in trace.notes)
    cpu = trace_step(Request(model, torch.randn(3, 200, 64)), opts)
    assert dq_accum not in set(cpu.sizes.values()) and not any("SDPA" in n for n in cpu.notes)


def test_dropout_and_rms_norm_keep_what_cuda_keeps():
    with FakeTensorMode():
        x = torch.empty(8, 32, 64, dtype=torch.bfloat16, requires_grad=True)
        w = torch.empty(64, dtype=torch.bfloat16, requires_grad=True)
        model = CudaAttention(A100)
        with CudaKernelMode(model):
            _, kept = _saved(lambda t: F.dropout(t, 0.1, True), x)
            _, normed = _saved(lambda t: F.rms_norm(t, (64,), w, 1e-6), x)
            _, inplace = _saved(lambda t: F.dropout(t.clone(), 0.1, True, inplace=True), x)
        _, cpu_kept = _saved(lambda t: F.dropout(t, 0.1, True), x)
        _, cpu_normed = _saved(lambda t: F.rms_norm(t, (64,), w, 1e-6), x)
    assert kept == [((8, 32, 64), torch.bool)]  # native_dropout's mask
    assert cpu_kept == [((8, 32, 64), torch.bfloat16)]  # the CPU's noise tensor
    assert inplace == cpu_kept  # in place, CUDA multiplies by noise too (dropout_ is never fused)
    assert sorted(normed, key=str) == sorted([((8, 32, 64), torch.bfloat16), ((8, 32, 1), torch.float32),
                                              ((64,), torch.bfloat16)], key=str)
    fp32_bytes = sum(math.prod(s) * 4 for s, d in cpu_normed if d == torch.float32 and len(s) == 3 and s[-1] == 64)
    assert fp32_bytes >= 8 * 32 * 64 * 4  # the composite keeps fp32 copies of the rows
    assert model.others == {"dropout": 1, "rms_norm": 1}


# --- whole estimates: the CPU's kernels are no longer carried into a CUDA estimate -----------------------------
def _pytorch_transformer():
    """PyTorch's own test Transformer (torch/testing/_internal/distributed/_tensor/common_dtensor.py), its classes
    taken from the installed file: importing the module needs PyTorch's test dependencies."""
    path = Path(torch.__file__).parent / "testing/_internal/distributed/_tensor/common_dtensor.py"
    names = {"ModelArgs", "Attention", "FeedForward", "Experts", "ExpertLayer", "TransformerBlock", "Transformer"}
    body = [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name in names]
    ns = {"torch": torch, "nn": nn, "F": F, "dataclass": dataclass, "DTensor": type("DTensor", (), {}),
          "DeviceMesh": object}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), ns)
    return ns["ModelArgs"], ns["Transformer"]


def test_pytorch_sac_ilp_transformer_within_5_percent_of_its_memtracker_figure():
    """test/distributed/_tools/test_sac_ilp.py: 4 layers, 12 heads, 768 wide, 1,024 tokens, attention and residual
    dropout 0.1, batch 8, Adam, two steps; its MemTracker on fake CUDA tensors expects 2,583,888,896 B ± 5 %
    (the CPU's math kernel made it 7,578,576,896 B here)."""
    ModelArgs, Transformer = _pytorch_transformer()

    def build():
        return Transformer(ModelArgs(n_layers=4, n_heads=12, vocab_size=8192, max_seq_len=1024, dim=768,
                                     dropout_p=0.1))

    est = vram_magic.estimate(build, torch.randint(0, 8192, (8, 1024)), optimizer="adam", loss_fn=lambda o: o.sum())
    assert abs(est.peak.total / 2_583_888_896 - 1) < 0.05
    assert any("efficient × 4" in n and "dropout as CUDA's fused kernel" in n for n in est.notes)


def _gpt2(attn_pdrop: float, resid_pdrop: float = 0.1):
    from transformers import GPT2Config, GPT2LMHeadModel

    def build():
        cfg = GPT2Config(n_layer=6, n_embd=768, n_head=12, attn_pdrop=attn_pdrop, resid_pdrop=resid_pdrop,
                         embd_pdrop=resid_pdrop, attn_implementation="sdpa")
        return GPT2LMHeadModel(cfg)

    return build


@pytest.mark.slow
def test_gpt2_attention_dropout_costs_nothing_on_a_gpu():
    """transformers' GPT-2 (6 layers, 768 wide, fp32, batch 8 x 1,024) for an A100: 18.25 GiB with attn_pdrop=0.1 and
    11.64 GiB with 0.0 while the CPU's math kernel was carried over; a GPU takes dropout in memory-efficient
    attention (fp32), so both read the same."""
    pytest.importorskip("transformers")
    ids = torch.randint(0, 50257, (8, 1024))
    with_dropout = vram_magic.estimate(_gpt2(0.1), {"input_ids": ids, "labels": ids}, gpu="A100-80GB")
    without = vram_magic.estimate(_gpt2(0.0), {"input_ids": ids, "labels": ids}, gpu="A100-80GB")
    assert abs(with_dropout.peak.total - without.peak.total) < 0.001 * without.peak.total
    assert with_dropout.peak.total < 11.5 * 2**30
    cpu = vram_magic.estimate(_gpt2(0.1), {"input_ids": torch.randint(0, 50257, (1, 128))}, device="cpu")
    assert not any("SDPA" in n for n in cpu.notes)


# --- on a GPU: the estimate against the allocator's own peak ---------------------------------------------------
def _real_peak(build, inputs, dtype):
    torch.manual_seed(0)
    model = build().to("cuda", dtype)
    opt = torch.optim.AdamW(model.parameters())
    batch = {k: v.cuda() for k, v in inputs.items()}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        out = model(**batch)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del out
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del model, opt, batch
    torch.cuda.empty_cache()
    return peak


def _detected_gpu():
    from vram_magic.estimator.device.gpus import find_gpu

    try:
        return find_gpu(torch.cuda.get_device_name(0))
    except ValueError:
        return None


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("attn_pdrop", [0.0, 0.1], ids=["no-dropout", "dropout"])
def test_gpu_gpt2_step_estimate_matches_max_memory_allocated(attn_pdrop, dtype):
    pytest.importorskip("transformers")
    ids = torch.randint(0, 50257, (4, 1024))
    inputs = {"input_ids": ids, "labels": ids}
    real = _real_peak(_gpt2(attn_pdrop), inputs, dtype)
    est = vram_magic.estimate(_gpt2(attn_pdrop), inputs, gpu=_detected_gpu(), dtype=dtype)
    assert abs(est.peak.total / real - 1) < 0.05, (est.peak.total, real, [n for n in est.notes if "SDPA" in n])
