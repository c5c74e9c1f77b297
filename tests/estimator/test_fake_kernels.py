"""Models whose fake runs needed the estimator's own rules, each checked against the real CPU step: MoE experts on
fp32 (aten._grouped_mm), builders whose constructors read values, LayerDrop's random draws, CTC loss, and the layout
of convolutions' size-1 tensors."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import vram_magic
from vram_magic.estimator.tracing import kernels
from vram_magic.estimator.tracing.tracer import tensor_spec

transformers = pytest.importorskip("transformers")


def _real_peak(model: nn.Module, batch: dict, loss=lambda out: out.loss) -> int:
    """The estimator's default step, twice, measured on the CPU."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    model.train()
    with warnings.catch_warnings(), vram_magic.measure(device="cpu") as m:
        warnings.simplefilter("ignore")
        for _ in range(2):
            out = model(**batch)
            loss(out).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del out
    return m.peak.total


@pytest.mark.parametrize("shape_b,transposed", [((3, 8, 16), False), ((3, 6, 8), True)])
def test_the_grouped_mm_kernel_gives_the_real_kernels_output(shape_b, transposed):
    a = torch.randn(10, 8)
    b = torch.randn(*shape_b)
    b = b.transpose(-2, -1) if transposed else b
    offs = torch.tensor([3, 7, 10], dtype=torch.int32)
    real = torch._grouped_mm(a, b, offs=offs)
    fake = kernels.grouped_mm(a, b, offs=offs)  # plain tensors: the same rule, no fake mode needed
    assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)
    with pytest.raises(RuntimeError):
        kernels.grouped_mm(a.double(), b.double(), offs=offs)


def test_an_fp32_moe_model_is_estimated_as_it_runs():
    cfg = transformers.Qwen3MoeConfig(vocab_size=500, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                      num_experts=4, num_experts_per_tok=2, head_dim=16)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    ids = torch.randint(0, 500, (2, 16))
    batch = {"input_ids": ids, "labels": ids.clone()}  # one tensor given twice is counted twice by the estimate
    est = vram_magic.estimate(model, batch, device="cpu")
    assert not est.partial
    assert est.peak.total == _real_peak(model, batch)


def test_ctc_kernels_give_the_cpu_kernels_shapes():
    lp = torch.randn(30, 2, 6).log_softmax(2)
    targets, il, tl = torch.randint(1, 6, (9,)), torch.tensor([30, 25]), torch.tensor([5, 4])
    nll, alpha = torch.ops.aten._ctc_loss.Tensor(lp, targets, il, tl, 0, False)
    fnll, falpha = kernels.ctc_loss(lp, targets, il, tl, 0, False)
    assert (fnll.shape, falpha.shape, falpha.stride()) == (nll.shape, alpha.shape, alpha.stride())
    grad = torch.ops.aten._ctc_loss_backward.Tensor(torch.ones(2), lp, targets, il, tl, nll, alpha, 0, False)
    assert kernels.ctc_loss_backward(torch.ones(2), lp, targets, il, tl, nll, alpha, 0).shape == grad.shape


class _TimmStyle(nn.Module):
    """Drop-path rates read from torch.linspace (no device) and trunc_normal_ init in the constructor."""

    def __init__(self) -> None:
        super().__init__()
        self.rates = [x.item() for x in torch.linspace(0, 0.1, 2)]
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in self.rates)
        self.pos = nn.Parameter(torch.zeros(1, 4, 32))
        nn.init.trunc_normal_(self.pos, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for r, b in zip(self.rates, self.blocks):
            x = x + b(x + self.pos) * (1.0 if r == 0 else 1.0 / (1 - r))
        return x


def test_a_builder_whose_constructor_reads_values_is_built():
    est = vram_magic.estimate(_TimmStyle, torch.randn(2, 4, 32), device="cpu")
    assert not est.partial and est.parameters == sum(p.numel() for p in _TimmStyle().parameters())
    assert torch.nn.init.trunc_normal_.__name__ == "trunc_normal_"  # put back


def test_layerdrop_keeps_every_layer_and_says_so():
    cfg = transformers.Wav2Vec2Config(vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                                      num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2, layerdrop=0.5,
                                      mask_time_prob=0.0, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.Wav2Vec2ForCTC(cfg)
    labels = torch.randint(1, 16, (2, 6))
    batch = {"input_values": torch.randn(2, 2000), "labels": labels}
    est = vram_magic.estimate(model, batch, device="cpu")
    assert not est.partial
    assert any("LayerDrop keeps every layer" in n for n in est.notes)
    # what the estimate takes is the step with every layer kept (equal to the real one: REPORT.md; not measured
    # here, as a real wav2vec2 step leaves 16 KiB alive in the process that later measured blocks would count)
    model.config.layerdrop = 0.0
    kept = vram_magic.estimate(model, batch, device="cpu")
    assert est.peak.total == kept.peak.total and not any("LayerDrop" in n for n in kept.notes)


def test_a_permuted_size_one_tensor_counts_as_channels_last():
    g = torch.randn(2, 1, 1, 8).permute(0, 3, 1, 2)
    assert g.is_contiguous() and tensor_spec(g)[3] is True
    assert tensor_spec(torch.randn(2, 8, 1, 1))[3] is False
    assert tensor_spec(torch.randn(2, 8, 4, 4))[3] is False
    assert tensor_spec(torch.randn(2, 8, 4, 4).contiguous(memory_format=torch.channels_last))[3] is True
