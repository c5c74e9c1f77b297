"""What each op of a traced step did, for the time model: its stage, its kind (a matmul, attention, a convolution,
anything else, or a view that moves nothing), its dtype, whether checkpointing's recompute ran it, its FLOPs (PyTorch's
own formulas, ``torch.utils.flop_counter``) and the bytes it read and wrote (its tensor arguments and results).

Kept as compact arrays: a big model's step is tens of thousands of ops.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

import torch

POINTWISE, MATMUL, ATTENTION, CONV, VIEW = range(5)
KINDS = ("pointwise", "matmul", "attention", "conv", "view")
#: dtype codes: the dtypes a time model tells apart (everything else, integers and bools, is "other")
DTYPES = ("fp32", "bf16", "fp16", "other")
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "_int_mm", "_weight_int8pack_mm",
                      "_weight_int4pack_mm", "_scaled_mm"})
_ATTENTION = ("attention",)  # scaled_dot_product_* and its kernels (flash, efficient, cudnn, math for CPU)
_CONVS = frozenset({"convolution", "convolution_backward", "mkldnn_convolution", "_convolution"})


def op_kind(func: Any, aliases: bool) -> int:
    """An op's kind code (``aliases``: the op returns a view of its input)."""
    if aliases:
        return VIEW
    name = func.overloadpacket.__name__
    if name in _MATMULS:
        return MATMUL
    if name in _CONVS:
        return CONV
    if any(word in name for word in _ATTENTION):
        return ATTENTION
    return POINTWISE


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPE_CODE.get(dtype, 3)


def tensor_bytes(value: Any) -> int:
    """Bytes a kernel reads or writes of ``value``: its elements (not its storage: a slice reads only itself), inside
    lists and tuples too."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def first_float_dtype(args: Any) -> int:
    """The dtype code of an op's first floating-point tensor argument (what its kernel computes in)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.is_floating_point():
                return dtype_code(a.dtype)
        elif isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor) and a[0].is_floating_point():
            return dtype_code(a[0].dtype)
    return 3


@dataclass
class OpLog:
    """One row per op, column by column."""

    stage: array = field(default_factory=lambda: array("b"))
    kind: array = field(default_factory=lambda: array("b"))
    dtype: array = field(default_factory=lambda: array("b"))
    recompute: array = field(default_factory=lambda: array("b"))
    flops: array = field(default_factory=lambda: array("d"))
    bytes: array = field(default_factory=lambda: array("d"))

    def add(self, stage: int, kind: int, dtype: int, recompute: bool, flops: float, nbytes: float) -> None:
        self.stage.append(stage)
        self.kind.append(kind)
        self.dtype.append(dtype)
        self.recompute.append(1 if recompute else 0)
        self.flops.append(flops)
        self.bytes.append(nbytes)

    def __len__(self) -> int:
        return len(self.stage)

    def rows(self, start: int = 0) -> Any:
        """``(stage, kind, dtype, recompute, flops, bytes)`` of each op from row ``start`` on."""
        return zip(self.stage[start:], self.kind[start:], self.dtype[start:], self.recompute[start:],
                   self.flops[start:], self.bytes[start:])
