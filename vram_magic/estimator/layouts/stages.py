"""Pipeline stages cut from a real model the way torchtitan's ``pipeline_llm`` cuts them: a stage is a copy of the
model with the other stages' layers removed; the embedding lives on the first stage only, the final norm and the
output head on the last only. Two kinds of model are cut:

* a transformers decoder-only causal LM laid out as Llama's (``<prefix>.embed_tokens``, ``<prefix>.layers`` a
  ``ModuleList``, ``<prefix>.norm``, ``<prefix>.rotary_emb`` and an output head: Llama, Mistral, Qwen2/3, Gemma,
  Gemma 2/3, Phi-3, Mixtral, Qwen3-MoE). Its ``*Model.forward`` does not survive deleted submodules (it calls
  ``embed_tokens``, loops over ``self.layers[: num_hidden_layers]``, calls ``norm``), so a stage runs what that
  forward runs, piece by piece, on its own pieces (:class:`DecoderStage`): the embedding (first stage), the positions,
  the rotary ``(cos, sin)`` (once per layer type where the rotary module takes one, as Gemma 3's does), the causal
  mask of each layer type it runs (transformers' own ``create_causal_mask`` / ``create_sliding_window_causal_mask``
  with the model's config: ``config.layer_types[i]`` where the config has it, else sliding-window when
  ``config.sliding_window`` is set, else full causal — the rule of those models' forwards in transformers 5.24), its
  layers called with keywords as the model calls them, and on the last stage the norm, the head and Gemma 2's logit
  soft-capping;
* a torchtitan model (``tok_embeddings``, ``layers`` an ``nn.ModuleDict``, ``norm``, ``output``), whose own forward
  skips the parts a stage has set to ``None``: the stage is the model's copy itself.

One tensor travels between stages: the hidden state ``(batch, seq, hidden)``; the last stage returns the logits.
Inside a stage the parameters keep the whole model's names (``model.layers.5.mlp.up_proj.weight``): the layers sit
in an ``nn.ModuleDict`` keyed by their index, as torchtitan's models keep theirs.

A weight tied across stages (Gemma's embedding and head) is held by each stage that uses it, one copy each, as a deep
copy gives it: the first stage's embedding and the last stage's head train their own copy, whose gradients a real job
all-reduces (torchtitan does not tie them). Not cut: padding masks (the stages make causal masks), KV caches, the MoE
router's auxiliary loss, Gemma 3's bidirectional attention."""

from __future__ import annotations

import copy
import difflib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class ModelParts:
    """The names (from the model's root) of what a stage is cut from."""

    kind: str  # "transformers" or "torchtitan"
    base: str  # the decoder body ("model"; "" for a torchtitan model, whose body is the model)
    embed: str
    layers: str  # the layers' container
    keys: tuple[str, ...]  # each layer's key in its container
    norm: str
    head: str
    rotary: str | None  # transformers' rotary module

    @property
    def n_layers(self) -> int:
        return len(self.keys)

    def layer_name(self, i: int) -> str:
        return f"{self.layers}.{self.keys[i]}"


def model_parts(model: nn.Module) -> ModelParts | None:
    """What ``model`` is made of, or ``None`` for a model laid out neither as a transformers decoder (Llama's layout)
    nor as a torchtitan model."""
    if isinstance(getattr(model, "layers", None), nn.ModuleDict) and all(
            isinstance(getattr(model, k, None), nn.Module) for k in ("tok_embeddings", "norm", "output")):
        return ModelParts("torchtitan", "", "tok_embeddings", "layers", tuple(model.layers.keys()), "norm", "output",
                          None)
    prefix = getattr(model, "base_model_prefix", None)
    base = getattr(model, prefix, None) if isinstance(prefix, str) and prefix else None
    if not isinstance(base, nn.Module) or not isinstance(getattr(base, "layers", None), nn.ModuleList):
        return None
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None or any(not isinstance(getattr(base, k, None), nn.Module)
                           for k in ("embed_tokens", "norm", "rotary_emb")):
        return None
    head_name = next((n for n, m in model.named_modules() if m is head), None)
    if head_name is None:
        return None
    return ModelParts("transformers", prefix, f"{prefix}.embed_tokens", f"{prefix}.layers",
                      tuple(str(i) for i in range(len(base.layers))), f"{prefix}.norm", head_name,
                      f"{prefix}.rotary_emb")


@dataclass(frozen=True)
class StagePlan:
    """``layers[s]``: the indices of the layers stage ``s`` runs; the embedding is stage 0's, norm and head the last
    stage's."""

    parts: ModelParts
    layers: tuple[tuple[int, ...], ...]

    @property
    def n_stages(self) -> int:
        return len(self.layers)

    def module_names(self, stage: int) -> list[str]:
        """The stage's modules, as torchtitan's ``module_fqns_per_model_part`` lists them."""
        p = self.parts
        out = [p.embed] if stage == 0 else []
        out += [p.layer_name(i) for i in self.layers[stage]]
        if stage == self.n_stages - 1:
            out += [p.norm, p.head]
        return out

    def describe(self, stage: int) -> str:
        """``stage 1: model.layers.4–model.layers.7, model.norm, lm_head``."""
        p, ls = self.parts, self.layers[stage]
        out = [p.embed] if stage == 0 else []
        if ls:
            first, last = p.layer_name(ls[0]), p.layer_name(ls[-1])
            out.append(first if len(ls) == 1 else f"{first}–{last}")
        if stage == self.n_stages - 1:
            out += [p.norm, p.head]
        return f"stage {stage}: " + ", ".join(out)


