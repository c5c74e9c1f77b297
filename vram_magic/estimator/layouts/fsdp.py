"""FSDP2 as large runs configure it, traced for real: ``fully_shard`` on each block and on the root, with
``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` and, with ``offload="params"``, ``CPUOffloadPolicy``.

Why traced rather than modelled (``zero.py`` models ZeRO-3 from an unsharded trace): with a mixed-precision policy
what a rank holds changes dtype between the optimizer's view and the compute's, and which buffer lives when is FSDP2's
own bookkeeping (torch 2.13, ``torch/distributed/fsdp/_fully_shard/``):

* the sharded parameters stay in their own dtype (fp32), padded to ``ceil(rows / world)`` rows on every rank
  (``FSDPParam._init_sharded_param``); the optimizer's state is made like them;
* before a unit's forward (and again before its backward, ``reshard_after_forward``) its shards are cast to
  ``param_dtype`` into one flat all-gather input (``_get_param_all_gather_inputs``: a foreach copy), the all-gather
  output is one flat ``param_dtype`` buffer of ``world ×`` that (``foreach_all_gather``), and each parameter's
  unsharded tensor is a ``param_dtype`` buffer of its own filled from it (``init_all_gather_outputs``,
  ``split_with_sizes_copy``); in the forward the flat buffer of one unit is kept until the next unit's copy-out
  (``AllGatherState``, the implicit prefetch), in the backward the next unit is gathered ahead (``_backward_prefetch``);
* autograd's gradients of the unsharded parameters are in ``param_dtype``; the post-backward copies them into a
  reduce-scatter input in ``reduce_dtype`` (``foreach_reduce``: ``chunk_cat``), frees them, and the reduce-scatter's
  output, ``1/world`` of it, is the unit's sharded gradients (cast to the parameters' dtype where ``reduce_dtype``
  differs); the input is kept until a later unit's reduce-scatter (``reduce_scatter_states``);
* the root (embeddings, the head) is not resharded after the forward.

The step runs that code on fake tensors: the rank's mesh is a ``DeviceMesh`` with no backend of its own, over a group
whose backend is PyTorch's fake one (``torch_private.register_fake_group``: its collectives complete at once and move
nothing), so no process group is made and the user's are never read. The trace is then one rank's (rank 0, whose
shards are the padded ones); what FSDP2 names in its scopes is named as ``%%vram`` names it on a real rank
(``engine/hooks/collectives.py``).

On a CUDA target with ``offload="params"`` the sharded parameters, their gradients and the optimizer's state (and its
update) are on the host: none of it is on the device (the trace runs on the CPU, where FSDP2's copies between host
and device are no-ops). The device then holds a parameter's fp32 shard while it is cast for the all-gather, and the
unit's reduce-scatter output (with its cast to fp32 where ``reduce_dtype`` is not) until it is copied to the host: both
modelled, alive during forward and backward.
What the host holds is the estimate's ``host``; the parameters and gradients of it are pinned (``CPUOffloadPolicy``'s
default), the estimate's ``pinned``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...engine.hooks.collectives import FSDP_ALL_GATHER, FSDP_REDUCE_SCATTER, FSDP_UNSHARDED, FSDP_UNSHARDED_GRADS
from ...engine.tracker.op_kinds import SCOPE_ENTER, SCOPE_EXIT
from ..options import Options, optimizer_name, short_dtype
from ..tracing.traced import FakeRun
from . import tensor

#: what FSDP2's scopes and resizes name (``engine/hooks/collectives.py``), kept over what the stage that made it says
FSDP_ROLES = frozenset({FSDP_ALL_GATHER, FSDP_REDUCE_SCATTER, FSDP_UNSHARDED, FSDP_UNSHARDED_GRADS})
#: what the rank's step claims as its own: never renamed after FSDP's scopes
_CLAIMED = ("parameters", "gradients", "optimizer_state")
#: the owner's label of the sharded gradients (the step claims each parameter's ``grad`` after backward)
SHARDED_GRADS = ("gradients", "gradients")


class FsdpRank:
    """The hooks ``step/trace.py`` calls for one FSDP2 rank (the interface of ``rank_trace.RankTrace``)."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.notes: list[str] = []
        self._unregister: Any = None

    def build(self, step: Any, model: nn.Module, units_of: Any) -> nn.Module:
        """``model`` (the fake copy) with ``fully_shard`` on each of its blocks (``units_of(model)``, what
        checkpointing wraps) and on itself."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        from ..torch_private import offline_mesh, register_fake_group

        opts = self.opts
        name = f"vram_magic-fsdp-{id(self):x}"
        unregister = register_fake_group(name, 0, opts.world)
        self._unregister = weakref.finalize(self, unregister)  # at the trace's end, or if it fails
        mesh = offline_mesh(opts.world, 0, name)
        mp = MixedPrecisionPolicy(param_dtype=opts.param_dtype, reduce_dtype=opts.reduce_dtype)
        # pinning needs an accelerator: the trace runs FSDP2's offload path unpinned (the bytes are the same)
        offload = CPUOffloadPolicy(pin_memory=False) if opts.offload_params else OffloadPolicy()
        units = [u for u in units_of(model) if u is not model]
        with step.mode:
            for unit in units:
                fully_shard(unit, mesh=mesh, mp_policy=mp, offload_policy=offload)
            fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
        self.notes.append(fsdp_note(opts, len(units)))
        return model

    def prepare(self, step: Any) -> None:
        pass

    def tracer(self, registry: Any, names: dict[int, str]) -> Any:
        return FsdpTracer(registry, names)

    def forward_backward(self, step: Any, last: bool) -> bool:
        return False  # the step's own forward and backward; FSDP2's hooks do the rest

    def local(self, t: Any) -> Any:
        return tensor.local(t)

    def local_bytes(self, p: Any) -> int:
        return tensor.local_bytes(p)

    def finish(self, tracer: Any, owner: dict[int, tuple[str, str]]) -> None:
        """FSDP2's buffers named as its scopes say (over what the stage that made them says), except what the step
        claimed: the sharded parameters, their gradients (the reduce-scatter's output) and the optimizer's state."""
        for serial, role in tracer.counts.roles.items():
            if role in FSDP_ROLES and owner.get(serial, ("",))[0] not in _CLAIMED:
                owner[serial] = role
        if self._unregister is not None:
            self._unregister()


class FsdpTracer(tensor.TensorParallelTracer):
    """The step tracer with DTensor's ops (the optimizer's on the sharded parameters) left to DTensor, as tensor
    parallelism's are, and FSDP2's named scopes heard as ``%%vram``'s tracker hears them (the engine's
    ``CollectiveScopes``): what is made inside one is its collective's buffer, a storage resized inside its
    all-gather a unit's unsharded parameters, autograd's gradients freed inside its reduce-scatter the unsharded
    gradients."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is SCOPE_ENTER or func is SCOPE_EXIT:
            out = func(*args, **(kwargs or {}))
            (self.collectives.scope_entered if func is SCOPE_ENTER else self.collectives.scope_exited)(args, out)
            return out
        return super().__torch_dispatch__(func, types, args, kwargs)


