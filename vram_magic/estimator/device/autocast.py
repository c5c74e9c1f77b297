"""``torch.autocast`` as CUDA runs it, modelled on the fake CPU run of an ``amp=`` estimate for ``device="cuda"``.

**Why.** The fake run executes on CPU tensors, so ``amp=`` runs ``torch.autocast("cpu")``, whose op lists
(``aten/src/ATen/autocast_mode.cpp``, the ``AutocastCPU`` block) differ from CUDA's (``AT_FORALL_*`` in
``autocast_mode.h`` and the ``Autocast`` block that uses them). CUDA casts the inputs of ``layer_norm``,
``group_norm``, ``rms_norm`` (2.12 on), ``exp``, ``pow``, ``rsqrt``, the losses, ... to fp32 (that copy is what
their backward keeps), runs ``softmax``, ``log_softmax``, ``sum``, ``cumsum``, ``prod`` and the vector norms with
an fp32 output, casts ``addmv``, ``einsum``, ``bilinear``'s family and the RNN cells to the lower precision; CPU
autocast does none of these, and casts the convolutions' padding overloads, ``cat``/``stack``, the pooling and
FFT families that CUDA leaves alone.

**How.** While a CUDA ``amp=`` trace runs, Python kernels registered at the ``AutocastCPU`` dispatch key
(:class:`CudaAutocast`, through ``torch.library``) — the key where autocast's own C++ kernels sit, above autograd,
so the casts are recorded by autograd and what a backward keeps is the cast tensor — apply CUDA's cast policy
(``WrapFunction_`` in ``autocast_mode.h``: ``lower_precision_fp``, ``fp32``, ``fp32_set_opt_dtype``,
``fp32_append_dtype``, ``promote``, the banned ``binary_cross_entropy``) to each op the installed release's CUDA
autocast registers (read from its dispatcher: ``AutocastCUDA`` kernels are built into every PyTorch, CPU builds
too), and let the ops only CPU autocast registers fall through. The switch stays CPU autocast's own
(``torch.autocast("cpu", dtype=amp)``), so what model code does with it — transformers' rotary embeddings turning
it off, ``torch.utils.checkpoint`` turning it on again for a recompute — acts as on CUDA. Lower-precision casts of
fp32 leaves that require grad (the weights) are cached until the outermost autocast region ends
(``cached_cast``, ``torch.autocast.__exit__``'s ``clear_autocast_cache``), so a weight used twice is cast once and
its copy lives until the forward (and loss) ends, as on a GPU; under ``inference_mode`` the installed
``cached_cast`` keeps none (each op casts again), and neither does this. :class:`CudaAutocastMode` applies the same
policy to the functions ``sdpa.py``'s ``CudaKernelMode`` catches above the dispatcher (SDPA,
``rms_norm``) and runs them with autocast off, as the C++ kernel redispatches; it is entered again for a
checkpoint's recompute (``estimator/fake/frameworks.py``), whose end also ends that recompute's cache.
``device="cpu"`` estimates never use any of this.

One CUDA-build-only registration is not modelled: ``_cudnn_rnn`` (``aten/src/ATen/cudnn/AutocastRNN.cpp``, which
casts an LSTM's or GRU's weights to fp16 into a new flat buffer); the fake run's RNNs are the CPU's anyway.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from ...engine.torch_private import has_kernel_for_dispatch_key
from ..torch_private import destroy_library, operator_names

# The policies by op overload, as CUDA's autocast registers them (autocast_mode.h's AT_FORALL_LOWER_PRECISION_FP,
# AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE, AT_FORALL_PROMOTE and the
# Autocast block of autocast_mode.cpp). Which of them a release registers is read from its dispatcher
# (cuda_registered): rms_norm from 2.12; the named-tensor overloads (softmax.Dimname, ...) until named tensors left.
LOWER = frozenset("""
_convolution.deprecated _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d.input
conv_transpose3d.input convolution prelu addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm baddbmm
bmm chain_matmul linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell
rnn_relu_cell _scaled_dot_product_flash_attention scaled_dot_product_attention cudnn_convolution
cudnn_convolution_transpose""".split())
FP32 = frozenset("""
acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow.Tensor_Scalar pow.Tensor_Tensor
pow.Scalar softplus layer_norm native_layer_norm rms_norm group_norm frobenius_norm.dim nuclear_norm nuclear_norm.dim
cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div l1_loss
smooth_l1_loss huber_loss mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss triplet_margin_loss
multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp upsample_nearest1d
_upsample_nearest_exact1d upsample_nearest2d _upsample_nearest_exact2d upsample_nearest3d _upsample_nearest_exact3d
upsample_linear1d upsample_bilinear2d _upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d
_upsample_bicubic2d_aa linalg_matrix_sqrth""".split())
SET_OPT_DTYPE = frozenset("""
prod prod.dim_int prod.dim_Dimname softmax.int softmax.Dimname log_softmax.int log_softmax.Dimname cumprod
cumprod.dimname cumsum cumsum.dimname linalg_vector_norm linalg_matrix_norm linalg_matrix_norm.str_ord sum
sum.dim_IntList sum.dim_DimnameList""".split())
#: fp32_append_dtype: the overload registered -> the dtype-taking overload it redispatches to
APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
                "norm.names_ScalarOpt_dim": "norm.names_ScalarOpt_dim_dtype"}
PROMOTE = frozenset("addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add"
                    .split())
BANNED = frozenset({"binary_cross_entropy"})
POLICIES = {**{n: "lower" for n in LOWER}, **{n: "fp32" for n in FP32}, **{n: "fp32_set_opt_dtype" for n in
            SET_OPT_DTYPE}, **{n: "fp32_append_dtype" for n in APPEND_DTYPE}, **{n: "promote" for n in PROMOTE},
            **{n: "banned" for n in BANNED}}
#: registered for CUDA by CUDA builds only (cuDNN's RNN: its weights recast into a flat fp16 buffer): not modelled
CUDA_BUILD_ONLY = frozenset({"_cudnn_rnn"})

_BANNED_MESSAGE = ("torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast (CUDA "
                   "refuses them under autocast; the estimate does as a GPU would). Many models use a sigmoid layer "
                   "right before the binary cross entropy layer. In this case, combine the two layers using "
                   "torch.nn.functional.binary_cross_entropy_with_logits or torch.nn.BCEWithLogitsLoss.")
_SOFTMAXES = ("softmax.int", "log_softmax.int")


def _overload(name: str) -> Any:
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def _exists(name: str) -> bool:
    try:
        _overload(name)
    except (AttributeError, RuntimeError):
        return False
    return True


@functools.lru_cache(maxsize=1)
def cuda_registered() -> frozenset[str]:
    """The ATen overloads the installed PyTorch's CUDA autocast registers (``"layer_norm"``, ``"pow.Scalar"``...)."""
    return frozenset(n[len("aten::"):] for n in operator_names()
                     if n.startswith("aten::") and has_kernel_for_dispatch_key(n, "AutocastCUDA"))


