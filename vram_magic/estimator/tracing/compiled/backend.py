"""Compiled models (``torch.compile``), estimated as compiled training runs them.

A compiled model saves for backward only what AOTAutograd's partitioner decides (cheap ops are recomputed in
the backward instead of saved), fuses chains of pointwise ops into one kernel that writes only its result,
and frees each buffer as soon as it is used. The estimate compiles the fake model with TorchDynamo and
AOTAutograd as Inductor does — Inductor's decompositions, its joint-graph passes, its min-cut partitioner and
its post-grad passes (pattern rewrites such as ``mm`` + ``add`` into one ``addmm``, which decide when a
gradient dies) — but instead of generating kernels it runs the partitioned forward and backward graphs op by
op on fake tensors, with what Inductor's kernels do to memory on top:

* which pointwise values are written to memory at all, as Inductor's lowering and fusion decide it (see
  ``fusion.py``): the others live inside the kernels that read them, and what they read stays alive
  until a kernel that recomputes them after a matmul has run;
* a kernel writes in place into a buffer of the same size that it reads for the last time (the saved
  activations are donated to the backward);
* a dead buffer that a later kernel of the same size takes stays allocated until then when the graph's own
  peak allows it (Inductor's memory planning);
* on the CPU, graphs with convolutions run channels-last (``layout.py``);
* every other value is freed after its last use (the graph's inputs too, as Inductor's boxed calling
  convention allows).

Not modelled: the order in which Inductor's scheduler runs kernels (graph order is used). The tracker ignores
the compiler's own work (``ignore_compile_internals``, and AOTAutograd compiling the backward inside the
step) and sees the graphs' ops when they run.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from ... import torch_private
from ...torch_private import OpOverload, modes_ignore_compile_internals
from . import layout as compiled_layout
from .fusion import base_node, inlined_nodes, kernel_reads

NOTE = ("compiled (torch.compile): activations saved for backward as AOTAutograd's min-cut partitioner decides "
        "them (with Inductor's decompositions and graph passes); the partitioned graphs run op by op on fake "
        "tensors, pointwise chains counted as fused kernels, buffers reused as Inductor plans them")


def supported() -> bool:
    """Whether this PyTorch runs compiled code under a dispatch mode that asks to be left out of compilation
    (``ignore_compile_internals``, PyTorch 2.9): before it, TorchDynamo skips the frame (and may keep skipping
    that code afterwards), so compiled parts are estimated as eager code instead."""
    return modes_ignore_compile_internals()


EAGER_NOTE = ("compiled parts estimated as eager code: this PyTorch ({version}) cannot run compiled code under the "
              "estimator's tracker (PyTorch 2.9 and later can); a compiled step usually needs less")


def is_compiled(module: Any) -> bool:
    """A ``torch.compile``'d module (an ``OptimizedModule`` wrapping the module it compiles)."""
    return type(module).__name__ == "OptimizedModule" and isinstance(getattr(module, "_orig_mod", None), nn.Module)


def _walk(module: nn.Module, prefix: str = "") -> Any:
    """``(name, module as found, the module it compiles or itself)``, named as in the model without wrappers."""
    inner = module._orig_mod if is_compiled(module) else module  # type: ignore[union-attr]
    yield prefix, module, inner
    for name, child in inner._modules.items():
        if child is not None:
            yield from _walk(child, f"{prefix}.{name}" if prefix else name)


def compiled_parts(model: nn.Module) -> dict[str, str]:
    """The compiled parts of a model, named as in the model without wrappers (``""``: the model itself), and
    how each was compiled: ``torch.compile(module)`` or ``module.compile()``."""
    out: dict[str, str] = {}
    for name, outer, inner in _walk(model):
        if outer is not inner:
            out[name] = "torch.compile"
        elif getattr(inner, "_compiled_call_impl", None) is not None:
            out[name] = "compile()"
    return out


