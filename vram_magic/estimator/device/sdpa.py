"""``scaled_dot_product_attention`` on CUDA, modelled on the fake CPU run, for every workload (training step,
inference, ``generate()``).

**Why.** The fake run executes on CPU tensors, and the CPU picks its own SDPA kernel: its flash kernel, or, with
attention dropout, the math kernel, which keeps the ``L × L`` scores and a dropout mask for the backward. A GPU
picks among cuDNN, flash, memory-efficient and math attention by the rules of ``aten/src/ATen/native/transformers/
cuda/sdp_utils.cpp`` (:func:`sdpa_kernel`), and the fused kernels take dropout without saving either.

**How.** Each call is run as the kernel PyTorch's CUDA composite would call (``attention.cpp``): the same ATen op
(``_scaled_dot_product_flash_attention``, ``_efficient_attention``, ``_cudnn_attention``, or the math composite)
on the fake CPU tensors, with the same preprocessing (a boolean mask made a float one, the mask padded to a
multiple of 8 for memory-efficient attention, head dims padded to 8 for flash). Fake tensors run those ops with
PyTorch's own meta functions (``torch/_meta_registrations.py``), so the outputs, the log-sum-exp and the
philox seed have the CUDA kernels' shapes, and autograd saves what their derivative formulas save (q, k, v,
output, log-sum-exp, seed: no scores, no dropout mask) and calls their backward ops. What the CUDA backward
kernels allocate for themselves and free before returning (flash's ``softmax_d`` and fp32 ``dq`` accumulator,
memory-efficient attention's ``delta`` and workspace) is added around those backward ops
(:meth:`CudaAttention.backward_scratch`). A training step's calls are caught at ``F.scaled_dot_product_attention``
(:class:`AttentionMode`, before autograd decomposes the op); under ``inference_mode`` the op reaches the
tracker's dispatch mode whole, which calls the same model.

The rules differ by release (:func:`rules_for`): read in the 2.5 sources, in sources of the 2.8–2.10 era
(cuDNN attention first on sm90/sm100, cuDNN ≥ 9.9) and of the 2.11–2.15 era (cuDNN first on sm90, sm100 and
sm103 when the runtime cuDNN is newer than 9.15.0, as the wheels of 2.11–2.15 bring: 9.19–9.26), and in main
after 2.15 (memory-efficient attention takes grouped-query attention; cuDNN refuses a dropout that is not a
multiple of 1/16; storage offsets aligned for memory-efficient attention). docs/cuda.md lists them.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

#: compute capability assumed when no GPU is named (Ampere, as an A100)
DEFAULT_CAPABILITY = (8, 0)

SDPA = torch.ops.aten.scaled_dot_product_attention.default
_MATH = torch.ops.aten._scaled_dot_product_attention_math.default
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention.default
_EFFICIENT = torch.ops.aten._scaled_dot_product_efficient_attention.default
_CUDNN = torch.ops.aten._scaled_dot_product_cudnn_attention.default
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_backward.default
_EFFICIENT_BACKWARD = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default
#: the CUDA kernels' backward ops, whose own scratch :meth:`CudaAttention.backward_scratch` sizes
BACKWARD_OPS = frozenset({_FLASH_BACKWARD, _EFFICIENT_BACKWARD})
_HALF = (torch.float16, torch.bfloat16)
_NATIVE_DROPOUT = torch.ops.aten.native_dropout.default
#: the fused RMSNorm kernel CUDA's ``rms_norm`` calls (2.8 on); absent from older releases, whose CUDA ``rms_norm``
#: runs the composite as the CPU does
_FUSED_RMS_NORM = getattr(torch.ops.aten, "_fused_rms_norm", None)


@dataclass(frozen=True)
class SdpaRules:
    """What differs between releases in the CUDA kernel choice."""

    release: tuple[int, int]
    cudnn_first: tuple[tuple[int, int], ...]  # capabilities on which cuDNN attention is tried first
    newest: tuple[int, int]  # the newest architecture the fused kernels accept
    efficient_gqa: bool  # memory-efficient attention takes grouped-query attention (enable_gqa)
    cudnn_dropout_sixteenths: bool  # cuDNN refuses a dropout probability that is not a multiple of 1/16
    efficient_offsets: bool  # memory-efficient attention wants q, k, v storage offsets aligned (sm80+)
    fused_rms_norm: bool = True  # CUDA's rms_norm calls the fused _fused_rms_norm (2.8 on)


def release_of(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (2, 13)


def rules_for(version: str | None = None) -> SdpaRules:
    """The CUDA rules of the release ``version`` (the installed PyTorch's by default)."""
    r = release_of(version or torch.__version__)
    if r < (2, 9):  # cuDNN after math in the order: never reached
        cudnn: tuple[tuple[int, int], ...] = ()
    elif r < (2, 11):
        cudnn = ((9, 0), (10, 0))
    else:
        cudnn = ((9, 0), (10, 0), (10, 3))
    newer = r > (2, 15)
    return SdpaRules(release=r, cudnn_first=cudnn, newest=(9, 0) if r < (2, 7) else (12, 1), efficient_gqa=newer,
                     cudnn_dropout_sixteenths=newer, efficient_offsets=newer,
                     fused_rms_norm=r >= (2, 8) and _FUSED_RMS_NORM is not None)


def target_capability(device: str, gpu: Any) -> tuple[tuple[int, int], bool] | None:
    """``(compute capability, whether a GPU was named)`` of an estimate for ``device``; ``None`` off CUDA (and for
    a GPU without a CUDA capability, which runs no CUDA kernels)."""
    if device != "cuda":
        return None
    if gpu is None:
        return DEFAULT_CAPABILITY, False
    cap = getattr(gpu, "capability", None)
    return (tuple(cap), True) if cap is not None else None


# --- the kernel choice (sdp_utils.cpp) ------------------------------------------------------------------

def _alignment(dtype: torch.dtype, capability: tuple[int, int]) -> int:
    """``minimum_gemm_alignment``: the head-dim multiple memory-efficient attention needs."""
    half = dtype in _HALF
    tensor_cores = capability >= (8, 0) or (capability >= (7, 0) and half)
    align = 4 if capability >= (8, 0) else 1
    return max(align, 128 // (16 if half else 32)) if tensor_cores else align


def _heads_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool, gqa: bool,
              same_kv_heads: bool = True) -> bool:
    """``check_batch_size_and_num_heads_dense``: equal batches, and equal heads or (where the kernel takes it and
    ``enable_gqa`` asks for it) query heads a multiple of the key/value heads."""
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        return False
    hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
    if enable_gqa and gqa:
        if same_kv_heads and hk != hv:
            return False
        return hq % hk == 0 and hq % hv == 0
    return hq == hk == hv


def _dense_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """4-d inputs, no empty sequence, a last dimension of stride 1 (the mask's too)."""
    if not q.dim() == k.dim() == v.dim() == 4 or q.shape[-2] == 0 or k.shape[-2] == 0:
        return False
    strides = all(t.stride(-1) == 1 or t.shape[-1] == 1 for t in (q, k, v))
    return strides and (mask is None or mask.stride(-1) == 1 or mask.shape[-1] == 1)


def _mask_shape_ok(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """``check_attn_mask_shape`` (cuDNN): a 2-d or 4-d mask, each dimension full or 1, not requiring grad."""
    if mask is None:
        return True
    if mask.requires_grad or mask.dim() not in (2, 4):
        return False
    want = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])[4 - mask.dim():]
    return all(m in (1, w) for m, w in zip(mask.shape, want))


