"""Fake kernels of the estimator's own, for ops whose PyTorch fake (meta) kernel is missing or disagrees with the
real kernels: the fake run must take the op as the real run on the modelled device takes it, with outputs of the
real kernel's shapes, strides and dtypes.

* ``aten._grouped_mm`` (Hugging Face MoE experts, ``experts_implementation="grouped_mm"``, the default in
  transformers 5): PyTorch's meta kernel (``torch/_meta_registrations.py``, ``_meta_grouped_mm_common``) copies
  the checks of CUDA's bf16 fast path and refuses fp32 and fp16, while the real kernels (CPU, and CUDA's fallback
  for other dtypes or GPUs: ``aten/src/ATen/native/GroupedMMUtils.h``) take fp32, bf16 and fp16 and pad the
  output's row stride to 16 bytes. Here: the real kernels' checks and output layout.
* ``aten._ctc_loss`` and ``aten._ctc_loss_backward`` (``F.ctc_loss``; wav2vec2, HuBERT): no fake kernel at all.
  Their outputs' shapes follow the CPU kernel (``aten/src/ATen/native/LossCTC.cpp``): the per-sample loss
  ``(B,)``, ``log_alpha`` ``(B, T, 2 * max(target_lengths) + 1)`` and the gradient like ``log_probs``; the
  backward keeps ``log_beta`` (as ``log_alpha``) alive while it runs.
* ``aten.native_layer_norm_backward``: PyTorch's fake kernel (its decomposition) lays the input's gradient out like
  the output's gradient, while the CPU and CUDA kernels make it contiguous (``layer_norm_backward_cpu``:
  ``dX = empty_like(*X, MemoryFormat::Contiguous)``, ``X = input.expect_contiguous()``; the CUDA kernel the same). A
  transposed output gradient (Swin's pooler: ``transpose`` then the final norm) otherwise gives a strided gradient
  that the next ``view`` must copy: one activation gradient too many at the backward's peak. Here: the fake
  kernel's outputs, the input's gradient contiguous.

Each entry is ``(kernel, scratch)``: ``kernel(*args, **kwargs)`` runs under the fake mode and returns the op's
outputs; ``scratch(*args, **kwargs)`` the ``(shape, dtype)`` of the buffers the real kernel holds while it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..fake.known_values import value_of
from ..torch_private import disable_current_modes

_HALF_OR_FLOAT = (torch.float32, torch.bfloat16, torch.float16)


# --- _grouped_mm -----------------------------------------------------------------------------------------------

def _check_strides(mat: torch.Tensor) -> None:
    """``check_valid_strides_and_return_transposed`` (GroupedMMUtils.h): row- or column-major in the last two
    dimensions, the leading stride a multiple of 16 bytes."""
    end = mat.dim() - 1
    align = 16 // mat.element_size()
    st, sz = mat.stride(), mat.shape
    if st[end - 1] == 1 and st[end] >= max(1, sz[end - 1]):
        lead = st[end]
    elif st[end] == 1 and st[end - 1] >= max(1, sz[end]):
        lead = st[end - 1]
    else:
        raise RuntimeError(f"Invalid strides/sizes, got {tuple(st)} for strides and {tuple(sz)} for sizes")
    if lead % align:
        raise RuntimeError("strides should be multiple of 16 bytes")


def grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``_grouped_mm_validate_inputs`` + ``create_grouped_gemm_output_tensor`` (GroupedMMUtils.h, torch 2.9+)."""
    for name, m in (("mat_a", mat_a), ("mat_b", mat_b)):
        if m.dtype not in _HALF_OR_FLOAT:
            raise RuntimeError(f"Expected {name} to be Float32, BFloat16 or Float16 matrix, got {m.dtype}")
        if m.dim() not in (2, 3):
            raise RuntimeError(f"{name} has to be 2 or 3d")
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if (not a2 or not b2) and mat_a.shape[-1] != mat_b.shape[-2]:
        raise RuntimeError("contraction dimension of mat_a and mat_b must match")
    _check_strides(mat_a)
    _check_strides(mat_b)
    if (offs is not None) != (a2 or b2):
        raise RuntimeError("Have to provide offsets if there is a 2d matrix, or no offset if both matrices are 3d")
    if offs is not None and (offs.dim() != 1 or offs.dtype != torch.int32):
        raise RuntimeError("Offsets have to be a 1-d int32 tensor")
    if bias is not None:
        raise RuntimeError("Bias not supported yet")
    dtype = out_dtype or mat_a.dtype
    if dtype != mat_a.dtype:
        raise RuntimeError("Grouped gemm output dtype must match `mat_a` dtype")
    if a2 and b2:
        size = [offs.shape[0], mat_a.shape[0], mat_b.shape[1]]
    elif a2:
        size = [mat_a.shape[0], mat_b.shape[-1]]
    elif b2:
        size = [mat_a.shape[1], mat_b.shape[1]]
    else:
        size = [mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1]]
    align = 16 // dtype.itemsize
    padded = -(-size[-1] // align) * align  # the row stride, padded to 16 bytes (not on ROCm)
    stride = [padded, 1] if a2 != b2 else [size[1] * padded, padded, 1]
    return torch.empty_strided(size, stride, dtype=dtype, device=mat_a.device)


# --- CTC loss --------------------------------------------------------------------------------------------------

def _lengths(lengths: Any) -> list[int] | None:
    """A lengths argument as a list of ints: as given (``int[]``), from a tensor's known values, else ``None``."""
    if isinstance(lengths, torch.Tensor):
        v = value_of(lengths)
        if v is None:
            return None
        with disable_current_modes():  # a real tensor: read outside the fake mode
            return [int(x) for x in v.reshape(-1).tolist()]
    return [int(x) for x in lengths]


def _max_target(targets: torch.Tensor, target_lengths: Any) -> int:
    """``max(target_lengths)``; where the lengths' values are not known, the most they can be (the padded targets'
    width, or all of the concatenated targets): the larger ``log_alpha``, so the estimate errs high, never low."""
    known = _lengths(target_lengths)
    if known is not None:
        return max(known, default=0)
    return int(targets.shape[1]) if targets.dim() == 2 else int(targets.shape[0])


def ctc_loss(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: Any, target_lengths: Any,
             blank: int = 0, zero_infinity: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``ctc_loss_cpu_template``: ``neg_log_likelihood`` ``(B,)`` and ``log_alpha`` ``(B, T, 2 * max_target + 1)``
    (``log_probs`` is ``(T, B, C)``, or ``(T, C)`` unbatched)."""
    batched = log_probs.dim() == 3
    t_len = log_probs.shape[0]
    b = log_probs.shape[1] if batched else 1
    width = 2 * _max_target(targets, target_lengths) + 1
    nll = torch.empty((b,), dtype=log_probs.dtype, device=log_probs.device)
    log_alpha = torch.empty((b, t_len, width), dtype=log_probs.dtype, device=log_probs.device)
    return nll, log_alpha


def ctc_loss_backward(grad: torch.Tensor, log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: Any,
                      target_lengths: Any, neg_log_likelihood: torch.Tensor, log_alpha: torch.Tensor, blank: int,
                      zero_infinity: bool = False) -> torch.Tensor:
    """``ctc_loss_backward_cpu_template``: the gradient, ``full_like(log_probs)`` (contiguous)."""
    return torch.empty(tuple(log_probs.shape), dtype=log_probs.dtype, device=log_probs.device)


def _ctc_backward_scratch(*args: Any, **kwargs: Any) -> list[tuple[tuple[int, ...], torch.dtype]]:
    log_alpha = args[6] if len(args) > 6 else kwargs["log_alpha"]
    return [(tuple(log_alpha.shape), log_alpha.dtype)]  # log_beta = at::empty_like(log_alpha)


# --- layer norm's backward ------------------------------------------------------------------------------------

def layer_norm_backward(*args: Any, **kwargs: Any) -> Any:
    """The fake kernel's outputs, the input's gradient (when asked for) contiguous as the real kernels make it."""
    grad_input, grad_weight, grad_bias = _aten.native_layer_norm_backward.default(*args, **kwargs)
    if grad_input is not None and not grad_input.is_contiguous():
        grad_input = torch.empty(tuple(grad_input.shape), dtype=grad_input.dtype, device=grad_input.device)
    return grad_input, grad_weight, grad_bias


def _none(*args: Any, **kwargs: Any) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return []


_aten = torch.ops.aten
#: op -> (fake kernel, its scratch)
OWN: dict[Any, tuple[Callable[..., Any], Callable[..., list[tuple[tuple[int, ...], torch.dtype]]]]] = {}
if hasattr(_aten, "_grouped_mm"):
    OWN[_aten._grouped_mm.default] = (grouped_mm, _none)
OWN[_aten._ctc_loss.default] = (ctc_loss, _none)
OWN[_aten._ctc_loss.Tensor] = (ctc_loss, _none)
OWN[_aten._ctc_loss_backward.default] = (ctc_loss_backward, _ctc_backward_scratch)
OWN[_aten._ctc_loss_backward.Tensor] = (ctc_loss_backward, _ctc_backward_scratch)
OWN[_aten.native_layer_norm_backward.default] = (layer_norm_backward, _none)
