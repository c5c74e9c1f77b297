"""Hugging Face models (transformers decoders, encoders and encoder-decoders, a PEFT LoRA model, a diffusers
UNet), built from configs with no download, estimated on fake tensors and checked against PyTorch's
profiler on the real CPU step: training, inference, activation checkpointing and bf16 autocast."""

from __future__ import annotations

import pytest
import torch

import vram_magic
from tests.support.zoo import real_peak

if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 6):
    pytest.skip("transformers 5 needs PyTorch 2.6 or later", allow_module_level=True)
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB, B, S = 1000, 4, 64
TOLERANCE = 0.005  # 0.5 %


def gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=128, n_head=4, vocab_size=VOCAB, n_positions=256))


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=256))


def bert():
    return transformers.BertForMaskedLM(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4, vocab_size=VOCAB,
        max_position_embeddings=256))


def t5():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        num_layers=2, num_decoder_layers=2, d_model=128, d_ff=256, num_heads=4, d_kv=32, vocab_size=VOCAB,
        decoder_start_token_id=0, pad_token_id=0))


def lora():
    peft = pytest.importorskip("peft")
    return peft.get_peft_model(llama(), peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


def unet():
    diffusers = pytest.importorskip("diffusers")
    return diffusers.UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8)


def text_batch(kind: str = "decoder", labels: bool = True, mask: torch.Tensor | None = None) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    out = {"input_ids": ids, "attention_mask": torch.ones(B, S, dtype=torch.long) if mask is None else mask}
    if labels:
        out["labels"] = torch.randint(0, VOCAB, (B, S // 2), generator=g) if kind == "t5" else ids.clone()
    return out


def unet_batch() -> dict:
    g = torch.Generator().manual_seed(1)
    return {"sample": torch.randn(2, 4, 16, 16, generator=g), "timestep": torch.tensor([10, 20]),
            "encoder_hidden_states": torch.randn(2, 8, 32, generator=g)}


FAMILIES = {
    "GPT-2 (decoder)": (gpt2, text_batch),
    "Llama (decoder, GQA)": (llama, text_batch),
    "BERT (encoder)": (bert, text_batch),
    "T5 (encoder-decoder)": (t5, lambda: text_batch("t5")),
    "Llama + LoRA (peft)": (lora, text_batch),
    "UNet2DCondition (diffusers)": (unet, unet_batch),
}


def unet_loss(out):
    return out.sample.sum()


MODES = {
    "training": {},
    "inference": {"inference": True},
    "checkpointing": {"checkpointing": True},
    "bf16 autocast": {"amp": torch.bfloat16},
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_estimate_within_half_a_percent_of_the_profiler(family, mode):
    build, make_inputs = FAMILIES[family]
    kwargs = MODES[mode]
    loss_fn = unet_loss if build is unet else None
    est = vram_magic.estimate(build, make_inputs, device="cpu", loss_fn=loss_fn, **kwargs)
    assert not est.partial, est.problem
    real = real_peak(build, make_inputs, loss_fn=loss_fn, **kwargs)
    assert abs(est.peak.total - real) / real < TOLERANCE, (est.peak.total, real)
    if kwargs.get("checkpointing"):
        own = "enable_gradient_checkpointing" if build is unet else "activation_checkpointing_enable"
        assert any(f"the model's own {own}()" in n for n in est.notes)


def test_padded_batch_keeps_its_mask_and_unpadded_drops_it():
    """transformers reads the attention mask to decide whether it can drop it: the estimate takes the same
    path as the real run in both cases (fake tensors alone would keep the mask every time)."""
    padded = torch.ones(B, S, dtype=torch.long)
    padded[:, -5:] = 0
    results = {}
    for name, mask in (("unpadded", None), ("padded", padded)):
        def make(mask=mask):
            return text_batch(mask=mask)
        est = vram_magic.estimate(llama, make, device="cpu")
        real = real_peak(llama, make)
        assert abs(est.peak.total - real) / real < TOLERANCE, (name, est.peak.total, real)
        results[name] = est.peak.total
    # the padded batch keeps a mask, so the grouped keys/values are repeated per head: more memory
    assert results["padded"] > results["unpadded"]


def test_inputs_made_by_an_expression_and_without_a_mask():
    # torch.ones(...) made on fake tensors still has known values; no mask at all works too
    est = vram_magic.estimate(llama, lambda: {"input_ids": torch.randint(0, VOCAB, (B, S)),
                                              "attention_mask": torch.ones(B, S, dtype=torch.long),
                                              "labels": torch.randint(0, VOCAB, (B, S))}, device="cpu")
    real = real_peak(llama, text_batch)
    assert abs(est.peak.total - real) / real < TOLERANCE

    def no_mask():
        ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(0))
        return {"input_ids": ids, "labels": ids}

    for build in (gpt2, llama):  # checkpointing a decoder fed no mask: no cache written twice, no excess
        est = vram_magic.estimate(build, no_mask, device="cpu", checkpointing=True)
        real = real_peak(build, no_mask, checkpointing=True)
        assert not est.partial and abs(est.peak.total - real) / real < TOLERANCE, (build.__name__, est.peak.total, real)


def test_batch_encoding_inputs_and_the_stated_loss():
    enc = transformers.BatchEncoding(text_batch(labels=False))
    model = gpt2()
    without = vram_magic.estimate(model, enc, device="cpu")
    assert without.loss.startswith("stand-in output.logits.sum()")
    assert "put labels in the inputs" in without.loss and "loss_fn=" in without.loss and "--loss" in without.loss
    assert "loss: stand-in" in str(without)
    with_labels = vram_magic.estimate(model, transformers.BatchEncoding(text_batch()), device="cpu")
    assert with_labels.loss == "the model's own loss (output.loss)"
    given = vram_magic.estimate(model, enc, device="cpu", loss_fn=lambda out: out.logits.float().mean())
    assert given.loss == "loss_fn (given)"
    # the model's own loss keeps an fp32 log-softmax of the logits: more than the stand-in's plain sum
    assert with_labels.peak.total > without.peak.total
    assert vram_magic.estimate(model, enc, device="cpu", inference=True).loss == ""


def test_every_what_if_row_runs_on_a_decoder_with_its_cache_on():
    model = gpt2()
    assert model.config.use_cache
    est = vram_magic.estimate(model, text_batch(), device="cpu", what_if=True)
    failed = [s for s in est.strategies if s.note.startswith("could not run")]
    assert not failed, failed
    assert model.config.use_cache and not model.is_activation_checkpointing  # the user's model is untouched


def test_checkpointing_without_the_models_own_switch_never_writes_a_cache_twice():
    """A model without transformers' switch: its blocks are wrapped, and their cache arguments dropped."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(32, 32)

        def forward(self, x, cache=None, use_cache=False):
            y = self.lin(x)
            if use_cache and cache is not None:
                cache.append(y)
                if len(cache) > 2:  # a recompute writing the cache again
                    raise RuntimeError("cache written twice")
            return y

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block() for _ in range(2))

        def forward(self, x):
            cache = []
            for b in self.blocks:
                x = b(x, cache=cache, use_cache=True)
            return x

    est = vram_magic.estimate(Net(), torch.randn(8, 32), device="cpu", checkpointing=True)
    assert any("torch.utils.checkpoint" in n for n in est.notes)


def test_estimating_leaves_the_random_generator_alone():
    # values kept beside fake tensors, and kernels run for real to measure their scratch (convolutions,
    # half-precision GEMMs), never draw from the user's generator
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    vram_magic.estimate(gpt2, text_batch, device="cpu")
    vram_magic.estimate(unet, unet_batch, device="cpu", amp="bf16", loss_fn=unet_loss)
    assert torch.equal(torch.rand(3), expected)