def _flash_ok(q: Any, k: Any, v: Any, mask: Any, dropout: float, causal: bool, enable_gqa: bool,
              cap: tuple[int, int], grad: bool, rules: SdpaRules) -> bool:
    d = q.shape[-1]
    if mask is not None or not (q.shape[-1] == k.shape[-1] == v.shape[-1] and d <= 256):
        return False
    if not (8, 0) <= cap <= rules.newest or q.dtype not in _HALF:
        return False
    if grad and ((8, 6) <= cap <= (8, 9) or (12, 0) <= cap <= (12, 1)) and (192 < d <= 224 or (d > 224 and dropout)):
        return False
    if causal and q.shape[-2] != k.shape[-2]:  # flash 2's causal mask is bottom-right aligned
        return False
    return _heads_ok(q, k, v, enable_gqa, True)


def _efficient_ok(q: Any, k: Any, v: Any, mask: Any, enable_gqa: bool, cap: tuple[int, int],
                  rules: SdpaRules) -> bool:
    if not (5, 0) <= cap <= rules.newest:
        return False
    dtypes = (torch.float16, torch.float32, torch.bfloat16) if cap >= (8, 0) else (torch.float16, torch.float32)
    if q.dtype not in dtypes:
        return False
    align = _alignment(q.dtype, cap)
    if not (q.shape[-1] == k.shape[-1] and q.shape[-1] % align == 0 and v.shape[-1] % align == 0):
        return False
    if rules.efficient_offsets and cap >= (8, 0) and any(t.storage_offset() % align for t in (q, k, v)):
        return False
    return _heads_ok(q, k, v, enable_gqa, rules.efficient_gqa)


