"""The fake run: two steps (forward, loss, backward, optimizer step, ``zero_grad``) of the user's model on
fake CPU tensors under the live-storage tracker. Optimizer state appears in the first step; the
steady-state peak is in the second. What comes out is plain data: every storage's size and owner, and the
order of allocations and frees.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from ..engine.registry import LiveStorages
from .adapt import adapt
from .fake import ModelSource, from_specs, has_lazy, is_named_tuple, materialize_lazy, resize, size_of, to_specs
from .frameworks import enable_checkpointing, estimating, not_tracing
from .optimizers import is_fused, make_optimizer
from .options import Options
from .quantize import count_parameters, parameter_labels
from .scripted import has_scripted
from .tracer import BACKWARD, FAKE_PROBLEMS, FORWARD, LOSS, OPTIMIZER, SETUP, ZERO_GRAD, StepTracer


class EstimateError(RuntimeError):
    """The model could not run on fake tensors for a reason in the model or its inputs (not a fake-tensor
    limitation): a shape mismatch, a missing argument, an exception in user code."""


@dataclass
class StepTrace:
    """Plain numbers from one fake run (no tensors)."""

    sizes: dict[int, int]
    owner: dict[int, tuple[str, str]]
    module: dict[int, str]
    events: array
    initial: tuple[int, ...]
    marks: dict[str, int]
    flops: dict[str, int]
    convs: list[tuple[int, Any, Any]]
    copies: list[tuple[int, int]]
    rnns: list[tuple[int, Any, Any, int]]
    host_scalars: set[int]
    problem: str | None = None
    fused: bool = False
    uses_matmul: bool = False
    batch: int | None = None
    seq: int | None = None
    micro_batch: int | None = None
    param_count: int = 0
    param_bytes: int = 0
    grad_bytes: int = 0
    state_bytes: int = 0
    unit_param_bytes: list[int] = field(default_factory=list)  # per checkpoint/sharding unit (largest blocks)
    gemms: list[tuple[int, Any, Any]] = field(default_factory=list)  # half-precision GEMMs (scratch measured)
    wall: float = 0.0
    loss: str = ""  # which loss the step trained on
    notes: list[str] = field(default_factory=list)  # what was modelled and how (checkpointing, compiled)
    answered: int = 0  # value reads answered from the inputs' real values


class Request:
    """What to estimate: the model's source, the inputs (specs or a callable) and the loss function."""

    def __init__(self, model: Any, inputs: Any, loss_fn: Callable[[Any], Any] | None = None) -> None:
        self.source = ModelSource(model)
        if callable(inputs) and not isinstance(inputs, torch.Tensor):
            self.inputs_fn: Callable[[], Any] | None = inputs
            self.specs: Any = None
        else:
            self.inputs_fn = None
            self.specs = to_specs(inputs)
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be a callable output -> scalar tensor, not {type(loss_fn).__name__}")
        self.loss_fn = loss_fn

    def input_specs(self, mode: FakeTensorMode) -> Any:
        if self.specs is None:
            assert self.inputs_fn is not None
            from .values import ValueMode

            with mode, ValueMode():
                try:
                    made = self.inputs_fn()
                except Exception as err:
                    raise EstimateError(f"the inputs callable raised {type(err).__name__}: {err}") from err
            specs = to_specs(made)
            from .fake import specs_in

            if not specs_in(specs):
                raise TypeError("the inputs callable must return a tensor, or a tuple/list or dict of tensors; "
                                f"it returned {type(made).__name__}")
            self.specs = specs  # shapes only: the callable runs once
        return self.specs


def default_loss(output: Any) -> torch.Tensor:
    return stand_in_loss(output)[0]


