"""PyTorch's private names sit behind two doors, ``vram_magic.engine.torch_private`` and
``vram_magic.estimator.torch_private``: every name they use resolves on the installed PyTorch (and does what the
package relies on), and no other module of the package reaches into PyTorch's private API.

The scan sees imports from private PyTorch modules, attribute chains from a name bound to ``torch`` (or one of its
modules) through a private attribute, the patched ``UntypedStorage.resize_`` / ``Module._apply``, and strings
naming a private PyTorch module. It does not see private attributes read off PyTorch objects held in a variable
(``op._schema``, ``module._parameters``) nor the ``_should_skip_dynamo`` hook the tracker overrides."""

from __future__ import annotations

import ast
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from vram_magic.engine import torch_private as engine_door
from vram_magic.estimator import torch_private as estimator_door
from vram_magic.estimator.layouts.pipeline import buffers_per_use

PACKAGE = Path(__file__).resolve().parent.parent / "vram_magic"
DOORS = {PACKAGE / "engine" / "torch_private.py", PACKAGE / "estimator" / "torch_private.py"}
PATCHED = {"resize_"}  # public methods the package replaces while it measures
TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _dotted(node: ast.AST) -> list[str] | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def private_uses(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` for each reference to PyTorch's private API in ``source``."""
    tree = ast.parse(source)
    roots: set[str] = set()  # local names bound to torch or something imported from it
    found: set[tuple[int, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    roots.add((a.asname or a.name).split(".")[0])
                    if any(map(_private, a.name.split("."))):
                        found.add((node.lineno, f"import {a.name}"))
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            for a in node.names:
                roots.add(a.asname or a.name)
                if any(map(_private, (node.module or "").split("."))) or _private(a.name):
                    found.add((node.lineno, f"from {node.module} import {a.name}"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = _dotted(node)
            # torch.ops.aten._foo names an ATen operator, not Python API
            if chain and chain[0] in roots and chain[1:2] != ["ops"] \
                    and any(_private(p) or p in PATCHED for p in chain[1:]):
                found.add((node.lineno, ".".join(chain)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("torch._"):
            found.add((node.lineno, repr(node.value)))
    return sorted(found)


def test_the_scan_sees_each_kind_of_private_use() -> None:
    source = ("import torch\nfrom torch import nn\nimport torch._dynamo\nfrom torch._subclasses import fake_tensor\n"
              "from torch.utils._python_dispatch import TorchDispatchMode\nfrom torch.cuda.memory import _snapshot\n"
              "a = torch._C._current_autograd_node\nb = nn.Module._apply\nc = torch.UntypedStorage.resize_\n"
              "d = 'torch._inductor'\ne = torch.ops.aten._local_scalar_dense\nf = torch.nn.functional.relu\n")
    lines = {line for line, _ in private_uses(source)}
    assert lines == {3, 4, 5, 6, 7, 8, 9, 10}


def test_no_module_outside_the_doors_uses_torch_private_names() -> None:
    uses = {f"{path.relative_to(PACKAGE.parent)}:{line}: {what}"
            for path in PACKAGE.rglob("*.py") if path not in DOORS
            for line, what in private_uses(path.read_text())}
    assert not uses, "PyTorch's private names outside the torch_private modules:\n" + "\n".join(sorted(uses))


def test_the_doors_do_use_private_names() -> None:  # the scan would see them, were they elsewhere
    for door in DOORS:
        assert len(private_uses(door.read_text())) > 5


# --- the engine's door -----------------------------------------------------------------------------------

class _Mode(engine_door.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


def test_mode_stack_names() -> None:
    from torch.utils import _python_dispatch as pd

    ours, theirs = _Mode(), _Mode()
    assert engine_door.current_mode_stack() == []
    ours.__enter__()
    theirs.__enter__()
    assert engine_door.current_mode_stack() == [ours, theirs]
    engine_door.leave_mode_stack(ours)  # theirs stays on, in place
    assert engine_door.current_mode_stack() == [theirs]
    assert pd._is_in_torch_dispatch_mode is True
    theirs.__exit__(None, None, None)
    assert engine_door.current_mode_stack() == []
    assert pd._is_in_torch_dispatch_mode is False
    assert pd._is_in_non_infra_torch_dispatch_mode is False

    with _Mode() as m:
        popped = engine_door.pop_mode()
        assert popped is m and engine_door.current_mode_stack() == []
        engine_door.push_mode(popped)
        with engine_door.disable_current_modes():
            assert engine_door.current_mode_stack() == []
        assert engine_door.current_mode_stack() == [m]
    assert engine_door.modes_ignore_compile_internals() is hasattr(pd.TorchDispatchMode, "ignore_compile_internals")


def test_never_compiled_marks_code() -> None:
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy  # noqa: F401
    except ImportError:  # torch 2.5.1 has no such marks: never_compiled leaves the code as it is
        assert TORCH < (2, 13)

    def f(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    engine_door.never_compiled(f, object())  # an object without code is left alone
    assert f(torch.ones(1)).item() == 2


def test_op_and_autograd_names() -> None:
    assert isinstance(torch.ops.aten.mm.default, engine_door.OpOverload)
    has = engine_door.has_kernel_for_dispatch_key
    assert has("aten::mm", "CPU") and not has("aten::linear", "CPU")
    assert has("aten::linear", "CompositeImplicitAutograd")
    assert engine_door.current_autograd_node() is None
    seen = []

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def]
            return x * 2

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def]
            seen.append(engine_door.current_autograd_node())
            return g * 2

    Twice.apply(torch.ones(3, requires_grad=True)).sum().backward()
    assert seen and seen[0] is not None and "Twice" in type(seen[0]).__name__


def test_module_names() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert engine_door.DYNAMO_MODULE == "torch._dynamo"
    with FakeTensorMode():
        fake = torch.empty(2)
    assert type(fake).__module__.startswith(engine_door.TRACING_TENSORS_PREFIX)
    assert engine_door.TRACING_TENSORS_PREFIX == engine_door.TRACING_TENSORS_PACKAGE + "."
    compiled = torch.compile(nn.Linear(2, 2))  # builds the wrapper only: nothing is compiled until it runs
    assert "torch._dynamo" in sys.modules
    assert isinstance(compiled, engine_door.optimized_module_class())


def test_storage_resize_patch() -> None:
    original = engine_door.storage_resize()
    calls = []

    def resize(self, size):  # type: ignore[no-untyped-def]
        calls.append(size)
        return original(self, size)

    engine_door.patch_storage_resize(resize)
    try:
        storage = torch.empty(4).untyped_storage()
        storage.resize_(64)
        assert calls == [64] and storage.nbytes() == 64
        engine_door.unpatch_storage_resize(original)  # not the one in place: left
        assert engine_door.storage_resize() is resize
    finally:
        engine_door.unpatch_storage_resize(resize)
    assert engine_door.storage_resize() is original and "resize_" not in torch.UntypedStorage.__dict__


def test_module_apply_patch() -> None:
    assert engine_door.MODULE_APPLY is nn.Module._apply
    seen = []

    def apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        seen.append(type(self).__name__)
        return engine_door.MODULE_APPLY(self, fn, recurse)

    engine_door.set_module_apply(apply)
    try:
        model = nn.Linear(2, 2).double()
    finally:
        engine_door.set_module_apply(engine_door.MODULE_APPLY)
    assert seen == ["Linear"] and model.weight.dtype == torch.float64
    assert nn.Module._apply is engine_door.MODULE_APPLY


def test_profiler_names() -> None:
    assert engine_door.profiler_enabled() is False and engine_door.python_profiler_enabled() is False
    engine_door.start_memory_profiler(False)
    try:
        assert engine_door.profiler_enabled() is True
        kept = torch.empty(1024)  # 4,096 B
    finally:
        result = engine_door.stop_profiler()
    allocation = engine_door.profiler_event_type().Allocation
    sizes, stack = [], list(result.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == allocation:
            sizes.append(node.extra_fields.alloc_size)
    assert 4096 in sizes and kept.numel() == 1024
    assert engine_door.profiler_record_scope().BACKWARD_FUNCTION is not None
    with torch.autograd.profiler.profile():
        assert engine_door.python_profiler_enabled() is True


def test_cuda_and_allocator_names() -> None:
    probe = engine_door.cuda_has_primary_context()
    assert probe is None or callable(probe)
    assert engine_door.default_device_context() is None
    torch.set_default_device("meta")
    try:
        assert engine_door.default_device_context().device == torch.device("meta")
    finally:
        torch.set_default_device(None)
    record = engine_door.record_memory_history()
    assert callable(record)

    def watched(*args, **kwargs):  # type: ignore[no-untyped-def]
        return record(*args, **kwargs)

    engine_door.set_record_memory_history(watched)
    try:
        assert torch.cuda.memory._record_memory_history is watched
    finally:
        engine_door.set_record_memory_history(record)
    assert torch.cuda.memory._record_memory_history is record
    if torch.cuda.is_available():
        assert isinstance(engine_door.cuda_history_enabled(), bool)
        assert "segments" in engine_door.memory_snapshot()
    else:  # a CPU build has no CUDA half of torch._C; a CUDA build without a GPU cannot ask the allocator
        with pytest.raises(RuntimeError if torch.backends.cuda.is_built() else AttributeError):
            engine_door.cuda_history_enabled()


def test_lazy_call_and_the_oom_observer() -> None:
    """``lazy_call`` runs at once where CUDA is initialised and queues otherwise (never initialising it); the observer
    hook exists on CUDA builds only."""
    import torch.cuda as tc

    ran: list[int] = []
    queued = len(tc._queued_calls)
    engine_door.lazy_call(lambda: ran.append(1))
    if tc.is_initialized():
        assert ran == [1]
    else:
        assert ran == [] and len(tc._queued_calls) == queued + 1
        tc._queued_calls.pop()  # this test's own, taken back
    observer = engine_door.attach_oom_observer()
    assert (observer is not None) == torch.backends.cuda.is_built()
    assert observer is None or callable(observer)


def test_group_store_entry() -> None:
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        entry = engine_door.group_store_entry(None)
        assert entry is not None and entry[1] is not None
        entry[1].set("key", "value")
        assert entry[1].get("key") == b"value"
        assert engine_door.group_store_entry(dist.group.WORLD) == entry
    finally:
        dist.destroy_process_group()


# --- the estimator's door --------------------------------------------------------------------------------

def test_fake_tensor_names() -> None:
    door = estimator_door
    with door.FakeTensorMode():
        fake = torch.empty(8, 4)
    assert isinstance(fake, door.FakeTensor) and fake.shape == (8, 4)
    with door.FakeTensorMode() as mode, door.FakeCopyMode(mode):
        import copy

        copied = copy.deepcopy(nn.Linear(4, 2))
    assert isinstance(copied.weight, door.FakeTensor)
    for exc in (door.DataDependentOutputException, door.DynamicOutputShapeException,
                door.UnsupportedOperatorException):
        assert issubclass(exc, Exception)
    assert logging.getLogger(door.FAKE_TENSOR_LOGGER).name == "torch._subclasses.fake_tensor"
    assert door.OpOverload is engine_door.OpOverload and door.TorchDispatchMode is engine_door.TorchDispatchMode
    assert door.pop_mode is engine_door.pop_mode and door.push_mode is engine_door.push_mode
    assert door.disable_current_modes is engine_door.disable_current_modes


def test_compiler_names() -> None:
    door = estimator_door
    config = door.dynamo_config()
    assert hasattr(config, "patch")
    assert hasattr(config, "recompile_limit") or hasattr(config, "cache_size_limit")
    assert callable(door.aot_autograd())
    try:
        partition_fn, select_decomp_table = door.inductor_partition()
        assert callable(partition_fn) and isinstance(select_decomp_table(), dict)
    except ImportError:  # torch 2.5.1: partition_fn is local to compile_fx; the estimator uses min_cut_partition
        assert TORCH < (2, 13)
    assert callable(door.min_cut_partition())
    assert callable(door.post_grad_passes())
    from torch._inductor.virtualized import V

    with door.FakeTensorMode() as mode:
        x = torch.empty(2)
    with door.inductor_fake_mode([x]):
        assert V.fake_mode is mode


def test_construct_script_module() -> None:
    scripted = torch.jit.script(nn.Linear(3, 2))
    copy = estimator_door.construct_script_module(scripted._c._replicate_for_data_parallel(), lambda _: None)
    assert isinstance(copy, torch.jit.RecursiveScriptModule)
    assert copy.weight.shape == (2, 3) and torch.equal(copy.weight, scripted.weight)


@pytest.mark.skipif(not buffers_per_use(), reason="a runtime making receive buffers per use (2.15)")
def test_interleaved_rank_ops_with_comms() -> None:
    """The interleaved schedule's lowered actions on rank 0 of 2 (stages 0 and 2 of 4, 4 micro-batches): each
    forward and backward of its stages, a receive before each of stage 2's forwards and before each of stage 0's
    and 2's backwards but the last stage's, and one wait for every send."""
    numbers = SimpleNamespace(n_local_stages=2, pp_group_size=2, _n_microbatches=4, number_of_rounds=2,
                              microbatches_per_round=2)
    ops = [(str(op.computation_type.value), op.stage_index, op.microbatch_index)
           for op in estimator_door.interleaved_rank_ops_with_comms(numbers, 0) if op is not None]
    kinds = [k for k, _, _ in ops]
    assert kinds.count("F") == 8 and kinds.count("B") == 8
    assert sorted((s, j) for k, s, j in ops if k == "RECV_F") == [(2, j) for j in range(4)]
    assert sorted((s, j) for k, s, j in ops if k == "RECV_B") == [(0, j) for j in range(4)] + [(2, j) for j in range(4)]
    assert kinds.count("WAIT_SEND_F") == kinds.count("SEND_F") == 8
    assert kinds.count("WAIT_SEND_B") == kinds.count("SEND_B") == 4  # stage 2 sends its inputs' gradients back
    # a receive comes before the action it feeds
    for k, s, j in ops:
        if k in ("RECV_F", "RECV_B"):
            assert ops.index((k, s, j)) < ops.index((k[-1], s, j))