def _cudnn_ok(q: Any, k: Any, v: Any, mask: Any, dropout: float, enable_gqa: bool, cap: tuple[int, int],
              rules: SdpaRules) -> bool:
    if not (8, 0) <= cap <= (12, 1) or q.dtype not in _HALF or not _mask_shape_ok(q, k, mask):
        return False
    if rules.cudnn_dropout_sixteenths and dropout * 16 != math.floor(dropout * 16):
        return False
    limit = 256 if cap == (9, 0) else 128
    dqk, dv = q.shape[-1], v.shape[-1]
    if dqk > limit or dv > limit or dqk % 8 or dv % 8 or k.shape[-2] == 1 or (dropout and q.shape[-2] == 1):
        return False
    return _heads_ok(q, k, v, True, True, same_kv_heads=False)


def sdpa_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, enable_gqa: bool,
                capability: tuple[int, int], *, dropout: float = 0.0, causal: bool = False, grad: bool = False,
                rules: SdpaRules | None = None) -> str:
    """``"cudnn"``, ``"flash"``, ``"efficient"`` or ``"math"``: what ``select_sdp_backend`` picks for these
    arguments on a GPU of ``capability`` (``grad``: an input requires grad under grad mode)."""
    rules = rules or rules_for()
    if not _dense_ok(q, k, v, mask):
        return "math"
    if capability in rules.cudnn_first and _cudnn_ok(q, k, v, mask, dropout, enable_gqa, capability, rules):
        return "cudnn"
    if _flash_ok(q, k, v, mask, dropout, causal, enable_gqa, capability, grad, rules):
        return "flash"
    if _efficient_ok(q, k, v, mask, enable_gqa, capability, rules):
        return "efficient"
    return "math"


# --- what each kernel allocates (attention.cpp, attention.cu, attention_backward.cu, flash_api.cpp) ---------

