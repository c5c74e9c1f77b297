"""Mixture-of-experts decoders of transformers built from small configs, their routers optionally forced to route as
the estimator assumes (balanced, or ``moe_imbalance``'s busiest expert), and the estimator's default step measured on
the CPU: shared by ``tests/estimator/test_moe.py`` and ``benchmarks/moe_routing.py``."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import vram_magic
from vram_magic.estimator.tracing.routing import assignment

B, S, VOCAB = 2, 64, 64  # the batch: 2 × 64 tokens of a 64-word vocabulary
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=VOCAB, max_position_embeddings=128, pad_token_id=0)
#: 8 experts, top-2, an expert's intermediate size 512 (Mixtral's ``intermediate_size``, the others'
#: ``moe_intermediate_size``; ``num_local_experts``: Mixtral's name for the count, ``num_experts``: Qwen's)
MOE = dict(BASE, num_local_experts=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512,
           shared_expert_intermediate_size=64)
MODELS: dict[str, dict[str, Any]] = {
    "mixtral": dict(MOE, intermediate_size=512), "qwen3_moe": MOE, "qwen2_moe": MOE, "olmoe": MOE,
    "gpt_oss": dict(BASE, num_local_experts=8, num_experts_per_tok=2, sliding_window=32,
                    layer_types=["sliding_attention", "full_attention"]),
    "deepseek_v3": dict({k: v for k, v in BASE.items() if k != "head_dim"}, n_routed_experts=8, num_experts_per_tok=2,
                        n_group=2, topk_group=1, moe_intermediate_size=512, n_shared_experts=1, first_k_dense_replace=0,
                        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
}
#: the routers laid out as Mixtral's (logits, softmax, top-k), which :class:`ForcedRouter` stands in for
FORCEABLE = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe")


class ForcedRouter(nn.Module):
    """Mixtral's and Qwen's top-k router with a constant added to its logits that makes ``topk`` choose ``routing``
    (tokens × k expert indices): the same ops in the real step and in the estimate's fake one, so a real step routes
    exactly as the estimate assumes."""

    def __init__(self, router: nn.Module, routing: torch.Tensor) -> None:
        super().__init__()
        self.weight, self.top_k, self.hidden_dim = router.weight, router.top_k, router.hidden_dim
        self.norm = getattr(router, "norm_topk_prob", True)
        bias = torch.zeros(routing.shape[0], router.weight.shape[0]).scatter_(1, routing, 1e4)
        self.register_buffer("bias", bias.to(router.weight.dtype))

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden.reshape(-1, self.hidden_dim), self.weight) + self.bias
        scores, chosen = torch.topk(F.softmax(logits, dtype=torch.float, dim=-1), self.top_k, dim=-1)
        if self.norm:
            scores /= scores.sum(dim=-1, keepdim=True)
        return logits, scores.to(logits.dtype), chosen


def forced(model: nn.Module, imbalance: float = 1.0, tokens: int = B * S) -> nn.Module:
    """``model`` with each decoder layer's router forced to the assumed routing of ``tokens`` tokens."""
    for layer in model.model.layers:
        gate = layer.mlp.gate
        layer.mlp.gate = ForcedRouter(gate, assignment(tokens, gate.top_k, gate.weight.shape[0], imbalance))
    return model


def build(name: str, implementation: str = "grouped_mm", imbalance: float | None = None,
          dtype: torch.dtype | None = None, **config: Any) -> nn.Module:
    """A small ``name`` decoder (``MODELS``, ``config`` over it), its experts run as ``implementation`` (transformers
    5.24: ``"grouped_mm"``, the default, or ``"eager"``), in ``dtype``; with ``imbalance``, its routers forced
    (:func:`forced`)."""
    import transformers

    cfg = transformers.AutoConfig.for_model(name, **{**MODELS[name], **config})
    cfg._experts_implementation = implementation
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    if dtype is not None:
        model = model.to(dtype)
    return forced(model, imbalance) if imbalance is not None else model


def batch(b: int = B, s: int = S) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (b, s), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def measured(model: nn.Module, data: Any, loss: Any = None) -> Any:
    """The estimator's default step, twice (forward, ``out.loss`` or ``loss(out)``, backward, AdamW with
    ``foreach=False``, ``zero_grad``), measured on the CPU with the model and the optimizer in the namespace: the
    cell's report."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    with warnings.catch_warnings(), vram_magic.measure(device="cpu",
                                                       namespace={"model": model, "opt": opt, "data": data}) as m:
        warnings.simplefilter("ignore")
        for _ in range(2):
            out = model(**data) if isinstance(data, dict) else model(data)
            (out.loss if loss is None else loss(out)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del out
    return m.report


__all__ = ["B", "FORCEABLE", "MODELS", "S", "VOCAB", "ForcedRouter", "batch", "build", "forced", "measured"]