@functools.lru_cache(maxsize=1)
def cpu_registered() -> frozenset[str]:
    """The ATen overloads the installed PyTorch's CPU autocast registers."""
    return frozenset(n[len("aten::"):] for n in operator_names()
                     if n.startswith("aten::") and has_kernel_for_dispatch_key(n, "AutocastCPU"))


def unknown_policies() -> frozenset[str]:
    """Overloads the installed release's CUDA autocast registers whose policy this module does not hold (a newer
    release's additions; run as if unlisted)."""
    return cuda_registered() - set(POLICIES) - CUDA_BUILD_ONLY


def cuda_policy(name: str) -> str | None:
    """The policy CUDA's autocast applies to the overload ``name`` in the installed release, ``None`` for none."""
    return POLICIES.get(name) if name in cuda_registered() else None


def release() -> tuple[int, int]:
    parts = torch.__version__.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


# --- cached_cast and the policies (autocast_mode.h / .cpp) ---------------------------------------------------

def _eligible(t: Any) -> bool:
    """``is_eligible``: a floating tensor other than double (every fake tensor stands for a CUDA one)."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


@contextlib.contextmanager
def _autocast_off() -> Iterator[None]:
    """What the C++ kernels' ``ExcludeDispatchKeyGuard`` does for their redispatch (``is_autocast_enabled`` reads
    that same exclusion)."""
    was = torch.is_autocast_enabled("cpu")
    torch.set_autocast_enabled("cpu", False)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cpu", was)


def _promote_type(values: Any, lower: torch.dtype) -> torch.dtype:
    """``promote_type``: fp32 if any eligible input is fp32, else the lower precision (doubles ignored)."""
    current = lower
    for v in values:
        for t in (v if isinstance(v, (list, tuple)) else (v,)):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype == torch.float64:
                continue
            if current == torch.float32 or t.dtype == torch.float32:
                current = torch.float32
            elif t.dtype != lower:
                raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return current


class CudaAutocast:
    """CUDA's autocast policy on the fake CPU run, for as long as it is entered (:meth:`__enter__` registers the
    kernels, :meth:`__exit__` removes them and drops the cache); :meth:`region` is the step's ``amp`` region."""

    def __init__(self) -> None:
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.counts: Counter[tuple[str, str]] = Counter()  # (policy, op) -> calls that cast or set a dtype
        self.cached = 0  # weight casts made once and reused from the cache
        self.made = 0  # casts made (cached or not)
        self._library: Any = None
        self._schemas: dict[str, Any] = {}

    # --- registration ------------------------------------------------------------------------------------
    def __enter__(self) -> CudaAutocast:
        library = torch.library.Library("aten", "IMPL")
        try:
            registered = cuda_registered()
            with warnings.catch_warnings():  # the dispatcher says it overrides CPU autocast's kernels: it is meant
                warnings.simplefilter("ignore", UserWarning)
                for name, policy in POLICIES.items():
                    if name in registered and _exists(name):
                        library.impl(name, self._kernel(name, policy), "AutocastCPU")
                for name in cpu_registered() - registered:
                    library.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
        except BaseException:
            destroy_library(library)
            raise
        self._library = library
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._library is not None:
            destroy_library(self._library)
            self._library = None
        self.clear()

    def clear(self) -> None:
        """The end of the outermost autocast region: its cached casts go (``clear_autocast_cache``)."""
        self.cache.clear()

    def region(self, dtype: torch.dtype) -> _Region:
        """``torch.autocast("cpu", dtype=dtype)`` as the outermost region, entered once per forward: the cache ends
        with it, as autocast's does."""
        return _Region(self, dtype)

    # --- the casts ---------------------------------------------------------------------------------------
    def cast(self, to: torch.dtype, arg: Any) -> Any:
        """``cached_cast(to, arg)``: an eligible tensor of another dtype cast with ``Tensor.to`` (autograd records
        it); lower-precision casts of fp32 leaves requiring grad, not views, kept for the region while the cache is
        on, outside ``inference_mode``. Lists of tensors element by element; anything else as it is."""
        if isinstance(arg, (list, tuple)):
            if arg and all(isinstance(t, torch.Tensor) for t in arg):
                return type(arg)(self.cast(to, t) for t in arg)
            return arg
        if not _eligible(arg) or arg.dtype == to:
            return arg
        self.made += 1
        # no hit under inference_mode: the installed cached_cast casts a weight again for each op there (three
        # matmuls of one weight: three casts under inference_mode, one under no_grad; CPU and CUDA share it)
        cacheable = (to == torch.get_autocast_dtype("cpu") and arg.dtype == torch.float32 and arg.requires_grad
                     and arg.is_leaf and not arg._is_view() and torch.is_autocast_cache_enabled()
                     and not torch.is_inference_mode_enabled())
        if not cacheable:
            return arg.to(to)
        hit = self.cache.get(id(arg))
        if hit is not None and hit[0] is arg:
            self.cached += 1
            return hit[1]
        out = arg.to(to)
        self.cache[id(arg)] = (arg, out)
        return out

    def cast_all(self, to: torch.dtype, args: Any, kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        return [self.cast(to, a) for a in args], {k: self.cast(to, v) for k, v in kwargs.items()}

    def _kernel(self, name: str, policy: str) -> Any:
        op = _overload(name)
        if policy == "banned":
            def banned(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError(_BANNED_MESSAGE)
            return banned
        if policy == "fp32_set_opt_dtype":
            return functools.partial(self._set_opt_dtype, name, op)
        if policy == "fp32_append_dtype":
            return functools.partial(self._append_dtype, name, _overload(APPEND_DTYPE[name]))
        return functools.partial(self._cast_and_call, name, policy, op)

    def _cast_and_call(self, name: str, policy: str, op: Any, *args: Any, **kwargs: Any) -> Any:
        """``lower_precision_fp``, ``fp32`` and ``promote``: every tensor input cast, the op run below autocast."""
        lower = torch.get_autocast_dtype("cpu")
        to = lower if policy == "lower" else torch.float32 if policy == "fp32" else \
            _promote_type([*args, *kwargs.values()], lower)
        with _autocast_off():
            made = self.made
            cast_args, cast_kwargs = self.cast_all(to, args, kwargs)
            if self.made > made:
                self.counts[(str(to).replace("torch.", ""), name.split(".")[0])] += 1
            return op(*cast_args, **cast_kwargs)

    def _set_opt_dtype(self, name: str, op: Any, *args: Any, **kwargs: Any) -> Any:
        """``fp32_set_opt_dtype``: where the first input is eligible and no ``dtype`` was given, the op runs with
        ``dtype=torch.float32`` (an fp32 output, no copy of the input); CUDA's ``softmax``/``log_softmax`` of an
        fp16 input with an fp32 dtype run ``_softmax(x, dim, half_to_float=True)``, with no fp32 copy of the input
        (``SoftMax.cpp``; the CPU's composite copies it first)."""
        with _autocast_off():
            if not args or not _eligible(args[0]):
                return op(*args, **kwargs)
            args, kwargs = self._with_dtype(name, op, list(args), dict(kwargs))
            self.counts[("float32", name.split(".")[0])] += 1
            x = args[0]
            if name in _SOFTMAXES and x.dtype == torch.float16 and args[2] == torch.float32:
                inner = torch.ops.aten._softmax if name == "softmax.int" else torch.ops.aten._log_softmax
                return inner.default(x, args[1], True)
            return op(*args, **kwargs)

    def _with_dtype(self, name: str, op: Any, args: list[Any], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        """``set_opt_dtype``: the ``dtype`` argument set to fp32 where it is unset (positional or keyword-only)."""
        schema = self._schemas.get(name)
        if schema is None:
            schema = self._schemas[name] = op._schema
        for i, arg in enumerate(schema.arguments):
            if arg.name != "dtype":
                continue
            if arg.kwarg_only:
                if kwargs.get("dtype") is None:
                    kwargs["dtype"] = torch.float32
                return args, kwargs
            while len(args) <= i:
                args.append(schema.arguments[len(args)].default_value)
            if args[i] is None:
                args[i] = torch.float32
            return args, kwargs
        return args, kwargs

    def _append_dtype(self, name: str, redispatch: Any, *args: Any, **kwargs: Any) -> Any:
        """``fp32_append_dtype``: ``norm`` redispatched to its dtype-taking overload, fp32 where the input is
        eligible, else its own dtype."""
        with _autocast_off():
            x = args[0]
            out = torch.float32 if _eligible(x) else x.dtype
            if out == torch.float32:
                self.counts[("float32", name.split(".")[0])] += 1
            rest = list(args[1:])
            if name == "norm.Scalar":
                p = rest[0] if rest else kwargs.get("p", 2)
                return redispatch(x, p, dtype=out)
            p, dim = rest[0], rest[1] if len(rest) > 1 else kwargs["dim"]
            keepdim = rest[2] if len(rest) > 2 else kwargs.get("keepdim", False)
            return redispatch(x, p, dim, keepdim, dtype=out)

    # --- what the estimate says --------------------------------------------------------------------------
    def note(self) -> str:
        r = release()
        text = f"autocast modelled with CUDA's op lists (PyTorch {r[0]}.{r[1]}'s AutocastCUDA registrations)"
        if not self.counts:
            return text + ": no op was cast"
        by_dtype: dict[str, Counter[str]] = {}
        for (dtype, op), n in self.counts.items():
            by_dtype.setdefault(dtype, Counter())[op] += n
        parts = []
        for dtype in sorted(by_dtype):
            ops = by_dtype[dtype].most_common()
            shown = ", ".join(f"{op} × {n}" for op, n in ops[:4]) + (", ..." if len(ops) > 4 else "")
            parts.append(f"to {dtype}: {shown}")
        text += ": " + "; ".join(parts)
        if self.cached:
            text += f"; {self.cached} weight casts reused from autocast's cache"
        unknown = unknown_policies()
        if unknown:
            text += f"; not modelled (policy unknown to this version): {', '.join(sorted(unknown))}"
        return text


class _Region:
    def __init__(self, autocast: CudaAutocast, dtype: torch.dtype) -> None:
        self.autocast, self.dtype = autocast, dtype
        self.inner: list[Any] = []

    def __enter__(self) -> None:
        inner = torch.autocast("cpu", dtype=self.dtype)
        inner.__enter__()
        self.inner.append(inner)

    def __exit__(self, *exc: Any) -> None:
        try:
            self.inner.pop().__exit__(*exc)
        finally:
            self.autocast.clear()


class CudaAutocastMode(TorchFunctionMode):
    """CUDA's autocast policy for the functions caught above the dispatcher by ``CudaKernelMode`` (entered below
    this mode): ``F.scaled_dot_product_attention`` (``lower_precision_fp``: query, key, value and a float mask cast)
    and ``F.rms_norm`` (``fp32``, where the release registers it), each then run with autocast off, as the C++ kernel
    redispatches (so the math kernel's own matmuls and softmax are not cast again). Leaving it (the end of the run,
    or of a checkpoint's recompute, which enters it again) ends the cache of the autocast region it was in."""

    _FUNCTIONS = {F.scaled_dot_product_attention: "scaled_dot_product_attention", F.rms_norm: "rms_norm"}

    def __init__(self, autocast: CudaAutocast) -> None:
        super().__init__()
        self.autocast = autocast

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = self._FUNCTIONS.get(func)
        if name is None or not torch.is_autocast_enabled("cpu"):
            return func(*args, **kwargs)
        policy = cuda_policy(name)
        if policy not in ("lower", "fp32"):
            return func(*args, **kwargs)
        to = torch.get_autocast_dtype("cpu") if policy == "lower" else torch.float32
        with _autocast_off():
            made = self.autocast.made
            cast_args, cast_kwargs = self.autocast.cast_all(to, args, kwargs)
            if self.autocast.made > made:
                self.autocast.counts[(str(to).replace("torch.", ""), name)] += 1
            return func(*cast_args, **cast_kwargs)

    def __exit__(self, *exc: Any) -> Any:
        self.autocast.clear()
        return super().__exit__(*exc)


def cuda_autocast(device: str, amp: Any) -> Any:
    """A :class:`CudaAutocast` to enter for a trace for ``device`` with autocast ``amp``, or ``None`` (the CPU's
    autocast, unchanged)."""
    return CudaAutocast() if device == "cuda" and amp is not None else None


__all__ = ["APPEND_DTYPE", "BANNED", "CUDA_BUILD_ONLY", "FP32", "LOWER", "POLICIES", "PROMOTE", "SET_OPT_DTYPE",
           "CudaAutocast", "CudaAutocastMode", "cpu_registered", "cuda_autocast", "cuda_policy", "cuda_registered",
           "release", "unknown_policies"]