def _round(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _float_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``convert_boolean_attn_mask``: zeros where attended, ``-inf`` elsewhere, in the query's dtype."""
    out = torch.zeros_like(mask, dtype=dtype)
    return out.masked_fill_(mask.logical_not(), float("-inf"))


def _efficient_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``preprocess_mask``: a mask whose leading strides are not multiples of 8 is copied padded to a multiple of
    8 in its last dimension (then sliced back); the result is expanded to ``(B, H, L, S)`` without a copy."""
    if any(mask.stride(i) % 8 for i in range(mask.dim() - 1)) or mask.stride(-1) != 1:
        last = mask.shape[-1]
        mask = F.pad(mask, (0, 8 - last % 8))[..., :last]
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _pad8(t: torch.Tensor) -> torch.Tensor:
    d = t.shape[-1]
    return t if d % 8 == 0 else F.pad(t, (0, 8 - d % 8))


class CudaAttention:
    """The model of SDPA on a GPU of compute capability ``capability`` (``named``: the GPU was named): call it as
    ``F.scaled_dot_product_attention`` is called; it counts the kernels it chose (:attr:`kernels`)."""

    def __init__(self, capability: tuple[int, int], named: bool = True, rules: SdpaRules | None = None) -> None:
        self.capability = tuple(capability)
        self.named = named
        self.rules = rules or rules_for()
        self.kernels: Counter[str] = Counter()
        self.others: Counter[str] = Counter()  # dropout and RMSNorm calls run as CUDA runs them (CudaKernelMode)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                 dropout: float = 0.0, causal: bool = False, scale: float | None = None,
                 enable_gqa: bool = False) -> torch.Tensor:
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        kernel = sdpa_kernel(q, k, v, mask, enable_gqa, self.capability, dropout=dropout, causal=causal, grad=grad,
                             rules=self.rules)
        self.kernels[kernel] += 1
        if mask is not None and mask.dtype == torch.bool:
            mask = _float_mask(mask, q.dtype)
        if kernel == "math":
            return _MATH(q, k, v, mask, dropout, causal, None, scale=scale, enable_gqa=enable_gqa)[0]
        if kernel == "flash":
            d = q.shape[-1]
            scale = 1.0 / math.sqrt(d) if scale is None else scale  # of the head dim before padding
            out = _FLASH(_pad8(q), _pad8(k), _pad8(v), dropout, causal, False, scale=scale)[0]
            return out if out.shape[-1] == d else out[..., :d]
        if kernel == "cudnn":
            return _CUDNN(q, k, v, mask, grad, dropout, causal, False, scale=scale)[0]
        if mask is not None:
            mask = _efficient_mask(mask, q, k)
        if q.dtype in _HALF and v.shape[-1] > 128:  # kNeedsOutputAccumulatorBuffer: an fp32 accumulator
            accumulator = torch.empty((q.shape[0], q.shape[2], q.shape[1], v.shape[-1]), dtype=torch.float32)
            del accumulator
        return _EFFICIENT(q, k, v, mask, grad, dropout, causal, scale=scale)[0]

    def backward_scratch(self, func: Any, args: Any) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The buffers a CUDA backward kernel allocates for itself and frees before it returns, as
        ``(shape, dtype)``: flash's ``softmax_d`` (fp32, queries rounded to 128) and non-deterministic ``dq``
        accumulator (fp32, head dim rounded to 32), and for grouped-query attention the expanded ``dk``/``dv``
        (``mha_bwd``); memory-efficient attention's ``delta`` (fp32, computed through an fp32 product of the
        output and its gradient where the kernel does not compute it: fp32 inputs) and its workspace, an fp32
        ``dq`` accumulator where the gradient is not fp32 or the keys are split (cutlassB)."""
        grad_out, q, k = args[0], args[1], args[2]
        b, h, m, d = (int(x) for x in q.shape)
        n = int(k.shape[2])
        f32 = torch.float32
        if func is _FLASH_BACKWARD:
            out = [((b, h, _round(m, 128)), f32),
                   ((b, _round(m, 128), h, _round(d, 32) if d <= 192 else 256), f32)]
            if k.shape[1] != h:
                out += [((b, n, h, d), q.dtype)] * 2
            return out
        if func is _EFFICIENT_BACKWARD:
            out = [((b, h, m), f32)]
            if q.dtype not in _HALF:
                out.append((tuple(int(x) for x in grad_out.shape), f32))
            splits = n > 128  # keys split in blocks of 64 (the heuristic keeps one split for short sequences)
            if q.dtype in _HALF or splits:
                out.append(((b, h, _round(m, 64), _round(d, 64)), f32))
            return out
        return []

    def note(self) -> str:
        text = kernel_note(self.kernels, self.capability, self.named, self.rules)
        if self.others:
            what = {"dropout": "dropout as CUDA's fused kernel (a bool mask kept for the backward, not the CPU's "
                               "noise tensor)", "rms_norm": "RMSNorm as CUDA's fused kernel (an fp32 rstd kept, not "
                                                           "the CPU composite's fp32 intermediates)"}
            text += ("; " if text else "") + "; ".join(f"{what[k]} × {n}" for k, n in sorted(self.others.items()))
        return text


def kernel_note(kernels: Mapping[str, int], capability: tuple[int, int], named: bool,
                rules: SdpaRules | None = None) -> str:
    """What the estimate's notes say of the SDPA calls modelled (empty where there were none)."""
    if not kernels:
        return ""
    rules = rules or rules_for()
    counts = ", ".join(f"{kernel} × {n}" for kernel, n in sorted(kernels.items()))
    where = f"compute capability {capability[0]}.{capability[1]}" + ("" if named else " assumed (pass gpu=)")
    text = (f"SDPA on CUDA modelled by PyTorch {rules.release[0]}.{rules.release[1]}'s kernel choice ({where}): "
            f"{counts}")
    if kernels.get("math"):
        text += ("; the math kernel materializes the L × L attention scores (no flash attention before compute "
                 "capability 8.0 or in fp32, and memory-efficient attention refuses grouped-query attention)")
    return text


class CudaKernelMode(TorchFunctionMode):
    """The functions whose CUDA kernel PyTorch chooses above autograd, where the fake CPU run would choose the
    CPU's (and autograd would save what the CPU's saves), run as on CUDA:

    * ``F.scaled_dot_product_attention``: sent to ``model`` (:class:`CudaAttention`);
    * ``F.dropout`` (not in place, 0 < p < 1): CUDA takes the fused ``native_dropout``, which keeps a bool mask for
      the backward, where the CPU multiplies by a noise tensor of the input's dtype and keeps that
      (``is_fused_kernel_acceptable`` in ``aten/src/ATen/native/Dropout.cpp``);
    * ``F.rms_norm`` (weight of the input's dtype, or none): CUDA takes the fused ``_fused_rms_norm``, which keeps
      the input and an fp32 ``rstd`` per row, where the CPU runs the composite and keeps its fp32 intermediates
      (``rms_norm_symint`` in ``layer_norm.cpp``)."""

    def __init__(self, model: CudaAttention) -> None:
        super().__init__()
        self.model = model

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return call_with(self.model, args, kwargs)
        if func is F.dropout:
            x, p, training, inplace = _bound(args, kwargs, ("input", "p", "training", "inplace"),
                                             (None, 0.5, True, False))
            if training and not inplace and 0 < p < 1 and isinstance(x, torch.Tensor) and x.numel() > 0:
                self.model.others["dropout"] += 1
                return _NATIVE_DROPOUT(x, p, True)[0]
        elif func is F.rms_norm and self.model.rules.fused_rms_norm:
            x, shape, weight, eps = _bound(args, kwargs, ("input", "normalized_shape", "weight", "eps"),
                                           (None, None, None, None))
            if isinstance(x, torch.Tensor) and (weight is None or weight.dtype == x.dtype):
                self.model.others["rms_norm"] += 1
                dims = len(shape) if isinstance(shape, (tuple, list)) else 1
                return _FusedRMSNorm.apply(x, weight, dims)
        return func(*args, **kwargs)


class _FusedRMSNorm(torch.autograd.Function):
    """What CUDA's ``_fused_rms_norm`` allocates and its derivative saves (``derivatives.yaml``: the input, the
    weight and ``rstd``, fp32 with the normalized dimensions kept as 1), and what its backward returns. On a CPU build
    the op is a composite, whose pieces autograd would save one by one, so its CUDA behaviour is written out."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, dims: int) -> torch.Tensor:
        rstd = torch.empty((*x.shape[: x.dim() - dims], *([1] * dims)), dtype=torch.float32)
        ctx.save_for_backward(x, rstd, weight)
        return torch.empty(x.shape, dtype=x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, rstd, weight = ctx.saved_tensors
        grad_weight = torch.empty_like(weight) if weight is not None and ctx.needs_input_grad[1] else None
        return torch.empty_like(x), grad_weight, None


def _bound(args: Any, kwargs: Mapping[str, Any], names: tuple[str, ...], defaults: tuple[Any, ...]) -> list[Any]:
    given = dict(zip(names, args))
    return [given.get(n, kwargs.get(n, d)) for n, d in zip(names, defaults)]


def call_with(model: CudaAttention, args: Any, kwargs: Mapping[str, Any]) -> torch.Tensor:
    """``model`` called with ``scaled_dot_product_attention``'s arguments, positional or by name."""
    q, k, v, mask, *values = _bound(args, kwargs, ("query", "key", "value", "attn_mask", "dropout_p", "is_causal",
                                                   "scale", "enable_gqa"), (None, None, None, None, 0.0, False, None,
                                                                            False))
    if torch.is_autocast_enabled("cpu"):  # the trace's autocast, standing for CUDA's
        # SDPA is on autocast's lower-precision list (autocast_mode.cpp): its floating-point arguments are cast
        # before the kernel is chosen (an fp32 rotary embedding's q and k become bf16, and flash can take them)
        low = torch.get_autocast_dtype("cpu")
        q, k, v, mask = (t.to(low) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
                         else t for t in (q, k, v, mask))
    return model(q, k, v, mask, *values)


__all__ = ["CudaKernelMode", "BACKWARD_OPS", "CudaAttention", "DEFAULT_CAPABILITY", "SDPA", "SdpaRules", "call_with",
           "kernel_note", "release_of", "rules_for", "sdpa_kernel", "target_capability"]
