"""A measured block while it runs: :class:`LiveStatus`, what a live view shows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..core.breakdown import Breakdown


@dataclass(frozen=True)
class LiveStatus:
    """A measured block while it runs (what a live view shows; read from another thread, so approximate).

    ``now``/``peak`` are bytes on the device (``None`` where the backend only knows them at the end);
    ``breakdown`` splits ``now`` by category where the backend can tell while running: storages alive at the
    start keep the category the scan gave them, storages made since count by the phase that made them
    (forward and backward → activations, a KV cache's updates → KV cache, the rest → other). ``phase`` is the
    phase of the latest allocation; ``step`` the decode step of a ``generate()`` call under way (0: none, or
    its prefill).
    """

    device: str
    backend: str
    elapsed: float
    phase: str
    now: int | None = None
    peak: int | None = None
    breakdown: Breakdown | None = None
    step: int = 0