def _layer_index(point: str, parts: ModelParts, model: nn.Module) -> int:
    """The layer a split point names: ``"model.layers.8"`` (or ``"layers.8"``, ``"8"``) → 8; ``ValueError`` naming
    what to give for a name that is no layer."""
    text = point.strip()
    short = parts.layers.rpartition(".")[2]
    for prefix in (parts.layers + ".", short + ".", ""):
        if text.startswith(prefix) and text[len(prefix):].split(".")[0] in parts.keys:
            key, _, rest = text[len(prefix):].partition(".")
            if rest:
                raise ValueError(f"split point {point!r} is inside layer {parts.layer_name(parts.keys.index(key))}: "
                                 f"a stage begins at a whole layer (give {parts.layer_name(parts.keys.index(key))!r})")
            return parts.keys.index(key)
    names = [n for n, _ in model.named_modules() if n]
    if text in names:
        raise ValueError(f"split point {point!r} is no layer of {parts.layers}: stages begin at layers (e.g. "
                         f"{parts.layer_name(parts.n_layers // 2)!r}); the embedding is the first stage's, norm and "
                         "head the last stage's")
    near = difflib.get_close_matches(text, names, n=3)
    raise ValueError(f"split point {point!r} names no module of {type(model).__name__}"
                     + (f" (nearest: {', '.join(near)})" if near else "")
                     + f"; stages begin at layers, e.g. pp=[{parts.layer_name(parts.n_layers // 2)!r}]")


def plan_stages(model: nn.Module, parts: ModelParts, n_stages: int, split_points: Sequence[str] = ()) -> StagePlan:
    """The stages: a stage begins at each split point (a layer's name), or the layers are split evenly into
    ``n_stages`` (the earlier stages take one more where they do not divide, as the ``nn.Sequential`` split does)."""
    n = parts.n_layers
    if split_points:
        at = sorted({_layer_index(p, parts, model) for p in split_points})
        if at[0] == 0:
            raise ValueError(f"split point {parts.layer_name(0)!r} is the first layer: a stage begins at each split "
                             "point, and the first stage at the first layer already")
        if len(at) + 1 != n_stages:
            raise ValueError(f"{len(at)} distinct split points make {len(at) + 1} stages, not {n_stages}")
        bounds = [0, *at, n]
    else:
        if n_stages > n:
            raise ValueError(f"{n_stages} pipeline stages need at least {n_stages} layers; {type(model).__name__} has "
                             f"{n}: give fewer stages (pp, or a schedule with one stage a rank)")
        per, extra = divmod(n, n_stages)
        bounds = [0]
        for s in range(n_stages):
            bounds.append(bounds[-1] + per + (1 if s < extra else 0))
    return StagePlan(parts, tuple(tuple(range(a, b)) for a, b in zip(bounds, bounds[1:])))


# --- the stage module -------------------------------------------------------------------------------------------
def _layer_types(config: Any, n: int) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    kind = "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"
    return [kind] * n


class DecoderStage(nn.Module):
    """One pipeline stage of a transformers decoder (built by :func:`build_stage`): ``forward(x)`` takes
    ``input_ids`` on the first stage, the hidden state elsewhere; returns the hidden state, or the logits on the last
    stage. Its submodules keep the whole model's names: ``model.embed_tokens``, ``model.layers.<i>``,
    ``model.norm``, ``model.rotary_emb``, ``lm_head``."""

    def __init__(self, body: nn.Module, head: nn.Module | None, plan: StagePlan, index: int) -> None:
        super().__init__()
        self.model = body  # the pruned body: embed_tokens / norm are None where not this stage's
        if head is not None:
            setattr(self, plan.parts.head.rpartition(".")[2], head)
        self._head_name = plan.parts.head.rpartition(".")[2]
        self.stage_index, self.n_stages = index, plan.n_stages
        self.is_first, self.is_last = index == 0, index == plan.n_stages - 1
        self.layer_ids = plan.layers[index]
        self.config = body.config
        self.layer_types = _layer_types(self.config, plan.parts.n_layers)
        if getattr(self.config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention: pipeline stages make causal masks only; estimate the "
                             "model with pp=1")
        self._rotary_by_type = "layer_type" in inspect.signature(body.rotary_emb.forward).parameters
        self._softcap = getattr(self.config, "final_logit_softcapping", None)
        # the hidden state is a sequence shard of this many (tensor parallelism with sequence parallelism: the
        # embedding's output is one): the positions count the whole sequence
        self.seq_shards = 1

    def _masks(self, hidden: torch.Tensor, pos: torch.Tensor) -> dict[str, Any]:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        make = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        out = {}
        for kind in {self.layer_types[i] for i in self.layer_ids}:
            if kind not in make:
                raise ValueError(f"layer type {kind!r}: pipeline stages make full and sliding-window causal masks "
                                 "only; estimate the model with pp=1")
            out[kind] = make[kind](config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                                   position_ids=pos)
        return out

    def _rotary(self, hidden: torch.Tensor, pos: torch.Tensor) -> dict[str, Any]:
        kinds = {self.layer_types[i] for i in self.layer_ids}
        if self._rotary_by_type:
            return {k: self.model.rotary_emb(hidden, pos, k) for k in kinds}
        pe = self.model.rotary_emb(hidden, position_ids=pos)
        return {k: pe for k in kinds}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        body = self.model
        hidden = body.embed_tokens(x) if self.is_first else x
        pos = torch.arange(hidden.shape[1] * self.seq_shards, device=hidden.device).unsqueeze(0)
        if self.layer_ids:
            masks, rotary = self._masks(hidden, pos), self._rotary(hidden, pos)
            for i in self.layer_ids:
                kind = self.layer_types[i]
                # keywords only: Mixtral's layer takes them in another order, and no use_cache
                hidden = body.layers[str(i)](hidden, attention_mask=masks[kind], position_embeddings=rotary[kind],
                                             position_ids=pos)
        if not self.is_last:
            return hidden
        logits = getattr(self, self._head_name)(body.norm(hidden))
        if self._softcap is not None:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits


