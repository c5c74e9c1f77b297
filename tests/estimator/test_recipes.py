"""The recipes people train with now, each lever checked against the real CPU step it models: a transformers Llama built
from a tiny config, trained twice under ``vram_magic.measure(device="cpu")`` by a step written once here, which is also
handed to the estimator as ``step=``. Each lever's estimate is within 1 % of the real peak and 2 % per category; the
estimate of ``step=`` reproduces the real step to the byte.

The real steps are plain PyTorch as the recipes write them (PyTorch's optimizer-in-backward tutorial,
``torch.autograd.graph.save_on_cpu``, torchtune's ``LinearCrossEntropyLoss`` loop, torchtitan's op-level selective
checkpointing policy), not the estimator's own code.
"""

from __future__ import annotations

import gc
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F

import vram_magic
from vram_magic.estimator import EstimateError

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB = 1000


def llama(layers: int = 2, hidden: int = 128, inter: int = 256, vocab: int = VOCAB):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=hidden, intermediate_size=inter, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=256))


def activations_heavy():  # the peak is the activations': the loss, checkpointing and offload levers show
    return llama()


def parameters_heavy():  # the peak holds every gradient: the optimizer in backward shows
    return llama(hidden=256, inter=512, vocab=2048)


def batch(vocab: int = VOCAB, b: int = 4, s: int = 64) -> dict:
    ids = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


