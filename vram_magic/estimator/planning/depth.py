"""The model at a smaller depth, for the screen of a large plan: identical blocks traced once and reused.

A decoder of ``D`` identical blocks costs a fake run ``D`` times one block's ops; the screen instead traces the model
with its first ``d`` and ``d + 1`` blocks only (``Survey.shallow``) and takes what one more block adds as every
block's (``screen.Fit``), so the screen's cost does not grow with the depth. The blocks are the ones activation
checkpointing and FSDP wrap (the longest list of like modules, ``step/trace.checkpoint_units``).

A builder's model is built, then cut; a transformers model whose class rebuilds the same modules from its config
with fewer layers (checked once, parameter by parameter) is built at the smaller depth directly, which skips building
the blocks that would be cut (half a second for a 70B model). A model given as a module is cut in a shell: the
modules on the way to the blocks copied, the blocks themselves shared, nothing of the user's changed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..fake.request import Request


@dataclass
class Survey:
    """What the planner reads of the whole model once: its blocks (``blocks`` of them, the list at ``path``), its
    config, and the parameter bytes of the embedding and the output head (``first``, ``last``: the parts outside the
    blocks that a pipeline's first and last stage hold)."""

    request: Request
    blocks: int
    path: str
    config: Any
    first: int = 0
    last: int = 0
    attention_error: str | None = None  # why context parallelism cannot shard its attention (None: it can)
    _by_config: Callable[[int], nn.Module] | None = field(default=None, repr=False)
    _shells: list[Any] = field(default_factory=list, repr=False)  # cut copies of a module source, kept alive

    @property
    def heads(self) -> tuple[int | None, int | None]:
        """The query and key/value heads (``None`` where the config has none)."""
        heads = getattr(self.config, "num_attention_heads", None)
        kv = getattr(self.config, "num_key_value_heads", None) or heads
        return (heads if isinstance(heads, int) else None), (kv if isinstance(kv, int) else None)

    @property
    def hidden(self) -> int:
        return int(getattr(self.config, "hidden_size", 0) or 0)

    def shallow(self, depth: int) -> Request:
        """The request with the model's first ``depth`` blocks only (the whole model when ``depth`` is its own)."""
        if depth >= self.blocks:
            return self.request
        source = self.request.source
        if source.builder is not None:
            build = self._by_config if self._by_config is not None else None
            if build is not None:
                def builder() -> nn.Module:
                    return build(depth)
            else:
                whole = source.builder

                def builder() -> nn.Module:
                    return cut(whole(), self.path, depth)
            builder.__name__ = getattr(source.builder, "__name__", "model")
            model: Any = builder
        else:
            module = source.module()
            if module is None:
                raise ValueError("the model this plan was made for no longer exists; plan again")
            model = shell(module, self.path, depth)
            self._shells.append(model)
        return Request(model, self.request.inputs_fn or self.request.specs, self.request.loss_fn,
                       name=self.request.name)


def survey(request: Request, mode: Any, dtype: Any) -> Survey:
    """The model built once on fake tensors (``mode``) and read: its blocks, config and head."""
    from ..step.trace import checkpoint_units

    model, _ = request.fake_model(mode, dtype)
    units = checkpoint_units(model)
    path = _path_of(model, units)
    config = getattr(model, "config", None)
    out = Survey(request, len(units) if path is not None else 0, path or "", config)
    if path is not None:  # "" where the model is the list of blocks (an nn.Sequential of them)
        in_blocks = {id(p) for u in units for p in u.parameters()}
        rest = [(n, p) for n, p in model.named_parameters() if id(p) not in in_blocks]
        head = _head_names(model)
        out.last = sum(p.numel() * p.element_size() for n, p in rest if n.startswith(head))
        out.first = sum(p.numel() * p.element_size() for n, p in rest) - out.last
        if request.source.builder is not None:
            out._by_config = _config_builder(model, path, dtype)
    from ..layouts.context import ring_shapes
    from ..options import make_options

    try:
        ring_shapes(model, make_options(device="cuda", cp=2), 1, 2)
    except ValueError as err:
        out.attention_error = str(err)
    return out


def _path_of(model: nn.Module, units: list[nn.Module]) -> str | None:
    """The name of the module list that holds ``units`` (``None`` if they are not one list's children)."""
    if len(units) < 2:
        return None
    first = units[0]
    for name, m in model.named_modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) == len(units) and m[0] is first:
            return name
    return None


