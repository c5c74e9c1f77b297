"""The recipes' levers as a plan's choices (``estimator/step/recipes/``): an optimizer stepping inside backward, the
activations saved on the host, the loss in chunks and op-level checkpointing. None changes the training's math; each
costs time (the levers' ops are in their traces: the per-parameter updates, the recomputed ops, the chunked head;
offload's PCIe copies are added, ``timing/cost.activation_transfers``), and some host memory or complexity, which the
rows say.

A plan searches them when no classic combination fits (or always, with ``allow="recipes"``): every non-empty set of
the levers that apply (activations on the host only on CUDA, where the host is not the device; an optimizer in backward
only without accumulation), each with no checkpointing, every block's or op-level checkpointing, with the layouts,
precisions and optimizers of the classic search. A model the chunked loss does not apply to (no causal LM head, no
labels) makes its combinations unfit, as a model that does not split makes tensor parallelism's.
"""

from __future__ import annotations

from itertools import combinations
from typing import Any

#: torchtune's default number of chunks (``LinearCrossEntropyLoss(num_output_chunks=8)``)
LOSS_CHUNKS = 8
IN_BACKWARD, OFFLOAD_ACTIVATIONS, CHUNKED_LOSS = "in_backward", "offload_activations", "loss_chunks"


def lever_options(levers: tuple[str, ...], checkpointing: Any) -> dict[str, Any]:
    """The :class:`~vram_magic.estimator.options.Options` fields of a choice's levers."""
    return {"optimizer_in_backward": IN_BACKWARD in levers, "offload_activations": OFFLOAD_ACTIVATIONS in levers,
            "loss_chunks": LOSS_CHUNKS if CHUNKED_LOSS in levers else 1,
            "checkpoint_ops": "ops" if checkpointing == "ops" else None}


def lever_kwargs(levers: tuple[str, ...], checkpointing: Any) -> dict[str, Any]:
    """The :func:`vram_magic.estimate` keyword arguments of a choice's levers."""
    out: dict[str, Any] = {}
    if IN_BACKWARD in levers:
        out["optimizer_in_backward"] = True
    if OFFLOAD_ACTIVATIONS in levers:
        out["offload_activations"] = True
    if CHUNKED_LOSS in levers:
        out["loss_chunks"] = LOSS_CHUNKS
    if checkpointing == "ops":
        out["checkpointing"] = "ops"
    return out


def lever_choices(make: Any, base: Any, per_rank: int, layouts: list[tuple[int | None, bool]], precisions: list[Any],
                  optimizers: list[Any], micro_sizes: Any) -> list[Any]:
    """Every combination with levers: ``make(micro, accumulate, checkpointing, zero, offload, amp, optimizer,
    levers)`` builds each (``planner.Choice``)."""
    names = [IN_BACKWARD, CHUNKED_LOSS] + ([OFFLOAD_ACTIVATIONS] if base.device == "cuda" else [])
    sets: list[tuple[str, ...]] = [s for n in range(1, len(names) + 1) for s in combinations(names, n)]
    out = []
    for levers in [(), *sets]:
        micros = [per_rank] if IN_BACKWARD in levers else micro_sizes(per_rank)
        for micro in micros:
            for ck in ([False, True, "ops"] if levers else ["ops"]):
                for amp in precisions:
                    for optimizer in optimizers:
                        for zero, offload in layouts:
                            out.append(make(micro, per_rank // micro, ck, zero, offload, amp, optimizer, levers))
    return out


def lever_facts(c: Any, changes: list[str], code: list[str], trade: list[str]) -> None:
    """What ``c``'s levers change, their code and what they cost besides time (none changes the numerics)."""
    if c.checkpointing == "ops":
        changes.append("op-level checkpointing")
        code.append("from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts\n"
                    "def policy(ctx, op, *args, **kwargs):  # torchtitan's op SAC: save matmul and attention outputs\n"
                    "    return CheckpointPolicy.MUST_SAVE if op in save_list else CheckpointPolicy.PREFER_RECOMPUTE\n"
                    "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False,\n"
                    "    'context_fn': lambda: create_selective_checkpoint_contexts(policy)})")
        trade.append("op-level checkpointing: the blocks' pointwise ops (and every second matmul) run again in the "
                     "backward; a policy to maintain per model")
    if IN_BACKWARD in c.levers:
        changes.append("optimizer in backward")
        if c.offload:
            code.append("from torchao.optim import CPUOffloadOptimizer  # state on the host, gradients sent at once\n"
                        "optimizer = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW,\n"
                        "                                offload_gradients=True)")
        else:
            code.append("optimizers = {p: torch.optim.AdamW([p]) for p in model.parameters()}\n"
                        "def step(p): optimizers[p].step(); optimizers[p].zero_grad()\n"
                        "for p in model.parameters(): p.register_post_accumulate_grad_hook(step)\n"
                        "# the training loop: loss.backward() only (no optimizer.step())")
        trade.append("optimizer in backward: no gradient accumulation and no clipping by the global norm (no moment "
                     "sees every gradient); one optimizer per parameter to checkpoint and schedule")
    if CHUNKED_LOSS in c.levers:
        changes.append(f"loss in {LOSS_CHUNKS} chunks")
        code.append("from torchtune.modules.loss import LinearCrossEntropyLoss  # or its loop, written out\n"
                    f"loss_fn = LinearCrossEntropyLoss(num_output_chunks={LOSS_CHUNKS})\n"
                    "hidden = model.model(input_ids=ids).last_hidden_state  # the forward stops before the head\n"
                    "loss = loss_fn(hidden, shifted_labels)  # with loss_fn.linear_projection = model.lm_head")
        trade.append(f"loss in chunks: the head runs as {LOSS_CHUNKS} smaller matmuls; the training loop calls the "
                     "decoder and the loss itself, not model(**batch).loss")
    if OFFLOAD_ACTIVATIONS in c.levers:
        changes.append("activations on the host")
        code.append("with torch.autograd.graph.save_on_cpu(pin_memory=True):\n    loss = model(**batch).loss\n"
                    "loss.backward()")
        trade.append("activations on the host: pinned host memory for every tensor saved for backward, and each "
                     "crosses PCIe twice a step (timed with no overlap; torchtune's OffloadActivations overlaps it)")


__all__ = ["CHUNKED_LOSS", "IN_BACKWARD", "LOSS_CHUNKS", "OFFLOAD_ACTIVATIONS", "lever_choices", "lever_facts",
           "lever_kwargs", "lever_options"]