# --- the real steps, written once: run for real below and handed to the estimator as step= ---------------------------
def plain_step(model, batch, optimizer):
    out = model(**batch)
    loss = out.loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def trainer_step(model, batch, optimizer):  # Hugging Face's Trainer: the output is dropped before backward
    model(**batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def in_backward_optimizers(model):
    """PyTorch's recipe: an AdamW per parameter, stepped (and its gradient freed) as soon as the gradient is ready."""
    optimizers = {p: torch.optim.AdamW([p], foreach=False) for p in model.parameters()}

    def step(p):
        optimizers[p].step()
        optimizers[p].zero_grad(set_to_none=True)

    hooks = [p.register_post_accumulate_grad_hook(step) for p in model.parameters()]
    return {"optimizers": optimizers, "hooks": hooks}


def in_backward_step(model, batch, optimizer):
    out = model(**batch)
    loss = out.loss
    loss.backward()


def offload_step(model, batch, optimizer):
    with torch.autograd.graph.save_on_cpu(pin_memory=True):
        out = model(**batch)
        loss = out.loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def linear_cross_entropy(head, hidden, labels, chunks):
    """torchtune's LinearCrossEntropyLoss.forward, written out."""
    mask = labels != -100
    total_elements = mask.sum()
    total_loss = 0.0
    for hidden_chunk, target_chunk in zip(hidden.tensor_split(chunks, dim=1), labels.tensor_split(chunks, dim=1)):
        mask_chunk = target_chunk != -100
        if mask_chunk.sum() == 0:
            mask_chunk[0] = True
        target_chunk = target_chunk[mask_chunk]
        logits = head(hidden_chunk[mask_chunk])
        total_loss += F.cross_entropy(logits.float(), target_chunk, reduction="sum", ignore_index=-100)
    return total_loss / total_elements


def chunked_loss(model, batch):  # a recipe's loss step: the decoder, the shifted labels, the chunked loss
    hidden = model.model(input_ids=batch["input_ids"], use_cache=False).last_hidden_state
    labels = F.pad(batch["labels"], (0, 1), value=-100)[..., 1:]
    return linear_cross_entropy(model.lm_head, hidden, labels, 4)


def chunked_step(model, batch, optimizer):
    chunked_loss(model, batch).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def torchtune_step(model, batch, optimizer):  # bf16 weights, optimizer in backward, chunked loss, op-level SAC
    chunked_loss(model, batch).backward()


SAVE = {torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.aten.max.default}


def op_sac_context():
    """torchtitan's "op" policy: matmul and attention outputs saved, every second mm and the rest recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    meta = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        key = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            meta[key] += 1
        save = func in SAVE and not (func == torch.ops.aten.mm.default and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def with_op_sac(build):
    def built():
        model = build()
        kwargs = {"use_reentrant": False, "context_fn": op_sac_context}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5's name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return model

    return built


def bf16(build):
    def built():
        return build().to(torch.bfloat16)

    return built


# lever: (the model's builder, the builder of the real model, the real step, what optimizer= makes, the lever's options)
CASES = {
    "keep_output": (activations_heavy, activations_heavy, plain_step, "adamw", {}),
    "Trainer's step": (activations_heavy, activations_heavy, trainer_step, "adamw", {"keep_output": False}),
    "optimizer_in_backward": (parameters_heavy, parameters_heavy, in_backward_step, in_backward_optimizers,
                              {"optimizer_in_backward": True}),
    "offload_activations": (activations_heavy, activations_heavy, offload_step, "adamw", {"offload_activations": True}),
    "loss_chunks": (activations_heavy, activations_heavy, chunked_step, "adamw", {"loss_chunks": 4,
                                                                                  "keep_output": False}),
    "checkpointing ops": (activations_heavy, with_op_sac(activations_heavy), plain_step, "adamw",
                          {"checkpointing": "ops"}),
    "torchtune": (activations_heavy, bf16(with_op_sac(activations_heavy)), torchtune_step, in_backward_optimizers,
                  {"dtype": "bf16", "optimizer_in_backward": True, "loss_chunks": 4, "checkpointing": "ops",
                   "keep_output": False}),
}


def inputs_for(build):
    return batch(vocab=2048, b=2, s=32) if build is parameters_heavy else batch()


def real_run(build, step, optimizer):
    """Two real steps measured on the CPU: the report (in-backward hooks removed afterwards, so the model is freed)."""
    gc.collect()
    model = build().train()
    made = optimizer(model) if callable(optimizer) else torch.optim.AdamW(model.parameters(), foreach=False)
    data = inputs_for(build) if build in (parameters_heavy, activations_heavy) else batch()
    with vram_magic.measure(device="cpu") as measured:
        for _ in range(2):
            step(model, data, made)
    for hook in made.get("hooks", ()) if isinstance(made, dict) else ():
        hook.remove()
    return measured.report


def assert_close(est, report, total=0.01, each=0.02):
    assert est.peak.total == pytest.approx(report.peak.total, rel=total)
    for category in ("parameters", "gradients", "optimizer_state", "activations", "kv_cache", "other"):
        assert est.peak[category] == pytest.approx(report.peak[category], rel=each, abs=0), category


@pytest.mark.parametrize("lever", list(CASES))
def test_each_lever_is_its_real_step(lever):
    """The lever's estimate within 1 % of the real step's peak (2 % per category); the real step itself as step= to the
    byte in every category."""
    build, real_build, step, optimizer, options = CASES[lever]
    report = real_run(real_build, step, optimizer)
    data = inputs_for(build)
    est = vram_magic.estimate(build, data, device="cpu", **{"optimizer": "adamw", **options})
    assert not est.partial
    assert_close(est, report)
    own = vram_magic.estimate(real_build, data, device="cpu", step=step, optimizer=optimizer)
    assert not own.partial
    assert {c: own.peak[c] for c in own.peak} == {c: report.peak.get(c, 0) for c in own.peak}
    assert own.step.startswith(f"your {step.__name__}(model, batch, optimizer)")


def test_checkpointing_takes_a_policy():
    """``checkpointing=`` takes a policy function or the list of ops to save, as
    ``create_selective_checkpoint_contexts`` does: the two spellings of "save the matmuls" agree, and save less than
    torchtitan's policy (which saves attention's outputs too, and recomputes every second matmul)."""
    from torch.utils.checkpoint import CheckpointPolicy

    def matmuls(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if func == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    listed = vram_magic.estimate(activations_heavy, batch(), device="cpu", checkpointing=[torch.ops.aten.mm.default])
    policy = vram_magic.estimate(activations_heavy, batch(), device="cpu", checkpointing=matmuls)
    ops = vram_magic.estimate(activations_heavy, batch(), device="cpu", checkpointing="ops")
    assert listed.peak == policy.peak and listed.peak.total != ops.peak.total
    assert "op-level checkpointing" in listed.description and any("policy matmuls" in n for n in policy.notes)


def test_the_step_convention_is_one_logits_tensor_here():
    """Against Hugging Face's Trainer step, keeping the output holds the logits through backward: 4 × 64 × 1,000 fp32
    values (Llama returns no KV cache in training here)."""
    kept = vram_magic.estimate(activations_heavy, batch(), device="cpu")
    dropped = vram_magic.estimate(activations_heavy, batch(), device="cpu", keep_output=False)
    assert kept.peak.total - dropped.peak.total == 4 * 64 * VOCAB * 4 == 1_024_000
    assert "keep_output=True" in kept.step and "out = model(**batch)" in kept.step
    assert "keep_output=False" in dropped.step and dropped.step.startswith("model(**batch).loss.backward()")
    for est in (kept, dropped):
        assert f"step: {est.step}" in est._text() and "step: " in est._html()


def test_levers_cut_what_they_name():
    """The optimizer in backward never holds every gradient; the chunked loss and op-level checkpointing hold fewer
    activations than the whole loss and no checkpointing; on CUDA the activations saved on the host leave the device."""
    x = inputs_for(parameters_heavy)
    plain = vram_magic.estimate(parameters_heavy, x, device="cpu")
    fused = vram_magic.estimate(parameters_heavy, x, device="cpu", optimizer_in_backward=True)
    assert plain.peak["gradients"] == sum(p.numel() * 4 for p in parameters_heavy().parameters())
    assert fused.peak["gradients"] < plain.peak["gradients"] / 3 and fused.peak.total < plain.peak.total
    assert fused.peak["optimizer_state"] == plain.peak["optimizer_state"]
    y = batch()
    base = vram_magic.estimate(activations_heavy, y, device="cpu", keep_output=False)
    assert vram_magic.estimate(activations_heavy, y, device="cpu", keep_output=False, loss_chunks=4).peak.total \
        < base.peak.total
    assert vram_magic.estimate(activations_heavy, y, device="cpu", checkpointing="ops").peak["activations"] \
        < vram_magic.estimate(activations_heavy, y, device="cpu").peak["activations"]
    cuda = vram_magic.estimate(activations_heavy, y)
    host = vram_magic.estimate(activations_heavy, y, offload_activations=True)
    assert host.peak["activations"] < cuda.peak["activations"] and host.host_pinned > 0
    assert "activations on the host (not in the peak)" in host._text()


def two_linears():
    return torch.nn.Sequential(torch.nn.Linear(1000, 1000, bias=False), torch.nn.Linear(1000, 1000, bias=False))


def test_pinned_host_memory_is_counted_by_hand():
    """``save_on_cpu`` copies every tensor autograd saves into a pinned block of the next power of two. Two
    Linear(1000, 1000, bias=False) on (8, 1000): the first saves its input (32,000 bytes → 32 KiB; its weight is not
    needed, the input wanting no gradient), the second its input (32 KiB) and its weight (4,000,000 bytes → 4 MiB)."""
    est = vram_magic.estimate(two_linears, torch.randn(8, 1000), offload_activations=True, optimizer="sgd")
    assert est.host_pinned == 2 * 32 * 1024 + 4 * 1024 * 1024
    plain = vram_magic.estimate(two_linears, torch.randn(8, 1000), optimizer="sgd")
    # after the forward the device holds the output, not the hidden state autograd saved (it went to the host):
    # 32,000 bytes, in a CUDA block of 32,256 (the caching allocator's 512-byte rounding)
    assert plain.after_forward["activations"] - est.after_forward["activations"] == 32_256


def test_offload_transfers_are_timed():
    """CUDA: each saved tensor crosses PCIe down and back up, at 85 % of the link, added to the step's transfers."""
    from vram_magic.estimator.device.gpus import find_gpu
    from vram_magic.estimator.timing.cost import PCIE_EFFICIENCY
    from vram_magic.estimator.timing.step_time import micro_ops, network_for, rates_for, step_time

    gpu = find_gpu("A100-80GB")
    est = vram_magic.estimate(two_linears, torch.randn(8, 1000), offload_activations=True, optimizer="sgd",
                              gpu="A100-80GB")
    trace = est.rerun.trace(est.options)
    assert trace.offloaded == 2 * (32_000 + 32_000 + 4_000_000)
    net = network_for(gpu, 1)
    t = step_time(micro_ops(trace, rates_for("cuda", gpu)), est.options, trace, net)
    assert t.transfers == pytest.approx(trace.offloaded / (net.pcie * PCIE_EFFICIENCY))


