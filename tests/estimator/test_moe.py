"""Mixture-of-experts models: the routed experts' parameters, gradients and optimizer state shown apart ("of which
experts") in estimates and in measured steps, bytes worked out by hand; the routing traced as the model routes, with a
stated assumption (balanced, or ``moe_imbalance``'s worst case) where the eager experts' shapes depend on it, checked
against real CPU steps whose router is forced to route that way, and against the real router."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vram_magic
from tests.support.moe import VOCAB, B, S, batch, build, measured
from vram_magic.core.units import format_bytes
from vram_magic.engine.scan.experts import expert_parameters, experts_of
from vram_magic.estimator.tracing.routing import assignment, busiest

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

H, INTER, E, K, LAYERS = 64, 256, 8, 2, 2  # hidden, an expert's intermediate size, experts, top-k, layers
TOKENS = B * S
#: the experts' weights by hand: per layer E × (gate_up (2I × H) + down (H × I)) fp32 values
EXPERT_BYTES = LAYERS * E * (2 * INTER * H + H * INTER) * 4
#: AdamW's state of them: two moments, and a 4-byte step counter per tensor (2 a layer)
EXPERT_STATE = 2 * EXPERT_BYTES + 4 * 2 * LAYERS


def qwen3_moe(implementation: str = "grouped_mm", imbalance: float | None = None, **kw) -> nn.Module:
    """The small Qwen3-MoE of these tests (``tests/support/moe.py``, an expert's intermediate size ``INTER``)."""
    return build("qwen3_moe", implementation, imbalance, moe_intermediate_size=INTER, **kw)


def moe_note(est) -> str:
    return next((n for n in est.notes if n.startswith("MoE routing")), "")


# --- the experts, found by structure ------------------------------------------------------------------------------

class ListMoE(nn.Module):
    """An MoE block as older code writes it: a ModuleList of expert MLPs, the router's topk in the block's forward, a
    loop over the experts gathering each one's tokens with ``torch.where`` (no transformers)."""

    def __init__(self, dim: int = 32, experts: int = 4, k: int = 2, tokens: int | None = None) -> None:
        super().__init__()
        self.k = k
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
                                     for _ in range(experts))
        self.shared_experts = nn.Sequential(nn.Linear(dim, dim))  # dense: every token runs it
        # a constant that forces the routing (zero when ``tokens`` is not given: the router's own choice)
        bias = torch.zeros(tokens or 1, experts)
        if tokens:
            bias.scatter_(1, assignment(tokens, k, experts), 1e4)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.topk((self.gate(flat) + self.bias).softmax(-1), self.k, dim=-1)
        out = self.shared_experts(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            out = out.index_add(0, token, expert(flat[token]) * weights[token, slot, None])
        return out.reshape(x.shape)


def test_experts_are_found_by_their_structure():
    model = qwen3_moe()
    found = [(name, type(block).__name__) for name, _, block in experts_of(model)]
    assert found == [(f"model.layers.{i}.mlp.experts", "Qwen3MoeSparseMoeBlock") for i in range(LAYERS)]
    assert sum(p.numel() * 4 for p in expert_parameters(model)) == EXPERT_BYTES
    listed = ListMoE()
    assert [n for n, _, _ in experts_of(listed)] == ["experts"]  # not the shared experts, not the router
    assert {id(p) for p in expert_parameters(listed)} == {id(p) for p in listed.experts.parameters()}
    lone = nn.Module()
    lone.experts = nn.Linear(4, 4)  # one module called experts is no MoE
    assert not list(experts_of(lone)) and not expert_parameters(nn.Linear(4, 4))
    qwen2 = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        shared_expert_intermediate_size=32))
    assert [n for n, _, _ in experts_of(qwen2)] == ["model.layers.0.mlp.experts"]  # its shared_expert is dense


# --- of which experts: estimate and measurement, by hand ------------------------------------------------------------

