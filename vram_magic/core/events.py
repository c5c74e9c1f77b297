"""The allocation history of one cell: one event model for CPU and CUDA, replayed for peak and timeline."""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from .breakdown import CATEGORIES, Breakdown

Frame = tuple[str, int, str]  # (filename, line, function)


class Block(NamedTuple):
    """One storage seen during the cell (or alive when it started). A named tuple: a cell makes one per
    allocation, and tuples are built several times faster than frozen dataclasses."""

    serial: int
    size: int
    category: str
    label: str
    site: tuple[Frame, ...] = ()
    phase: str = ""  # "forward", "backward", "optimizer", "cell" for allocations made during the cell
    module: str = ""  # the innermost module whose forward made it ("model.layers.3.mlp"), if any


@dataclass(frozen=True)
class Trace:
    """``events`` holds ``+serial`` for an allocation and ``-serial`` for a free, in order.

    ``initial`` are the serials alive before the first event that the cell frees (or that changed hands);
    ``base`` sums, as ``(category, label, bytes)`` rows, the storages alive throughout the cell — they are
    constant, so they need no block each. ``peak_index`` is the number of events applied when memory was
    highest (0: the peak is the start). ``steps``: ``(event index, stage, step)`` where each stage of a
    ``generate()`` call began (``prefill`` with step 0, ``decode`` with its step number, ``cell`` where a call
    ended).
    """

    device: str
    blocks: Mapping[int, Block]
    initial: tuple[int, ...]
    events: array = field(default_factory=lambda: array("q"))
    peak_index: int = 0
    truncated: bool = False
    base: tuple[tuple[str, str, int], ...] = ()
    steps: tuple[tuple[int, str, int], ...] = ()

    def alive_at(self, index: int) -> set[int]:
        return alive_after(self.initial, self.events, index)

    def breakdown_at(self, index: int) -> Breakdown:
        rows: dict[tuple[str, str], int] = {}
        for cat, label, n in self.base:
            rows[(cat, label)] = rows.get((cat, label), 0) + n
        for serial in self.alive_at(index):
            b = self.blocks[serial]
            rows[(b.category, b.label)] = rows.get((b.category, b.label), 0) + b.size
        return Breakdown.from_rows(rows)

    def totals(self) -> dict[str, list[int]]:
        """Bytes per category after each event, starting with the state before the first event."""
        current = dict.fromkeys(CATEGORIES, 0)
        for cat, _, n in self.base:
            current[cat] += n
        for s in self.initial:
            current[self.blocks[s].category] += self.blocks[s].size
        series: dict[str, list[int]] = {c: [current[c]] for c in CATEGORIES}
        for ev in self.events:
            b = self.blocks[abs(ev)]
            current[b.category] += b.size if ev > 0 else -b.size
            for c in CATEGORIES:
                series[c].append(current[c])
        return series

    def sites_at(self, index: int, top: int = 5) -> list[tuple[str, int]]:
        """Bytes alive at ``index`` grouped by the innermost user frame that allocated them."""
        by_site: dict[str, int] = {}
        for serial in self.alive_at(index):
            b = self.blocks[serial]
            if not b.site:
                continue
            key = format_frame(b.site[0])
            by_site[key] = by_site.get(key, 0) + b.size
        return sorted(by_site.items(), key=lambda kv: -kv[1])[:top]

    def modules_at(self, index: int, top: int = 5) -> list[tuple[str, int]]:
        """Bytes alive at ``index`` grouped by the module whose forward allocated them."""
        by_module: dict[str, int] = {}
        for serial in self.alive_at(index):
            b = self.blocks[serial]
            if b.module:
                by_module[b.module] = by_module.get(b.module, 0) + b.size
        return sorted(by_module.items(), key=lambda kv: -kv[1])[:top]

    def phases(self) -> dict[str, int]:
        """Bytes allocated during the cell per phase (``forward``, ``backward``, ``optimizer``, ``cell``)."""
        out: dict[str, int] = {}
        for b in self.blocks.values():
            if b.phase:
                out[b.phase] = out.get(b.phase, 0) + b.size
        return out

    def largest_allocations(self, top: int = 3) -> list[tuple[int, Block]]:
        """``[(event_index, block), ...]`` of the largest allocations made during the cell."""
        allocs = [(i, self.blocks[ev]) for i, ev in enumerate(self.events) if ev > 0]
        allocs.sort(key=lambda ib: -ib[1].size)
        return allocs[:top]


class Peak(NamedTuple):
    """The highest level a stream of allocation events reaches: ``level`` bytes, first reached once ``index`` deltas
    were applied (0: the start)."""

    level: int
    index: int


def peak_of(deltas: Iterable[int], start: int = 0, *, spikes: Mapping[int, int] | None = None,
            skip: range = range(0)) -> Peak:
    """The peak of a level that starts at ``start`` bytes and changes by each of ``deltas`` in turn (``+size`` an
    allocation, ``-size`` a free, 0 an event that changes nothing): the first time the highest level is reached.

    ``spikes``: bytes alive only at one index (after that many deltas: kernel scratch, a collective's buffer), added to
    the level there and not carried on. ``skip``: indices whose level is not a candidate (a stretch that is left out
    of the peak); the level still moves through them."""
    level = peak = start
    at = 0
    if spikes is None and not skip:  # the common case, kept to one comparison per event
        for i, d in enumerate(deltas, 1):
            level += d
            if level > peak:
                peak, at = level, i
        return Peak(peak, at)
    for i, d in enumerate(deltas, 1):
        level += d
        if i in skip:
            continue
        high = level + spikes.get(i, 0) if spikes else level
        if high > peak:
            peak, at = high, i
    return Peak(peak, at)


def event_deltas(events: Iterable[int], sizes: Mapping[int, int]) -> Iterator[int]:
    """The deltas of ``events`` (``+serial`` an allocation, ``-serial`` a free), each serial's bytes in ``sizes``."""
    for ev in events:
        yield sizes[ev] if ev > 0 else -sizes[-ev]


def alive_after(initial: Iterable[int], events: Sequence[int], index: int) -> set[int]:
    """The serials alive once the first ``index`` events (``+serial`` alloc, ``-serial`` free) are applied."""
    alive = set(initial)
    for ev in events[:index]:
        if ev > 0:
            alive.add(ev)
        else:
            alive.discard(-ev)
    return alive


def format_frame(frame: Frame) -> str:
    filename, line, name = frame
    short = cell_name(filename)
    where = f"{short}:{line}"
    return where if name in ("<module>", "") else f"{where} in {name}"


def cell_name(filename: str) -> str:
    """``<cell 3>`` or ``<ipython-input-3-abc>`` → ``cell 3``; a path → its base name."""
    if filename.startswith("<cell ") and filename.endswith(">"):
        return filename[1:-1]
    if filename.startswith("<ipython-input-"):
        parts = filename[1:-1].split("-")
        if len(parts) >= 3 and parts[2].isdigit():
            return f"cell {parts[2]}"
    return filename.rsplit("/", 1)[-1]
