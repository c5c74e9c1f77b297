"""Which ops' CPU kernels allocate inside themselves (kernel scratch), and the one kind that a rule gives exactly.

The tracker hands these ops to ``Tracker._scratch_op``: fp32 GEMMs get :func:`gemm_copies` at once; the others are
timed and measured at the allocator (engine/profiler/kernel_scratch.py). The list was found by timing every op of the
zoo's training
steps (``tests/support/zoo.py``), a torch.ao int8 MLP and a bf16 MLP against the profiler's memory events
(``python benchmarks/scratch.py --find``); every op of torch.ao's quantized namespaces counts.
"""

from __future__ import annotations

import time
from typing import Any

import torch

#: the clock the tracker stamps timed calls with: PyTorch's profiler converts its own to this one
now = time.time_ns

#: what a block of kernel scratch counts as
SCRATCH = ("other", "kernel scratch (inside ops)")

TIMED = frozenset({
    "aten::convolution", "aten::convolution_backward", "aten::_convolution", "aten::mkldnn_convolution",
    "aten::_slow_conv2d_forward", "aten::_slow_conv2d_backward",
    "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::_addmm_activation",
    "aten::native_batch_norm", "aten::native_batch_norm_backward",
    "aten::native_layer_norm", "aten::native_layer_norm_backward",
    "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    "aten::mkldnn_rnn_layer", "aten::mkldnn_rnn_layer_backward",
    "aten::_ctc_loss_backward", "aten::_ctc_loss_backward.Tensor",  # log_beta, as large as log_alpha (LossCTC.cpp)
})
#: (prefixes of op names) torch.ao's quantized ops, and bitsandbytes' optimizer updates, whose CPU kernels
#: (bitsandbytes 0.50.2: bitsandbytes/backends/cpu/ops.py) dequantize both moments to fp32 and compute in eager ops
#: inside the op
NAMESPACES = ("quantized::", "_quantized::", "bitsandbytes::optimizer_update")
#: GEMMs whose copies a rule gives (measured equal to the profiler's on every GEMM of the zoo); in half precision
#: they go through oneDNN, whose packing is timed instead
RULE = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default})
HALF = (torch.bfloat16, torch.float16)


def uses_scratch(func: Any) -> bool:
    if func in RULE:
        return True
    try:
        name = func.name()
    except Exception:
        return False
    return name in TIMED or name.startswith(NAMESPACES)


def gemm_copies(func: Any, args: Any, out: torch.Tensor) -> int:
    """Bytes of the operand copies the CPU GEMM (``addmm_impl_cpu_``) makes inside the op: an operand whose
    strides BLAS cannot take (an expanded gradient, a strided slice) is cloned contiguous first. Worked out once per
    layout (shapes, strides, dtype): a loop calls the same GEMMs again and again."""
    m1, m2 = (args[0], args[1]) if func is torch.ops.aten.mm.default else (args[1], args[2])
    if not (isinstance(m1, torch.Tensor) and isinstance(m2, torch.Tensor)):
        return 0
    try:
        key = (m1.shape, m1.stride(), m2.shape, m2.stride(), out.stride(), m1.dtype, m2.dtype)
        hit = _COPIES.get(key)
    except TypeError:  # symbolic sizes
        return _copies(m1, m2, out)
    if hit is None:
        if len(_COPIES) > 10_000:
            _COPIES.clear()
        hit = _COPIES[key] = _copies(m1, m2, out)
    return hit


_COPIES: dict[Any, int] = {}


def _copies(m1: torch.Tensor, m2: torch.Tensor, out: torch.Tensor) -> int:
    if m1.dim() != 2 or m2.dim() != 2:
        return 0
    m, k, n = m1.shape[0], m1.shape[1], m2.shape[1]
    rs = out.stride()
    if rs[0] == 1 and (out.shape[1] == 1 or rs[1] >= max(1, m)):
        transpose_c = False
    elif rs[1] == 1 and (out.shape[0] == 1 or rs[0] >= max(1, n)):
        m1, m2, m, n, transpose_c = m2, m1, n, m, True
    else:
        return out.numel() * out.element_size()  # the result is computed in a Fortran-ordered copy
    i, j = (1, 0) if transpose_c else (0, 1)

    def needs_copy(t: torch.Tensor, first: int, second: int) -> bool:
        st = t.stride()
        return not ((st[i] == 1 and st[j] >= max(1, first)) or (st[j] == 1 and st[i] >= max(1, second)))

    extra = 0
    if needs_copy(m1, m, k):
        extra += m1.numel() * m1.element_size()
    if needs_copy(m2, k, n):
        extra += m2.numel() * m2.element_size()
    return extra


__all__ = ["HALF", "NAMESPACES", "RULE", "SCRATCH", "TIMED", "gemm_copies", "now", "uses_scratch"]