def test_the_experts_share_of_a_step_estimated_and_measured_to_the_byte():
    model, data = qwen3_moe(), batch()
    est = vram_magic.estimate(model, data, device="cpu")
    report = measured(model, data)
    assert not est.partial and est.peak.total == report.peak.total
    assert est.experts["parameters"] == report.experts["parameters"] == EXPERT_BYTES
    assert est.experts["optimizer_state"] == report.experts["optimizer_state"] == EXPERT_STATE
    assert est.experts["gradients"] == report.experts["gradients"] > 0  # the peak is in the backward
    assert est.experts == est.peak.experts == report.peak.experts
    assert report.peak.parameters > EXPERT_BYTES  # the dense rest: attention, embeddings, routers, norms
    assert f"of which experts {format_bytes(EXPERT_BYTES)}" in str(est)
    assert "of which experts" in str(report) and "of which experts" in report._html()
    assert "of which experts" in est._html()
    dense = vram_magic.estimate(nn.Linear(8, 8), torch.randn(2, 8), device="cpu")
    assert dense.experts == {"parameters": 0, "gradients": 0, "optimizer_state": 0}
    assert "of which experts" not in str(dense)


@pytest.mark.parametrize("name,dtype", [("mixtral", torch.float32), ("mixtral", torch.bfloat16),
                                        ("qwen3_moe", torch.bfloat16)])
def test_a_real_step_of_mixtral_and_qwen3_moe_in_fp32_and_bf16(name, dtype):
    """The fp32 step that once raised (``aten._grouped_mm``'s meta kernel took bf16 only) and the bf16 one, each to
    the byte against the real CPU step, and the experts' share of each model state worked out by hand."""
    model, data = build(name, dtype=dtype), batch()
    cfg, size = model.config, torch.finfo(dtype).bits // 8
    inter = cfg.intermediate_size if name == "mixtral" else cfg.moe_intermediate_size  # an expert's
    params = cfg.num_hidden_layers * 8 * 3 * inter * cfg.hidden_size * size  # gate, up, down of 8 experts a layer
    est = vram_magic.estimate(model, data, device="cpu")
    report = measured(model, data)
    assert not est.partial and est.peak.total == report.peak.total
    assert est.experts == report.experts
    assert est.experts["parameters"] == params
    assert est.experts["optimizer_state"] == 2 * params + 4 * 2 * cfg.num_hidden_layers  # moments; fp32 steps
    assert 0 < est.experts["gradients"] <= params
    assert est.peak.parameters > params  # the dense rest


# --- routing -----------------------------------------------------------------------------------------------------

def test_the_grouped_experts_are_exact_for_any_router_and_imbalance_changes_nothing():
    """transformers' default experts sort the (token, expert) pairs and run one grouped GEMM: no shape depends on the
    routing, so the estimate equals the step with the real (random) router."""
    model, data = qwen3_moe("grouped_mm"), batch()
    est = vram_magic.estimate(model, data, device="cpu")
    assert est.peak.total == measured(model, data).peak.total
    worst = vram_magic.estimate(model, data, device="cpu", moe_imbalance=3)
    assert worst.peak.total == est.peak.total
    assert "exact for any routing" in moe_note(est) and "moe_imbalance=3 changes nothing" in moe_note(worst)


def test_the_eager_experts_run_on_the_assumed_routing_and_match_a_step_routed_so():
    """The eager experts loop over the experts hit and gather each one's tokens (nonzero, where): shapes only the
    router's values decide. The estimate runs that loop on a balanced routing and says so; a real step whose router
    is forced to route the same way measures the same bytes, and one whose busiest expert takes twice its share
    measures what ``moe_imbalance=2`` estimates."""
    data = batch()
    balanced = vram_magic.estimate(qwen3_moe("eager", 1), data, device="cpu")
    assert not balanced.partial
    assert balanced.peak.total == measured(qwen3_moe("eager", 1), data).peak.total
    note = moe_note(balanced)
    assert "assumed balanced in 2 MoE blocks" in note and f"{TOKENS} tokens × top-{K} over {E} experts, 32 each" in note
    worst = vram_magic.estimate(qwen3_moe("eager", 2), data, device="cpu", moe_imbalance=2)
    assert worst.peak.total == measured(qwen3_moe("eager", 2), data).peak.total
    assert worst.peak.total > balanced.peak.total
    assert "moe_imbalance=2" in moe_note(worst) and "the busiest 64" in moe_note(worst)


