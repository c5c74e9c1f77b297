"""``loss_chunks=N``: a transformers causal LM's loss computed from its hidden states chunk by chunk, as torchtune's
``LinearCrossEntropyLoss`` does (``torchtune/modules/loss/cross_entropy_loss.py``; its ``CEWithChunkedOutputLoss``
before it chunked the logits the same way).

The step runs the decoder (``model.base_model``, e.g. ``model.model``) for the hidden states, shifts the labels as a
causal LM's loss does (``labels[..., 1:]``, the last position ``-100``), and splits both into N chunks along the
sequence. For each chunk: the positions whose label is not ``-100`` are selected (``hidden[mask]``, a copy), the head
(``model.get_output_embeddings()``) makes their logits, and ``F.cross_entropy(logits.float(), labels, reduction="sum")``
adds to the loss, which is divided by the number of valid labels at the end.

What it holds, as PyTorch runs it (no recomputation: torchtune does none): the full-vocabulary logits of the whole batch
never exist at once, and neither does their fp32 upcast — one chunk's at a time, freed before the next. What each chunk
saves for backward stays until the backward: its selected hidden states (for the head's weight gradient) and its
log-softmax in fp32 (for the cross-entropy's), so the fp32 log-probabilities of every valid token, the size of fp32
logits, are alive at the end of the forward. The backward then goes chunk by chunk: one chunk's gradients of the
log-probabilities and logits at a time, where the whole loss would make the whole batch's. Liger's fused kernel, which
computes the gradient in the forward and saves no logits at all, is another recipe (a Triton kernel, not modelled).

Where the labels' values are unknown (inputs made on fake tensors by a builder), every position is taken as valid but
the last of each row (the shift's pad), and the estimate says so.

A model the lever does not fit (no output projection, no base model returning ``last_hidden_state``, no ``labels`` in
the inputs) is refused with a ``ValueError`` that says why.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...fake.known_values import attach, value_of
from ...torch_private import disable_current_modes

IGNORE = -100
UNKNOWN_LABELS = ("loss in chunks: the labels' values are unknown (made on fake tensors), so every position was taken "
                  "as valid but the last of each row (the shift's pad); padding or prompt tokens masked with -100 "
                  "would make each chunk's selection smaller")


def chunked_cross_entropy(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, chunks: int) -> torch.Tensor:
    """torchtune's ``LinearCrossEntropyLoss.forward`` on ``hidden`` ``(batch, seq, dim)`` and shifted ``labels``
    ``(batch, seq)``: the mean cross-entropy of the valid labels, the head run chunk by chunk."""
    mask = labels != IGNORE
    total_elements = mask.sum()
    total_loss: Any = 0.0
    for hidden_chunk, target_chunk in zip(hidden.tensor_split(chunks, dim=1), labels.tensor_split(chunks, dim=1)):
        mask_chunk = target_chunk != IGNORE
        if mask_chunk.sum() == 0:  # torchtune unmasks one token so that every rank computes a loss
            mask_chunk[0] = True
        target_chunk = target_chunk[mask_chunk]
        logits = head(hidden_chunk[mask_chunk])
        total_loss += F.cross_entropy(logits.float(), target_chunk, reduction="sum", ignore_index=IGNORE)
    return total_loss / total_elements


def shifted(labels: torch.Tensor) -> torch.Tensor:
    """The labels a causal LM's loss compares position t with: those of t + 1, the last ``-100``."""
    return F.pad(labels, (0, 1), value=IGNORE)[..., 1:]


class ChunkedLoss:
    """The lever on one fake model: its decoder, its head and the number of chunks."""

    def __init__(self, base: nn.Module, head: nn.Module, chunks: int, notes: list[str]) -> None:
        self.base, self.head, self.chunks, self.notes = base, head, chunks, notes

    @classmethod
    def of(cls, model: nn.Module, chunks: int, inputs: Any) -> ChunkedLoss:
        """The lever for ``model``; ``ValueError`` naming what is missing where it does not apply."""
        get = getattr(model, "get_output_embeddings", None)
        head = get() if callable(get) else None
        base = getattr(model, "base_model", None)
        generates = getattr(model, "can_generate", None)  # transformers: a causal LM can, a masked LM cannot
        causal = not callable(generates) or bool(generates())
        if not isinstance(head, nn.Linear) or not isinstance(base, nn.Module) or base is model or not causal:
            raise ValueError(f"loss_chunks computes a causal LM's loss from its hidden states: {type(model).__name__} "
                             "is no causal LM with an output projection (get_output_embeddings() returning a Linear) "
                             "beside a base model that returns the hidden states (a transformers *ForCausalLM has "
                             "both); write the chunked loss into step= instead")
        if not isinstance(inputs, Mapping) or "labels" not in inputs:
            raise ValueError("loss_chunks computes the causal LM loss from the labels: put labels in the inputs "
                             "(e.g. {'input_ids': ids, 'labels': ids})")
        notes = []
        config = getattr(model, "config", None)
        for attr in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
            if getattr(config, attr, None) not in (None, 1, 1.0):
                notes.append(f"loss in chunks: the model's {attr} (applied after its head) is not in the chunked loss, "
                             "as torchtune's LinearCrossEntropyLoss leaves it out")
        return cls(base, head, chunks, notes)

    def forward_loss(self, inputs: Mapping[str, Any], loss_stage: Any) -> tuple[Any, torch.Tensor]:
        """``(the decoder's output, the loss)``: the decoder on the inputs but the labels (no cache asked for), then the
        chunked loss; ``loss_stage()`` is called between the two."""
        kwargs = {k: v for k, v in inputs.items() if k != "labels"}
        if "use_cache" in _parameters(self.base):
            kwargs["use_cache"] = False
        out = self.base(**kwargs)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        loss_stage()
        labels = shifted(inputs["labels"])
        if value_of(labels) is None:  # the mask decides the selected rows' shapes: every label valid but the pad
            with disable_current_modes():
                assumed = torch.zeros(tuple(labels.shape), dtype=labels.dtype)
                assumed[..., -1] = IGNORE
            attach(labels, assumed)
            if UNKNOWN_LABELS not in self.notes:
                self.notes.append(UNKNOWN_LABELS)
        return out, chunked_cross_entropy(self.head, hidden, labels, self.chunks)

    def describe(self) -> str:
        return (f"loss in {self.chunks} chunks (torchtune's LinearCrossEntropyLoss): hidden = model.base_model(...); "
                "per chunk of the sequence the valid positions' logits and their fp32 cross-entropy, summed; each "
                "chunk's log-softmax (fp32) saved for backward, no recomputation")


def _parameters(module: nn.Module) -> Any:
    try:
        return inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return {}


__all__ = ["IGNORE", "ChunkedLoss", "chunked_cross_entropy", "shifted"]
