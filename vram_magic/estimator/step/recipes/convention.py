"""The step an estimate assumed, in words: what stays alive when.

The built-in step keeps the model's output alive through backward by default (``keep_output=True``)::

    out = model(**batch); loss = out.loss; loss.backward(); optimizer.step(); optimizer.zero_grad()

which is how a notebook's loop is usually written, and the larger of the two conventions: measured on 48 tiny
transformers configurations, it needs 4–13 % more than ``model(**batch).loss.backward()`` (Hugging Face's Trainer),
which frees the output (its logits, and the KV cache a model returns in training: GPT-2, Gemma-2/3, Falcon, BigCode, T5)
before backward. An estimate that says "fits" should not be the smaller one, so that is the default;
``keep_output=False`` estimates the Trainer's step, and ``step=fn`` settles it exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

KEPT = "the output kept alive through backward (keep_output=True, the default; keep_output=False frees it first, as " \
       "Hugging Face's Trainer does)"
DROPPED = "the output freed before backward, as Hugging Face's Trainer does (keep_output=False)"


def call_of(specs: Any) -> str:
    """How the step calls the model on the inputs."""
    if isinstance(specs, Mapping):
        return "model(**batch)"
    if isinstance(specs, (tuple, list)) and not hasattr(specs, "_fields"):
        return "model(*batch)"
    return "model(batch)"


def loss_of(used: str) -> str:
    """The loss as code, from what the step trained on (``step/loss.py``'s words)."""
    if not used or used.startswith("the model's own"):
        return "out.loss"
    if used.startswith("loss_fn"):
        return "loss_fn(out)"
    return used.replace("output", "out")


def step_words(opts: Any, specs: Any, loss_used: str, user: Any = None, chunked: Any = None) -> str:
    """The step of ``opts`` in one line: its code and what it keeps alive."""
    if opts.inference:
        return f"one forward under torch.inference_mode(): {call_of(specs)}"
    if opts.pp > 1:
        return (f"the {opts.schedule} pipeline schedule over {opts.micro_batches or opts.pp} micro-batches, as "
                "torch.distributed.pipelining runs each stage's forwards and backwards, then optimizer.step()")
    if user is not None:
        return (f"your {user.name}(model, batch, optimizer), traced exactly as written, {opts.steps} times (the first "
                "makes the optimizer's state); its stages read as %%vram reads a cell")
    update = "" if opts.optimizer_in_backward else "; optimizer.step(); optimizer.zero_grad()"
    if chunked is not None:
        forward, loss, call = ("out = model.base_model(**inputs); loss = chunked_cross_entropy(out.last_hidden_state, "
                               f"labels, {opts.loss_chunks})"), "loss", ""
    else:
        call, loss = call_of(specs), loss_of(loss_used)
        forward = f"out = {call}; loss = {loss}"
    if opts.keep_output:
        backward = f"{forward}; loss.backward()"
    else:
        backward = (loss.replace("out", call, 1) if call else forward + "; del out; loss") + ".backward()"
    if opts.optimizer_in_backward:
        backward += " (each parameter's optimizer stepping inside it)"
    if opts.accumulate > 1:
        backward = f"for each of {opts.accumulate} micro-batches: {backward}, then"
        update = update.replace("; ", " ", 1)
    text = f"{backward}{update} — {KEPT if opts.keep_output else DROPPED}"
    if opts.offload_activations:
        text += "; the forward under save_on_cpu(pin_memory=True)"
    return text


__all__ = ["DROPPED", "KEPT", "call_of", "loss_of", "step_words"]
