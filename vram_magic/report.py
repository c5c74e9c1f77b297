"""Result types: frozen, plain numbers in bytes, never a tensor reference. They render themselves."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from operator import itemgetter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from .trace import Trace

CATEGORIES: tuple[str, ...] = ("parameters", "gradients", "optimizer_state", "activations", "kv_cache", "other")
LABELS: dict[str, str] = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "activations": "activations",
    "kv_cache": "KV cache",
    "other": "other",
}
#: categories that tables, legends and columns show only where some breakdown in view has them
OPTIONAL: frozenset[str] = frozenset({"kv_cache"})


def shown_categories(*breakdowns: Mapping[str, int] | None) -> tuple[str, ...]:
    """The categories a view of these breakdowns shows: all of them, less an optional one (the KV cache) that
    every breakdown has at zero, so views of training cells keep their five columns."""
    present = [b for b in breakdowns if b is not None]
    return tuple(c for c in CATEGORIES if c not in OPTIONAL or any(b.get(c, 0) for b in present))


@dataclass(frozen=True)
class Breakdown(Mapping[str, int]):
    """Bytes per category; the six categories (``kv_cache`` zero where nothing generates) add up to :attr:`total`.

    ``detail`` refines them: ``(category, label, bytes)`` rows such as ``("other", "x", 4096)`` for a tensor
    held by the variable ``x`` or ``("activations", "graph held by loss", ...)``.
    """

    parameters: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    activations: int = 0
    kv_cache: int = 0
    other: int = 0
    detail: tuple[tuple[str, str, int], ...] = ()

    def __getitem__(self, key: str) -> int:
        if key not in CATEGORIES:
            raise KeyError(key)
        return int(getattr(self, key))

    def __iter__(self) -> Iterator[str]:
        return iter(CATEGORIES)

    def __len__(self) -> int:
        return len(CATEGORIES)

    @property
    def total(self) -> int:
        return sum(self[c] for c in CATEGORIES)

    @property
    def trainable(self) -> int:
        """Bytes of parameters that train: all of them less the rows named frozen (``requires_grad=False``, and
        quantized weights, which never train)."""
        return self.parameters - sum(n for c, label, n in self.detail if c == "parameters" and "(frozen" in label)

    def details(self, category: str | None = None) -> dict[str, int]:
        """``{label: bytes}`` of the detail rows, optionally of one category only."""
        out: dict[str, int] = {}
        for cat, label, n in self.detail:
            if category is None or cat == category:
                out[label] = out.get(label, 0) + n
        return out

    def __sub__(self, other: Breakdown) -> Breakdown:
        rows: dict[tuple[str, str], int] = {}
        for cat, label, n in self.detail:
            rows[(cat, label)] = rows.get((cat, label), 0) + n
        for cat, label, n in other.detail:
            rows[(cat, label)] = rows.get((cat, label), 0) - n
        return Breakdown(
            **{c: self[c] - other[c] for c in CATEGORIES},
            detail=tuple((c, lab, n) for (c, lab), n in rows.items() if n),
        )

    @classmethod
    def from_rows(cls, rows: Mapping[tuple[str, str], int]) -> Breakdown:
        """Build from ``{(category, label): bytes}``."""
        sums = dict.fromkeys(CATEGORIES, 0)
        for (cat, _), n in rows.items():
            sums[cat] += n
        detail = tuple(sorted([(c, lab, n) for (c, lab), n in rows.items() if n], key=itemgetter(2), reverse=True))
        return cls(**sums, detail=detail)

    def as_dict(self) -> dict[str, int]:
        return {c: self[c] for c in CATEGORIES}


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
