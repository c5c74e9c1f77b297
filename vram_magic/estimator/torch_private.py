"""PyTorch's private names that the estimator relies on (fake tensors, TorchDynamo's configuration, AOTAutograd,
Inductor and functorch internals, TorchScript's module copy), all in one place; the engine's own are in
:mod:`vram_magic.engine.torch_private`, which this module re-exports where the estimator needs them.

Each name says which PyTorch releases it was checked on (as in the engine's module: "2.5.1, 2.13, 2.15" read in
those releases' sources, tests/test_torch_private.py passing on each). ``torch._subclasses.fake_tensor`` is loaded with
``torch`` itself, so its names are bound here; TorchDynamo, Inductor and functorch's partitioners take seconds to
import and are imported by their accessors, when an estimate first needs them.
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch._subclasses import fake_tensor as _fake_tensor

from ..engine.torch_private import OpOverload as OpOverload
from ..engine.torch_private import TorchDispatchMode as TorchDispatchMode
from ..engine.torch_private import disable_current_modes as disable_current_modes
from ..engine.torch_private import modes_ignore_compile_internals as modes_ignore_compile_internals
from ..engine.torch_private import pop_mode as pop_mode
from ..engine.torch_private import push_mode as push_mode

# --- fake tensors (torch/_subclasses/fake_tensor.py) -------------------------------------------------------

class FakeTensorMode(_fake_tensor.FakeTensorMode):
    """The mode that makes every tensor a fake one (shapes, dtypes, devices; no memory), told that no device is
    there to initialise. PyTorch's own ``avoid_device_init`` asks ``torch.cuda.is_available()``, which runs
    ``cuInit`` on a GPU machine (forked children could no longer use CUDA) and would make a fake run there differ
    from one on a CPU-only machine (constants moved to a device folded or not): the estimate runs on fake CPU tensors
    wherever it runs. A property on 2.5.1, 2.13 and 2.15 (the setter takes an older release's assignment)."""

    @property
    def avoid_device_init(self) -> bool:
        return True

    @avoid_device_init.setter
    def avoid_device_init(self, value: bool) -> None:
        pass


#: A fake tensor's class. Checked on torch 2.5.1, 2.13, 2.15.
FakeTensor = _fake_tensor.FakeTensor
#: ``copy.deepcopy`` under it turns real tensors into fake ones. Checked on torch 2.5.1, 2.13, 2.15.
FakeCopyMode = _fake_tensor.FakeCopyMode
#: What a fake op raises where its output depends on data, has a data-dependent shape, or has no fake kernel.
#: Checked on torch 2.5.1, 2.13, 2.15.
DataDependentOutputException = _fake_tensor.DataDependentOutputException
DynamicOutputShapeException = _fake_tensor.DynamicOutputShapeException
UnsupportedOperatorException = _fake_tensor.UnsupportedOperatorException
#: The logger fake tensors report a model's shape errors to. Checked on torch 2.5.1, 2.13, 2.15.
FAKE_TENSOR_LOGGER = _fake_tensor.__name__


# --- TorchDynamo, AOTAutograd, Inductor (imported when first asked for) ----------------------------------

def dynamo_config() -> Any:
    """``torch._dynamo.config`` (``.patch(**values)``; ``recompile_limit`` and ``accumulated_recompile_limit``
    where this PyTorch has them: torch 2.13, 2.15; 2.5.1 calls the first ``cache_size_limit``). The module itself
    checked on torch 2.5.1, 2.13, 2.15. Imports TorchDynamo."""
    import torch._dynamo

    return torch._dynamo.config


def aot_autograd() -> Any:
    """``torch._dynamo.backends.common.aot_autograd``: a TorchDynamo backend from AOTAutograd's compilers.
    Checked on torch 2.5.1, 2.13, 2.15. Imports TorchDynamo."""
    from torch._dynamo.backends.common import aot_autograd as make

    return make


def inductor_partition() -> tuple[Any, Any]:
    """``(partition_fn, select_decomp_table)`` from Inductor (``torch._inductor.compile_fx``,
    ``torch._inductor.decomposition``); raises ImportError or AttributeError where they moved. Checked on torch
    2.13, 2.15; in 2.5.1 ``partition_fn`` is local to ``compile_fx`` (ImportError: the caller falls back to
    :func:`min_cut_partition`). Imports Inductor."""
    from torch._inductor.compile_fx import partition_fn
    from torch._inductor.decomposition import select_decomp_table

    return partition_fn, select_decomp_table


def min_cut_partition() -> Any:
    """``torch._functorch.partitioners.min_cut_rematerialization_partition``, AOTAutograd's own partitioner.
    Checked on torch 2.5.1, 2.13, 2.15."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    return min_cut_rematerialization_partition


def inductor_fake_mode(example_inputs: Any) -> Any:
    """A context in which Inductor's passes see the fake mode of ``example_inputs``, as Inductor would set it:
    ``torch._inductor.virtualized.V.set_fake_mode(torch._guards.detect_fake_mode(...))``. Checked on torch 2.5.1,
    2.13, 2.15. Imports Inductor."""
    from torch._guards import detect_fake_mode
    from torch._inductor.virtualized import V

    return V.set_fake_mode(detect_fake_mode(example_inputs))


def post_grad_passes() -> Any:
    """``torch._inductor.compile_fx._recursive_post_grad_passes(gm, is_inference=...)``, Inductor's post-grad
    pattern rewrites. Checked on torch 2.5.1, 2.13, 2.15. Imports Inductor."""
    from torch._inductor.compile_fx import _recursive_post_grad_passes

    return _recursive_post_grad_passes


# --- TorchScript (torch/jit/_script.py) ------------------------------------------------------------------

def construct_script_module(cpp_module: Any, init: Any) -> Any:
    """``torch.jit._script.RecursiveScriptModule._construct``: a Python script module around a C++ one. Checked
    on torch 2.5.1, 2.13, 2.15."""
    from torch.jit._script import RecursiveScriptModule

    return RecursiveScriptModule._construct(cpp_module, init)


# --- tensor parallelism (torch/distributed/device_mesh.py) -------------------------------------------------

def offline_mesh(size: int, rank: int, group_name: str) -> Any:
    """A one-dimensional ``DeviceMesh`` of ``size`` CPU ranks seen from ``rank``, with no backend behind it:
    ``DeviceMesh("cpu", range(size), _init_backend=False, _rank=rank)``, its ``_dim_group_names`` set to
    ``group_name`` (a group :func:`named_group` registered). ``parallelize_module(..., src_data_rank=None)`` shards
    with it without communicating, and DTensor's functional collectives on fake tensors run their fake kernels.
    ``_rank`` and ``_dim_group_names`` checked on torch 2.13 and 2.15; torch 2.5.1 has no ``_rank`` (its mesh asks
    the default group for the rank): ``TypeError`` there."""
    from torch.distributed.device_mesh import DeviceMesh

    # named after its group: a mesh equal to an earlier one (same ranks, same names) would meet DTensor's cached
    # shardings of that one, which name the earlier group
    mesh = DeviceMesh("cpu", list(range(size)), mesh_dim_names=(group_name,), _init_backend=False, _rank=rank)
    mesh._dim_group_names = [group_name]
    return mesh


def register_group(name: str, rank: int, size: int) -> Any:
    """A ``ProcessGroup`` with no backend (``ProcessGroup(HashStore(), rank, size)``) registered in c10d's group
    table under ``name``, which only answers its size (the functional collectives ask a group's size by name, for
    their outputs' shapes); a function that unregisters it. Neither the default group nor any group the user made is
    read or changed. ``torch._C._distributed_c10d._register_process_group`` / ``_unregister_process_group`` checked
    on torch 2.13, 2.15."""
    import torch.distributed as dist

    return _registered(name, dist.ProcessGroup(dist.HashStore(), rank, size))


def _registered(name: str, group: Any) -> Any:
    """``group`` registered in c10d's group table under ``name``; a function that unregisters it (the table holds
    it weakly: the closure keeps it until then)."""
    from torch._C._distributed_c10d import _register_process_group, _unregister_process_group

    _register_process_group(name, group)
    kept = [group]

    def unregister() -> None:
        kept.clear()
        try:
            _unregister_process_group(name)
        except RuntimeError:
            pass

    return unregister


def register_fake_group(name: str, rank: int, size: int) -> Any:
    """:func:`register_group` with PyTorch's fake backend behind the group (``FakeProcessGroup._create_internal(rank,
    size)``, registered as the group's CPU backend with ``ProcessGroup._register_backend`` and
    ``_set_default_backend(BackendType.CUSTOM)``): its collectives complete at once and move nothing, so FSDP2's own
    code (``fully_shard``, whose all-gathers and reduce-scatters go through ``torch.distributed`` with the group) runs
    one rank on fake tensors. A function that unregisters it. The default group is never read or changed. Checked on
    torch 2.13."""
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import FakeProcessGroup

    group = dist.ProcessGroup(dist.HashStore(), rank, size)
    group._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM,
                            FakeProcessGroup._create_internal(rank, size))
    return _registered(name, group)


@contextlib.contextmanager
def dtensor_shape_runs(flag: Any) -> Any:
    """While the context is open, ``flag.propagating`` is true whenever ``DTensor`` works out an op's output shape
    by running the op on fake tensors of the global shapes (``DTensor._op_dispatcher.sharding_propagator.
    _propagate_tensor_meta_non_cached``, which enters the active fake mode again: its ops reach the modes below).
    The propagator's method is wrapped on the instance and unwrapped on exit. Checked on torch 2.13, 2.15."""
    from torch.distributed.tensor import DTensor

    prop = DTensor._op_dispatcher.sharding_propagator
    name = "_propagate_tensor_meta_non_cached"
    original = getattr(type(prop), name, None)
    if original is None or name in vars(prop):
        yield
        return

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        before, flag.propagating = flag.propagating, True
        try:
            return original(prop, *args, **kwargs)
        finally:
            flag.propagating = before

    setattr(prop, name, wrapped)
    try:
        yield
    finally:
        delattr(prop, name)


