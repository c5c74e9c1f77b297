"""What each block of a measured block's history counts as: shared by both backends.

A block alive at the end belongs to whoever the namespace scan says holds it; one freed before the end keeps
the role an optimizer step or the allocator's scopes revealed (a gradient, optimizer state, a tensor saved for
backward), or else counts by the phase that made it.
"""

from __future__ import annotations

from .tracker import BACKWARD, CELL, FORWARD, INFERENCE, OPTIMIZER

UNATTRIBUTED = ("other", "unattributed")

# What an allocation freed before the cell ended counts as, by the phase it was made in.
PHASE_CATEGORY = {
    FORWARD: ("activations", "forward intermediates"),
    INFERENCE: ("activations", "forward intermediates (no grad)"),
    # gradients of activations flowing through backward: they scale with the batch like activations do
    BACKWARD: ("activations", "activation gradients (backward)"),
    OPTIMIZER: ("other", "optimizer temporaries"),
    CELL: ("other", "temporaries"),
}

# The allocator backend cannot tell a module's forward from other code of the cell: what it made outside
# backward and the optimizer step, and freed before the end, is named so.
UNSCOPED = ("activations", "forward and cell temporaries")

# While the block runs: what memory made in each phase counts as in the live view (before the end-of-block scan
# tells which of it became gradients or optimizer state).
LIVE_PHASE_CATEGORY = {
    FORWARD: ("activations", "forward intermediates"),
    INFERENCE: ("activations", "forward intermediates (no grad)"),
    BACKWARD: ("activations", "made during backward"),
    OPTIMIZER: ("other", "made by the optimizer step"),
    CELL: ("other", "made by the cell's code"),
}

_NOT_VARIABLES = {label for _, label in PHASE_CATEGORY.values()} | {"unattributed", "", UNSCOPED[1],
                                                                     "saved for backward"}


def holder_name(label: str) -> str:
    """The variable behind a detail label (``graph held by loss`` → ``loss``); "" for labels that name none."""
    if label in _NOT_VARIABLES or label.startswith(("buffers of ", "output cache ", "held by the graph of ",
                                                    "gradients (", "allocator")):
        return ""
    if label.startswith("graph held by "):
        return label[len("graph held by "):]
    return label
