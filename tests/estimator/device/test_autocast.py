"""``amp=`` estimates for CUDA run CUDA's autocast policy on the fake CPU run (vram_magic/estimator/device/autocast.py),
not the CPU's lists: ``aten/src/ATen/autocast_mode.h``'s ``AT_FORALL_*`` lists and the ``Autocast`` block of
``autocast_mode.cpp``, which every PyTorch build registers (CPU builds too) and the installed release's dispatcher
names. What each op does is checked against PyTorch's own CUDA kernels, run on fake CUDA tensors
(``benchmarks/autocast_probe.py``); the numbers below are worked out by hand. Also here: a checkpointed model
estimated for CUDA, whose recompute runs with no function mode on the stack unless the forward's are entered again."""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import vram_magic
from tests.support import ROOT
from vram_magic.estimator.device import autocast as ac
from vram_magic.estimator.torch_private import FakeTensorMode
from vram_magic.estimator.tracing.errors import EstimateError

KiB, MiB = 1024, 2**20
RELEASE = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


class _Ops(TorchDispatchMode):
    """The ATen ops that reach the fake tensors, with their inputs' dtypes and their outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[str, tuple[torch.dtype, ...], object]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func is not torch.ops.prim.device.default:
            self.rows.append((str(func), tuple(a.dtype for a in args if isinstance(a, torch.Tensor)), out))
        return out

    def named(self, prefix: str) -> list[tuple[str, tuple[torch.dtype, ...], object]]:
        return [r for r in self.rows if r[0].startswith(prefix)]


# --- the lists: the installed release's registrations, each with its policy ------------------------------------
def test_every_cuda_autocast_registration_of_the_installed_release_has_its_policy():
    registered = ac.cuda_registered()
    assert not ac.unknown_policies(), sorted(ac.unknown_policies())
    lower = {"linear", "mm", "matmul", "baddbmm", "addmv", "einsum", "prelu", "scaled_dot_product_attention"}
    assert lower <= registered and all(ac.cuda_policy(n) == "lower" for n in lower)
    assert ac.cuda_policy("layer_norm") == ac.cuda_policy("exp") == ac.cuda_policy("pow.Tensor_Scalar") == "fp32"
    assert ac.cuda_policy("softmax.int") == ac.cuda_policy("sum") == "fp32_set_opt_dtype"
    assert ac.cuda_policy("binary_cross_entropy") == "banned" and ac.cuda_policy("cat") is None  # CPU's promote only
    # rms_norm joined the fp32 list in 2.12 (read in 2.5.1's, 2.13's and 2.15's registrations)
    assert (ac.cuda_policy("rms_norm") == "fp32") == (RELEASE >= (2, 12))
    # what only CPU autocast casts: the padding overloads of the convolutions, cat, stack, the pooling and FFT families
    assert {"conv2d.padding", "cat", "stack", "avg_pool3d", "fft_fft"} <= ac.cpu_registered() - registered


@pytest.mark.slow
def test_each_op_runs_as_pytorchs_own_cuda_autocast_kernels_run_it():
    """PyTorch's AutocastCUDA kernels on fake CUDA tensors against the model on fake CPU tensors, op by op, in bf16
    and fp16: 40 cases (the GEMM, convolution, norm, pointwise, reduction, loss and promote families, the banned
    binary cross entropy, SDPA's math kernel); the same on 2.5.1, 2.13 and 2.15 (cases whose CUDA side needs a
    driver, on a CUDA build without a GPU, read n/a)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))  # a benchmark's probe, run here as a test
    from autocast_probe import compare

    pairs = compare(["bfloat16", "float16"])
    compared = {k: v for k, v in pairs.items() if not (v[0] and v[0][0].startswith("n/a"))}
    assert len(compared) >= 70
    different = {k: v for k, v in compared.items() if v[0] != v[1]}
    assert not different, different
    # what they agree on, in PyTorch's words: an fp16 softmax takes half_to_float (no fp32 copy of its input)
    assert pairs[("float16", "softmax")][1][-1] == "aten._softmax.default float16 -> float32"
    assert pairs[("bfloat16", "softmax")][1][-2:] == ["aten._to_copy.default bfloat16 -> float32",
                                                      "aten._softmax.default float32 -> float32"]


