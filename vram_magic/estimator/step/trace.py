"""The fake run: two steps (forward, loss, backward, optimizer step, ``zero_grad``) of the user's model on
fake CPU tensors under the live-storage tracker. Optimizer state appears in the first step; the
steady-state peak is in the second. What comes out is plain data: every storage's size and owner, and the
order of allocations and frees.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...engine.phases import PHASE_CATEGORY, Phase, phase_category
from ...engine.scan.registry import LiveStorages
from ..device.autocast import CudaAutocastMode, cuda_autocast
from ..device.sdpa import CudaAttention, CudaKernelMode
from ..fake.convert import call_model, from_specs, has_lazy, materialize_lazy, resize, size_of, tensors_in
from ..fake.frameworks import enable_checkpointing, fake_run, not_tracing
from ..fake.lora import adapt_linear_layers
from ..fake.quantize import count_parameters, parameter_labels
from ..fake.request import Request
from ..fake.scripted import has_scripted
from ..options import Options
from ..torch_private import FakeTensorMode
from ..tracing.errors import EstimateError, failure_message
from ..tracing.routing import routing_for
from ..tracing.traced import FakeRun
from ..tracing.tracer import BACKWARD, FAKE_PROBLEMS, FORWARD, LOSS, OPTIMIZER, SETUP, ZERO_GRAD, StepTracer
from .experts import ExpertLabels
from .first_step import claim_state, run_first_step, state_key
from .loss import describe_loss, stand_in_loss
from .low_bit_optimizers import ModelledOptimizer, paged_bytes, recipe_note
from .muon import MUON_NOTE, MuonWithAdamW
from .optimizers import is_fused
from .recipes.levers import Levers, checkpoint_context, make_step_optimizer


def checkpoint_units(model: nn.Module) -> list[nn.Module]:
    """The blocks activation checkpointing (and FSDP) wraps: the children of the longest ModuleList, Sequential or
    ModuleDict (a pipeline stage's layers, torchtitan's) of like modules; else the model's children."""
    best: list[nn.Module] = []
    for m in model.modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential, nn.ModuleDict)) and len(m) >= 2:
            kids = list(m.values()) if isinstance(m, nn.ModuleDict) else list(m)
            kinds = {type(k) for k in kids}
            if len(kinds) == 1 and len(kids) > len(best) and any(True for _ in kids[0].parameters()):
                best = kids
    if not best:
        best = [c for c in model.children() if any(True for _ in c.parameters())]
    return best


def trace_step(request: Request, opts: Options, sdpa: tuple[tuple[int, int], bool] | None = None,
               states: dict[Any, Any] | None = None) -> FakeRun:
    """The fake run; ``sdpa``: ``(compute capability, whether the GPU was named)`` to run attention as the CUDA
    kernels do (:func:`.cuda_attention.target_capability`), ``None`` to keep the CPU's; ``states``: the optimizer
    state that earlier fake runs of the same workload left after their first step (``first_step.py``), read and
    added to."""
    import time

    t0 = time.perf_counter()
    with fake_run() as mode:
        return _trace(request, opts, mode, t0, sdpa, states)


def _trace(request: Request, opts: Options, mode: FakeTensorMode, t0: float, sdpa: Any,
           states: dict[Any, Any] | None = None) -> FakeRun:
    from ..layouts.rank_trace import rank_trace

    step = _FakeStep(request, opts, mode, rank_trace(opts))
    step.states = states
    step.build()
    step.prepare()
    if sdpa is not None:
        step.tracer.attention = CudaAttention(*sdpa)
    step.autocast = cuda_autocast(opts.device, opts.amp)  # amp= for CUDA: CUDA's op lists
                                                          # (estimator/device/autocast.py)
    with step.autocast if step.autocast is not None else contextlib.nullcontext():
        step.run()
    return step.result(t0)


