"""What each block of a measured block's history counts as: shared by both backends.

A block alive at the end belongs to whoever the namespace scan says holds it; one freed before the end keeps
the role an optimizer step or the allocator's scopes revealed (a gradient, optimizer state, a tensor saved for
backward), or else counts by the phase that made it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .tracker import BACKWARD, CELL, DECODE, FORWARD, INFERENCE, KV_UPDATE, OPTIMIZER, PREFILL

UNATTRIBUTED = ("other", "unattributed")
# memory a KV cache's update made (its growth, a static layer's preallocation, a quantized layer's dequantized
# copy) that no scan found held at the end: the copies the cache replaced step by step
KV_MADE = ("kv_cache", "made by cache updates")
# freed blocks made at the line that made a hand-written decoder's cache (its earlier, replaced copies)
KV_SAME_LINE = ("kv_cache", "earlier copies (the cache's line)")

# What an allocation freed before the cell ended counts as, by the phase it was made in.
PHASE_CATEGORY = {
    FORWARD: ("activations", "forward intermediates"),
    INFERENCE: ("activations", "forward intermediates (no grad)"),
    # gradients of activations flowing through backward: they scale with the batch like activations do
    BACKWARD: ("activations", "activation gradients (backward)"),
    OPTIMIZER: ("other", "optimizer temporaries"),
    CELL: ("other", "temporaries"),
    PREFILL: ("activations", "prefill intermediates"),
    DECODE: ("activations", "decode intermediates"),
    KV_UPDATE: KV_MADE,
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
    PREFILL: ("activations", "made by the prefill"),
    DECODE: ("activations", "made by the decode steps"),
    KV_UPDATE: ("kv_cache", "made by cache updates"),
}

_NOT_VARIABLES = {label for _, label in PHASE_CATEGORY.values()} | {"unattributed", "", UNSCOPED[1],
                                                                     "saved for backward", KV_SAME_LINE[1]}


def kv_cache_sites(allocs: Mapping[int, tuple[Any, ...]], alive: Mapping[int, int],
                   owner: Callable[[int], tuple[str, str] | None]) -> set[int]:
    """``id()`` of the (interned) sites whose allocations, made in the block, ended held by a hand-written KV cache:
    the line of a decoder that grows its cache (``torch.cat([past_k, k])``). Blocks made there and freed before the
    end are the copies the cache replaced step by step: KV cache too (``KV_SAME_LINE``).

    A site counts only where every block made there was made in a module that also made a block of the cache: a
    decoder from a library has no lines of the user's inside it, so all its allocations share the line that
    called it, in every module (its MLPs' too), and that line is not the cache's. A Hugging Face cache's blocks
    are made in its updates (``KV_UPDATE``) and need no site."""
    modules: dict[int, set[int]] = {}
    for serial, (_, phase, site, module) in allocs.items():
        if not site or phase == KV_UPDATE:
            continue
        key = alive.get(serial)
        cat = owner(key) if key is not None else None
        if cat is not None and cat[0] == "kv_cache":
            modules.setdefault(id(site), set()).add(module)
    if not modules:
        return set()
    sites = set(modules)
    for _, _, site, module in allocs.values():
        if site and id(site) in sites and module not in modules[id(site)]:
            sites.discard(id(site))
    return sites


def holder_name(label: str) -> str:
    """The variable behind a detail label (``graph held by loss`` → ``loss``); "" for labels that name none."""
    if label in _NOT_VARIABLES or label.startswith(("buffers of ", "output cache ", "held by the graph of ",
                                                    "gradients (", "allocator")):
        return ""
    if label.startswith("graph held by "):
        return label[len("graph held by "):]
    return label