def stand_in_loss(output: Any) -> tuple[torch.Tensor, str]:
    """The loss a step trains on when no ``loss_fn`` is given, and what it was: the output's own ``loss``
    (a Hugging Face model given ``labels``), else the sum of the output (of its floating tensors)."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss, "the model's own loss (output.loss)"
    if isinstance(output, torch.Tensor):
        return output.sum(), "output.sum()"
    parts: list[torch.Tensor] = []
    names: list[str] = []
    items = list(output.items()) if isinstance(output, Mapping) else list(enumerate(output)) if isinstance(
        output, (tuple, list)) else []
    for k, v in items:
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.requires_grad:
            parts.append(v.sum())
            names.append(f"output.{k}" if isinstance(k, str) and k.isidentifier() else f"output[{k!r}]")
    if not parts:
        raise EstimateError(f"cannot make a loss from the model's output ({type(output).__name__}); pass loss_fn, "
                            "e.g. loss_fn=lambda out: out.logits.sum()")
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total, " + ".join(f"{n}.sum()" for n in names)


def _call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, torch.Tensor):
        return model(inputs)
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if is_named_tuple(inputs) and _takes_one(model, inputs):
        return model(inputs)  # one structured argument, read by its fields
    return model(*inputs)


def _takes_one(model: nn.Module, inputs: tuple) -> bool:
    """Whether ``model.forward`` takes a named tuple whole: it accepts one argument (else its fields are the
    arguments, as a plain tuple's are)."""
    try:
        inspect.signature(model.forward).bind(inputs)
    except TypeError:
        return False
    except ValueError:  # no signature to read
        return True
    return True


def checkpoint_units(model: nn.Module) -> list[nn.Module]:
    """The blocks activation checkpointing (and FSDP) wraps: the children of the longest ModuleList or
    Sequential of like modules; else the model's children."""
    best: list[nn.Module] = []
    for m in model.modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) >= 2:
            kids = list(m)
            kinds = {type(k) for k in kids}
            if len(kinds) == 1 and len(kids) > len(best) and any(True for _ in kids[0].parameters()):
                best = kids
    if not best:
        best = [c for c in model.children() if any(True for _ in c.parameters())]
    return best


def trace_step(request: Request, opts: Options) -> StepTrace:
    import logging
    import time

    t0 = time.perf_counter()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)  # fake tensors log a model's shape errors; ours says it once, clearly
    try:
        with warnings.catch_warnings(), estimating():
            warnings.simplefilter("ignore")
            return _trace(request, opts, mode, t0)
    finally:
        log.setLevel(level)


