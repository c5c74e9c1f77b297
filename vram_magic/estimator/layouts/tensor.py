"""Tensor parallelism as ``torch.distributed.tensor.parallel.parallelize_module`` does it, traced for real.

The fake copy of the model is parallelized with the user's plan (the dict of ``ColwiseParallel`` /
``RowwiseParallel`` / ``SequenceParallel`` / ``PrepareModuleInput`` styles PyTorch takes) or, for the transformers
decoders the estimator knows, torchtitan's plan under transformers' names; the step then runs on one rank's
``DTensor`` shards. What a rank holds is what PyTorch makes on it: the sharded parameters, their gradients and
optimizer state, the activations as the styles leave them (a colwise layer's output split by features, a rowwise
layer's partial sum whole, a norm's output split by the sequence under sequence parallelism) and the functional
collectives' outputs when they are alive. The collectives run their fake kernels (new tensors of the output's
shape), so no communication is needed: the mesh is a ``DeviceMesh`` with no backend behind it
(:func:`..torch_private.offline_mesh`), whose group, registered under a name of its own for the trace, only answers
its size; the default group and the user's groups (a notebook's) are never read or changed.

Why traced rather than modelled: which tensors a rank holds whole and which split depends on every op's sharding
rule (DTensor's propagation), on where the styles redistribute, and on what autograd saves of each; running
PyTorch's own code on fake tensors gives all three as a real rank has them.

A collective's output counts as a buffer ("other") unless the forward keeps it for backward (an activation, named
after the collective), as ``%%vram`` names them (``engine/hooks/collectives.py``). On the CPU gloo stages an
all-gather in a buffer of the output's size and reduces a copy of a reduce-scatter's input, both alive at the
collective: the trace adds them there (a CUDA estimate gives them no bytes: NCCL has no staging copy).
"""

from __future__ import annotations

import copy
import fnmatch
from typing import Any

import torch
from torch import nn

from ...engine.hooks.collectives import GLOO_STAGING, TP_ROLES, tp_collective
from ...engine.phases import Phase
from ..torch_private import dtensor_shape_runs, offline_mesh, pop_mode, push_mode, register_group
from ..tracing.errors import EstimateError
from ..tracing.tracer import StepObserver, StepTracer
from .foreach import foreach_locally, is_pointwise_foreach

#: what the default plan says of itself in the notes
DEFAULT_NOTE = ("tensor parallelism: torchtitan's plan for its Llama under transformers' names (attention q/k/v "
                "colwise, o rowwise; MLP gate/up colwise, down rowwise; sequence parallelism on the norms, the "
                "embedding rowwise into a sequence shard, the head colwise back to replicated logits)")


def is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(t: Any) -> Any:
    """A rank's own tensor: a ``DTensor``'s local shard, anything else as it is."""
    if is_dtensor(t):
        with torch.no_grad():
            return t.to_local()
    return t


def local_bytes(p: Any) -> int:
    t = local(p)
    return int(t.numel() * t.element_size())


# --- the plan -----------------------------------------------------------------------------------------------------
def decoder_parts(model: nn.Module) -> tuple[str, Any, Any] | None:
    """``(prefix, layers, config)`` of a transformers decoder laid out as Llama's (``model.layers[i].self_attn.
    q_proj`` …, ``mlp.gate_proj`` …), else ``None``."""
    for prefix, base in (("model.", getattr(model, "model", None)), ("", model)):
        layers = getattr(base, "layers", None)
        if not isinstance(layers, nn.ModuleList) or not len(layers):
            continue
        first = layers[0]
        attn, mlp = getattr(first, "self_attn", None), getattr(first, "mlp", None)
        if all(isinstance(getattr(attn, f"{p}_proj", None), nn.Linear) for p in "qkvo") and \
                all(isinstance(getattr(mlp, f"{p}_proj", None), nn.Linear) for p in ("gate", "up", "down")):
            return prefix, layers, getattr(model, "config", None)
    return None


