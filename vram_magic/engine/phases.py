"""The phases of a step, one enumeration for the whole package, and what memory made in each counts as.

The tracker notes the phase of every allocation it sees (``Tracker.phase()``): plain cell code, a module's
forward (with or without grad), the loss (code outside any module after a forward with grad, before its backward),
backward, an optimizer step, and inside ``generate()`` the prefill, the decode steps and a KV cache's updates. The
estimator drives its built-in step itself and says which part of it runs (``StepTracer.stage``): the same phases, with
one of its own (``zero_grad``); its ``SETUP`` (the code around the step) is the tracker's ``CELL``.

Values are small integers (an :class:`~enum.IntEnum`): the tracker keeps bytes per phase in a list indexed by
them, and stores them in each allocation's record.
"""

from __future__ import annotations

from enum import IntEnum


class Phase(IntEnum):
    CELL = 0  # code outside any module's forward, backward or optimizer step
    SETUP = 0  # the estimator's name for it: the code around the traced step
    FORWARD = 1
    BACKWARD = 2
    OPTIMIZER = 3
    INFERENCE = 4  # a forward without grad
    PREFILL = 5  # generate()'s prompt
    DECODE = 6  # generate()'s decode loop
    KV_UPDATE = 7  # a KV cache's update (its growth, a reorder, a crop)
    LOSS = 8  # the loss: code outside any module after a forward with grad, before its backward
    ZERO_GRAD = 9  # the estimator's zero_grad after the optimizer step


# What each phase is called in reports and the live view, indexed by phase.
PHASE_NAMES = ("cell", "forward", "backward", "optimizer", "inference", "prefill", "decode", "cache update", "loss",
               "zero_grad")

# The phases the tracker tells apart on its own (the others are set by whoever drives the step).
TRACKED = (Phase.CELL, Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER, Phase.INFERENCE, Phase.PREFILL,
           Phase.DECODE, Phase.KV_UPDATE, Phase.LOSS)

# memory a KV cache's update made (its growth, a static layer's preallocation, a quantized layer's dequantized
# copy) that no scan found held at the end: the copies the cache replaced step by step
KV_MADE = ("kv_cache", "made by cache updates")
# what backward makes inside a module's forward: activation checkpointing running the forward again
RECOMPUTED = ("activations", "recomputed (checkpointing)")

# What an allocation that is not held at the end (freed before the end of a measured block, or a temporary of
# an estimated step) counts as, by the phase it was made in.
PHASE_CATEGORY: dict[int, tuple[str, str]] = {
    Phase.CELL: ("other", "temporaries"),
    Phase.FORWARD: ("activations", "forward intermediates"),
    # gradients of activations flowing through backward: they scale with the batch like activations do
    Phase.BACKWARD: ("activations", "activation gradients (backward)"),
    Phase.OPTIMIZER: ("other", "optimizer temporaries"),
    Phase.INFERENCE: ("activations", "forward intermediates (no grad)"),
    Phase.PREFILL: ("activations", "prefill intermediates"),
    Phase.DECODE: ("activations", "decode intermediates"),
    Phase.KV_UPDATE: KV_MADE,
    # the loss computed outside any module (inside one: forward intermediates): what it saves for backward (a chunked
    # loss's log-probabilities) is an activation
    Phase.LOSS: ("activations", "loss (outside modules)"),
    Phase.ZERO_GRAD: ("other", "zero_grad temporaries"),
}

# While a measured block runs: what memory made in each phase counts as in the live view (before the end-of-block
# scan tells which of it became gradients or optimizer state).
LIVE_PHASE_CATEGORY: dict[int, tuple[str, str]] = {
    **PHASE_CATEGORY,
    Phase.CELL: ("other", "made by the cell's code"),
    Phase.BACKWARD: ("activations", "made during backward"),
    Phase.OPTIMIZER: ("other", "made by the optimizer step"),
    Phase.PREFILL: ("activations", "made by the prefill"),
    Phase.DECODE: ("activations", "made by the decode steps"),
}


def phase_category(phase: int, module: str = "", recomputed: bool = False) -> tuple[str, str]:
    """What a temporary made in ``phase`` counts as: :data:`PHASE_CATEGORY`, where a loss computed inside a module
    (``module``: the innermost one) is that module's forward intermediates and what backward makes while it runs a
    module's forward again (``recomputed``) is :data:`RECOMPUTED`."""
    if phase == Phase.LOSS and module:
        return PHASE_CATEGORY[Phase.FORWARD]
    if phase == Phase.BACKWARD and recomputed:
        return RECOMPUTED
    return PHASE_CATEGORY.get(phase, PHASE_CATEGORY[Phase.CELL])


__all__ = ["KV_MADE", "LIVE_PHASE_CATEGORY", "PHASE_CATEGORY", "PHASE_NAMES", "RECOMPUTED", "TRACKED", "Phase",
           "phase_category"]
