"""Who holds each live storage: parameters, gradients, optimizer state, activations or other.

A scan walks the user's namespace (modules, optimizers, tensors, containers and plain objects, a few levels
deep: walk.py), then claims the storages of what it found and of the autograd graphs hanging off its
tensors (:class:`Claims`, here). It returns plain data keyed by ``id(storage)``; the storages themselves are only
registered (weakly) in the :class:`LiveStorages`.

Nothing here may fail the user's cell: every read of a user object is guarded (objects whose attributes,
``__class__`` or items raise, tensor subclasses that raise on access), and what could not be read, or was
left out by a bound, is named in the scan's notes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..hooks import pipeline
from ..hooks.collectives import FSDP_ALL_GATHER, FSDP_REDUCE_SCATTER, FSDP_UNSHARDED, FSDP_UNSHARDED_GRADS
from ..hooks.kv_cache import kv_cache_tensors
from ..hooks.quantized import packed_info
from ..tensors import grad, grad_fn, storage_parts
from .autograd_graph import saved_tensors
from .containers import Found
from .experts import marked
from .registry import LiveStorages
from .walk import MAX_NOTES, NamespaceWalk

#: objects visited one by one per scan, and what this bound leaves out is noted. Plain data in big containers
#: (strings, numbers, plain tensors: see containers.py) is read at C speed and does not count.
MAX_OBJECTS = 200_000


@dataclass(frozen=True)
class Group:
    """The storages of one big container read at C speed (containers.py), claimed as a whole: a measured cell
    counts them by their sum, without a look at each, while the container is unchanged (measuring/measurement.py)."""

    found: Found
    owner: tuple[str, str]
    keys: frozenset[int]
    device: str
    total: int


@dataclass
class Scan:
    """``owner[id(storage)] = (category, label)``, plus the names that hold each graph. The storages of big
    containers are in ``groups`` instead (one owner each); :meth:`lookup` reads both."""

    owner: dict[int, tuple[str, str]] = field(default_factory=dict)
    groups: list[Group] = field(default_factory=list)
    # id(storage) -> variable name holding it, for the tensors claimed one by one (those of a big container read
    # at C speed are claimed by its name in `owner` only)
    holders: dict[int, str] = field(default_factory=dict)
    module_names: dict[int, str] = field(default_factory=dict)  # id(module) -> "model.layers.3.mlp"
    expert_params: set[int] = field(default_factory=set)  # id() of the MoE blocks' routed experts' parameters
    optimizer_names: dict[int, str] = field(default_factory=dict)  # id(optimizer) -> "opt"
    notes: list[str] = field(default_factory=list)  # what could not be read, or was left out

    def category(self, key: int) -> tuple[str, str]:
        return self.lookup(key, ("other", "unattributed"))  # type: ignore[return-value]

    def lookup(self, key: int | None, default: tuple[str, str] | None = None) -> tuple[str, str] | None:
        """The owner of storage ``key``, in ``owner`` or a group."""
        hit = self.owner.get(key)  # type: ignore[arg-type]
        if hit is not None:
            return hit
        group = self.group_of(key)  # type: ignore[arg-type]
        return group.owner if group is not None else default

    def owner_get(self) -> Any:
        """``lookup``, or ``owner.get`` itself when there are no groups (the hot loops' category function)."""
        return self.lookup if self.groups else self.owner.get

    def group_of(self, key: int) -> Group | None:
        for group in self.groups:
            if key in group.keys:
                return group
        return None


class Claims:
    """The storages of what a walk found, claimed in order of priority (the first claim wins): FSDP's buffers,
    torch.ao's packed weights, parameters and their gradients, optimizer state, KV caches, module buffers, pipeline
    stages' tensors, the namespace's tensors and cached outputs, then what their autograd graphs saved."""

    def __init__(self, registry: LiveStorages, walk: NamespaceWalk) -> None:
        self.registry = registry
        self.walk = walk
        self.scan = Scan()
        self.frozen = False  # a frozen (or quantized) parameter was claimed: the notes say how much trains
        self.expert_grads: set[int] = set()  # id() of the gradients of the routed experts' parameters

    def claim(self, t: Any, category: str, label: str, holder: str | None = None, frozen: bool = False) -> int | None:
        key = None
        parts = storage_parts(t)
        if parts is None:
            self.walk.unread(holder or label, RuntimeError("a tensor that raises when read"))
            return None
        if frozen:
            self.frozen = True
        for storage, kind in parts:
            kind = f"frozen, {kind}" if frozen and kind else ("frozen" if frozen else kind)
            key = self._own(storage, category, f"{label} ({kind})" if kind else label, holder)
        return key

    def _own(self, storage: Any, category: str, label: str, holder: str | None) -> int:
        key = id(storage)
        if self.registry.get(key) is None:
            self.registry.add(storage)
        owner = self.scan.owner
        if key not in owner and (not self.scan.groups or self.scan.group_of(key) is None):
            owner[key] = (category, label)
            if holder:
                self.scan.holders[key] = holder
        return key

    def _claim_found(self, found: Found, owner_of: tuple[str, str]) -> None:
        """Claim the storages of a big container's tensors (a hundred thousand of them) in C: those no earlier
        claim took. A container none of whose storages another claim took, on one device, is a group: claimed as
        a whole."""
        keys = found.keyset()
        groups = self.scan.groups
        total = found.total() if self.scan.owner.keys().isdisjoint(keys) else None
        if total is not None and all(g.keys.isdisjoint(keys) for g in groups) and self.registry.group(id(found), keys):
            groups.append(Group(found, owner_of, keys, total[0], total[1]))
            return
        owner, mine = self.scan.owner, found.owners(owner_of)
        if groups:  # the storages another group holds stay its own
            mine = {k: v for k, v in mine.items() if self.scan.group_of(k) is None}
        if len(owner) * 4 < len(mine):  # start from the container's claims (a copy in C), the earlier ones on top
            merged = mine.copy()
            merged.update(owner)
            self.scan.owner = merged
        elif owner.keys().isdisjoint(mine.keys()):
            owner.update(mine)
        else:
            owner.update(dict.fromkeys(mine.keys() - owner.keys(), owner_of))

    def _claim_all(self, items: Iterable[tuple[Any, str]], category: str, prefix: str = "",
                   grads: list[tuple[Any, str]] | None = None, experts: set[int] | None = None) -> None:
        """``claim`` for many ``(tensor, holder)`` pairs (the scan's hot loop: parameters of big models).
        ``grads``: collects the ``.grad`` of each tensor on the way; ``experts``: ``id()`` of the tensors that are the
        routed experts' (their labels marked, experts.py; the gradients of those go to ``expert_grads``)."""
        reg_get, reg_add = self.registry.get, self.registry.add
        owner, holders = self.scan.owner, self.scan.holders
        labels: dict[str, tuple[str, str]] = {}
        plain = torch.Tensor
        param = torch.nn.Parameter
        parameters = category == "parameters"  # frozen ones (requires_grad=False) are named so
        for t, holder in items:
            cls = type(t)
            name = marked(holder) if experts and id(t) in experts else holder
            if parameters and ((not t.requires_grad) if cls is plain or cls is param else _frozen(t)):
                self.claim(t, category, prefix + name, holder, frozen=True)
            elif cls is plain or cls is param:
                try:
                    storage = t.untyped_storage()
                except (RuntimeError, NotImplementedError):
                    continue
                key = id(storage)
                if reg_get(key) is None:
                    reg_add(storage)
                if key not in owner:
                    label = labels.get(name)
                    if label is None:
                        label = labels[name] = (category, prefix + name)
                    owner[key] = label
                    holders[key] = holder
            else:  # a subclass: its parts, guarded
                self.claim(t, category, prefix + name, holder)
            if grads is not None:
                g = t.grad if cls is plain or cls is param else grad(t)
                if g is not None:
                    grads.append((g, holder))
                    if name is not holder:
                        self.expert_grads.add(id(g))

    def assign(self) -> Scan:
        names = self.scan.module_names
        params: list[tuple[Any, str]] = []
        buffers: list[tuple[Any, str]] = []
        for name, m in self.walk.modules:
            try:
                self.walk.module_contents(name, m, names, params, buffers)
            except Exception as err:
                self.walk.unread(name, err)
        for name, opt in self.walk.optimizers:
            try:
                self.scan.optimizer_names.setdefault(id(opt), name)
                params.extend((p, name) for group in opt.param_groups for p in group.get("params", ()))
            except Exception as err:
                self.walk.unread(name, err)
        for name, state in self.walk.fsdp.values():  # before parameters: an unsharded parameter is FSDP's buffer
            try:
                self._fsdp_buffers(name, state)
            except Exception as err:
                self.walk.unread(f"the FSDP state of {name}", err)
        for obj, name in self.walk.packed:
            try:
                self._claim_packed(obj, name)
            except Exception as err:
                self.walk.unread(f"the packed weights of {name}", err)
        grads: list[tuple[Any, str]] = []
        experts = self.scan.expert_params = self.walk.expert_params
        self._claim_all(params, "parameters", grads=grads, experts=experts)
        self._claim_all(grads, "gradients", experts=self.expert_grads)
        state_tensors: list[tuple[Any, str]] = []
        expert_state: set[int] = set()  # id() of the routed experts' state tensors
        for name, opt in self.walk.optimizers:
            try:
                states = [(opt.state, name)]
                if type(opt).__name__ == "ZeroRedundancyOptimizer":  # ZeRO-1: the state of this rank's partition
                    states.append((opt.optim.state, f"{name} (ZeRO partition)"))
                # bitsandbytes' two code books (256 fp32 values each), made with the optimizer before any state and
                # shared by every 8-bit parameter's state
                books = getattr(opt, "name2qmap", None)
                if isinstance(books, Mapping):
                    state_tensors.extend((v, name) for v in books.values() if isinstance(v, torch.Tensor))
                for states_of, label in states:
                    for p, state in states_of.items():
                        if isinstance(state, Mapping):
                            tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
                            state_tensors.extend((v, label) for v in tensors)
                            if experts and id(p) in experts:
                                expert_state.update(map(id, tensors))
            except Exception as err:
                self.walk.unread(f"{name}.state", err)
        self._claim_all(state_tensors, "optimizer_state", experts=expert_state)
        graphs = self._claim_kv_caches()
        self._claim_all(buffers, "other", "buffers of ")
        for name, holder in self.walk.pipelines or ():  # a stage's own tensors, before its attributes' and the graphs'
            try:
                for stage in pipeline.stages_of(holder):
                    for t, (category, label) in pipeline.held_tensors(stage):
                        self.claim(t, category, label, name)
            except Exception as err:
                self.walk.unread(f"the pipeline stage of {name}", err)
        for name, t in self.walk.tensors:
            if type(t) is Found:  # the tensors of a big container, all leaves: "other", by the container's name
                self._claim_found(t, ("other", name))
                continue
            # a forward output (part of a graph) is an activation; a leaf (input, user data) is "other"
            fn = grad_fn(t)
            self.claim(t, "activations" if fn is not None else "other", name, name)
            if fn is not None:
                graphs.append((name, fn))
        for name, t in self.walk.cache_tensors:
            if type(t) is Found:
                self._claim_found(t, ("other", f"output cache {name}"))
                continue
            self.claim(t, "other", f"output cache {name}", name)
            fn = grad_fn(t)
            if fn is not None:
                graphs.append((name, fn))
        for name, fn in graphs:
            try:
                for saved, is_leaf in saved_tensors(fn):
                    if is_leaf:  # a leaf the graph reaches that nothing in the namespace holds any more: a
                        # Parameter is still one (its module gone); any other tensor is "other"
                        parameter = isinstance(saved, torch.nn.Parameter)
                        self.claim(saved, "parameters" if parameter else "other", f"held by the graph of {name}",
                                   name)
                    else:
                        self.claim(saved, "activations", f"graph held by {name}", name)
            except Exception as err:
                self.walk.unread(f"the autograd graph of {name}", err)
        self._notes()
        return self.scan

    def _claim_kv_caches(self) -> list[tuple[str, Any]]:
        """The tensors of the KV caches found: ``kv_cache``, named by who holds them; the autograd graphs they hold
        (a cache filled by a forward with grad) are returned to be claimed as activations."""
        graphs: list[tuple[str, Any]] = []
        for name, obj in self.walk.kv_caches:
            try:
                for _, t in kv_cache_tensors(obj, name):
                    self.claim(t, "kv_cache", name, name)
                    fn = grad_fn(t)
                    if fn is not None:
                        graphs.append((name, fn))
            except Exception as err:
                self.walk.unread(name, err)
        return graphs

    def _claim_packed(self, obj: Any, name: str) -> None:
        """A torch.ao quantized module's packed weights: the object stands for its buffer in the registry (its
        size worked out from the layout, see engine/hooks/quantized.py); the bias it keeps is a tensor of its own."""
        size, fmt, bias = packed_info(obj)
        if not fmt:
            return
        key = id(obj)
        if self.registry.get(key) is None:
            self.registry.add_new(obj, key, size, "cpu")
        self.frozen = True
        if key not in self.scan.owner:
            self.scan.owner[key] = ("parameters", f"{name} (frozen, {fmt})")
            self.scan.holders[key] = name
        storage = bias.storage if bias is not None else None
        if storage is not None:
            self._own(storage, "parameters", f"{name} (frozen)", name)

    def _fsdp_buffers(self, name: str, state: Any) -> None:
        """What FSDP2 holds beside the sharded parameters: each unit's unsharded parameters (all-gather outputs,
        empty while resharded), an all-gather in flight, reduce-scatter inputs kept until their collective ends,
        gradients accumulated unsharded (no reduce-scatter between micro-batches)."""
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # PyTorch before grouped fully_shard
            group = getattr(state, "_fsdp_param_group", None)
            groups = [group] if group is not None else []
        for group in groups:
            for fp in group.fsdp_params:
                sharded = fp.__dict__.get("sharded_param")  # named after the module even when only an optimizer
                if isinstance(sharded, torch.Tensor):  # holds it (the module holds the unsharded one)
                    self.claim(sharded, "parameters", name, name)
                inner = getattr(fp, "_unsharded_inner_tensors", None) or []
                for t in list(getattr(fp, "all_gather_outputs", ())) + list(inner):
                    self.claim(t, FSDP_UNSHARDED[0], FSDP_UNSHARDED[1], name)
                unsharded = fp.__dict__.get("_unsharded_param")
                if unsharded is not None:
                    self.claim(unsharded, FSDP_UNSHARDED[0], FSDP_UNSHARDED[1], name)
                acc = fp.__dict__.get("unsharded_accumulated_grad")
                if isinstance(acc, torch.Tensor):
                    self.claim(acc, FSDP_UNSHARDED_GRADS[0], FSDP_UNSHARDED_GRADS[1], name)
            result = getattr(group, "_all_gather_result", None)
            out = getattr(result, "all_gather_output", None)
            if isinstance(out, torch.Tensor):
                self.claim(out, FSDP_ALL_GATHER[0], FSDP_ALL_GATHER[1], name)
        comm = getattr(state, "_comm_ctx", None)
        for rs in list(getattr(comm, "reduce_scatter_states", None) or ()):
            t = getattr(rs, "reduce_scatter_input", None)
            if isinstance(t, torch.Tensor):
                self.claim(t, FSDP_REDUCE_SCATTER[0], FSDP_REDUCE_SCATTER[1], name)

    def _notes(self) -> None:
        notes = self.scan.notes
        if self.frozen:
            notes.append(self._frozen_note())
        if self.walk.unread_names:
            notes.append("the scan could not read " + ", ".join(self.walk.unread_names) + "; memory only they hold "
                         "counts as unattributed")
        if self.walk.skipped:
            what = ", ".join(f"{n} ({k:,} items)" for n, k in list(self.walk.skipped.items())[:MAX_NOTES])
            notes.append(f"the scan stopped after {self.walk.max_objects:,} objects and did not look into {what}; "
                         "memory only they hold counts as unattributed")

    def _frozen_note(self) -> str:
        """How much of the parameters trains, and the formats of the quantized ones."""
        from ...core.units import format_bytes

        total = frozen = 0
        formats: dict[str, int] = {}
        get = self.registry.get
        for key, (cat, label) in self.scan.owner.items():
            if cat != "parameters":
                continue
            entry = get(key)
            size = entry.size if entry is not None else 0
            total += size
            at = label.rfind("(frozen")
            if at >= 0:
                frozen += size
                fmt = label[at + len("(frozen"):]
                fmt = (fmt[:-1] if fmt.endswith(")") else fmt).lstrip(", ")
                if fmt:
                    formats[fmt] = formats.get(fmt, 0) + size
        text = f"parameters: {format_bytes(total - frozen)} trainable, {format_bytes(frozen)} frozen"
        if formats:
            text += ", of which " + "; ".join(f"{format_bytes(n)} {f}" for f, n in formats.items())
        return text


def _frozen(t: Any) -> bool:
    try:
        return not t.requires_grad
    except Exception:  # a subclass that raises on access: claimed (guarded) as a trainable one
        return False


def scan_namespace(namespace: Mapping[str, Any] | None, registry: LiveStorages, depth: int = 3) -> Scan:
    """Attribute every storage reachable from ``namespace`` (an IPython ``user_ns`` or a module's globals)."""
    walk = NamespaceWalk(registry, namespace, MAX_OBJECTS).walk(namespace, depth)
    return Claims(registry, walk).assign()