def default_plan(model: nn.Module) -> dict[str, Any] | None:
    """torchtitan's tensor-parallel plan of its Llama (``parallelize_llama``: sequence parallelism on, the loss
    not parallel), written for a transformers decoder laid out as Llama's (Llama, Mistral, Qwen2); ``None`` for
    any other model."""
    parts = decoder_parts(model)
    if parts is None:
        return None
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    prefix, layers, _ = parts
    plan: dict[str, Any] = {f"{prefix}embed_tokens": RowwiseParallel(input_layouts=Replicate(),
                                                                      output_layouts=Shard(1)),
                            f"{prefix}norm": SequenceParallel()}
    if isinstance(getattr(model, "lm_head", None), nn.Linear):
        plan["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    for i in range(len(layers)):
        at = f"{prefix}layers.{i}."
        plan.update({
            at + "input_layernorm": SequenceParallel(),
            # the decoder layer calls its attention with keyword arguments
            at + "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                 desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            **{at + f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
            at + "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            at + "post_attention_layernorm": SequenceParallel(),
            at + "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            at + "mlp.gate_proj": ColwiseParallel(), at + "mlp.up_proj": ColwiseParallel(),
            at + "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        })
    return plan


def resolve(model: nn.Module, plan: tuple[tuple[str, Any], ...] | None,
            tp: int) -> tuple[list[tuple[str, Any]], list[str]]:
    """The plan on ``model``'s module names (patterns expanded as ``parallelize_module`` expands them), checked
    against the model and ``tp``; and the notes. ``ValueError`` for a model with no plan and no default, a name
    that matches no module, or a width ``tp`` does not divide."""
    notes: list[str] = []
    if plan is None:
        given = default_plan(model)
        if given is None:
            raise ValueError(
                f"tensor parallelism needs a parallelize_plan for {type(model).__name__}: a dict from module names to "
                "ColwiseParallel / RowwiseParallel / SequenceParallel styles, as parallelize_module takes it (e.g. "
                "{'0': ColwiseParallel(), '2': RowwiseParallel()} for Linear → GELU → Linear); a default plan is "
                "known for transformers decoders laid out as Llama's (Llama, Mistral, Qwen2)")
        items = list(given.items())
        notes.append(DEFAULT_NOTE)
    else:
        items = list(plan)
    names = [n for n, _ in model.named_modules() if n]
    resolved: list[tuple[str, Any]] = []
    for key, style in items:
        found = [key] if key in names else [n for n in names if fnmatch.fnmatchcase(n, key)]
        if not found:
            near = [n for n in names if n.split(".")[-1] == key.split(".")[-1]][:3]
            hint = f"; did you mean {', '.join(repr(n) for n in near)}?" if near else \
                f"; its modules are named like {', '.join(repr(n) for n in names[:4])}"
            raise ValueError(f"parallelize_plan names {key!r}, which is no module of {type(model).__name__}{hint}")
        resolved.extend((n, style) for n in found)
    for name, style in resolved:
        check_width(model, name, model.get_submodule(name), style, tp)
    check_heads(model, tp)
    return resolved, notes


def check_width(model: nn.Module, name: str, module: nn.Module, style: Any, tp: int) -> None:
    """``ValueError`` where a style would split a width ``tp`` does not divide."""
    kind = type(style).__name__
    dims: list[tuple[str, int]] = []
    if isinstance(module, nn.Linear):
        if kind == "ColwiseParallel":
            dims.append(("out_features", module.out_features))
        elif kind == "RowwiseParallel":
            dims.append(("in_features", module.in_features))
    elif isinstance(module, nn.Embedding):
        if kind == "ColwiseParallel":
            dims.append(("embedding_dim", module.embedding_dim))
        elif kind == "RowwiseParallel":
            dims.append(("num_embeddings", module.num_embeddings))
    elif kind in ("ColwiseParallel", "RowwiseParallel"):
        raise ValueError(f"parallelize_plan: {kind} on {name!r} ({type(module).__name__}): PyTorch's {kind} "
                         "shards nn.Linear and nn.Embedding only")
    for what, width in dims:
        if width % tp:
            raise ValueError(f"tp={tp} does not divide {name!r}'s {what} ({width}): {kind} splits it into {tp} "
                             "equal shards; choose a tp that divides it")


def check_heads(model: nn.Module, tp: int) -> None:
    """Attention splits whole heads: ``tp`` must divide the query and key/value heads of a decoder it knows."""
    parts = decoder_parts(model)
    config = parts[2] if parts is not None else None
    if config is None:
        return
    for what in ("num_attention_heads", "num_key_value_heads"):
        n = getattr(config, what, None)
        if isinstance(n, int) and n % tp:
            raise ValueError(f"tp={tp} does not divide the model's {what} ({n}): each rank computes whole heads")


def shards_sequence(plan: list[tuple[str, Any]]) -> bool:
    """Whether the plan hands the layers sequence shards (sequence parallelism: a style whose output is
    ``Shard(1)``, as the default plan's embedding is): a pipeline stage then receives a shard of the sequence."""
    from torch.distributed.tensor import Shard

    for _, style in plan:
        layouts = getattr(style, "output_layouts", None)
        if any(isinstance(x, Shard) and x.dim == 1 for x in (layouts if isinstance(layouts, tuple) else (layouts,))):
            return True
    return False


def needs_positions(plan_given: bool, model: nn.Module) -> bool:
    """Under the default plan the embeddings' output is a sequence shard, from which a decoder would count its
    positions: the inputs get ``position_ids`` (as the measured runs pass them)."""
    return not plan_given and decoder_parts(model) is not None


def shard(model: nn.Module, plan: list[tuple[str, Any]], tp: int, mode: Any, group: str, rank: int = 0) -> nn.Module:
    """``parallelize_module`` with each style of ``plan`` (copied: PyTorch writes ``src_data_rank`` into it), one
    module at a time from its parent, on a mesh whose group (``group``: :func:`fake_group`) has no backend;
    ``src_data_rank=None``: every rank cuts its
    shard out of its own copy, which needs no communication (the real job's broadcast leaves the same shards)."""
    from torch.distributed.tensor.parallel import parallelize_module

    try:
        mesh = offline_mesh(tp, rank, group)
    except TypeError as err:
        raise EstimateError(f"tensor-parallel estimates need a PyTorch whose DeviceMesh can be made without a "
                            f"process group (2.7 or later; this is {torch.__version__}): {err}") from err
    with mode:  # the mesh is made outside: its constructor reads its ranks' values
        for path, style in plan:
            parent, _, leaf = path.rpartition(".")
            parallelize_module(model.get_submodule(parent) if parent else model, mesh, {leaf: copy.deepcopy(style)},
                               src_data_rank=None)
    return model


def fake_group(tp: int, rank: int = 0) -> tuple[str, Any]:
    """``(name, unregister)``: a group of ``tp`` ranks with no backend, under a name of its own, for the functional
    collectives' size queries while one trace runs."""
    import uuid

    name = f"vram_magic-estimate-{uuid.uuid4().hex[:12]}"
    return name, register_group(name, rank, tp)


def collective_volumes(trace: Any) -> tuple[dict[str, int], int]:
    """``({kind: bytes}, count)``: what the traced last step's tensor-parallel collectives returned on the rank (their
    outputs, named by :class:`TensorParallelTracer`), for the time they take."""
    start = trace.marks.get("step_start", 0)
    out: dict[str, int] = {}
    count = 0
    for serial in trace.events[start:]:
        if serial <= 0:
            continue
        label = trace.owner.get(serial, ("", ""))[1]
        if label.startswith("tensor-parallel "):
            kind = label.split(" ")[1]
            out[kind] = out.get(kind, 0) + trace.sizes.get(serial, 0)
            count += 1
    return out, count


# --- the tracer -----------------------------------------------------------------------------------------------------
class _Observer(StepObserver):
    def storage_freed(self, entry: Any) -> bool:
        tracer = self.tracer
        kind = tracer.collective_outputs.get(entry.serial)  # type: ignore[attr-defined]
        if kind is not None and tracer.stage == Phase.BACKWARD:
            tracer.saved.add(entry.serial)  # type: ignore[attr-defined]
        return super().storage_freed(entry)


class TensorParallelTracer(StepTracer):
    """The step tracer with ``DTensor``'s ops left to ``DTensor`` (so that the ops on its shards come back through
    this mode and are counted as they are made) and the functional collectives' outputs noted, with gloo's staging
    copies on the CPU."""

    def __init__(self, registry: Any, names: dict[int, str]) -> None:
        super().__init__(registry, names, observer=_Observer)
        self.propagating = False  # set while DTensor runs an op on global shapes (torch_private.dtensor_shape_runs)
        self.collective_outputs: dict[int, str] = {}  # serial -> "all-reduce", "all-gather", ...
        self.saved: set[int] = set()  # collective outputs freed while backward ran: kept by the forward
        self.staging: dict[int, str] = {}  # serial -> gloo's buffer of that kind

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if types and any(is_dtensor_type(t) for t in types):
            if is_pointwise_foreach(func) and not self.propagating:
                done = foreach_locally(self, func, args, kwargs or {})
                if done is not NotImplemented:
                    return done
            return NotImplemented
        if self.propagating:
            # DTensor works out an op's output shape by running it on fake tensors of the global shapes, with the
            # step's fake mode entered again above this one: no memory of the rank's
            return func(*args, **(kwargs or {}))
        if is_wait(func):
            # the real op returns the tensor it waited on; its fake kernel would return a new one (empty_like)
            return args[0]
        kind = tp_collective(func)
        if kind is None:
            return super().__torch_dispatch__(func, types, args, kwargs)
        first = self.registry.next_serial()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        made = 0
        for t in out if isinstance(out, (tuple, list)) else (out,):
            entry = self.registry.get(id(t.untyped_storage())) if isinstance(t, torch.Tensor) else None
            if entry is not None and entry.serial >= first:
                self.collective_outputs[entry.serial] = kind
                made += entry.size
        if kind in GLOO_STAGING and made and self.target == "cpu":
            size = made if kind == "all-gather" else _nbytes(args[0] if args else None)
            self._staging(kind, size)
        return out

    def __enter__(self) -> Any:
        self._shapes = dtensor_shape_runs(self)
        self._shapes.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            self._shapes.__exit__(None, None, None)

    def _staging(self, kind: str, size: int) -> None:
        """gloo's buffer for this collective, alive beside its output and freed before the caller goes on."""
        first = self.registry.next_serial()
        push_mode(self)
        try:
            buf = torch.empty(size, dtype=torch.uint8)
        finally:
            pop_mode()
        entry = self.registry.get(id(buf.untyped_storage()))
        if entry is not None and entry.serial >= first:
            self.staging[entry.serial] = kind
        del buf

    def collective_roles(self) -> dict[int, tuple[str, str]]:
        """What each collective's output and gloo's buffers count as."""
        out: dict[int, tuple[str, str]] = {}
        for serial, kind in self.collective_outputs.items():
            buffer, saved = TP_ROLES[kind]
            out[serial] = saved if serial in self.saved else buffer
        for serial, kind in self.staging.items():
            out[serial] = GLOO_STAGING[kind]
        return out


def is_wait(func: Any) -> bool:
    """Whether ``func`` is the functional collectives' ``wait_tensor``."""
    return getattr(func, "namespace", None) in _FUNCTIONAL and str(getattr(func, "__name__", "")).startswith(
        "wait_tensor")


_FUNCTIONAL = ("_c10d_functional", "c10d_functional")


def is_dtensor_type(t: type) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, type) and issubclass(t, DTensor)


def _nbytes(t: Any) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return int(t.numel() * t.element_size()) if isinstance(t, torch.Tensor) else 0


__all__ = ["DEFAULT_NOTE", "collective_volumes", "TensorParallelTracer", "decoder_parts", "default_plan",
           "fake_group", "is_dtensor", "local", "local_bytes", "needs_positions", "resolve", "shard",
           "shards_sequence"]
