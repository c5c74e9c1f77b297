"""What each block of a measured block's history counts as: shared by both backends.

A block alive at the end belongs to whoever the namespace scan says holds it; one freed before the end keeps
the role an optimizer step or the allocator's scopes revealed (a gradient, optimizer state, a tensor saved for
backward), or else counts by the phase that made it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ...core.breakdown import EXPERTS
from ..phases import KV_MADE, LIVE_PHASE_CATEGORY, PHASE_CATEGORY, TRACKED, Phase

UNATTRIBUTED = ("other", "unattributed")
# freed blocks made at the line that made a hand-written decoder's cache (its earlier, replaced copies)
KV_SAME_LINE = ("kv_cache", "earlier copies (the cache's line)")

# The allocator backend cannot tell a module's forward from other code of the cell: what it made outside
# backward and the optimizer step, and freed before the end, is named so.
UNSCOPED = ("activations", "forward and cell temporaries")

# (PHASE_CATEGORY and LIVE_PHASE_CATEGORY, what memory made in each phase counts as, are phases.py's)
# the labels of a measured block's phases name no variable (a variable may be called "loss": the loss phase's label
# says more)
_NOT_VARIABLES = {PHASE_CATEGORY[p][1] for p in TRACKED} | {"unattributed", "", UNSCOPED[1],
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
        if not site or phase == Phase.KV_UPDATE:
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
    """The variable behind a detail label (``graph held by loss`` → ``loss``, ``model (experts)`` → ``model``); ""
    for labels that name none."""
    label = label.removesuffix(EXPERTS)
    if label in _NOT_VARIABLES or label.startswith(("buffers of ", "output cache ", "held by the graph of ",
                                                    "gradients (", "allocator")):
        return ""
    if label.startswith("graph held by "):
        return label[len("graph held by "):]
    return label


__all__ = ["KV_MADE", "KV_SAME_LINE", "LIVE_PHASE_CATEGORY", "PHASE_CATEGORY", "UNATTRIBUTED", "UNSCOPED",
           "holder_name", "kv_cache_sites"]
