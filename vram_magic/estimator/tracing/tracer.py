"""The engine's live-storage tracker, taught about a fake step: which stage and module made each storage,
the FLOPs of every op, the convolutions whose kernels use scratch the dispatcher cannot see, and the op that
fake tensors could not run.

The tracker counts; the step tracer hears of module forwards, new storages and frees through its public observer
hooks (:class:`StepObserver`), and runs each op itself (fake tensors' own rules: value reads, problems, FLOPs).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from ...engine.phases import PHASE_NAMES, Phase
from ...engine.scan.registry import Entry, LiveStorages
from ...engine.torch_private import never_compiled
from ...engine.tracker.mode import Tracker
from ...engine.tracker.observer import TrackerObserver
from ...engine.tracker.op_kinds import aliases, is_composite, run_decomposed
from ...engine.tracker.scratch_ops import gemm_copies
from ..device.sdpa import BACKWARD_OPS, SDPA, CudaAttention, call_with
from ..fake.known_values import answer, drawn, propagate
from ..torch_private import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
    pop_mode,
    push_mode,
)
from .fake_outputs import FakeOutputs
from .kernels import OWN
from .oplog import OpLog, Traits, op_traits
from .routing import CHOOSERS, Routing

# The stages of a traced step (engine/phases.py holds every phase), under the names they always had here
SETUP, FORWARD, LOSS, BACKWARD, OPTIMIZER, ZERO_GRAD = Phase.SETUP, Phase.FORWARD, Phase.LOSS, Phase.BACKWARD, \
    Phase.OPTIMIZER, Phase.ZERO_GRAD
STAGES = ("setup", "forward", "loss", "backward", "optimizer", "zero_grad")

_ITEM = torch.ops.aten._local_scalar_dense.default
_DEVICE = torch.ops.prim.device.default
_CONV = torch.ops.aten.convolution.default
_CONV_BACKWARD = torch.ops.aten.convolution_backward.default
_MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "_scaled_dot_product_flash_attention_for_cpu",
                       "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                       "_scaled_dot_product_cudnn_attention"})
_RNN = torch.ops.aten.mkldnn_rnn_layer.default
_RNN_BACKWARD = torch.ops.aten.mkldnn_rnn_layer_backward.default
_MM_OPS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default})
_GEMM_OPS = _MM_OPS | {torch.ops.aten.bmm.default}
_HALF = (torch.bfloat16, torch.float16)
FAKE_PROBLEMS = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)


def strided_spec(args: Any) -> Any:
    """A GEMM's arguments as ``("S", shape, stride, dtype)`` (layout matters to oneDNN's packing), others as is."""
    return tuple(("S", tuple(int(x) for x in a.shape), tuple(int(x) for x in a.stride()), a.dtype)
                 if isinstance(a, torch.Tensor) else a for a in args)


def _strides_like_channels_last(t: torch.Tensor) -> bool:
    """``Tensor::suggest_memory_format() == ChannelsLast`` (c10 ``is_channels_last_strides_2d_s4``), which is how
    oneDNN's convolutions choose their layout. A tensor with size-1 dimensions can be contiguous in both formats
    (a ``permute`` back from NHWC of ``(N, C, 1, 1)``: strides ``(C, 1, C, C)``); the convolution reads its
    strides as channels-last, and its scratch differs (ConvNeXt's depthwise backward: 6.4 MB against 0.1 MB)."""
    sizes, strides = t.shape, t.stride()
    if strides[1] == 0:
        return False
    low = 0
    for d in (1, 3, 2, 0):
        if sizes[d] == 0 or strides[d] < low:
            return False
        if d == 0 and low == strides[1]:  # N111: not channels-last
            return False
        low = strides[d] * (sizes[d] if sizes[d] > 1 else 1)
    return True


def tensor_spec(t: Any, channels_last: bool = False) -> Any:
    """``("T", shape, dtype, channels-last)`` for a tensor (``channels_last``: every 4-d tensor counted so, as
    Inductor lays them out), the same inside lists and tuples, anything else as is."""
    if isinstance(t, torch.Tensor):
        cl = t.dim() == 4 and (channels_last or _strides_like_channels_last(t))
        return ("T", tuple(int(s) for s in t.shape), t.dtype, cl)
    if isinstance(t, (list, tuple)):
        return tuple(tensor_spec(v, channels_last) for v in t)
    return t


# op -> its only kernel is its decomposition, with no CPU kernel of its own (as ``silu_backward`` has)
_COMPOSITE: dict[Any, bool] = {}
# op -> what the op log keeps of its kind (oplog.py)
_KIND: dict[Any, Traits] = {}


def _shapes(args: Any, kwargs: Any) -> str:
    """The arguments an op saw, as people read them: ``(4, 64, 128) float32, (4, 1, 64, 64) bool, 0.5``."""
    parts = []
    for a in list(args) + list((kwargs or {}).values()):
        if isinstance(a, torch.Tensor):
            parts.append(f"{tuple(a.shape)} {str(a.dtype).replace('torch.', '')}")
        elif isinstance(a, (list, tuple)) and a and all(isinstance(x, torch.Tensor) for x in a):
            parts.append("[" + ", ".join(str(tuple(x.shape)) for x in a) + "]")
        elif isinstance(a, (int, float, bool)) or a is None:
            parts.append(repr(a))
    return ", ".join(parts)


def reads_input(args: Any, kwargs: Any, input_keys: set[int]) -> bool:
    """Whether an op's arguments include one of the inputs (``input_keys``: ``id()`` of their storages) directly."""
    for a in list(args) + list((kwargs or {}).values()):
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, torch.Tensor):
                try:
                    if id(t.untyped_storage()) in input_keys:
                        return True
                except (RuntimeError, NotImplementedError):
                    pass
    return False