def _shallow(module: nn.Module) -> nn.Module:
    """A new module object sharing ``module``'s submodules, parameters and buffers, whose own registries can change
    without touching ``module``."""
    new = copy.copy(module)
    for registry in ("_modules", "_parameters", "_buffers"):
        object.__setattr__(new, registry, dict(getattr(module, registry)))
    return new


def _own_buffers(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` with copies of its own buffers: each stage of a deep copy holds its own (rotary
    frequencies), also where one rank holds two stages."""
    new = _shallow(module)
    for name, b in module._buffers.items():
        if b is not None:
            new._buffers[name] = b.clone()
    return new


def build_stage(model: nn.Module, plan: StagePlan, index: int, copy_weights: bool = True) -> nn.Module:
    """Stage ``index`` of ``plan``: a deep copy of ``model`` without the other stages' modules (torchtitan's way).
    The copy never copies what it drops (the dropped modules go into ``deepcopy``'s memo as ``None``), and ``model``
    is left as it was.

    ``copy_weights=False``: the stage is made over ``model``'s own modules instead (a shallow copy of the body), for a
    caller that owns ``model`` already (the estimator's fake copy: the modules keep their ids and names); its buffers
    are copies, and a head tied to the embedding of another stage gets its own weight, as a deep copy holds them."""
    p = plan.parts
    last = index == plan.n_stages - 1
    body = model.get_submodule(p.base) if p.base else model
    head = model.get_submodule(p.head)
    layers = body.get_submodule(p.layers.rpartition(".")[2])
    mine = {p.keys[i] for i in plan.layers[index]}
    drop: list[nn.Module] = [m for k, m in layers.named_children() if k not in mine]
    embed = model.get_submodule(p.embed)
    if index != 0:
        drop.append(embed)
    if not last:
        drop += [model.get_submodule(p.norm), head]
    if copy_weights:
        memo: dict[int, Any] = {id(m): None for m in drop}
        # body and head in one deepcopy: a head tied to the embedding stays tied in a stage that holds both, and gets
        # a copy of its own otherwise
        new_body, new_head = copy.deepcopy((body, head), memo)
    else:
        new_body, new_head = _shallow(body), head
        if last and index != 0 and any(w is embed.weight for w in head.parameters(recurse=False)):
            new_head = _shallow(head)
            w = head.weight
            new_head._parameters["weight"] = nn.Parameter(torch.empty_like(w), requires_grad=w.requires_grad)
        if p.kind == "transformers":
            new_body._modules["rotary_emb"] = _own_buffers(body.rotary_emb)
        else:
            new_body = _own_buffers(new_body)
    container = new_body._modules[p.layers.rpartition(".")[2]]
    kept = nn.ModuleDict({k: m for k, m in container._modules.items() if k in mine and m is not None})
    new_body._modules[p.layers.rpartition(".")[2]] = kept
    if index != 0:
        new_body._modules[p.embed.rpartition(".")[2]] = None
    if not last:
        new_body._modules[p.norm.rpartition(".")[2]] = None
    if p.kind == "torchtitan":
        new_body._modules[p.head] = new_head if last else None
        return new_body
    return DecoderStage(new_body, new_head if last else None, plan, index)


def hidden_like(model: nn.Module, parts: ModelParts) -> tuple[int, torch.dtype]:
    """The hidden size and dtype of what travels between the stages (the residual stream, in the embedding's
    dtype)."""
    embed = model.get_submodule(parts.embed)
    return int(embed.weight.shape[1]), embed.weight.dtype


__all__ = ["DecoderStage", "ModelParts", "StagePlan", "build_stage", "hidden_like", "model_parts", "plan_stages"]
