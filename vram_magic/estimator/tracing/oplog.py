"""What each op of a traced step did, for the time model: its stage, its kind, its dtype, whether checkpointing's
recompute ran it, its FLOPs (PyTorch's own formulas, ``torch.utils.flop_counter``), the bytes it read and wrote (its
tensor arguments and results), the bytes of results it allocated, its largest tensor's elements, and for a matmul its
shape and operands' layout (a CPU's reduced-precision GEMMs differ tenfold by layout).

Kinds: a matmul, attention, a convolution, a view or allocation (moves nothing), plain elementwise work and copies
(*pointwise*), and the elementwise work whose time goes into computing each element rather than moving it: random
numbers, transcendental functions (``tanh``, ``exp``), activations (``gelu``, ``silu``), softmax, the normalisations
(layer, group and RMS norm) and batch norm (statistics over the batch: more passes over each element).
In-place ops move the bytes they read and write (``mul_`` reads and writes its tensor); ops that only write
(``fill_``, ``zeros``) move their results; allocations move nothing.

Kept as compact arrays: a big model's step is tens of thousands of ops.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from math import prod
from typing import Any

import torch
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

POINTWISE, MATMUL, ATTENTION, CONV, VIEW, RANDOM, TRANSCENDENTAL, ACTIVATION, SOFTMAX, NORM, BATCH_NORM = range(11)
KINDS = ("pointwise", "matmul", "attention", "conv", "view", "random", "transcendental", "activation", "softmax",
         "norm", "batch norm")
#: dtype codes: the dtypes a time model tells apart (everything else, integers and bools, is "other")
DTYPES = ("fp32", "bf16", "fp16", "other")
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
#: a matmul's operands as a row-major kernel sees them: (A transposed?, B transposed?) as NN, NT, TN, TT
LAYOUTS = ("NN", "NT", "TN", "TT")

_MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "_int_mm", "_weight_int8pack_mm",
                      "_weight_int4pack_mm", "_scaled_mm"})
_ATTENTION = ("attention",)  # scaled_dot_product_* and its kernels (flash, efficient, cudnn, math for CPU)
_CONVS = frozenset({"convolution", "convolution_backward", "mkldnn_convolution", "_convolution"})
_BY_NAME = {
    RANDOM: ("bernoulli", "bernoulli_", "uniform_", "normal", "normal_", "random_", "exponential_", "cauchy_",
             "log_normal_", "geometric_", "rand", "randn", "rand_like", "randn_like", "randint", "randint_like",
             "randperm", "multinomial", "native_dropout", "_fused_dropout"),
    TRANSCENDENTAL: ("exp", "exp_", "exp2", "expm1", "log", "log_", "log2", "log10", "log1p", "tanh", "tanh_",
                     "sigmoid", "sigmoid_", "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh",
                     "asinh", "acosh", "atanh", "erf", "erfc", "erfinv", "lgamma", "digamma", "logsumexp",
                     "logaddexp", "softplus", "log_sigmoid_forward"),
    ACTIVATION: ("gelu", "gelu_", "gelu_backward", "silu", "silu_", "silu_backward", "mish", "mish_backward", "elu",
                 "elu_backward", "selu", "celu", "softplus_backward", "log_sigmoid_backward", "glu", "glu_backward"),
    SOFTMAX: ("_softmax", "_log_softmax", "_safe_softmax", "_softmax_backward_data", "_log_softmax_backward_data"),
    NORM: ("native_layer_norm", "native_layer_norm_backward", "native_group_norm", "native_group_norm_backward",
           "_fused_rms_norm", "_fused_rms_norm_backward"),
    BATCH_NORM: ("native_batch_norm", "native_batch_norm_backward", "_native_batch_norm_legit",
                 "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training",
                 "_batch_norm_with_update", "batch_norm_backward"),
}
_KIND_OF = {name: kind for kind, names in _BY_NAME.items() for name in names}
#: ops that move nothing although PyTorch's schema does not call their result a view: views under another name,
#: in-place changes of metadata, allocations
_MOVES_NOTHING = frozenset({"_unsafe_view", "lift_fresh", "lift_fresh_copy", "_reshape_alias", "detach_", "t_",
                            "transpose_", "squeeze_", "unsqueeze_", "as_strided_", "resize_", "resize_as_", "set_",
                            "swapdims_", "swapaxes_", "requires_grad_", "empty", "empty_like", "empty_strided",
                            "new_empty", "new_empty_strided", "empty_permuted", "_record_function_enter_new",
                            "_record_function_exit"})
#: ops that write their results without reading their arguments' elements
_WRITE_ONLY = frozenset({"fill_", "zero_", "zeros", "ones", "full", "zeros_like", "ones_like", "full_like", "arange",
                         "scalar_tensor", "new_zeros", "new_ones", "new_full", "linspace", "eye"})
#: how an op's bytes are counted: its arguments and results; its results only; ``copy_``'s source and result
ALL, RESULTS, COPY = range(3)


@dataclass(frozen=True)
class Traits:
    """What the op log keeps of an op's kind, decided once per op: its kind, whether it writes into an argument (so
    allocates nothing), how its bytes are counted."""

    kind: int
    mutates: bool
    count: int


def op_traits(func: Any, aliases: bool) -> Traits:
    """An op's :class:`Traits` (``aliases``: some result of the op is an argument or a view of one)."""
    name = func.overloadpacket.__name__
    try:
        schema = func._schema
        mutates = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    except AttributeError:
        mutates = False
    count = COPY if name == "copy_" else RESULTS if name in _WRITE_ONLY else ALL
    if name in _MATMULS:
        return Traits(MATMUL, mutates, count)
    if name in _CONVS:
        return Traits(CONV, mutates, count)
    if any(word in name for word in _ATTENTION):
        return Traits(ATTENTION, mutates, count)
    if name in _KIND_OF:
        return Traits(_KIND_OF[name], mutates, count)
    if name in _MOVES_NOTHING or (aliases and not mutates):
        return Traits(VIEW, mutates, count)
    return Traits(POINTWISE, mutates, count)