def interleaved_rank_ops(numbers: Any, rank: int) -> list[Any]:
    """``ScheduleInterleaved1F1B._calculate_single_rank_operations(numbers, rank)``: the actions PyTorch's interleaved
    schedule runs on ``rank``, computed from the numbers it reads from its stages (``numbers``: an object with
    ``n_local_stages``, ``pp_group_size``, ``_n_microbatches``, ``number_of_rounds``, ``microbatches_per_round``).
    Checked on torch 2.13, 2.15."""
    from torch.distributed.pipelining import schedules

    return schedules.ScheduleInterleaved1F1B._calculate_single_rank_operations(numbers, rank)


def interleaved_rank_ops_with_comms(numbers: Any, rank: int) -> list[Any]:
    """The interleaved schedule's actions on ``rank`` with its communication, lowered as the runtime of torch 2.15
    lowers them (``_PipelineScheduleRuntime._prepare_schedule_with_comms``: ``_add_reduce_grad``, ``_add_send_recv``,
    ``_add_wait_send``; stage s on rank s mod p): each receive, send and wait where the rank runs it."""
    from torch.distributed.pipelining import schedules

    ranks, m = numbers.pp_group_size, numbers._n_microbatches
    compute = {r: schedules.ScheduleInterleaved1F1B._calculate_single_rank_operations(numbers, r)
               for r in range(ranks)}
    lowered = {r: schedules._add_reduce_grad(compute[r], m) for r in compute}
    lowered = schedules._add_send_recv(lowered, stage_to_rank=lambda s: s % ranks,
                                       num_stages=numbers.n_local_stages * ranks)
    return schedules._add_wait_send(lowered)[rank]