def test_fp16_softmax_takes_half_to_float_and_bf16_copies_first():
    """``SoftMax.cpp``: CUDA's ``softmax(x, dim, dtype=float)`` of an fp16 input runs ``_softmax(x, dim, True)``;
    a bf16 input is converted first (an fp32 copy of the scores, freed after)."""
    mode = FakeTensorMode()
    with mode:
        x = torch.empty(4, 8, dtype=torch.float16)
        y = torch.empty(4, 8, dtype=torch.bfloat16)
    with ac.CudaAutocast() as cast:
        ops = _Ops()
        with mode, ops, torch.autocast("cpu", dtype=torch.float16):
            out = torch.softmax(x, -1)
        assert out.dtype == torch.float32 and not ops.named("aten._to_copy")
        assert [r[1] for r in ops.named("aten._softmax")] == [(torch.float16,)]
        ops = _Ops()
        with mode, ops, torch.autocast("cpu", dtype=torch.bfloat16):
            out = torch.softmax(y, -1)
        assert out.dtype == torch.float32 and [r[1] for r in ops.named("aten._to_copy")] == [(torch.bfloat16,)]
    assert cast.counts[("float32", "softmax")] == 2


def test_weight_casts_are_cached_as_autocasts_own_cache_keeps_them():
    """``cached_cast``: a lower-precision cast of an fp32 leaf that requires grad is made once per autocast region
    (hit for every later op of the region; cleared when it ends), and not cached under ``inference_mode``, where
    the installed binary casts again for each op. The CPU's C++ cache (the same function) is the reference: the
    same number of casts over three matmuls of one weight, for each grad mode."""
    mode = FakeTensorMode()
    with mode:
        w = nn.Parameter(torch.empty(8, 8))
        x = torch.empty(2, 8, dtype=torch.bfloat16)

    def casts(model: bool, grad: object) -> int:
        ops = _Ops()
        region = ac.CudaAutocast() if model else contextlib.nullcontext()
        with region, grad(), mode, ops, torch.autocast("cpu", dtype=torch.bfloat16):  # type: ignore[operator]
            for _ in range(3):
                torch.mm(x, w)
        return len([r for r in ops.rows if "to_copy" in r[0] or r[0] == "aten.to.dtype"])

    for grad in (torch.enable_grad, torch.no_grad, torch.inference_mode):
        assert casts(True, grad) == casts(False, grad), grad
    assert casts(True, torch.no_grad) == 1 and casts(True, torch.inference_mode) == 3

    with ac.CudaAutocast() as cast:
        region = cast.region(torch.bfloat16)
        with mode:
            with region:
                first, second = torch.mm(x, w), torch.mm(x, w)
                assert len(cast.cache) == 1 and cast.cached == 1
            assert not cast.cache  # the region's end clears it
            with region:  # the same region object is entered again for the next forward
                torch.mm(x, w)
                assert len(cast.cache) == 1
    assert first.dtype == second.dtype == torch.bfloat16