def _trace(request: Request, opts: Options, mode: FakeTensorMode, t0: float) -> StepTrace:
    import time

    try:
        model, compiled = request.source.fake(mode, opts.dtype)
    except (TypeError, ValueError):
        raise
    except FAKE_PROBLEMS as err:
        raise EstimateError(f"building the model on fake tensors failed at {err}: the model's constructor reads "
                            "tensor values; pass an nn.Module built normally instead of a builder") from err
    except Exception as err:
        raise EstimateError(f"building the model raised {type(err).__name__}: {err}") from err
    specs = request.input_specs(mode)
    batch, seq = size_of(specs, 0), size_of(specs, 1)
    if opts.batch is not None and batch is not None:
        specs, batch = resize(specs, 0, batch, opts.batch), opts.batch
    if opts.seq is not None and seq is not None:
        specs, seq = resize(specs, 1, seq, opts.seq), opts.seq
    micro_batch = batch
    if opts.accumulate > 1 and batch is not None:
        micro_batch = -(-batch // opts.accumulate)
        specs = resize(specs, 0, batch, micro_batch)
    if has_lazy(model):
        try:
            materialize_lazy(model, specs, mode, opts.dtype, _call)
        except Exception as err:
            raise EstimateError(f"the model's lazy modules make their parameters on a first forward, which failed "
                                f"on meta tensors ({type(err).__name__}: {err}); run one forward of the model "
                                "before estimating it") from err
    with mode:
        inputs = from_specs(specs, opts.dtype if opts.amp is None else None)
    model, notes = adapt(model, opts, mode)  # quantize=, lora= (quantize.py, lora.py)
    if opts.inference:
        model.eval()
    else:
        model.train()
    units = checkpoint_units(model)
    if opts.checkpointing and not opts.inference:
        notes.append("checkpointing: " + enable_checkpointing(model, units))
    params = [p for p in model.parameters()]
    trainable = [p for p in params if p.requires_grad]
    if not opts.inference and not trainable:
        raise EstimateError("the model has no parameters that require gradients; use inference=True")
    optimizer = None
    masters: list[nn.Parameter] = []
    if not opts.inference:
        with mode:
            if opts.master_weights:  # the optimizer updates an fp32 copy; the model keeps bf16/fp16 weights
                masters = [nn.Parameter(torch.empty(p.shape, dtype=torch.float32)) for p in trainable]
            optimizer = make_optimizer(opts.optimizer, masters or trainable, opts.device)
    registry = LiveStorages()
    owner: dict[int, tuple[str, str]] = {}

    def claim(t: Any, cat: tuple[str, str]) -> int | None:
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return None
        entry = registry.add(t.untyped_storage())
        owner.setdefault(entry.serial, cat)
        return entry.serial

    for p, label in parameter_labels(model):  # quantized, adapters, frozen: named before the plain ones
        claim(p, ("parameters", label))
    for p in params:
        claim(p, ("parameters", "parameters"))
    for b in model.buffers():
        claim(b, ("other", "buffers"))
    for t in _tensors(inputs):
        claim(t, ("other", "inputs"))
    for m in masters:
        claim(m, ("optimizer_state", "fp32 master weights"))
    updater = _MasterStep(optimizer, trainable, masters) if masters else optimizer
    names = {id(m): (name or type(m).__name__) for name, m in model.named_modules()}
    runner: Any = model
    if compiled:
        from .compiled import EAGER_NOTE, NOTE, recompile, supported

        where = ", ".join(repr(n) if n else "the whole model" for n in sorted(compiled))
        if supported():
            runner = recompile(model, compiled)
            notes.append(f"{NOTE}; compiled: {where}")
        else:  # never call compiled code under the tracker here: TorchDynamo would skip (and poison) the frame
            notes.append(EAGER_NOTE.format(version=torch.__version__) + f"; compiled: {where}")
            compiled = {}
    tracer = StepTracer(registry, names)
    tracer.target = opts.device
    tracer.input_keys = {id(t.untyped_storage()) for t in _tensors(inputs) if t.layout == torch.strided}
    loss_used = ["loss_fn (given)"] if request.loss_fn is not None else [""]

    def stated_loss(output: Any) -> torch.Tensor:
        loss, loss_used[0] = stand_in_loss(output)
        return loss

    loss_fn = request.loss_fn or stated_loss
    marks: dict[str, int] = {}
    host_scalars: set[int] = set()
    n_micro = 1 if opts.inference else min(opts.accumulate, 2)
    # TorchScript's profiling executor runs a module's code as written first and an optimized graph (its own
    # autodiff, other saved tensors) from the next call with the same input types on: real steps until then
    scripted = has_scripted(model)
    steps = max(opts.steps, 3) if scripted and opts.steps > 1 else opts.steps
    last_flops: list[int] = []
    problem = None
    amp = torch.autocast("cpu", dtype=opts.amp) if opts.amp is not None else contextlib.nullcontext()
    try:
        with mode, tracer, _compiled_step(bool(compiled), tracer), not_tracing():
            for step in range(steps):
                last = step == steps - 1
                if last:
                    marks["step_start"] = len(tracer.events)
                    last_flops = list(tracer.flops)
                if opts.inference:
                    tracer.stage = FORWARD
                    with torch.inference_mode(), amp:
                        out = _call(runner, inputs)
                    if last:
                        marks["forward_end"] = len(tracer.events)
                    del out
                    continue
                if step == 0 and steps > 1 and not scripted:
                    _first_step(updater, trainable, tracer, claim, host_scalars)
                    continue
                for micro in range(n_micro):
                    out = loss = None  # the previous micro-batch's output lives until this one replaces it
                    tracer.stage = FORWARD
                    with amp:
                        out = _call(runner, inputs)
                        tracer.stage = LOSS
                        loss = loss_fn(out)
                    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                        raise EstimateError("loss_fn must return a scalar tensor, got "
                                            f"{type(loss).__name__}{tuple(getattr(loss, 'shape', ()))}")
                    if last and micro == n_micro - 1:
                        marks["forward_end"] = len(tracer.events)
                    tracer.stage = BACKWARD
                    loss.backward()
                    for p in trainable:
                        claim(p.grad, ("gradients", "gradients"))
                assert optimizer is not None
                for i, p in enumerate(trainable):  # state stood in for a parameter this step leaves without a gradient
                    key = masters[i] if masters else p
                    if p.grad is None and key in optimizer.state:
                        del optimizer.state[key]
                if last:
                    marks["backward_end"] = len(tracer.events)
                tracer.stage = OPTIMIZER
                updater.step()
                _claim_state(optimizer, claim, host_scalars)
                if last:
                    marks["step_end"] = len(tracer.events)
                tracer.stage = ZERO_GRAD
                updater.zero_grad(set_to_none=True)
                del out, loss  # as a loop that ends each step with `del out, loss` (or returns) does
            tracer.stage = SETUP
    except FAKE_PROBLEMS as err:
        where = tracer.problem or (str(err), tracer.module() or "(top level)", type(err).__name__)
        problem = (f"{where[0]} in module {where[1]!r} needs real tensor values ({where[2]}), which fake tensors do "
                   "not have; the estimate covers what ran before it")
        marks.setdefault("forward_end", len(tracer.events))
    except EstimateError:
        raise
    except Exception as err:
        raise EstimateError(_failure(err, tracer, model, specs)) from err
    sizes = {serial: size for serial, size in tracer.initial.items()}
    sizes.update(tracer.late)
    made = tracer.made
    module: dict[int, str] = {}
    root = names.get(id(model), "")  # the model's own forward, outside its children: not a child's path
    own = f"({root}.forward itself)"
    for serial, record in tracer.allocs.items():  # (size, phase, site, ...) as the engine records it
        sizes[serial] = record[0]
        stage, mod, recompute = made.get(serial, (SETUP, "", False))
        module[serial] = own if mod == root and mod else mod
        if serial in owner:
            continue
        if stage in (FORWARD, LOSS):
            owner[serial] = ("activations", "loss" if stage == LOSS and not mod else "forward intermediates")
        elif stage == BACKWARD:
            # the gradients flowing back through the graph count as activations, as measure() counts them
            owner[serial] = ("activations", "recomputed (checkpointing)") if recompute else (
                "activations", "activation gradients (backward)")
        elif stage == OPTIMIZER:
            owner[serial] = ("other", "optimizer temporaries")
        elif stage == ZERO_GRAD:
            owner[serial] = ("other", "zero_grad temporaries")
        else:
            owner[serial] = ("other", "temporaries")
    for serial in tracer.late:
        owner.setdefault(serial, ("other", "temporaries"))
    step_flops = [now - before for now, before in zip(tracer.flops, last_flops or [0] * len(tracer.flops))]
    scale = opts.accumulate / n_micro if opts.accumulate > 1 else 1.0
    flops = {
        "forward": int((step_flops[FORWARD] + step_flops[LOSS]) * scale),
        "backward": int(step_flops[BACKWARD] * scale),
        "optimizer": int(step_flops[OPTIMIZER]),
    }
    param_bytes = sum(sizes.get(s, 0) for s, c in owner.items() if c[0] == "parameters")
    grad_bytes = sum(p.numel() * p.element_size() for p in trainable) if not opts.inference else 0
    state_bytes = sum(sizes.get(s, 0) for s, c in owner.items() if c[0] == "optimizer_state")
    seen: set[int] = set()
    unit_bytes = []
    for u in units:
        n = 0
        for p in u.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel() * p.element_size()
        unit_bytes.append(n)
    trace = StepTrace(
        sizes=sizes, owner=owner, module=module, events=tracer.events,
        initial=tuple(tracer.initial) + tuple(tracer.late), marks=marks, flops=flops,
        convs=tracer.convs, copies=tracer.copies, rnns=tracer.rnns, gemms=tracer.gemms,
        host_scalars=host_scalars, problem=problem, fused=bool(optimizer is not None and is_fused(optimizer)),
        uses_matmul=tracer.matmul, batch=batch, seq=seq, micro_batch=micro_batch,
        param_count=count_parameters(model), param_bytes=param_bytes, grad_bytes=grad_bytes,
        state_bytes=state_bytes, unit_param_bytes=unit_bytes, wall=time.perf_counter() - t0,
        loss="" if opts.inference else _describe_loss(loss_used[0], model, specs), notes=notes,
        answered=tracer.answered,
    )
    return trace


_STAGE_WORDS = {FORWARD: "the forward pass", LOSS: "the loss", BACKWARD: "the backward pass",
                OPTIMIZER: "the optimizer step", ZERO_GRAD: "zero_grad", SETUP: "the step"}


def _failure(err: Exception, tracer: StepTracer, model: nn.Module, specs: Any) -> str:
    """What went wrong, where (op, module, the shapes the op saw, the stage) and, only when the inputs are
    the likely cause, a word about them."""
    message = str(err).strip().splitlines()[0] if str(err).strip() else ""
    if tracer.failed_in is None:
        where = tracer.module() or "(top level)"
        stage = _STAGE_WORDS.get(tracer.stage, "the step")
        text = f"the model raised {type(err).__name__} in module {where!r} during {stage}: {message}"
        if isinstance(err, TypeError) and tracer.stage == FORWARD and not tracer.modstack:
            bad = _call_mismatch(model, specs)
            if bad:
                text += f" — the inputs do not match the model's forward(): {bad}"
        return text
    op, where, shapes = tracer.failed_in
    stage = tracer.failed_stage
    during = _STAGE_WORDS.get(stage, "the step")
    if stage == BACKWARD and where != "(top level)":
        during = "the recomputed forward of activation checkpointing (in the backward pass)"
    text = (f"the model raised {type(err).__name__} in module {where!r} at {op} on ({shapes}) during {during}: "
            f"{message}")
    if tracer.failed_on_input and stage in (FORWARD, LOSS):
        text += f" — the op received one of the inputs directly: check their shapes and dtypes ({_describe(specs)})"
    return text


def _describe(specs: Any) -> str:
    from .fake import TensorSpec

    def one(s: Any) -> str:
        return f"{tuple(s.shape)} {str(s.dtype).replace('torch.', '')}" if isinstance(s, TensorSpec) else repr(s)

    if isinstance(specs, Mapping):
        return ", ".join(f"{k}={one(v)}" for k, v in specs.items())
    if isinstance(specs, (tuple, list)):
        return ", ".join(one(v) for v in specs)
    return one(specs)


def _call_mismatch(model: nn.Module, specs: Any) -> str:
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return ""
    try:
        if isinstance(specs, Mapping):
            sig.bind(**specs)
        elif isinstance(specs, (tuple, list)) and not (is_named_tuple(specs) and _takes_one(model, specs)):
            sig.bind(*specs)
        else:
            sig.bind(specs)
    except TypeError as bad:
        return f"{bad} (forward{sig})"
    return ""


@contextlib.contextmanager
def _compiled_step(compiled: bool, tracer: StepTracer) -> Any:
    """Each estimate compiles a new fake copy of the model: TorchDynamo must not stop compiling (and fall back
    to eager) because the same code was compiled for earlier estimates. The compiled graphs tell the tracer
    which of their values a fused kernel keeps to itself."""
    if not compiled:
        yield
        return
    import torch._dynamo

    from .compiled import ACTIVE

    ACTIVE.append(tracer)
    try:
        limits = {name: 1 << 20 for name in ("recompile_limit", "accumulated_recompile_limit")
                  if hasattr(torch._dynamo.config, name)}
        with torch._dynamo.config.patch(**limits):
            yield
    finally:
        ACTIVE.remove(tracer)


def _describe_loss(used: str, model: nn.Module, specs: Any) -> str:
    if not used or used.startswith("the model's own") or used.startswith("loss_fn"):
        return used or "none (the step stopped before the loss)"
    hint = 'pass loss_fn=... (%vram_estimate: --loss "lambda out: ...")'
    try:
        takes_labels = "labels" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        takes_labels = False
    if takes_labels and not (isinstance(specs, Mapping) and "labels" in specs):
        hint = "put labels in the inputs to train on the model's own loss, or " + hint
    return f"stand-in {used}: the model computed no loss; {hint}"


def _claim_state(optimizer: torch.optim.Optimizer, claim: Callable[..., int | None], host_scalars: set[int]) -> None:
    for state in optimizer.state.values():
        for key, v in state.items():
            if isinstance(v, torch.Tensor):
                scalar = v.dim() == 0
                s = claim(v, ("optimizer_state", "step counters" if scalar else str(key)))
                if scalar and s is not None:
                    host_scalars.add(s)


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


def _first_step(optimizer: Any, trainable: list[nn.Parameter], tracer: StepTracer,
                claim: Callable[..., int | None], host_scalars: set[int]) -> None:
    """The first step only has to leave the optimizer's state behind; its forward and backward are the same
    ops as the second step's (no tensor of theirs outlives the step), so stand-in gradients replace them:
    half the ops of a big model's estimate. A parameter the second step leaves without a gradient loses the
    state stood in for it before that step's update."""
    tracer.stage = BACKWARD
    for p in trainable:
        p.grad = torch.empty_like(p)
        claim(p.grad, ("gradients", "gradients"))
    tracer.stage = OPTIMIZER
    optimizer.step()
    _claim_state(optimizer, claim, host_scalars)
    tracer.stage = ZERO_GRAD
    optimizer.zero_grad(set_to_none=True)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors(v)]
    return []


__all__ = ["EstimateError", "Request", "StepTrace", "trace_step", "SETUP", "OPTIMIZER"]
