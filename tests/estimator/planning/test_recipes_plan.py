"""The recipes' levers in the planner (``estimator/planning/recipes.py``): an optimizer in backward, activations on the
host, the loss in chunks and op-level checkpointing are searched when nothing classic fits (or always, with
``allow="recipes"``), keep the numerics, say their costs, and each row's options give its memory."""

from __future__ import annotations

import pytest
import torch

import vram_magic

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def tiny_llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=1000, max_position_embeddings=256))


def tokens(vocab: int = 1000, b: int = 4, s: int = 64) -> dict:
    ids = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def lever_rows(plan):
    return [r for r in plan.rows if {"optimizer_in_backward", "loss_chunks", "offload_activations"} & set(r.options)
            or r.options.get("checkpointing") == "ops"]


def test_levers_are_rows_that_keep_the_numerics():
    plan = vram_magic.plan(tiny_llama, tokens(), device="cpu", budget="64MiB", allow="recipes", top=40)
    rows = lever_rows(plan)
    seen = {k for r in rows for k, v in r.options.items() if k in ("optimizer_in_backward", "loss_chunks")}
    assert seen == {"optimizer_in_backward", "loss_chunks"}
    assert any(r.options.get("checkpointing") == "ops" for r in rows)
    assert not any("offload_activations" in r.options for r in rows)  # on a CPU the host is the device
    for r in rows:
        if "amp" not in r.options:
            assert r.numerics == ()
        assert r.tradeoffs and r.code
        assert not any(r.options.get("optimizer_in_backward") and r.options.get("accumulate", 1) > 1 for r in rows)
    row = next(r for r in rows if r.options.get("loss_chunks") and r.options.get("checkpointing") == "ops")
    est = vram_magic.estimate(tiny_llama, tokens(), **row.options)
    assert est.needed == row.needed
    assert "LinearCrossEntropyLoss" in "\n".join(row.code) and "create_selective_checkpoint_contexts" in \
        "\n".join(row.code)


def test_without_allow_the_levers_wait_for_nothing_classic_to_fit():
    fits = vram_magic.plan(tiny_llama, tokens(), device="cpu", budget="64MiB", top=5)
    assert not lever_rows(fits)  # a classic row fits: the search stays classic
    with pytest.raises(ValueError, match="recipes"):
        vram_magic.plan(tiny_llama, tokens(), device="cpu", budget="64MiB", allow="recipez")


def llama3_8b():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0))


@pytest.mark.slow
def test_llama3_8b_full_fine_tune_on_one_24gb_gpu():
    """bf16 weights (15 GiB) and AdamW's bf16 moments (30 GiB) do not fit 24 GiB however the classic levers combine
    (accumulation, checkpointing, the state on the host still leave every gradient, 15 GiB): the plan's rows are the
    recipes', with the optimizer in backward, and say why."""
    batch = tokens(vocab=128256, b=2, s=2048)
    plan = vram_magic.plan(llama3_8b, lambda: batch, gpu="RTX-4090", dtype="bf16", top=3)
    assert plan.rows and all(r.fits for r in plan.rows)
    assert any("nothing classic fits" in n for n in plan.notes)
    for r in plan.rows:
        assert r.options["optimizer_in_backward"] is True and r.numerics == ()
        assert r.needed <= 24 * 2**30
    assert any("no gradient accumulation" in t for t in plan.rows[0].tradeoffs)