# --- an estimate worked out by hand ----------------------------------------------------------------------------
def _norm_softmax() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 1024), nn.LayerNorm(1024), nn.Softmax(-1))


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_layer_norm_and_softmax_keep_fp32_on_cuda(amp):
    """Linear(1024, 1024) → LayerNorm(1024) → Softmax, fp32 weights, batch 64, SGD, ``amp=``; what the forward
    leaves for the backward. On CUDA (A100) layer_norm is on the fp32 list (its bf16 input is copied to fp32 and
    that copy saved) and softmax on the fp32_set_opt_dtype list (an fp32 output, saved); the CPU's lists have
    neither, so its layer norm keeps the linear's bf16 output (and bf16 mean/rstd) and its softmax is bf16. CUDA
    sizes in the allocator's 512-byte blocks."""
    x = torch.randn(64, 1024)
    half = 64 * 1024 * 2  # (64, 1024) in bf16/fp16: 131,072 B
    cuda = vram_magic.estimate(_norm_softmax(), x, amp=amp, gpu="A100-80GB", optimizer="sgd")
    expected = (half  # the input cast to the lower precision: the linear's weight gradient needs it
                + 2 * half  # the linear's output cast to fp32 for layer_norm, saved by it
                + 512 + 512  # layer_norm's fp32 mean and rstd, 64 × 4 B each, in 512-byte blocks
                + 2 * half  # softmax's fp32 output, saved by it (and the step's output)
                + 512)  # the loss: output.sum() on the fp32_set_opt_dtype list, an fp32 scalar
    assert cuda.after_forward.activations == expected == 656_896
    assert any("to float32: layer_norm × 1, softmax × 1, sum × 1" in n for n in cuda.notes), cuda.notes
    # CPU autocast's lists (device="cpu": unchanged), 2 bytes a row for mean and rstd
    cpu = vram_magic.estimate(_norm_softmax(), x, amp=amp, device="cpu", optimizer="sgd")
    assert cpu.after_forward.activations == half + half + 2 * 64 * 2 + half + 2 == 393_474
    assert not any("autocast" in n for n in cpu.notes)
    # (the CPU's lists on the CUDA estimate, as before: 393,216 B of half-precision tensors and four 512-byte blocks)


def test_cuda_autocast_leaves_cpu_autocast_as_it_was():
    """The kernels are registered for the CUDA trace only: afterwards CPU autocast casts by its own lists again
    (layer_norm of a bf16 input stays bf16, cat promotes to fp32)."""
    vram_magic.estimate(_norm_softmax(), torch.randn(4, 1024), amp="bf16", gpu="A100-80GB", optimizer="sgd")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = torch.randn(4, 8).bfloat16()
        assert F.layer_norm(h, (8,)).dtype == torch.bfloat16
        assert torch.cat([h, torch.randn(4, 8)]).dtype == torch.float32
        assert torch.mm(torch.randn(4, 8), torch.randn(8, 8)).dtype == torch.bfloat16


def test_binary_cross_entropy_fails_under_cuda_autocast_as_on_a_gpu():
    """CUDA's autocast refuses ``F.binary_cross_entropy`` (``binary_cross_entropy_banned``); the CPU's runs it in
    fp32. The estimate says what a GPU would."""
    model = nn.Sequential(nn.Linear(64, 8), nn.Sigmoid())
    x, y = torch.randn(4, 64), torch.rand(4, 8)

    def loss(out):
        return F.binary_cross_entropy(out, y)

    with pytest.raises(EstimateError, match="binary_cross_entropy_with_logits"):
        vram_magic.estimate(model, x, loss_fn=loss, amp="bf16", gpu="A100-80GB")
    assert vram_magic.estimate(model, x, loss_fn=loss, amp="bf16", device="cpu").total > 0


