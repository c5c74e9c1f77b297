"""The report of one measured cell (:class:`CellReport`) with the parts that live only in one: the state at its
out-of-memory failure (:class:`OomInfo`) and its suggestions (:class:`Advice`). Frozen, plain numbers in bytes, never
a tensor reference; a report renders itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..core.rendered import Rendered

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ..core.breakdown import Breakdown
    from ..core.device_stats import DeviceStats
    from ..core.events import Trace
    from ..core.host import HostUsage


@dataclass(frozen=True)
class Advice:
    """One actionable suggestion, ranked by the bytes it would save."""

    title: str
    detail: str
    saving: int = 0
    concerns: str = ""
    kind: str = ""

    def __str__(self) -> str:
        from ..core.units import format_bytes

        save = f" (saves ~{format_bytes(self.saving)})" if self.saving else ""
        return f"{self.title}{save}: {self.detail}"


@dataclass(frozen=True)
class OomInfo:
    """The state at an out-of-memory failure."""

    message: str
    requested: int | None
    capacity: int | None
    live: Breakdown
    holders: tuple[tuple[str, int], ...] = ()
    site: tuple[tuple[str, int, str], ...] = ()
    phase: str = ""  # where the failing request was made: forward, backward, optimizer, cell, prefill, decode, ...

    def __bool__(self) -> bool:
        return True


@dataclass(frozen=True)
class CellReport(Rendered):
    """Memory of one measured cell (or ``with vram_magic.measure()`` block).

    ``before``/``after``/``peak`` are :class:`Breakdown` mappings; ``delta`` is ``after`` minus the previous
    measured cell's ``after`` (minus ``before`` for the first one).
    """

    device: str
    before: Breakdown
    after: Breakdown
    peak: Breakdown
    delta: Breakdown
    cell: int | None = None
    previous: int | None = None
    wall_time: float = 0.0
    capacity: int | None = None
    budget: int | None = None
    stats: DeviceStats | None = None
    error: str | None = None
    oom: OomInfo | None = None
    advice: tuple[Advice, ...] = ()
    notes: tuple[str, ...] = ()
    source: str = ""
    trace: Trace | None = field(default=None, repr=False, compare=False)
    backend: str = "tracker"  # which backend measured: "tracker" (dispatch level) or "allocator"
    host: HostUsage | None = None  # the process's and its children's resident memory (None: no /proc here)

    @property
    def total(self) -> int:
        return self.after.total

    @property
    def experts(self) -> dict[str, int]:
        """A mixture of experts' routed experts at the cell's peak: bytes of their parameters, gradients and optimizer
        state (``peak.experts``; zeros for a dense model)."""
        return self.peak.experts

    def timeline(self, top: int = 3) -> Figure:
        """Memory over the cell's allocation events, stacked by category, as a matplotlib ``Figure``."""
        from .render.timeline import timeline_figure

        return timeline_figure(self, top=top)

    def save_snapshot(self, path: str) -> str:
        """Write the cell's allocation history as a PyTorch memory-snapshot pickle; returns the path."""
        from .snapshot import save_snapshot

        return save_snapshot(self, path)

    def peak_sites(self, top: int = 5) -> list[tuple[str, int]]:
        """The user code lines whose allocations were alive at the peak: ``[("cell:3 in f", bytes), ...]``."""
        if self.trace is None:
            return []
        return self.trace.sites_at(self.trace.peak_index, top=top)

    def peak_modules(self, top: int = 5) -> list[tuple[str, int]]:
        """The modules whose forward allocated what was alive at the peak: ``[("model.0", bytes), ...]``."""
        if self.trace is None:
            return []
        return self.trace.modules_at(self.trace.peak_index, top=top)

    def _text(self) -> str:
        from .render.text import report_text

        return report_text(self)

    def _html(self) -> str:
        from .render.html import report_html

        return report_html(self)