def _head_names(model: nn.Module) -> str:
    """The output head's parameter prefix (``lm_head``, ``output``, …): the last child with parameters."""
    children = [(n, c) for n, c in model.named_children() if any(True for _ in c.parameters())]
    return children[-1][0] if children else ""


def cut(model: nn.Module, path: str, depth: int) -> nn.Module:
    """``model`` (built for the plan, its own) with the first ``depth`` blocks of the list at ``path`` (``""``: the
    model is the list)."""
    if not path:
        return type(model)(*list(model)[:depth])
    parent_name, _, leaf = path.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    blocks = getattr(parent, leaf)
    setattr(parent, leaf, type(blocks)(*list(blocks)[:depth]) if isinstance(blocks, nn.Sequential)
            else nn.ModuleList(list(blocks)[:depth]))
    _set_layers(model, depth)
    return model


def shell(model: nn.Module, path: str, depth: int) -> nn.Module:
    """A copy of ``model``'s modules on the way to its blocks, holding the first ``depth`` of them (shared, not
    copied): the user's model is never changed."""
    if not path:
        return type(model)(*list(model)[:depth])
    root = copy.copy(model)
    root._modules = dict(model._modules)
    node = root
    parts = path.split(".")
    for part in parts[:-1]:
        child = copy.copy(node._modules[part])
        child._modules = dict(child._modules)
        node._modules[part] = child
        node = child
    blocks = node._modules[parts[-1]]
    node._modules[parts[-1]] = type(blocks)(*list(blocks)[:depth]) if isinstance(blocks, nn.Sequential) \
        else nn.ModuleList(list(blocks)[:depth])
    config = getattr(model, "config", None)
    if config is not None and isinstance(getattr(config, "num_hidden_layers", None), int):
        config = copy.copy(config)
        config.num_hidden_layers = depth
        for m in (root, *(_along(root, parts))):
            if getattr(m, "config", None) is getattr(model, "config", None):
                m.config = config
    return root


def _along(root: nn.Module, parts: list[str]) -> list[nn.Module]:
    out, node = [], root
    for part in parts[:-1]:
        node = node._modules[part]
        out.append(node)
    return out


def _set_layers(model: nn.Module, depth: int) -> None:
    """The config's layer count (and per-layer lists) made ``depth``, where the model reads them."""
    config = getattr(model, "config", None)
    if config is None or not isinstance(getattr(config, "num_hidden_layers", None), int):
        return
    config.num_hidden_layers = depth
    types = getattr(config, "layer_types", None)
    if isinstance(types, list):
        config.layer_types = types[:depth]


def _signature(model: nn.Module, path: str, depth: int) -> list[tuple[str, tuple[int, ...], Any, str]]:
    """The parameters and buffers of ``model`` outside its blocks and in its first ``depth`` blocks, with their
    modules' classes: what must match for a model rebuilt at that depth to be the same model."""
    prefix = path + "."
    keep = [f"{prefix}{i}." for i in range(depth)]
    out = []
    classes = {n: type(m).__name__ for n, m in model.named_modules()}
    for n, t in [*model.named_parameters(), *model.named_buffers()]:
        if n.startswith(prefix) and not any(n.startswith(k) for k in keep):
            continue
        owner = n.rpartition(".")[0]
        out.append((n, tuple(t.shape), t.dtype, classes.get(owner, "")))
    return sorted(out, key=lambda x: x[0])


def _config_builder(model: nn.Module, path: str, dtype: Any) -> Callable[[int], nn.Module] | None:
    """For a transformers model: ``build(depth)`` making it again from its config with ``depth`` layers, if the model
    made so at one layer is the given one's first layer and the rest (same names, shapes, dtypes, classes)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "num_hidden_layers") or not hasattr(type(model), "config_class"):
        return None
    cls = type(model)

    def build(depth: int) -> nn.Module:
        c = copy.deepcopy(config)
        c.num_hidden_layers = depth
        types = getattr(c, "layer_types", None)
        if isinstance(types, list):
            c.layer_types = types[:depth]
        return cls(c)

    import torch

    from ..fake.convert import init_skipped
    from ..fake.frameworks import fake_run

    old = torch.get_default_dtype()
    try:
        with fake_run() as mode, mode, init_skipped():
            if dtype is not None:
                torch.set_default_dtype(dtype)
            trial = build(1)
        if _signature(trial, path, 1) != _signature(model, path, 1):
            return None
    except Exception:
        return None
    finally:
        torch.set_default_dtype(old)
    return build


__all__ = ["Survey", "cut", "shell", "survey"]