def test_a_failing_step_says_where():
    """A step that raises names the op, the module and the line of the step."""
    def broken_step(model, batch, optimizer):
        out = model(**batch)
        loss = out.logits @ torch.ones(3, 3)  # the wrong shape
        loss.backward()

    with pytest.raises(EstimateError) as caught:
        vram_magic.estimate(activations_heavy, batch(), device="cpu", step=broken_step)
    text = str(caught.value)
    assert "your step broken_step() raised RuntimeError" in text and ("aten.matmul" in text or "aten.mm" in text)
    assert "loss = out.logits @ torch.ones(3, 3)" in text and "of broken_step" in text


def test_bad_recipes_say_what_to_do():
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    with pytest.raises(ValueError, match="is no causal LM with an output projection"):
        vram_magic.estimate(mlp, torch.randn(4, 8), loss_chunks=4)
    with pytest.raises(ValueError, match="put labels in the inputs"):
        vram_magic.estimate(activations_heavy, {"input_ids": batch()["input_ids"]}, loss_chunks=4)
    with pytest.raises(ValueError, match="settles accumulate"):
        vram_magic.estimate(mlp, torch.randn(4, 8), step=plain_step, accumulate=2)
    with pytest.raises(ValueError, match="drop loss_fn"):
        vram_magic.estimate(mlp, torch.randn(4, 8), step=plain_step, loss_fn=lambda out: out.sum())
    with pytest.raises(ValueError, match="not traced under FSDP2's own MixedPrecisionPolicy"):
        vram_magic.estimate(mlp, torch.randn(4, 8), step=plain_step, zero=3, world=2, param_dtype="bf16")
    with pytest.raises(ValueError, match="cannot take accumulate"):
        vram_magic.estimate(mlp, torch.randn(4, 8), optimizer_in_backward=True, accumulate=2)
    with pytest.raises(TypeError, match="is for step=fn"):
        vram_magic.estimate(mlp, torch.randn(4, 8), optimizer=in_backward_optimizers)
    with pytest.raises(ValueError, match="loss_chunks must be"):
        vram_magic.estimate(mlp, torch.randn(4, 8), loss_chunks=0)


