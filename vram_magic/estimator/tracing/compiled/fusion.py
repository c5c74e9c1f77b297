"""Which values of a compiled graph Inductor writes to memory, and how long what its kernels read stays alive.

Inductor lowers each pointwise op to an expression that its consumers inline (computed inside their kernel,
recomputed in each) unless it is *realized* into a buffer of its own; then its scheduler fuses kernels, and a
realized buffer read only inside the kernel that computes it is not written to memory either. Modelled here as
Inductor decides them (``GraphLowering.run_node``, ``StorageBox.should_realize_on_reuse``,
``has_exceeded_max_reads``; the CPU's thresholds where the step runs on the CPU):

* realized: a graph output (saved activations included), a value an op other than a pointwise op or a
  reduction reads (a matmul, a convolution: an extern kernel); a value used more than once whose expression is
  heavy to recompute on the CPU (an ``exp``, ``log``, ``sigmoid``, ``tanh``), large (more ops than Inductor's
  threshold) or reads more than 4 buffers; any value whose expression has accumulated too many reads;
* a realized value stays out of memory when every kernel that reads it can be fused with the kernel that
  computes it: pointwise or reductions over as many elements, with no path between the two through a kernel
  that cannot join them (an extern kernel);
* a value inlined into a kernel is read where that kernel runs: when that is after an extern kernel that
  depends on the value (a residual's sum recomputed after a matmul), the buffers its expression loads stay
  alive until then.

Not modelled: the order the scheduler runs fused kernels in (graph order is used), its limits on a fused
kernel's size, and fusion across different iteration sizes. Checked against Inductor's own output code on the
models of ``benchmarks/estimate_compiled.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from ...torch_private import OpOverload

#: Ops whose reuse a CPU kernel would not recompute (``should_realize_on_reuse``'s heavy ops).
HEAVY = frozenset({"exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh"})
REUSE_READS = 4  # config.realize_reads_threshold
OPCOUNT = {"cpu": 50, "cuda": 30}  # realize_cpu_opcount_threshold, _realize_opcount_threshold_default
ACCUMULATED_READS = {"cpu": 12, "cuda": 8}  # realize_cpu_acc_reads_threshold, _realize_acc_reads_threshold_default


def base_node(node: Any, kinds: dict[Any, str]) -> Any:
    """The node a chain of views starts from."""
    while kinds.get(node) == "view" and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def inlined_nodes(gm: torch.fx.GraphModule, kinds: dict[Any, str], device: str = "cuda") -> set[Any]:
    """The pointwise values Inductor never writes to memory: inlined into their consumers' kernels, or realized
    but read only inside the kernel that computes them (``device``: where the step runs, "cpu" or "cuda")."""
    outputs: set[Any] = set()
    for node in gm.graph.nodes:
        if node.op == "output":
            outputs.update(node.all_input_nodes)
    cpu = device == "cpu"
    opcount, accumulated = OPCOUNT["cpu" if cpu else "cuda"], ACCUMULATED_READS["cpu" if cpu else "cuda"]
    inline: set[Any] = set()  # not realized: inlined into every consumer
    reads: dict[Any, frozenset[Any]] = {}  # what a kernel computing this value loads (realized values, inputs)
    body: dict[Any, int] = {}  # ops in its expression, inlined producers included
    heavy: dict[Any, bool] = {}
    for node in gm.graph.nodes:
        if node.op == "output" or kinds.get(node) == "view":
            continue
        r: set[Any] = set()
        ops, h = 1, _heavy(node)
        for used in node.all_input_nodes:
            b = base_node(used, kinds)
            if b in inline:
                r |= reads[b]
                ops += body[b]
                h = h or heavy[b]
            else:
                r.add(used)
        reads[node], body[node], heavy[node] = frozenset(r), ops + len(r), h
        if kinds.get(node) != "pointwise" or node in outputs:
            continue
        users = _consumers(node, kinds, outputs)
        if not users or any(u is None or kinds.get(u) not in ("pointwise", "reduction") for u in users):
            continue  # an output, or read by an extern kernel: realized
        fanout = len(node.users) > 1 or any(kinds.get(v) == "view" and len(v.users) > 1 for v in node.users)
        large = body[node] > opcount
        if (fanout and ((cpu and h) or large or len(r) > REUSE_READS)) or len(r) > accumulated or large:
            continue  # realized on reuse, or with too many reads accumulated
        inline.add(node)
    return inline | _kernel_local(gm, kinds, outputs, inline, reads)


def _kernel_local(gm: torch.fx.GraphModule, kinds: dict[Any, str], outputs: set[Any], inline: set[Any],
                  reads: dict[Any, frozenset[Any]]) -> set[Any]:
    """Realized pointwise values that every kernel loading them can be fused with (their buffer is removed)."""
    loaders: dict[Any, list[Any]] = {}
    for node, loaded in reads.items():
        if node in inline:
            continue
        for used in loaded:
            loaders.setdefault(base_node(used, kinds), []).append(node)
    behind = _behind_kernels(gm, kinds)
    index = {node: i for i, node in enumerate(gm.graph.nodes)}

    def fusible(node: Any, kernel: Any) -> bool:
        return (kinds.get(kernel) in ("pointwise", "reduction") and not (behind[node] >> index[kernel]) & 1
                and _numel(kernel, kinds) == _numel(node, kinds))

    local: set[Any] = set()
    for node, kind in kinds.items():
        if kind != "pointwise" or node in inline or node in outputs or node not in loaders:
            continue
        users = _consumers(node, kinds, outputs)
        if users and None not in users and all(fusible(node, k) for k in loaders[node]):
            local.add(node)
    return local


def _behind_kernels(gm: torch.fx.GraphModule, kinds: dict[Any, str]) -> dict[Any, int]:
    """For each node, the nodes (as bits of their position) it reaches through a kernel that no pointwise or
    reduction kernel can be fused with: what it cannot share a kernel with."""
    nodes = list(gm.graph.nodes)
    index = {node: i for i, node in enumerate(nodes)}
    reach: dict[Any, int] = {}
    behind: dict[Any, int] = {}
    for node in reversed(nodes):
        r = b = 0
        for user in node.users:
            r |= reach[user] | (1 << index[user])
            b |= behind[user]
            if kinds.get(user) == "other" and user.op != "output":
                b |= reach[user] | (1 << index[user])
        reach[node], behind[node] = r, b
    return behind


def _consumers(node: Any, kinds: dict[Any, str], outputs: set[Any]) -> list[Any]:
    """The nodes reading ``node`` (through views); ``None`` for a view that leaves the graph."""
    out: list[Any] = []
    for user in node.users:
        if kinds.get(user) == "view":
            if user in outputs:
                return [None]
            out.extend(_consumers(user, kinds, outputs))
        else:
            out.append(user)
    return out


def _heavy(node: Any) -> bool:
    target = getattr(node, "target", None)
    name = getattr(target, "__name__", "") if isinstance(target, OpOverload) else ""
    return name.split(".")[0] in HEAVY


def _numel(node: Any, kinds: dict[Any, str]) -> int | None:
    """Elements a kernel iterates over: a pointwise value's own, a reduction's input's."""
    if kinds.get(node) == "reduction" and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    val = node.meta.get("val")
    try:
        return int(val.numel()) if isinstance(val, torch.Tensor) else None
    except (TypeError, ValueError, RuntimeError):  # a symbolic size
        return None


def kernel_reads(gm: torch.fx.GraphModule, kinds: dict[Any, str], virtual: set[Any]) -> dict[Any, set[Any]]:
    """``{kernel: values it reads late}``: a kernel that inlines a value computed before an extern kernel it
    depends on (a residual's sum recomputed after a matmul) reads that value's inputs where it runs, so they
    live until then. (A kernel fused with the value's other consumers reads them with those; not extended.)"""
    behind = _behind_kernels(gm, kinds)
    index = {node: i for i, node in enumerate(gm.graph.nodes)}
    expanded: dict[Any, set[Any]] = {}  # what a value computed inside a kernel reads, in graph order
    out: dict[Any, set[Any]] = {}
    for node in gm.graph.nodes:
        if kinds.get(node) == "view":
            continue
        r: set[Any] = set()
        late: set[Any] = set()
        for used in node.all_input_nodes:
            b = base_node(used, kinds)
            if b in virtual:
                r |= expanded[b]
                if (behind[b] >> index[node]) & 1:
                    late |= expanded[b]
            else:
                r.add(used)
        if node in virtual:
            expanded[node] = r
        elif late:
            out[node] = late
    return out