def runtime_schedule_order(class_name: str, ranks: int, n_local: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """The actions one of PyTorch's runtime schedules (``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``,
    ``ScheduleInterleavedZeroBubble``, ...) runs on ``rank``, with the communication it lowers into them: the schedule
    is built on stand-in stages (only their numbers are read) and its ``pipeline_order_with_comms`` read, an
    ``OVERLAP_F_B`` action as its sub-actions in their order; ``(kind, stage, micro-batch or -1)``. PyTorch's own
    ``ValueError`` for micro-batches it refuses passes through. Checked on torch 2.13."""
    from types import SimpleNamespace

    from torch.distributed import pipelining

    cls = getattr(pipelining, class_name)
    stand_ins = [SimpleNamespace(num_stages=ranks * n_local, group_size=ranks, group_rank=rank, submod=None)
                 for _ in range(n_local)]
    schedule = cls(stand_ins, n_microbatches=m, loss_fn=lambda output, target: output)
    out = []
    for action in schedule.pipeline_order_with_comms[rank]:
        for a in action.sub_actions or (action,):
            j = a.microbatch_index
            out.append((str(a.computation_type.value), int(a.stage_index), -1 if j is None else int(j)))
    return out


def pipeline_backward() -> Any:
    """``torch.distributed.pipelining._backward``: ``stage_backward`` (a stage's whole backward),
    ``stage_backward_input`` (the gradients of its inputs, keeping what the weights' gradients need) and
    ``stage_backward_weight``, as a ``PipelineStage`` runs them. Checked on torch 2.13."""
    from torch.distributed.pipelining import _backward

    return _backward


__all__ = [
    "FAKE_TENSOR_LOGGER", "DataDependentOutputException", "DynamicOutputShapeException", "FakeCopyMode",
    "FakeTensor", "FakeTensorMode", "OpOverload", "TorchDispatchMode", "UnsupportedOperatorException",
    "aot_autograd", "construct_script_module", "disable_current_modes", "dtensor_shape_runs", "dynamo_config",
    "inductor_fake_mode", "inductor_partition", "interleaved_rank_ops", "interleaved_rank_ops_with_comms",
    "min_cut_partition", "pipeline_backward", "runtime_schedule_order",
    "modes_ignore_compile_internals", "offline_mesh", "pop_mode", "post_grad_passes", "push_mode", "register_group",
    "register_fake_group",
]


def operator_names() -> list[str]:
    """Every operator the dispatcher knows, as ``"aten::layer_norm"``, ``"aten::pow.Scalar"``
    (``torch._C._dispatch_get_all_op_names``; read on torch 2.5.1 and 2.13)."""
    import torch

    return list(torch._C._dispatch_get_all_op_names())


def destroy_library(library: Any) -> None:
    """Remove what a ``torch.library.Library`` registered now, not when it is collected (``Library._destroy``; the
    kernels it overrode come back; read on torch 2.5.1 and 2.13)."""
    library._destroy()


def function_modes() -> list[Any]:
    r"""The ``TorchFunctionMode``\ s active now, outermost first (``torch.overrides._get_current_function_mode_stack``;
    read on torch 2.13, and an empty list where a release lacks it)."""
    import torch.overrides

    stack = getattr(torch.overrides, "_get_current_function_mode_stack", None)
    return list(stack()) if stack is not None else []


def dtensor_from_local(local: Any, mesh: Any, placements: Any, shape: Any, stride: Any) -> Any:
    """A ``DTensor`` around ``local`` (a shard already placed), of global ``shape`` and ``stride``, without
    ``DTensor``'s sharding propagation or any collective: ``DTensor(local, DTensorSpec(mesh, placements,
    tensor_meta=TensorMeta(shape, stride, local.dtype)), requires_grad=False)``
    (``torch.distributed.tensor._dtensor_spec``; checked on torch 2.13)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    meta = TensorMeta(shape, stride, local.dtype)
    return DTensor(local, DTensorSpec(mesh, placements, tensor_meta=meta), requires_grad=False)