def op_kind(func: Any, aliases: bool) -> int:
    """An op's kind code (``aliases``: the op returns a view of its input)."""
    return op_traits(func, aliases).kind


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


def sized(value: Any) -> tuple[int, int]:
    """``(bytes, elements of the largest tensor)`` of ``value``, inside lists and tuples too."""
    if isinstance(value, torch.Tensor):
        n = value.numel()
        return n * value.element_size(), n
    if isinstance(value, (list, tuple)):
        total = most = 0
        for v in value:
            b, n = sized(v)
            total += b
            most = max(most, n)
        return total, most
    return 0, 0


def first_float_dtype(args: Any) -> int:
    """The dtype code of an op's first floating-point tensor argument (what its kernel computes in)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.is_floating_point():
                return dtype_code(a.dtype)
        elif isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor) and a[0].is_floating_point():
            return dtype_code(a[0].dtype)
    return 3


def _transposed(t: torch.Tensor) -> bool:
    """Whether a matmul reads ``t`` (its last two dimensions) as column-major: PyTorch's CPU matmul passes a
    column-major operand to BLAS as transposed and copies one that is neither row- nor column-major (an expanded
    gradient) into row-major order (``addmm_impl_cpu_``)."""
    rows, cols = t.shape[-2], t.shape[-1]
    s_rows, s_cols = t.stride(-2), t.stride(-1)
    if s_cols == 1 and s_rows >= max(1, cols):
        return False
    return s_rows == 1 and s_cols >= max(1, rows)


def gemm_shape(args: Any) -> tuple[int, int, int, int, int] | None:
    """``(batch, m, n, k, layout)`` of a matmul: its last two matrix arguments ``(…, m, k) @ (…, k, n)`` and the
    layout code (:data:`LAYOUTS`)."""
    mats = [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2]
    if len(mats) < 2:
        return None
    a, b = mats[-2], mats[-1]
    m, k = a.shape[-2], a.shape[-1]
    n = b.shape[-1]
    batch = prod(a.shape[:-2]) if a.dim() > 2 else 1
    return int(batch), int(m), int(n), int(k), 2 * _transposed(a) + _transposed(b)


def cpu_attention_shape(name: str, args: Any, kwargs: dict[str, Any]) -> tuple[int, int, int, int, int] | None:
    """``(batch × heads, query length, key length, head dim, causal)`` of the CPU's flash attention kernels (their
    tensors are ``(batch, heads, length, dim)``), whose speed depends on the lengths; None for other kernels."""
    if "flash_attention_for_cpu" not in name:
        return None
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    try:
        q, k = (tensors[1], tensors[2]) if "backward" in name else (tensors[0], tensors[1])
    except IndexError:
        return None
    if q.dim() != 4 or k.dim() != 4:
        return None
    return (int(q.shape[0] * q.shape[1]), int(q.shape[2]), int(k.shape[2]), int(q.shape[3]),
            int(_causal(name, args, kwargs)))


def _causal(name: str, args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether a scaled-dot-product attention kernel's call asks for a causal mask (``is_causal``: the forward's fifth
    argument, the backward's eighth)."""
    index = 7 if "backward" in name else 4
    return (args[index] if len(args) > index else kwargs.get("is_causal", False)) is True


