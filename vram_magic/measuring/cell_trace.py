"""A measured block's :class:`~vram_magic.core.events.Trace`, from what its backend recorded (the tracker's history, or
the allocator's record replayed) and the namespace scans before and after it: which storages are still alive,
and each allocation's category, line and module."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..core.events import Block, Trace
from ..engine.profiler.recorder import ReplayedBlock
from ..engine.scan.attribution import Scan
from ..engine.scan.categories import KV_SAME_LINE, PHASE_CATEGORY, UNATTRIBUTED, UNSCOPED, kv_cache_sites
from ..engine.scan.registry import LiveStorages
from ..engine.scan.summed import Counted
from ..engine.tracker.counts import StorageCounts
from ..engine.tracker.frames import SiteNamer
from ..engine.tracker.mode import FORWARD, PHASE_NAMES


def alive_tracked(counted: Counted, counts: StorageCounts) -> dict[int, int]:
    """serial → key of every storage alive now; storages that appeared without passing through dispatch
    (``torch.from_numpy``, compiled kernels) are counted as allocated at the end of the block."""
    allocs, late, start = counts.allocs, counts.late, counted.start_serial
    alive: dict[int, int] = {}
    for key, entry in counted.individually(counted.stable):
        serial = entry.serial
        alive[serial] = key
        if serial >= start and serial not in allocs and serial not in late:
            counts.adopt(entry)
    return alive


def alive_replayed(registry: LiveStorages, device: str, rep: ReplayedBlock) -> dict[int, int]:
    """The same from the allocator's record: blocks alive at the end are matched to the storages the scan
    found by address."""
    by_addr: dict[int, tuple[int, Any]] = {}
    alive: dict[int, int] = {}
    freed = {-ev for ev in rep.events if ev < 0}
    for key, entry in registry.live(device):
        if entry.serial in rep.initial:
            if entry.serial not in freed:
                alive[entry.serial] = key
            continue
        storage = entry()
        try:
            addr = int(storage.data_ptr()) if storage is not None else 0
        except Exception:
            addr = 0
        by_addr.setdefault(addr, (key, entry))
    for serial, addr in rep.addr.items():
        hit = by_addr.pop(addr, None) if addr else None
        if hit is not None:
            alive[serial] = hit[0]
            hit[1].serial = serial  # the storage's entry takes the block's serial: later blocks see it
    for key, entry in by_addr.values():  # found by the scan, never allocated through the allocator
        if entry.serial in rep.allocs or entry.serial in rep.late:
            continue
        rep.allocs[entry.serial] = (entry.size, FORWARD, (), 0)
        rep.events.append(entry.serial)
        rep.current += entry.size
        if rep.current > rep.peak:
            rep.peak = rep.current
            rep.peak_index = len(rep.events)
        alive[entry.serial] = key
    return alive


def live_rows(registry: LiveStorages, device: str, scan: Scan,
              allocs: Mapping[int, tuple[Any, ...]]) -> dict[tuple[str, str], int]:
    """``(category, label) → bytes`` of the storages alive now (a truncated history's end)."""
    rows: dict[tuple[str, str], int] = {}
    for key, entry in registry.live(device):
        alloc = allocs.get(entry.serial)
        owner = scan.lookup(key)
        cat = owner if owner is not None else PHASE_CATEGORY[alloc[1]] if alloc is not None else UNATTRIBUTED
        rows[cat] = rows.get(cat, 0) + entry.size
    return rows


def block_trace(device: str, source: StorageCounts | ReplayedBlock, scans: tuple[Scan, Scan], alive: Mapping[int, int],
                expanded: Mapping[int, int], counted: Counted, counts: StorageCounts | None,
                steps: Sequence[tuple[int, int, int]],
                cell_files: Mapping[str, int] | None) -> Trace:
    """The block's trace: the storages alive before it (summed where alive throughout), then each allocation with
    its category (the owner the scan after found, else its role or phase), line and module. ``scans``: the
    namespace before and after the block; ``steps``: where generate()'s stages began in the history."""
    scan_before, scan_after = scans
    blocks: dict[int, Block] = {}
    freed = {-ev for ev in source.events if ev < 0}
    base: dict[tuple[str, str], int] = {}
    initial = []
    category = scan_after.owner_get()
    for g in counted.stable:  # alive throughout, counted as a whole
        base[g.owner] = base.get(g.owner, 0) + g.total
    # the storages of the groups that changed, still alive or freed in the block, go one by one
    for start in (source.initial, expanded, counted.grouped_freed(counts), source.late):
        for serial, size in start.items():
            key = alive.get(serial)
            if key is None or serial in freed:
                cat = category(key, UNATTRIBUTED) if key is not None else counted.before_category(serial, counts)
                blocks[serial] = Block(serial, size, cat[0], cat[1])
                initial.append(serial)
            else:  # alive throughout: a constant, summed
                cat = category(key, UNATTRIBUTED)
                base[cat] = base.get(cat, 0) + size
    names = {**scan_before.module_names, **scan_after.module_names}
    sites = SiteNamer(cell_files)
    optimizers = {**scan_before.optimizer_names, **scan_after.optimizer_names}
    roles = source.roles
    phase_names = PHASE_NAMES
    unscoped = isinstance(source, ReplayedBlock)
    kv_sites = kv_cache_sites(source.allocs, alive, category)
    for serial, (size, phase, site, module) in source.allocs.items():
        key = alive.get(serial)
        cat = category(key) if key is not None else None
        if cat is None:
            role = roles.get(serial)
            if role is not None:
                label = role[1]
                if isinstance(label, tuple):  # a routed expert's gradient or state: (id(optimizer), the mark)
                    label = optimizers.get(label[0], "optimizer") + label[1]
                cat = (role[0], optimizers.get(label, "optimizer") if isinstance(label, int) else label)
            elif unscoped and phase == FORWARD:
                cat = UNSCOPED
            elif site and id(site) in kv_sites:
                cat = KV_SAME_LINE
            else:
                cat = PHASE_CATEGORY[phase]
        blocks[serial] = Block(serial, size, cat[0], cat[1], sites(site) if site else (), phase_names[phase],
                               names.get(module, "") if module else "")
    return Trace(device, blocks, tuple(initial), source.events, source.peak_index, source.truncated,
                 base=tuple((c, lab, n) for (c, lab), n in base.items()),
                 steps=tuple((i, phase_names[p], n) for i, p, n in steps))


__all__ = ["alive_replayed", "alive_tracked", "block_trace", "live_rows"]
