"""The report of one out-of-memory error (:class:`OomReport`), with what a CUDA device said at the failure
(:class:`CudaAtOom`). Frozen, plain numbers in bytes, never a tensor or a frame; written to and read from JSON (a
script's or a rank's report file); a report renders itself."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ..core.breakdown import Breakdown, breakdown_from_dict, breakdown_to_dict
from ..core.host import HostUsage
from ..core.rendered import Rendered
from ..engine.scan.categories import holder_name
from ..measuring.report import Advice

FORMAT = "vram_magic.oom/1"


@dataclass(frozen=True)
class CudaAtOom:
    """What a CUDA device's caching allocator held when the request failed. ``total``: the device's memory (or the
    allowed maximum under a memory fraction); ``outside``: what the CUDA context and other processes held beside
    PyTorch's reserved segments; ``largest_free``: the largest free block inside PyTorch's segments (what a request
    can be served from without a new segment); ``recent``: the allocations the cell made, by size and site where
    known; ``biggest``: the largest blocks alive, with their sites where the history kept stacks; ``what_ifs``:
    ``(setting, fits or None, margin, how, what to set)``."""

    device: str
    total: int
    free: int
    allocated: int
    reserved: int
    outside: int
    largest_free: int = 0
    inactive_split: int = 0
    alloc_retries: int = 0
    ooms: int = 0
    recent: tuple[tuple[str, int], ...] = ()
    biggest: tuple[tuple[str, int], ...] = ()
    what_ifs: tuple[tuple[str, bool | None, int, str, str], ...] = ()
    history: str = ""  # what the history covered

    @property
    def fragmented(self) -> int:
        """Bytes reserved by PyTorch but not allocated: cached, or split off blocks too small to serve."""
        return max(self.reserved - self.allocated, 0)


@dataclass(frozen=True)
class OomReport(Rendered):
    """An out-of-memory error explained. ``where``: the cell or script (and rank) it happened in; ``error``: its
    message; ``requested``: the bytes of the failed request where known; ``alive``: what was alive then, by category,
    with the variables (and the failed frames' locals) that held it in ``alive.detail``; ``cuda``: the device's side
    on CUDA; ``host``: the process's and its children's resident memory then."""

    where: str
    error: str
    device: str
    alive: Breakdown
    requested: int | None = None
    request: str = ""  # what the message says of the request where it does not pin its size down
    capacity: int | None = None
    cuda: CudaAtOom | None = None
    host: HostUsage | None = None
    advice: tuple[Advice, ...] = ()
    notes: tuple[str, ...] = ()
    rank: int | None = None
    cell: int | None = None
    time: float = 0.0
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def holders(self, top: int = 5) -> list[tuple[str, int]]:
        """The variables that held the most, largest first: ``[("model", bytes), ...]`` (a graph counts for the
        variable that holds it)."""
        rows: dict[str, int] = {}
        for _, label, n in self.alive.detail:
            name = holder_name(label)
            if name:
                rows[name] = rows.get(name, 0) + n
        return sorted(rows.items(), key=lambda kv: -kv[1])[:top]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data (``from_dict`` reads it back)."""
        return {
            "format": FORMAT, "where": self.where, "error": self.error, "device": self.device,
            "alive": breakdown_to_dict(self.alive), "requested": self.requested, "request": self.request,
            "capacity": self.capacity,
            "cuda": asdict(self.cuda) if self.cuda is not None else None,
            "host": asdict(self.host) if self.host is not None else None,
            "advice": [asdict(a) for a in self.advice], "notes": list(self.notes), "rank": self.rank,
            "cell": self.cell, "time": self.time,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OomReport:
        if d.get("format") != FORMAT:
            raise ValueError(f"not a vram_magic out-of-memory report (format {d.get('format')!r}, expected "
                             f"{FORMAT!r})")
        cuda = d.get("cuda")
        if cuda is not None:
            cuda = {**cuda, **{k: tuple(tuple(x) for x in cuda.get(k, ())) for k in ("recent", "biggest", "what_ifs")}}
        return cls(
            where=str(d["where"]), error=str(d["error"]), device=str(d["device"]),
            alive=breakdown_from_dict(d.get("alive", {})), requested=d.get("requested"), request=d.get("request", ""),
            capacity=d.get("capacity"),
            cuda=CudaAtOom(**cuda) if cuda is not None else None,
            host=HostUsage(**d["host"]) if d.get("host") else None,
            advice=tuple(Advice(**a) for a in d.get("advice", ())), notes=tuple(d.get("notes", ())),
            rank=d.get("rank"), cell=d.get("cell"), time=float(d.get("time", 0.0)))

    def _text(self) -> str:
        from .render import oom_text

        return oom_text(self)

    def _html(self) -> str:
        from .render import oom_html

        return oom_html(self)


__all__ = ["FORMAT", "CudaAtOom", "OomReport"]