def test_a_step_that_logs_its_loss():
    """A value read outside the model (``loss.item()`` for a log) is answered and said; the estimate is whole."""
    def logged(model, batch, optimizer):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"loss {loss.item():.3f}")

    est = vram_magic.estimate(activations_heavy, batch(), device="cpu", step=logged)
    assert not est.partial and any("read 2 value(s) outside the model" in n for n in est.notes)


def test_the_command_line_takes_the_recipes():
    import argparse

    from vram_magic.estimator.cli.arguments import OPTIONS, build

    parser = argparse.ArgumentParser()
    for flags, kwargs in OPTIONS:
        parser.add_argument(*flags, **kwargs)
    ns = {"model": activations_heavy, "data": batch(), "train": plain_step, "fused": in_backward_optimizers}
    args = parser.parse_args(["model", "--input", "data", "--step", "train", "--optimizer", "fused",
                              "--checkpointing", "ops", "--offload-activations"])
    _, _, kwargs = build(args, ns)
    assert kwargs["step"] is plain_step and kwargs["optimizer"] is in_backward_optimizers
    assert kwargs["checkpointing"] == "ops" and kwargs["offload_activations"] is True
    args = parser.parse_args(["model", "--input", "data", "--keep-output", "no", "--loss-chunks", "8",
                              "--optimizer-in-backward"])
    _, _, kwargs = build(args, ns)
    assert kwargs["keep_output"] is False and kwargs["loss_chunks"] == 8 and kwargs["optimizer_in_backward"]
    args = parser.parse_args(["model", "--input", "data", "--checkpointing"])
    assert build(args, ns)[2]["checkpointing"] is True


def test_the_magic_takes_a_step_from_the_namespace(shell):
    shell.run_cell("import torch\nfrom tests.estimator.test_recipes import activations_heavy, batch, trainer_step\n"
                   "data = batch()")
    result = shell.run_cell("%vram_estimate activations_heavy --input data --step trainer_step --device cpu -q -o e")
    assert result.error_in_exec is None and result.error_before_exec is None
    est = shell.user_ns["e"]
    assert est.step.startswith("your trainer_step(model, batch, optimizer)")
    direct = vram_magic.estimate(activations_heavy, batch(), device="cpu", keep_output=False)
    assert est.peak.total == direct.peak.total