def test_the_eager_experts_with_the_real_router_are_within_a_percent():
    model, data = qwen3_moe("eager"), batch()
    est = vram_magic.estimate(model, data, device="cpu")
    real = measured(model, data).peak.total
    assert not est.partial and abs(est.peak.total - real) / real < 0.01


def test_older_moe_code_with_a_list_of_experts():
    tokens = 4 * 16
    x = torch.randn(4, 16, 32)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), ListMoE(tokens=tokens), nn.Linear(32, 8))
    est = vram_magic.estimate(model, x, device="cpu")
    report = measured(model, x, loss=lambda out: out.sum())
    assert not est.partial and "assumed balanced in 1 MoE block" in moe_note(est)
    assert est.peak.total == report.peak.total
    per_expert = (32 * 128 + 128 + 128 * 32 + 32) * 4
    assert est.experts["parameters"] == report.experts["parameters"] == 4 * per_expert


def test_the_assumed_routing():
    r = assignment(128, 2, 8)
    assert r.shape == (128, 2) and all(len(set(row.tolist())) == 2 for row in r)
    assert torch.bincount(r.flatten(), minlength=8).tolist() == [32] * 8
    w = assignment(128, 2, 8, 2.0)
    counts = torch.bincount(w.flatten(), minlength=8).tolist()
    assert counts[0] == busiest(128, 2, 8, 2.0) == 64 and sum(counts) == 256 and max(counts[1:]) - min(counts[1:]) <= 1
    assert all(len(set(row.tolist())) == 2 for row in w)
    assert busiest(128, 2, 8, 100) == 128  # an expert takes each token at most once
    assert torch.bincount(assignment(10, 4, 4, 3).flatten()).tolist() == [10] * 4  # top-k of all: nothing to skew


def test_moe_imbalance_is_checked_and_reaches_the_command_line():
    model, data = nn.Linear(8, 8), torch.randn(2, 8)
    for wrong in (0.5, "many", True, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="moe_imbalance"):
            vram_magic.estimate(model, data, device="cpu", moe_imbalance=wrong)
    from vram_magic.estimator.cli.estimate_cmd import parser

    args = parser().parse_args(["m:m", "--shape", "8", "--batch", "2", "--moe-imbalance", "1.5"])
    from vram_magic.estimator.cli.arguments import recipe_options

    assert recipe_options(args, {})["moe_imbalance"] == 1.5


def test_routing_masks_too_large_to_keep_stop_the_estimate_and_say_why(monkeypatch):
    from vram_magic.estimator.fake import known_values

    monkeypatch.setattr(known_values, "LIMIT", 100)
    monkeypatch.setattr(known_values, "ROUTED_LIMIT", 200)  # the one-hot mask: 128 × 2 × 9 elements
    est = vram_magic.estimate(qwen3_moe("eager"), batch(), device="cpu")
    assert est.partial and "grouped_mm experts need none" in moe_note(est)


def test_a_top_1_router_and_experts_named_by_their_index():
    """Switch Transformers routes with argmax and names its experts ``f"expert_{idx}"`` from a routing tensor."""
    cfg = transformers.SwitchTransformersConfig(vocab_size=VOCAB, d_model=32, d_ff=64, d_kv=8, num_heads=4,
                                                num_layers=2, num_decoder_layers=2, num_sparse_encoder_layers=1,
                                                num_sparse_decoder_layers=1, num_experts=4, expert_capacity=64,
                                                decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.SwitchTransformersForConditionalGeneration(cfg)
    ids = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    data = {"input_ids": ids, "labels": ids.clone()}
    est = vram_magic.estimate(model, data, device="cpu")
    assert not est.partial and "32 tokens × top-1 over 4 experts, 8 each" in moe_note(est)
    report = measured(model, data)
    assert est.experts["parameters"] == report.experts["parameters"] == 2 * 4 * (2 * 32 * 64) * 4
    # its random router leaves one expert without a token in this small batch: no gradient, so AdamW makes no state
    # for it (2 moments × 4,096 values + 2 step counters); the balanced routing gives every expert its share
    missed = 2 * (2 * 32 * 64) * 4 + 2 * 4
    assert report.peak.optimizer_state == est.peak.optimizer_state - missed
    assert 0 < est.peak.total - report.peak.total < 0.03 * report.peak.total