def test_sdpa_inputs_are_cast_and_its_kernel_runs_below_autocast():
    """SDPA is on CUDA's lower-precision list: fp32 query and key (a norm's output) are cast before the kernel is
    chosen, and the kernel runs with autocast off (the math kernel's own fp32 matmuls and softmax are not cast
    again). A block of LayerNorm → SDPA on an A100: flash, in bf16."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(64)

        def forward(self, x):
            h = self.norm(x).view(x.shape[0], x.shape[1], 4, 16).transpose(1, 2)  # fp32 on CUDA: layer_norm's list
            return x + F.scaled_dot_product_attention(h, h, h, is_causal=True).transpose(1, 2).reshape(x.shape)

    model = nn.Sequential(nn.Linear(64, 64), *[Block() for _ in range(2)])
    est = vram_magic.estimate(model, torch.randn(2, 128, 64), amp="bf16", gpu="A100-80GB")
    assert any("flash × 2" in n for n in est.notes), est.notes
    assert any("scaled_dot_product_attention × 2" in n for n in est.notes), est.notes


# --- checkpointing on CUDA: the recompute enters the forward's function modes again -----------------------------
def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=4096, n_positions=512))


def _sdpa_counts(est) -> str:
    return next(n for n in est.notes if n.startswith("SDPA")).split(": ")[-1].split(";")[0]


@pytest.mark.slow
@pytest.mark.parametrize("gpu, kernel", [("T4", "efficient"), ("A100-80GB", "efficient")])
def test_checkpointed_gpt2_for_cuda_recomputes_through_the_cuda_kernels(gpu, kernel):
    """A checkpointed transformers model estimated for CUDA failed with 'a different number of tensors was saved':
    PyTorch's backward runs checkpoint's recompute with no TorchFunctionMode on the stack, so the recompute ran the
    CPU's attention where the forward had run CUDA's. Now the forward's modes are entered again for it
    (``vram_magic/estimator/fake/frameworks.py``'s ``modes_again``): GPT-2 (4 layers, 256 wide, fp32) runs, every block
    checkpointed
    needs less than every second one, which needs less than none, and the notes count the recomputed SDPA calls
    (4 + 4 for every block, 4 + 2 for every second)."""
    pytest.importorskip("transformers")
    ids = torch.randint(0, 4096, (2, 256))
    inputs = {"input_ids": ids, "labels": ids}
    runs = {ck: vram_magic.estimate(_gpt2, inputs, gpu=gpu, checkpointing=ck) for ck in (False, 2, True)}
    assert runs[True].total < runs[2].total < runs[False].total
    assert _sdpa_counts(runs[False]) == f"{kernel} × 4"
    assert _sdpa_counts(runs[2]) == f"{kernel} × 6"
    assert _sdpa_counts(runs[True]) == f"{kernel} × 8"


@pytest.mark.slow
def test_checkpointed_recompute_casts_as_its_forward_did():
    """The autocast mode is entered again for the recompute too: a checkpointed LayerNorm → SDPA block whose SDPA
    inputs are fp32 (layer_norm's output on CUDA) casts them in the recompute as in the forward (otherwise the
    recompute would save fp32 tensors where the forward saved bf16 ones, and PyTorch's checkpoint refuses that),
    and the cast weights of a recompute go when it ends. On a T4 in bf16 the math kernel runs, whose own fp32
    matmuls would be cast again in a recompute run under autocast. GPT-2 bf16 on an A100 with every block
    checkpointed: flash for the forward and the recompute."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.proj = nn.LayerNorm(64), nn.Linear(64, 64)

        def forward(self, x):
            h = self.norm(x).view(x.shape[0], x.shape[1], 4, 16).transpose(1, 2)
            a = F.scaled_dot_product_attention(h, h, h, is_causal=True).transpose(1, 2).reshape(x.shape)
            return x + self.proj(a)

    model = nn.Sequential(nn.Linear(64, 64), nn.Sequential(*[Block() for _ in range(3)]))
    x = torch.randn(2, 128, 64)
    plain = vram_magic.estimate(model, x, amp="bf16", gpu="T4")
    ck = vram_magic.estimate(model, x, amp="bf16", gpu="T4", checkpointing=True)
    assert _sdpa_counts(plain) == "math × 3" and _sdpa_counts(ck) == "math × 6"
    assert any("scaled_dot_product_attention × 6" in n for n in ck.notes), ck.notes
    assert ck.after_forward.activations < plain.after_forward.activations
    pytest.importorskip("transformers")
    ids = torch.randint(0, 4096, (2, 256))
    gpt2 = vram_magic.estimate(_gpt2, {"input_ids": ids, "labels": ids}, amp="bf16", gpu="A100-80GB",
                               checkpointing=True)
    assert _sdpa_counts(gpt2) == "flash × 8"


def test_checkpointed_llama_for_an_a100_under_bf16_autocast():
    """A transformers Llama (4 layers, 256 wide, GQA 8/2 heads) with its own gradient checkpointing, estimated for
    an A100 with ``amp="bf16"``: it raised CheckpointError ('a different number of tensors was saved during the
    original forward and recomputation') while the recompute ran without the forward's function modes. Now flash for
    the forward and the recompute (4 + 4), every linear cast again in the recompute (28 + 28 + the head), and less
    left after the forward than without checkpointing."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    ids = torch.randint(0, 4096, (2, 128))
    runs = {ck: vram_magic.estimate(lambda: LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}, amp="bf16",
                                    gpu="A100-80GB", checkpointing=ck) for ck in (False, True)}
    assert _sdpa_counts(runs[False]) == "flash × 4" and _sdpa_counts(runs[True]) == "flash × 8"
    assert any("to bfloat16: linear × 57" in n for n in runs[True].notes), runs[True].notes
    assert runs[True].after_forward.activations < runs[False].after_forward.activations


def test_generate_for_cuda_runs_cuda_autocast():
    """generate= under ``amp=`` for CUDA: the same policy at the dispatcher (its SDPA reaches the tracker whole);
    under ``inference_mode`` no weight cast is cached, on the CPU's autocast as on this."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=256)
    ids = torch.randint(0, 1000, (2, 64))
    est = vram_magic.estimate(lambda: GPT2LMHeadModel(cfg), ids, generate=4, amp="bf16", gpu="A100-80GB")
    note = next(n for n in est.notes if n.startswith("autocast modelled"))
    assert "to bfloat16: addmm" in note and "reused from autocast's cache" not in note


# --- on a GPU: the estimate against the allocator's own peak of a bf16-autocast step ---------------------------
def _real_amp_peak(build, inputs, dtype):
    torch.manual_seed(0)
    model = build().to("cuda")
    opt = torch.optim.AdamW(model.parameters())
    batch = {k: v.cuda() for k, v in inputs.items()} if isinstance(inputs, dict) else inputs.cuda()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        with torch.autocast("cuda", dtype=dtype):
            out = model(**batch) if isinstance(batch, dict) else model(batch)
            loss = out.loss if hasattr(out, "loss") else out.sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del out, loss
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del model, opt, batch
    torch.cuda.empty_cache()
    return peak


def _builders():
    def llama():
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=688,
                                            num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                                            max_position_embeddings=1024))

    def gpt2():
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8192, n_positions=1024))

    def norm_softmax():
        return nn.Sequential(nn.Linear(4096, 4096), nn.LayerNorm(4096), nn.Softmax(-1))

    return {"gpt2": gpt2, "llama": llama, "linear-layernorm-softmax": norm_softmax}


@pytest.mark.cuda
@pytest.mark.parametrize("amp", ["bf16", "fp16"])
@pytest.mark.parametrize("name", ["gpt2", "llama", "linear-layernorm-softmax"])
def test_gpu_autocast_step_estimate_matches_max_memory_allocated(name, amp):
    """Two AdamW steps of an fp32 model under ``torch.autocast("cuda")``: the estimate with ``amp=`` for the
    detected GPU within 5 % of ``max_memory_allocated``."""
    from vram_magic.estimator.device.gpus import find_gpu

    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("no bf16 on this GPU")
    if name != "linear-layernorm-softmax":
        pytest.importorskip("transformers")
    ids = torch.randint(0, 8192, (4, 512))
    inputs = {"input_ids": ids, "labels": ids} if name != "linear-layernorm-softmax" else torch.randn(2048, 4096)
    build = _builders()[name]
    real = _real_amp_peak(build, inputs, dtype)
    try:
        gpu = find_gpu(torch.cuda.get_device_name(0))
    except ValueError:
        gpu = None
    est = vram_magic.estimate(build, inputs, gpu=gpu, amp=amp)
    assert abs(est.peak.total / real - 1) < 0.05, (est.peak.total, real, [n for n in est.notes if "autocast" in n])