def attention_flops(name: str, args: Any, kwargs: dict[str, Any]) -> int:
    """FLOPs of a scaled-dot-product attention kernel PyTorch's counter has no formula for (the CPU's flash kernels),
    from its query, key and value (and output gradient): half the full count for a causal mask, whose blocks above
    the diagonal the kernel skips."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    try:
        if "backward" in name:
            grad, q, k, v = (t.shape for t in tensors[:4])
            flops = sdpa_backward_flop_count(grad, q, k, v)
        else:
            q, k, v = (t.shape for t in tensors[:3])
            flops = sdpa_flop_count(q, k, v)
    except (AssertionError, ValueError, IndexError):
        return 0
    return int(flops // 2 if _causal(name, args, kwargs) else flops)


@dataclass
class OpLog:
    """One row per op, column by column; ``shape`` indexes :attr:`shapes` (a matmul's ``(batch, m, n, k, layout)``, the
    CPU flash attention's ``(batch × heads, query length, key length, head dim, causal)``),
    -1 for other ops."""

    stage: array = field(default_factory=lambda: array("b"))
    kind: array = field(default_factory=lambda: array("b"))
    dtype: array = field(default_factory=lambda: array("b"))
    recompute: array = field(default_factory=lambda: array("b"))
    flops: array = field(default_factory=lambda: array("d"))
    bytes: array = field(default_factory=lambda: array("d"))
    fresh: array = field(default_factory=lambda: array("d"))
    elements: array = field(default_factory=lambda: array("d"))
    shape: array = field(default_factory=lambda: array("i"))
    shapes: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    _shape_ids: dict[tuple[int, int, int, int, int], int] = field(default_factory=dict, repr=False)

    def add(self, stage: int, kind: int, dtype: int, recompute: bool, flops: float, nbytes: float,
            fresh: float = 0.0, elements: float = 0.0, shape: tuple[int, int, int, int, int] | None = None) -> None:
        self.stage.append(stage)
        self.kind.append(kind)
        self.dtype.append(dtype)
        self.recompute.append(1 if recompute else 0)
        self.flops.append(flops)
        self.bytes.append(nbytes)
        self.fresh.append(fresh)
        self.elements.append(elements)
        if shape is None:
            self.shape.append(-1)
        else:
            index = self._shape_ids.get(shape)
            if index is None:
                index = self._shape_ids[shape] = len(self.shapes)
                self.shapes.append(shape)
            self.shape.append(index)

    def record(self, traits: Traits, name: str, stage: int, recompute: bool, flops: float, args: Any,
               kwargs: dict[str, Any], out: Any) -> None:
        """The row of one op that ran: ``traits`` from :func:`op_traits`, ``flops`` from PyTorch's counter."""
        kind = traits.kind
        if kind == VIEW:
            self.add(stage, kind, first_float_dtype(args), recompute, flops, 0.0)
            return
        out_bytes, out_most = sized(out)
        if traits.count == RESULTS:
            nbytes, most = out_bytes, out_most
        elif traits.count == COPY:
            src_bytes, src_most = sized(args[1:2])
            nbytes, most = src_bytes + out_bytes, max(src_most, out_most)
        else:
            in_bytes, in_most = sized(args)
            if kwargs:
                kw_bytes, kw_most = sized(tuple(kwargs.values()))
                in_bytes, in_most = in_bytes + kw_bytes, max(in_most, kw_most)
            nbytes, most = in_bytes + out_bytes, max(in_most, out_most)
        shape = gemm_shape(args) if kind == MATMUL else None
        if kind == ATTENTION:
            shape = cpu_attention_shape(name, args, kwargs)
            if not flops:
                flops = attention_flops(name, args, kwargs)
        self.add(stage, kind, first_float_dtype(args), recompute, flops, nbytes, 0.0 if traits.mutates else out_bytes,
                 most, shape)

    def __len__(self) -> int:
        return len(self.stage)

    def full(self) -> bool:
        """Whether every row has its bytes allocated, elements and shape (an op log built from the first six columns
        alone has not)."""
        n = len(self.stage)
        return len(self.fresh) == n and len(self.elements) == n and len(self.shape) == n

    def rows(self, start: int = 0) -> Any:
        """``(stage, kind, dtype, recompute, flops, bytes)`` of each op from row ``start`` on."""
        return zip(self.stage[start:], self.kind[start:], self.dtype[start:], self.recompute[start:],
                   self.flops[start:], self.bytes[start:])

    def rows_full(self, start: int = 0, end: int | None = None) -> Any:
        """``(stage, kind, dtype, recompute, flops, bytes, fresh, elements, shape)`` of rows ``start`` … ``end - 1``,
        ``shape`` the matmul's ``(batch, m, n, k, layout)`` or None."""
        shapes = self.shapes
        return zip(self.stage[start:end], self.kind[start:end], self.dtype[start:end], self.recompute[start:end],
                   self.flops[start:end], self.bytes[start:end], self.fresh[start:end], self.elements[start:end],
                   (shapes[i] if i >= 0 else None for i in self.shape[start:end]))

    def slice(self, start: int, end: int) -> OpLog:
        """Rows ``start`` … ``end - 1`` as an op log of their own."""
        out = OpLog(self.stage[start:end], self.kind[start:end], self.dtype[start:end], self.recompute[start:end],
                    self.flops[start:end], self.bytes[start:end], self.fresh[start:end], self.elements[start:end],
                    self.shape[start:end], list(self.shapes))
        out._shape_ids = dict(self._shape_ids)
        return out
