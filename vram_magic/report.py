"""Result types: frozen, plain numbers in bytes, never a tensor reference. They render themselves."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from .trace import Trace

from .breakdown import CATEGORIES as CATEGORIES
from .breakdown import LABELS as LABELS
from .breakdown import OPTIONAL as OPTIONAL
from .breakdown import Breakdown as Breakdown
from .breakdown import shown_categories as shown_categories


@dataclass(frozen=True)
class DeviceStats:
    """What the device itself says. On CUDA this reconciles with nvidia-smi:
    ``used_by_process ≈ reserved + cuda_context_and_other``."""

    device: str
    allocated: int
    reserved: int | None = None
    total: int | None = None
    free: int | None = None
    inactive_split: int | None = None
    peak_allocated: int | None = None

    @property
    def used(self) -> int | None:
        """Bytes in use on the whole device (what nvidia-smi shows for all processes)."""
        if self.total is None or self.free is None:
            return None
        return self.total - self.free

    @property
    def outside_allocator(self) -> int | None:
        """CUDA context, other libraries and other processes: used minus PyTorch's reserved."""
        if self.used is None or self.reserved is None:
            return None
        return max(self.used - self.reserved, 0)

    @property
    def cached(self) -> int | None:
        """Reserved by PyTorch's caching allocator but not holding a tensor."""
        return None if self.reserved is None else self.reserved - self.allocated


@dataclass(frozen=True)
class Advice:
    """One actionable suggestion, ranked by the bytes it would save."""

    title: str
    detail: str
    saving: int = 0
    concerns: str = ""
    kind: str = ""

    def __str__(self) -> str:
        from .units import format_bytes

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


@dataclass(frozen=True)
class CellReport:
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

    @property
    def total(self) -> int:
        return self.after.total

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

    def __str__(self) -> str:
        from .render.text import report_text

        return report_text(self)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        from .render.html import report_html
        from .render.text import report_text

        return {"text/plain": report_text(self), "text/html": report_html(self)}

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))