def _shaped_specs(request: Request, opts: Options,
                  mode: FakeTensorMode) -> tuple[Any, int | None, int | None, int | None]:
    """``(specs, batch, seq, micro-batch)``: the inputs resized to the asked batch and sequence length, then to one
    micro-batch of gradient accumulation."""
    specs = request.input_specs(mode)
    batch, seq = size_of(specs, 0), size_of(specs, 1)
    if opts.batch is not None and batch is not None:
        specs, batch = resize(specs, 0, batch, opts.batch), opts.batch
    if opts.seq is not None and seq is not None:
        specs, seq = resize(specs, 1, seq, opts.seq), opts.seq
    if opts.cp > 1:  # a context-parallel rank runs its shard of the sequence (layouts/context.py)
        from ..layouts.context import shard_length

        specs = resize(specs, 1, seq, shard_length(seq, opts.cp))
    micro_batch = batch
    if opts.accumulate > 1 and batch is not None:
        micro_batch = -(-batch // opts.accumulate)
        specs = resize(specs, 0, batch, micro_batch)
    return specs, batch, seq, micro_batch


class _FakeStep:
    """One fake run, a method per job: the model and its inputs on fake tensors (:meth:`build`), the optimizer,
    the storages alive before the step and the tracer (:meth:`prepare`), the steps under the tracer
    (:meth:`run`), and the plain numbers they leave (:meth:`result`)."""

    def __init__(self, request: Request, opts: Options, mode: FakeTensorMode, parallel: Any = None) -> None:
        self.request, self.opts, self.mode = request, opts, mode
        self.parallel = parallel  # one rank of a tensor- or pipeline-parallel job (layouts/rank_trace.py), or None
        self.owner: dict[int, tuple[str, str]] = {}
        self.marks: dict[str, int] = {}
        self.host_scalars: set[int] = set()
        self.problem: str | None = None
        self.loss_used = "loss_fn (given)" if request.loss_fn is not None else ""
        self.last_flops: list[int] = []
        self.n_micro = 1 if opts.inference else min(opts.accumulate, 2)
        self.ops_start = 0  # the op log's row where the last step starts
        self.autocast: Any = None  # CUDA's autocast policy (estimator/device/autocast.py), for amp= estimates for CUDA
        self.states: dict[Any, Any] | None = None  # the optimizer state earlier runs' first steps left (first_step.py)
        self.levers = Levers(opts)  # the recipes' levers (step/recipes/): the user's step, the loss, what is saved
        self.experts: ExpertLabels | None = None  # the MoE experts' parameters, gradients and state (experts.py)

    # --- the model and its inputs on fake tensors -------------------------------------------------------------
    def build(self) -> None:
        opts, mode = self.opts, self.mode
        model, self.compiled = self.request.fake_model(mode, opts.dtype)
        self.specs, self.batch, self.seq, self.micro_batch = _shaped_specs(self.request, opts, mode)
        if has_lazy(model):
            try:
                materialize_lazy(model, self.specs, mode, opts.dtype, call_model)
            except Exception as err:
                raise EstimateError(f"the model's lazy modules make their parameters on a first forward, which "
                                    f"failed on meta tensors ({type(err).__name__}: {err}); run one forward of the "
                                    "model before estimating it") from err
        with mode:
            self.inputs = from_specs(self.specs, opts.dtype if opts.amp is None else None)
        model, self.notes = adapt_linear_layers(model, opts, mode)  # quantize=, lora=
        if opts.float8:  # torchao's Float8Linear in place of the linear layers (step/float8.py)
            from .float8 import float8_linears

            model = float8_linears(model, mode, self.notes)
        if opts.inference:
            model.eval()
        else:
            model.train()
        if self.parallel is not None:
            model = self.parallel.build(self, model, checkpoint_units)
            self.notes += self.parallel.notes
        self.context = None  # context parallelism's ring attention (layouts/context.py)
        if opts.cp > 1:
            from ..layouts.context import ring_shapes

            self.context = ring_shapes(model, opts, self.micro_batch, self.seq // opts.cp)
        self.units = checkpoint_units(model)
        if opts.checkpointing and not opts.inference:
            self.notes.append("checkpointing: " + enable_checkpointing(
                model, self.units, int(opts.checkpointing), modes=not self.compiled,
                context_fn=checkpoint_context(opts, not self.compiled)))
        self.levers.build(model, self.inputs)
        self.model = model

    # --- the optimizer, the storages alive before the step, the tracer ------------------------------------------
    def prepare(self) -> None:
        opts, mode, model = self.opts, self.mode, self.model
        self.params = [p for p in model.parameters()]
        self.trainable = [p for p in self.params if p.requires_grad]
        if not opts.inference and not self.trainable:
            raise EstimateError("the model has no parameters that require gradients; use inference=True")
        self.optimizer: torch.optim.Optimizer | None = None
        self.masters: list[nn.Parameter] = []
        if not opts.inference:
            with mode:
                if opts.master_weights:  # the optimizer updates an fp32 copy; the model keeps bf16/fp16 weights
                    # empty_like: a tensor-parallel rank's DTensor parameter gets a master of its own shard
                    self.masters = [nn.Parameter(torch.empty_like(p, dtype=torch.float32)) for p in self.trainable]
                self.optimizer = make_step_optimizer(opts, self.masters or self.trainable)
        self.registry = LiveStorages()
        self.experts = ExpertLabels.of(model, self.trainable, self.masters, self.optimizer, self._events)
        for p, label in parameter_labels(model):  # quantized, adapters, frozen: named before the plain ones
            self.claim(p, ("parameters", label))
        for p in self.params:
            self.claim(p, ("parameters", "parameters"))
        for b in model.buffers():
            self.claim(b, ("other", "buffers"))
        for t in tensors_in(self.inputs):
            self.claim(t, ("other", "inputs"))
        for m in self.masters:
            self.claim(m, ("optimizer_state", "fp32 master weights"))
        self.updater: Any = _MasterStep(self.optimizer, self.trainable, self.masters) if self.masters else \
            self.optimizer
        self.names = {id(m): (name or type(m).__name__) for name, m in model.named_modules()}
        self.runner = self._runner()
        if self.parallel is not None:
            self.parallel.prepare(self)
        self.tracer = (self.parallel.tracer if self.parallel is not None else self.levers.tracer_class)(self.registry,
                                                                                                       self.names)
        self.tracer.target = opts.device
        self.tracer.routing = routing_for(model, self.names, opts.moe_imbalance)  # MoE blocks (tracing/routing.py)
        self.levers.prepare(self)
        if isinstance(self.optimizer, ModelledOptimizer):  # its update's row in the op log, for the time model
            self.optimizer.ops = self.tracer.ops
            self.notes.append(recipe_note(self.optimizer.recipe, opts.device))
        elif isinstance(self.optimizer, MuonWithAdamW):
            self.notes.append(MUON_NOTE)
        self.tracer.input_keys = {id(t.untyped_storage()) for t in tensors_in(self.inputs) if t.layout == torch.strided}

    def claim(self, t: Any, cat: tuple[str, str]) -> int | None:
        """``t``'s storage counted as ``cat`` (unless something claimed it first); its serial."""
        if self.experts is not None and isinstance(t, torch.Tensor):
            cat = self.experts.label(t, cat)
        if self.parallel is not None:
            t = self.parallel.local(t)
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return None
        entry = self.registry.add(t.untyped_storage())
        self.owner.setdefault(entry.serial, cat)
        return entry.serial

    def _events(self) -> int:
        """The tracer's events so far (-1 before it exists): what changes when gradients or state may have."""
        tracer = getattr(self, "tracer", None)
        return len(tracer.counts.events) if tracer is not None else -1

    def _runner(self) -> Any:
        """What the step calls: the model, with its compiled parts compiled again on the fake copy
        (``tracing/compiled/backend.py``)."""
        if not self.compiled:
            return self.model
        from ..tracing.compiled.backend import EAGER_NOTE, NOTE, recompile, supported

        where = ", ".join(repr(n) if n else "the whole model" for n in sorted(self.compiled))
        if supported():
            runner = recompile(self.model, self.compiled)
            self.notes.append(f"{NOTE}; compiled: {where}")
            return runner
        # never call compiled code under the tracker here: TorchDynamo would skip (and poison) the frame
        self.notes.append(EAGER_NOTE.format(version=torch.__version__) + f"; compiled: {where}")
        self.compiled = {}
        return self.model

    # --- the steps under the tracer ---------------------------------------------------------------------------
    def run(self) -> None:
        """The steps; a value fake tensors do not have ends the run early with a partial estimate."""
        opts, tracer = self.opts, self.tracer
        # TorchScript's profiling executor runs a module's code as written first and an optimized graph (its own
        # autodiff, other saved tensors) from the next call with the same input types on: real steps until then
        scripted = has_scripted(self.model)
        steps = max(opts.steps, 3) if scripted and opts.steps > 1 else opts.steps
        self.amp: Any = self.autocast.region(opts.amp) if self.autocast is not None else \
            torch.autocast("cpu", dtype=opts.amp) if opts.amp is not None else contextlib.nullcontext()
        try:
            with self.mode, tracer, _compiled_step(bool(self.compiled), tracer), not_tracing(), \
                    _attention_mode(tracer, bool(self.compiled)), _autocast_mode(self.autocast, bool(self.compiled)):
                for step in range(steps):
                    last = step == steps - 1
                    if last:
                        self.marks["step_start"] = len(tracer.counts.events)
                        self.last_flops = list(tracer.flops)
                        self.ops_start = len(tracer.ops)
                    if opts.inference:
                        self._forward(last)
                    elif step == 0 and steps > 1 and not scripted and not self.levers.real_first_step:
                        assert self.optimizer is not None
                        run_first_step(self.updater, self.optimizer, self.masters or self.trainable, self.trainable,
                                       tracer, self.claim, self.host_scalars, self.states, self._state_key())
                    else:
                        self._train_step(last)
                tracer.stage = SETUP
        except FAKE_PROBLEMS as err:
            where = tracer.problem or (str(err), tracer.module() or "(top level)", type(err).__name__)
            self.problem = (f"{where[0]} in module {where[1]!r} needs real tensor values ({where[2]}), which fake "
                            "tensors do not have; the estimate covers what ran before it")
            self.marks.setdefault("forward_end", len(tracer.counts.events))
        except EstimateError:
            raise
        except Exception as err:
            user = self.levers.user
            raise EstimateError(user.failure(err, tracer, self.model, self.specs) if user is not None else
                                failure_message(err, tracer, self.model, self.specs)) from err

    def _forward(self, last: bool) -> None:
        """An inference step: one forward under ``inference_mode``."""
        self.tracer.stage = FORWARD
        with torch.inference_mode(), self.amp:
            out = call_model(self.runner, self.inputs)
        if last:
            self.marks["forward_end"] = len(self.tracer.counts.events)
        del out

    def _train_step(self, last: bool) -> None:
        """A training step: forward, loss and backward of each micro-batch, the optimizer step, ``zero_grad``."""
        tracer, marks, optimizer = self.tracer, self.marks, self.optimizer
        if self.levers.user is not None:
            return self.levers.user.run(self, last)
        loss_fn = self.request.loss_fn or self._stated_loss
        out = loss = None
        piped = self.parallel is not None and self.parallel.forward_backward(self, last)
        for micro in range(0 if piped else self.n_micro):
            out = loss = None  # the previous micro-batch's output lives until this one replaces it
            with self.amp, self.levers.saving():
                out, loss = self.levers.forward_loss(self, loss_fn)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise EstimateError("loss_fn must return a scalar tensor, got "
                                    f"{type(loss).__name__}{tuple(getattr(loss, 'shape', ()))}")
            if last and micro == self.n_micro - 1:
                marks["forward_end"] = len(tracer.counts.events)
            if not self.opts.keep_output:  # model(**batch).loss.backward(): the output is freed before backward
                out = None
            tracer.stage = BACKWARD
            loss.backward()
            for p in self.trainable:
                self.claim(p.grad, ("gradients", "gradients"))
        assert optimizer is not None
        for i, p in enumerate(self.trainable):  # state stood in for a parameter this step leaves without a gradient
            key = self.masters[i] if self.masters else p
            if p.grad is None and key in optimizer.state and not self.levers.real_first_step:
                del optimizer.state[key]
        if last:
            marks["backward_end"] = len(tracer.counts.events)
        tracer.stage = OPTIMIZER
        self.updater.step()
        claim_state(optimizer, self.claim, self.host_scalars)
        if last:
            marks["step_end"] = len(tracer.counts.events)
        tracer.stage = ZERO_GRAD
        self.updater.zero_grad(set_to_none=True)
        del out, loss  # as a loop that ends each step with `del out, loss` (or returns) does

    def _state_key(self) -> Any:
        """What decides the state the first step leaves (first_step.state_key); None where the first step always
        runs: for CUDA, whose simulated caching allocator places each block by the order of everything allocated before
        it (state made inside the update, between its temporaries, leaves other segments than state made up front),
        and for a rank of a tensor- or pipeline-parallel job, whose parameters are shards."""
        if self.parallel is not None or self.opts.device != "cpu":
            return None
        return state_key(self.opts.optimizer, self.opts.device, bool(self.masters), self.masters or self.trainable)

    def _bytes(self, p: Any) -> int:
        """A parameter's bytes on this rank (a tensor-parallel shard's own)."""
        return self.parallel.local_bytes(p) if self.parallel is not None else p.numel() * p.element_size()

    def _stated_loss(self, output: Any) -> torch.Tensor:
        loss, self.loss_used = stand_in_loss(output)
        return loss

    # --- the plain numbers ------------------------------------------------------------------------------------
    def result(self, t0: float) -> FakeRun:
        import time

        opts, tracer, owner = self.opts, self.tracer, self.owner
        sizes, module = _label_storages(tracer, owner, self.names, self.model)
        if self.parallel is not None:
            self.parallel.finish(tracer, owner)
        if tracer.attention is not None:
            note = tracer.attention.note()
            if note:
                self.notes.append(note)
        if self.autocast is not None:
            self.notes.append(self.autocast.note())
        if tracer.routing is not None:
            self.notes.extend(tracer.routing.notes())
        if tracer.draws:
            where = ", ".join(sorted(set(tracer.draws)))
            self.notes.append(f"random draws read in the forward (in {where}) were taken at the top of their range: "
                              "'torch.rand() < p' is False, so LayerDrop keeps every layer (the most memory); the real "
                              "step drops each with its probability")
        step_flops = [now - before for now, before in zip(tracer.flops, self.last_flops or [0] * len(tracer.flops))]
        scale = opts.accumulate / self.n_micro if opts.accumulate > 1 else 1.0
        flops = {
            "forward": int((step_flops[FORWARD] + step_flops[LOSS]) * scale),
            "backward": int(step_flops[BACKWARD] * scale),
            "optimizer": int(step_flops[OPTIMIZER]),
        }
        return FakeRun(
            sizes=sizes, owner=owner, module=module, events=tracer.counts.events,
            initial=tuple(tracer.counts.initial) + tuple(tracer.counts.late), marks=self.marks, flops=flops,
            convs=tracer.convs, copies=tracer.copies, rnns=tracer.rnns, gemms=tracer.gemms,
            host_scalars=self.host_scalars, problem=self.problem,
            fused=bool(self.optimizer is not None and is_fused(self.optimizer)),
            uses_matmul=tracer.matmul, batch=self.batch, seq=self.seq, micro_batch=self.micro_batch,
            param_count=count_parameters(self.model),
            param_bytes=sum(sizes.get(s, 0) for s, c in owner.items() if c[0] == "parameters"),
            grad_bytes=sum(self._bytes(p) for p in self.trainable) if not opts.inference else 0,
            state_bytes=sum(sizes.get(s, 0) for s, c in owner.items() if c[0] == "optimizer_state"),
            unit_param_bytes=_unit_bytes(self.units, self._bytes), wall=time.perf_counter() - t0,
            loss="" if opts.inference else "your step's own (traced as written)" if opts.step is not None else
            describe_loss(self.loss_used, self.model, self.specs), **self.levers.finish(self), notes=self.notes,
            answered=tracer.answered, ops=tracer.ops, ops_start=self.ops_start, micro_steps=self.n_micro,
            paged=paged_bytes(self.optimizer) if self.optimizer is not None else 0, context=self.context,
        )


def _label_storages(tracer: StepTracer, owner: dict[int, tuple[str, str]], names: dict[int, str],
                    model: nn.Module) -> tuple[dict[int, int], dict[int, str]]:
    """Each storage's size and the module that made it; ``owner`` completed with what the unclaimed ones count
    as, by the stage that made them (the one phase → category table, ``engine.phases``)."""
    sizes = {serial: size for serial, size in tracer.counts.initial.items()}
    sizes.update(tracer.counts.late)
    made = tracer.made
    module: dict[int, str] = {}
    root = names.get(id(model), "")  # the model's own forward, outside its children: not a child's path
    own = f"({root}.forward itself)"
    for serial, record in tracer.counts.allocs.items():  # (size, phase, site, ...) as the engine records it
        sizes[serial] = record[0]
        stage, mod, recompute = made.get(serial, (SETUP, "", False))
        module[serial] = own if mod == root and mod else mod
        if serial in owner:
            continue
        owner[serial] = phase_category(stage, mod, recompute)
    for serial in tracer.counts.late:
        owner.setdefault(serial, PHASE_CATEGORY[Phase.CELL])
    return sizes, module


def _unit_bytes(units: list[nn.Module], nbytes: Callable[[Any], int]) -> list[int]:
    """Bytes of each checkpoint/sharding unit's parameters (a parameter shared by two counted in the first)."""
    seen: set[int] = set()
    unit_bytes = []
    for u in units:
        n = 0
        for p in u.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                n += nbytes(p)
        unit_bytes.append(n)
    return unit_bytes


@contextlib.contextmanager
def _compiled_step(compiled: bool, tracer: StepTracer) -> Any:
    """Each estimate compiles a new fake copy of the model: TorchDynamo must not stop compiling (and fall back
    to eager) because the same code was compiled for earlier estimates. The compiled graphs tell the tracer
    which of their values a fused kernel keeps to itself."""
    if not compiled:
        yield
        return
    from ..torch_private import dynamo_config
    from ..tracing.compiled.backend import ACTIVE

    config = dynamo_config()

    ACTIVE.append(tracer)
    try:
        limits = {name: 1 << 20 for name in ("recompile_limit", "accumulated_recompile_limit")
                  if hasattr(config, name)}
        with config.patch(**limits):
            yield
    finally:
        ACTIVE.remove(tracer)


def _attention_mode(tracer: StepTracer, compiled: bool) -> Any:
    """SDPA, dropout and RMSNorm calls caught before autograd splits them into the CPU's kernels (not in compiled
    models: TorchDynamo would trace the mode)."""
    if tracer.attention is None or compiled:
        return contextlib.nullcontext()
    return CudaKernelMode(tracer.attention)


def _autocast_mode(autocast: Any, compiled: bool) -> Any:
    """CUDA's autocast for the functions the attention mode catches, entered above it (not in compiled models)."""
    if autocast is None or compiled:
        return contextlib.nullcontext()
    return CudaAutocastMode(autocast)


class _MasterStep:
    """Mixed precision with fp32 master weights (the ZeRO paper's scheme, DeepSpeed's and Megatron's): the
    half-precision gradients are cast to fp32 for the update, the optimizer updates the fp32 master copy, and
    the result is copied back into the model's half-precision weights."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter],
                 masters: list[nn.Parameter]) -> None:
        self.optimizer, self.params, self.masters = optimizer, params, masters
        self.state = optimizer.state

    def step(self) -> None:
        for p, m in zip(self.params, self.masters):
            m.grad = p.grad.to(torch.float32) if p.grad is not None else None
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                m.grad = None
                p.copy_(m)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for p in self.params:
            p.grad = None


__all__ = ["checkpoint_units", "trace_step"]