def fsdp_note(opts: Options, units: int) -> str:
    """What the trace did, in words."""
    pd = short_dtype(opts.param_dtype) if opts.param_dtype is not None else "the parameters' own dtype"
    rd = short_dtype(opts.reduce_dtype) if opts.reduce_dtype is not None else pd
    text = (f"FSDP2 traced for real on one of {opts.world} ranks (rank 0: the padded shards): fully_shard on each of "
            f"{units} blocks and on the root, MixedPrecisionPolicy(param_dtype={pd}, reduce_dtype={rd}); the "
            "sharded parameters, the optimizer's state and the update in the parameters' dtype, the all-gathers and "
            f"the compute in {pd}, the reduce-scatters in {rd}")
    if opts.offload_params:
        text += ("; CPUOffloadPolicy: the sharded parameters, their gradients and the "
                 f"{optimizer_name(opts.optimizer)} state on the host, the update on the CPU")
    return text


@dataclass(frozen=True)
class FsdpLayout:
    """One FSDP2 rank's share, as traced: the sizes are the rank's already; on a CUDA target with ``offload_params``
    what the host holds is taken off the device and the two transient device copies are added."""

    offload_params: bool
    offload: bool
    cuda: bool  # the target is a GPU (on a CPU the host is the device: FSDP2's copies between them are no-ops)
    largest_shard: int  # bytes of the largest parameter's fp32 shard (its copy to the device before the cast)
    largest_unit_shard: int  # bytes of the largest unit's reduce-scatter output (fp32) before its copy to the host

    @classmethod
    def of(cls, opts: Options, trace: FakeRun) -> FsdpLayout:
        shards = [n for s, n in trace.sizes.items() if trace.owner.get(s, ("",))[0] == "parameters"]
        units = trace.unit_param_bytes
        largest_unit = max(units) if units else trace.param_bytes
        # the reduce-scatter's output in reduce_dtype, and its cast to the parameters' dtype where that differs
        reduce, own = opts.reduce_dtype or opts.param_dtype or opts.dtype, _itemsize(opts.dtype)
        unit_rs = largest_unit + (largest_unit * _itemsize(reduce) // own if _itemsize(reduce) != own else 0)
        return cls(opts.offload_params, opts.offload, opts.device == "cuda", max(shards, default=0), unit_rs)

    def on_host(self, trace: FakeRun, opts: Options) -> dict[int, bool]:
        """Storage → pinned (``True``) or pageable (``False``), for what the host holds on a CUDA target."""
        if opts.device != "cuda" or not (self.offload or self.offload_params):
            return {}
        out: dict[int, bool] = {}
        for s, (cat, label) in trace.owner.items():
            if cat == "optimizer_state" or label == "optimizer temporaries":
                out[s] = False
            elif self.offload_params and (cat == "parameters" or (cat, label) == SHARDED_GRADS):
                out[s] = True
        return out

    def rank_sizes(self, trace: FakeRun, opts: Options) -> tuple[dict[int, int], int]:
        sizes = dict(trace.sizes)
        if opts.device == "cuda" and not trace.fused and not self.offload_params:
            for s in trace.host_scalars:
                sizes[s] = 0
        state_bytes = sum(sizes[s] for s, (cat, _) in trace.owner.items() if cat == "optimizer_state" and s in sizes)
        for s in self.on_host(trace, opts):
            if s in sizes:
                sizes[s] = 0
        return sizes, state_bytes

    def host_bytes(self, trace: FakeRun, opts: Options) -> tuple[int, int]:
        """``(host, pinned)``: the bytes the host keeps for the rank (what of it is alive when the update ends: the
        parameters, their gradients and the optimizer's state), and the pinned part of them."""
        where = self.on_host(trace, opts)
        if not where:
            return 0, 0
        from ...core.events import alive_after

        host = pinned = 0
        for s in alive_after(trace.initial, trace.events, trace.marks.get("step_end", len(trace.events))):
            if s in where:
                n = trace.sizes.get(s, 0)
                host += n
                pinned += n if where[s] else 0
        return host, pinned

    def buffers(self, training: bool) -> dict[str, int]:
        if not (self.offload_params and self.cuda and training):
            return {}
        return {"a parameter's fp32 shard copied to the device for its cast (CPUOffloadPolicy)": self.largest_shard,
                "a unit's reduce-scatter output before its copy to the host (CPUOffloadPolicy)":
                    self.largest_unit_shard}

    def window(self, trace: FakeRun) -> tuple[int, int]:
        return trace.marks.get("step_start", 0), trace.marks.get("backward_end", len(trace.events))

    def model_states(self, trace: FakeRun, opts: Options, state_bytes: int) -> int:
        """The rank's sharded parameters, gradients and optimizer state on the device (none of them with
        ``offload="params"`` on CUDA)."""
        if opts.device == "cuda" and self.offload_params:
            return 0
        state = 0 if opts.device == "cuda" and self.offload else state_bytes
        return trace.param_bytes + trace.grad_bytes + state

    def notes(self, opts: Options) -> list[str]:
        if opts.device == "cuda" and self.offload_params:
            return ["on the device: FSDP2's all-gathered parameters, the unsharded gradients and the reduce-scatter "
                    "buffers, the activations; a parameter's fp32 shard while it is cast for the all-gather and a "
                    "unit's reduce-scatter output while it is copied to the host (modelled). Not modelled: the "
                    "caching allocator's per-stream pools (FSDP2's all-gathers and reduce-scatters run on streams of "
                    "their own on CUDA)"]
        if opts.device == "cuda":
            return ["not modelled: the caching allocator's per-stream pools (FSDP2's all-gathers and reduce-scatters "
                    "run on streams of their own on CUDA, traced here in the order one CPU stream runs them)"]
        return []


def _itemsize(dtype: torch.dtype | None) -> int:
    return torch.empty((), dtype=dtype or torch.float32).element_size()


__all__ = ["FSDP_ROLES", "FsdpLayout", "FsdpRank", "FsdpTracer", "fsdp_note"]