def copy_plain(model: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """``copy.deepcopy`` of the model in which every compiled wrapper is copied as the module it compiles."""
    for _, outer, inner in _walk(model):
        if outer is not inner and id(outer) not in memo:
            memo[id(outer)] = copy.deepcopy(inner, memo)
    root = model._orig_mod if is_compiled(model) else model  # type: ignore[union-attr]
    return copy.deepcopy(root, memo)


def strip(model: nn.Module) -> nn.Module:
    """The model (our own fake build) with every compiled wrapper replaced by the module it compiles."""
    for _, _, inner in list(_walk(model)):
        for name, child in list(inner._modules.items()):
            if child is not None and is_compiled(child):
                inner._modules[name] = child._orig_mod
    return model._orig_mod if is_compiled(model) else model  # type: ignore[union-attr,return-value]


def _compile(target: Any, backend: Any) -> Any:
    # Its own region of TorchDynamo's cache: what the estimate compiles never counts against the recompile
    # limit of the user's own compiled model (which would fall back to eager)
    # (static shapes: an estimate runs one shape, and what-ifs at other batches must not turn it dynamic)
    try:
        return torch.compile(target, backend=backend, dynamic=False, isolate_recompiles=True)
    except TypeError:  # a PyTorch without isolated regions
        return torch.compile(target, backend=backend, dynamic=False)


def recompile(model: nn.Module, parts: dict[str, str]) -> Any:
    """Compile the parts of the plain (fake) model that were compiled, with the estimating backend (a copied
    ``compile()`` still holds the user's compiled call: it is replaced here); what to call for a step."""
    backend = estimating_backend()
    runner: Any = model
    for name, how in sorted(parts.items(), key=lambda kv: -len(kv[0])):  # innermost first
        m = model.get_submodule(name) if name else model
        if how == "compile()":
            m._compiled_call_impl = _compile(m._call_impl, backend)  # type: ignore[assignment]
        elif name:
            parent, _, leaf = name.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            owner._modules[leaf] = _compile(m, backend)  # type: ignore[assignment]
        else:
            runner = _compile(m, backend)
    return runner


def estimating_backend() -> Any:
    """TorchDynamo backend: AOTAutograd with Inductor's decompositions and partitioner; graphs run op by op."""
    aot_autograd = torch_private.aot_autograd()
    try:
        partition_fn, select_decomp_table = torch_private.inductor_partition()
    except (ImportError, AttributeError):  # Inductor's private names moved: AOTAutograd's own min-cut partitioner
        from functools import partial

        partition_fn = partial(torch_private.min_cut_partition(), compiler="inductor")

        def select_decomp_table() -> Any:
            return {}

    def partition(gm: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        # Inductor's joint-graph passes read the fake mode Inductor would have set
        with _unseen(), torch_private.inductor_fake_mode(joint_inputs):
            return partition_fn(gm, joint_inputs, **kwargs)

    import functools

    return aot_autograd(fw_compiler=_runner, bw_compiler=_runner, partition_fn=partition,
                        inference_compiler=functools.partial(_runner, is_inference=True),
                        decompositions=select_decomp_table(), keep_inference_input_mutations=True)


#: The step tracer while a compiled model runs (it is told which values a fused kernel keeps to itself).
ACTIVE: list[Any] = []

_FUSIBLE_NAMES = frozenset({"_to_copy", "inductor_random", "inductor_randint", "full", "scalar_tensor", "iota",
                            "gather", "embedding", "where"})


def _kind(node: Any) -> str:
    """``pointwise`` (computed inside the kernel of its consumer), ``reduction``, ``view`` or ``other``."""
    if node.op != "call_function" or not isinstance(node.target, OpOverload):
        return "other"
    target = node.target
    if torch.Tag.pointwise in target.tags or target.__name__.split(".")[0] in _FUSIBLE_NAMES:
        return "pointwise"
    if torch.Tag.reduction in target.tags:
        return "reduction"
    try:
        if any(r.alias_info is not None for r in target._schema.returns):
            return "view"
    except AttributeError:
        pass
    return "other"


class GraphFacts(NamedTuple):
    """What the passes below read of a graph, worked out once: each node's kind, its position, the buffers
    that leave the graph (through views), and each buffer's last reader other than a view (through its views)."""

    kinds: dict[Any, str]
    order: dict[Any, int]
    outputs: set[Any]
    last: dict[Any, int]


def graph_facts(gm: torch.fx.GraphModule) -> GraphFacts:
    kinds = {node: _kind(node) for node in gm.graph.nodes}
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    outputs: set[Any] = set()
    last: dict[Any, int] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            outputs.update(base_node(n, kinds) for n in node.all_input_nodes)
        if kinds.get(node) != "view":
            for used in node.all_input_nodes:
                base = base_node(used, kinds)
                last[base] = max(last.get(base, -1), order[node])
    return GraphFacts(kinds, order, outputs, last)


def _same_size(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return int(a.untyped_storage().nbytes()) == int(b.untyped_storage().nbytes())
    except (TypeError, ValueError, RuntimeError):  # symbolic sizes
        return False


def reused_buffers(gm: torch.fx.GraphModule, virtual: set[Any], facts: GraphFacts) -> dict[Any, Any]:
    """``{node: buffer}``: a pointwise kernel that writes its result into a buffer it reads for the last time,
    of the same size and dtype (Inductor's in-place reuse). In a backward graph the saved activations are
    donated to it and can be reused too; the forward's inputs (parameters, the batch) never are."""
    kinds, order, outputs, last = facts

    def donated(node: Any) -> bool:
        if node.op != "placeholder":
            return node.op == "call_function"
        return not str(node.target).startswith(("primals", "tangents"))

    out: dict[Any, Any] = {}
    taken: set[Any] = set()
    for node in order:
        if node in virtual or kinds.get(node) != "pointwise":
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        kernel, stack = {node}, [node]
        while stack:  # the virtual values computed inside this kernel
            for used in stack.pop().all_input_nodes:
                b = base_node(used, kinds)
                if b in virtual and b not in kernel:
                    kernel.add(b)
                    stack.append(b)
        end = order[node]
        for k in sorted(kernel, key=order.__getitem__):
            for used in k.all_input_nodes:
                b = base_node(used, kinds)
                bval = b.meta.get("val")
                if (b in kernel or b in taken or b in outputs or not donated(b) or last.get(b, -1) > end
                        or not isinstance(bval, torch.Tensor) or bval.dtype != val.dtype
                        or not _same_size(bval, val)):
                    continue
                out[node] = b
                taken.add(b)
                break
            if node in out:
                break
    return out


def deferred_frees(gm: torch.fx.GraphModule, virtual: set[Any], inplace: dict[Any, Any],
                   facts: GraphFacts, inputs: dict[Any, Any] | None = None) -> dict[Any, Any]:
    """``{node: buffer}``: Inductor's memory planning does not free a dead buffer when a later kernel can take
    it (same dtype and size); it stays allocated until that kernel writes into it. Which buffer each kernel
    takes, planned as Inductor plans it: in run order, the most recently freed buffer of the right size, kept
    for it only when that kernel comes next or keeping it does not raise the graph's own peak
    (``AllocateLine.should_reuse_buffer``); ``inputs``: the graph's input values, whose storages (views of one
    buffer among them) the graph's peak counts once."""
    kinds, order, outputs, last = facts
    dies_at: dict[int, list[Any]] = {}
    for b, i in last.items():
        dies_at.setdefault(i, []).append(b)

    def allocates(node: Any) -> bool:
        return (node.op == "call_function" and isinstance(node.target, OpOverload)
                and kinds.get(node) != "view" and node not in virtual
                and isinstance(node.meta.get("val"), torch.Tensor))

    def poolable(b: Any) -> bool:
        if b in outputs or b in virtual or not isinstance(b.meta.get("val"), torch.Tensor):
            return False
        if b.op == "placeholder":
            return not str(b.target).startswith(("primals", "tangents"))
        return allocates(b)

    def key(b: Any) -> tuple[Any, Any]:
        val = b.meta["val"]
        try:
            return val.dtype, int(val.untyped_storage().nbytes())
        except (TypeError, ValueError, RuntimeError):  # a symbolic size: never matched
            return val.dtype, id(b)

    profile, kernel = _planned_profile(order, last, allocates, poolable, key, inputs or {})
    peak = max(profile, default=0)
    pool: dict[tuple[Any, int], list[Any]] = {}
    freed_at: dict[Any, int] = {}
    taken_inplace = set(inplace.values())
    out: dict[Any, Any] = {}
    for node, i in order.items():
        if allocates(node) and node not in inplace:
            free = pool.get(key(node))
            if free:
                b = free[-1]
                size = key(node)[1] if isinstance(key(node)[1], int) else 0
                lo = freed_at[b] + 1
                if kernel[i] == kernel[freed_at[b]] + 1 or max(profile[lo:i], default=0) + size <= peak:
                    out[node] = free.pop()
                    for p in range(lo, i):
                        profile[p] += size
        for b in dies_at.get(i, ()):
            if poolable(b) and b not in taken_inplace:
                pool.setdefault(key(b), []).append(b)
                freed_at[b] = i
    return out


def _planned_profile(order: dict[Any, int], last: dict[Any, int], allocates: Any, poolable: Any,
                     key: Any, inputs: dict[Any, Any]) -> tuple[list[int], list[int]]:
    """The graph's own bytes at each position of the run (the freeable inputs, what its kernels allocate,
    each freed after its last reader) as Inductor's peak estimate sees them, without buffers kept for reuse;
    and each position's kernel number (consecutive kernels: the next one takes a buffer at no cost)."""
    def size(b: Any) -> int:
        n = key(b)[1]
        return n if isinstance(n, int) and n < 1 << 62 else 0

    # the freeable inputs, a storage once (saved views of one buffer), freed when its last view dies
    storages: dict[int, list[Any]] = {}
    for b in order:
        if b.op == "placeholder" and poolable(b):
            value = inputs.get(b)
            try:
                sid = id(value.untyped_storage()) if isinstance(value, torch.Tensor) else id(b)
            except (RuntimeError, NotImplementedError):
                sid = id(b)
            storages.setdefault(sid, []).append(b)
    frees: dict[int, int] = {}  # position -> bytes freed after it
    current = 0
    for views in storages.values():
        n = max(size(b) for b in views)
        current += n
        i = max(last.get(b, order[b]) for b in views)
        frees[i] = frees.get(i, 0) + n
    for b, i in last.items():
        if b.op != "placeholder" and poolable(b):
            frees[i] = frees.get(i, 0) + size(b)
    profile: list[int] = []
    kernel: list[int] = []
    k = 0
    for node, i in order.items():
        if allocates(node):  # a kernel writing in place takes over its input's bytes, freed with that input
            k += 1
            current += size(node)
        profile.append(current)
        kernel.append(k)
        current -= frees.get(i, 0)
    return profile, kernel


def _post_grad(gm: torch.fx.GraphModule, example_inputs: Any, is_inference: bool) -> None:
    """Inductor's own post-grad passes (its pattern rewrites, e.g. ``mm`` + ``add`` into ``addmm`` placed where
    the addend is ready, which decides when a gradient dies). Private to Inductor: where a PyTorch lacks them
    or they fail, the graph runs as partitioned."""
    try:
        passes = torch_private.post_grad_passes()
        with torch_private.inductor_fake_mode(example_inputs):
            passes(gm, is_inference=is_inference)
    except Exception:  # noqa: BLE001 - an optional refinement of the model, never a reason to fail
        return


@contextlib.contextmanager
def _unseen() -> Iterator[None]:
    """The compiler's own work, out of the step tracer's sight: AOTAutograd compiles the backward when it
    first runs (inside the step), and the post-grad passes trace their replacements on fake tensors that the
    new nodes keep (a real step compiles before the memory that matters, and keeps no tensors of it)."""
    tracer = ACTIVE[-1] if ACTIVE else None
    if tracer is None:
        yield
        return
    before = tracer.compiling
    tracer.compiling = True
    try:
        yield
    finally:
        tracer.compiling = before


def _runner(gm: torch.fx.GraphModule, example_inputs: Any, is_inference: bool = False) -> Any:
    """A boxed callable that runs ``gm``'s nodes one by one and drops each value after its last use — the
    inputs too (the caller's list is emptied), as Inductor's generated code does."""
    with _unseen():
        return _make_runner(gm, example_inputs, is_inference)


def _make_runner(gm: torch.fx.GraphModule, example_inputs: Any, is_inference: bool) -> Any:
    _post_grad(gm, example_inputs, is_inference)
    device = ACTIVE[-1].target if ACTIVE else "cuda"  # the device the step is estimated for
    nodes = list(gm.graph.nodes)
    facts = graph_facts(gm)
    virtual = inlined_nodes(gm, facts.kinds, device)
    # a value computed inside a kernel reads its inputs where that kernel runs: they live until then
    reads = kernel_reads(gm, facts.kinds, virtual)
    drop = {used: facts.order[node] for node in nodes for used in node.all_input_nodes}
    for node, loaded in reads.items():
        for used in loaded:
            drop[used] = max(drop.get(used, -1), facts.order[node])
            b = base_node(used, facts.kinds)
            facts.last[b] = max(facts.last.get(b, -1), facts.order[node])
    last_use: dict[Any, list[Any]] = {}
    for used, i in drop.items():
        last_use.setdefault(nodes[i], []).append(used)
    map_arg = torch.fx.node.map_arg
    reuse = reused_buffers(gm, virtual, facts)
    plan: list[dict[Any, Any]] = []  # deferred_frees, planned at the first run: it reads the inputs' storages
    layout = compiled_layout.applies(gm, device)  # channels-last convolutions
    converted = compiled_layout.converted_inputs(gm) if layout else set()
    weight_grads = compiled_layout.weight_gradients(gm) if layout else set()

    def run(args: list[Any]) -> Any:
        tracer = ACTIVE[-1] if ACTIVE else None
        if tracer is None:
            return execute(args, None)
        before, tracer.channels_last_convs = tracer.channels_last_convs, layout
        try:
            return execute(args, tracer)
        finally:
            tracer.channels_last_convs = before

    def execute(args: list[Any], tracer: Any) -> Any:
        holding: dict[Any, Any] = {}  # dead buffers kept for the kernel that will write into them
        values = list(args)
        args.clear()
        if not plan:
            inputs = dict(zip([n for n in nodes if n.op == "placeholder"], values))
            plan.append(deferred_frees(gm, virtual, reuse, facts, inputs))
            inputs.clear()
        deferred = plan[0]
        kept = set(deferred.values())
        env: dict[Any, Any] = {}
        i = 0
        for node in nodes:
            if node.op == "placeholder":
                env[node] = compiled_layout.channels_last(values[i]) if node in converted else values[i]
                values[i] = None
                i += 1
            elif node.op == "call_function":
                a = map_arg(node.args, env.__getitem__)
                k = map_arg(node.kwargs, env.__getitem__)
                if node in deferred:
                    holding.pop(deferred[node], None)
                if tracer is not None and node in reuse:
                    tracer.outputs.release(env.get(reuse[node]))
                if tracer is not None and node in virtual:
                    tracer.outputs.fusing = True
                    try:
                        env[node] = node.target(*a, **k)
                    finally:
                        tracer.outputs.fusing = False
                else:
                    env[node] = node.target(*a, **k)
                if node in weight_grads:
                    env[node] = compiled_layout.with_contiguous_weight_gradient(env[node])
            elif node.op == "get_attr":
                target: Any = gm
                for part in str(node.target).split("."):
                    target = getattr(target, part)
                env[node] = target
            elif node.op == "call_module":
                a = map_arg(node.args, env.__getitem__)
                k = map_arg(node.kwargs, env.__getitem__)
                env[node] = gm.get_submodule(str(node.target))(*a, **k)
            elif node.op == "call_method":
                a = map_arg(node.args, env.__getitem__)
                k = map_arg(node.kwargs, env.__getitem__)
                env[node] = getattr(a[0], str(node.target))(*a[1:], **k)
            elif node.op == "output":
                return map_arg(node.args[0], env.__getitem__)
            for used in last_use.get(node, ()):
                value = env.pop(used, None)
                if used in kept:
                    holding[used] = value
        return None

    run._boxed_call = True  # type: ignore[attr-defined]
    return run