class StepObserver(TrackerObserver):
    """What the step tracer hears from the tracker: the module stack by name, which stage and module made each
    storage, and the frees of values already counted as freed (:meth:`.FakeOutputs.release`)."""

    def __init__(self, tracer: StepTracer) -> None:
        self.tracer = tracer

    def module_entered(self, module: Any) -> None:
        tracer = self.tracer
        tracer.modstack.append(tracer.names.get(id(module), type(module).__name__))

    def module_exited(self, module: Any) -> None:
        if self.tracer.modstack:
            self.tracer.modstack.pop()

    def storage_counted(self, entry: Entry) -> None:
        tracer = self.tracer
        recompute = tracer.stage == BACKWARD and bool(tracer.modstack)
        tracer.made[entry.serial] = (tracer.stage, tracer.module(), recompute)

    def storage_freed(self, entry: Entry) -> bool:
        fused = self.tracer.outputs.fused
        if entry.serial in fused:
            fused.discard(entry.serial)
            return False
        return True


class StepTracer(Tracker):
    """Counts the storages of fake tensors (their storages live on ``meta``) during a traced step."""

    def __init__(self, registry: LiveStorages, names: dict[int, str],
                 observer: type[StepObserver] | None = None) -> None:
        super().__init__(registry, "meta", record_sites=False, observer=(observer or StepObserver)(self))
        self.stage = SETUP
        self.names = names
        self.modstack: list[str] = []
        self.made: dict[int, tuple[int, str, bool]] = {}  # serial -> (stage, module, made by a recompute)
        self.flops = [0] * len(PHASE_NAMES)  # per stage
        self.convs: list[tuple[int, Any, Any]] = []  # (events so far, op, argument specs)
        self.problem: tuple[str, str, str] | None = None  # (op, module, exception name)
        self.item_value = 1.0
        self.failed_in: tuple[str, str, str] | None = None  # (op, module, argument shapes)
        self.answered = 0  # value reads answered from real values
        self.draws: list[str] = []  # modules whose value reads were answered from a stated random draw
        self.input_keys: set[int] = set()  # id() of the inputs' storages
        self.failed_stage = SETUP
        self.failed_on_input = False  # the failing op read an input tensor (or a view of one) directly
        self.outputs = FakeOutputs(self.counts, registry)  # how a fake op's outputs are counted
        # set while the compiler works inside the step (AOTAutograd compiles the backward at its first call):
        # the tensors its passes make on their own fake tensors are no memory of the step
        self.compiling = False
        self.target = "cuda"  # the device the step is estimated for ("cpu" or "cuda")
        self.channels_last_convs = False  # set while a compiled graph runs its convolutions channels-last
        self.rnns: list[tuple[int, Any, Any, int]] = []  # (events so far, op, argument specs, workspace serial)
        self.copies: list[tuple[int, int]] = []  # (events so far, bytes) of operand copies inside CPU GEMMs
        self.gemms: list[tuple[int, Any, Any]] = []  # (events so far, op, strided argument specs): half GEMMs
        self.matmul = False  # cuBLAS would be used (and allocate its workspace) on CUDA
        self.ops = OpLog()  # every op's stage, kind, dtype, FLOPs and bytes moved, for the time model
        # set for a CUDA estimate: SDPA runs as the CUDA kernel PyTorch would pick (estimator/device/sdpa.py)
        self.attention: CudaAttention | None = None
        self.scratching = False  # set while a CUDA attention backward runs with its kernel's scratch alive
        self.routing: Routing | None = None  # the model's MoE blocks and the routing assumed in them (routing.py)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # off while TorchDynamo and AOTAutograd compile a model (their tracing is no memory of the step), on while
        # the compiled graphs run
        return True

    def module(self) -> str:
        """The innermost module whose forward runs now, by name ("" outside any)."""
        return self.modstack[-1] if self.modstack else ""

    # --- storages ---------------------------------------------------------------------------------------
    # --- SDPA as the CUDA kernel runs it --------------------------------------------------------------------
    def _cuda_sdpa(self, args: Any, kwargs: Any) -> Any:
        """The op reached this mode whole (under ``inference_mode``): the model's ops, each seen by this mode."""
        assert self.attention is not None
        push_mode(self)
        try:
            return call_with(self.attention, args, kwargs or {})
        finally:
            pop_mode()

    def _with_scratch(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        """A CUDA attention backward op, with the buffers its kernel allocates for itself alive while it runs."""
        assert self.attention is not None
        push_mode(self)
        try:
            scratch = [torch.empty(shape, dtype=dtype) for shape, dtype in self.attention.backward_scratch(func, args)]
        finally:
            pop_mode()
        self.scratching = True
        try:
            return self.__torch_dispatch__(func, types, args, kwargs)
        finally:
            self.scratching = False
            del scratch

    def _own_kernel(self, func: Any, own: Any, args: Any, kwargs: Any) -> Any:
        """An op run by the estimator's own fake kernel (kernels.py); the buffers its real kernel holds besides its
        outputs (``_ctc_loss_backward``'s ``log_beta``) alive for a moment once the outputs are counted."""
        kernel, scratch = own
        out = kernel(*args, **kwargs)
        shapes = scratch(*args, **kwargs)
        if shapes:
            self.outputs.see_outputs(out, func)  # counted once: the caller's second look finds them known
            push_mode(self)
            try:
                held = [torch.empty(shape, dtype=dtype) for shape, dtype in shapes]
            finally:
                pop_mode()
            del held
        return out

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.attention is not None and not self.compiling:
            if func is SDPA:
                return self._cuda_sdpa(args, kwargs)
            if func in BACKWARD_OPS and not self.scratching:
                return self._with_scratch(func, types, args, kwargs)
        if self.compiling:
            return func(*args, **(kwargs or {}))
        if func is _DEVICE:
            # Asked tens of thousands of times by autograd and optimizers; answer as FakeTensor would,
            # without the trip through the fake mode (a third of a big model's estimate time).
            fake = args[0]
            mode = getattr(fake, "fake_mode", None)
            if mode is not None:
                return torch.device("meta") if mode.in_kernel_invocation else fake.fake_device
        kwargs = kwargs or {}
        composite = _COMPOSITE.get(func)
        if composite is None:
            composite = _COMPOSITE[func] = is_composite(func, ("CPU",))
        if composite:
            # Under inference_mode, composite ops (linear, cross_entropy_loss, ...) reach the dispatch mode whole;
            # the fake kernel would decompose them out of our sight. Their parts allocate real memory (the
            # log-softmax inside a loss), so they are decomposed here, with this mode seeing each part.
            out = run_decomposed(self, func, args, kwargs)
            if out is not NotImplemented:
                return out
        if func is _ITEM:
            # A value read on the host. Optimizers such as Adafactor read norms; memory does not depend on
            # the value. In the model itself it may steer control flow, so it is reported as a problem.
            if self.stage == OPTIMIZER:
                return self.item_value
        own = OWN.get(func)
        try:
            out = func(*args, **kwargs) if own is None else self._own_kernel(func, own, args, kwargs)
        except FAKE_PROBLEMS as err:
            # a value read or a value-dependent shape: answered from the real values of small tensors
            # (masks, ids) when they are known, as the real run would answer it
            known, out = answer(func, args, kwargs)
            if self.routing is not None:
                self.routing.answered(args, known, self.modstack)
            if not known:
                if self.problem is None:
                    self.problem = (str(func), self.module() or "(top level)", type(err).__name__)
                raise
            self.answered += 1
            if drawn(args):
                self.draws.append(self.module() or "(top level)")
        except Exception:
            if self.failed_in is None:  # the module hooks unwind before the caller sees the exception
                self.failed_in = (str(func), self.module() or "(top level)", _shapes(args, kwargs))
                self.failed_stage = self.stage
                self.failed_on_input = reads_input(args, kwargs, self.input_keys)
            raise
        else:
            propagate(func, args, kwargs, out)
            if self.routing is not None and func in CHOOSERS:
                self.routing.chose(func, self.modstack, args, kwargs, out)
        self.outputs.see_outputs(out, func)
        packet = func.overloadpacket
        counter = flop_registry.get(packet)
        flops = int(counter(*args, **kwargs, out_val=out)) if counter is not None else 0
        self.flops[self.stage] += flops
        traits = _KIND.get(func)
        if traits is None:
            traits = _KIND[func] = op_traits(func, aliases(func))
        self.ops.record(traits, packet.__name__, self.stage, self.stage == BACKWARD and bool(self.modstack), flops,
                        args, kwargs, out)
        if not self.matmul and packet.__name__ in _MATMULS:
            self.matmul = True
        if func is _CONV or func is _CONV_BACKWARD:
            self.convs.append((len(self.counts.events), func, tensor_spec(args, self.channels_last_convs)))
        elif func is _RNN or func is _RNN_BACKWARD:
            workspace = 0
            if func is _RNN:  # fake kernels return an empty workspace; the real one is sized by probing
                entry = self.registry.get(id(out[3].untyped_storage()))
                workspace = entry.serial if entry is not None else 0
            self.rnns.append((len(self.counts.events), func, tensor_spec(args), workspace))
        elif func in _GEMM_OPS and isinstance(out, torch.Tensor) and out.dtype in _HALF:
            # half-precision GEMMs go through oneDNN, whose packing scratch depends on shapes, strides and
            # threads: measured per distinct GEMM (scratch.gemm_scratch), not derived from a rule
            self.gemms.append((len(self.counts.events), func, strided_spec(args)))
        elif func in _MM_OPS and isinstance(out, torch.Tensor):
            extra = gemm_copies(func, args, out)
            if extra:
                self.copies.append((len(self.counts.events), extra))
        return out


never_compiled(StepTracer.__torch_dispatch__)  # see engine.torch_private.never_compiled
