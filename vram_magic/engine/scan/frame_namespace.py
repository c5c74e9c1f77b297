"""Where a block's variables are looked for, and the memory of a device now (``%vram``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...core.breakdown import Breakdown
from ...core.device_stats import DeviceStats
from ..cuda import device as cuda
from .attribution import scan_namespace
from .registry import LiveStorages


class FrameNamespace(Mapping[str, Any]):
    """The caller's globals and locals, read afresh at each scan (variables made in the block count)."""

    def __init__(self, frame: Any) -> None:
        self._frame = frame
        self.scan_id = id(frame.f_globals)  # what the scans of its blocks remember is kept under the module's

    def _merged(self) -> dict[str, Any]:
        merged = dict(self._frame.f_globals)
        merged.update(self._frame.f_locals)
        return merged

    def __getitem__(self, key: str) -> Any:
        return self._merged()[key]

    def __iter__(self) -> Any:
        return iter(self._merged())

    def __len__(self) -> int:
        return len(self._merged())

    def items(self) -> Any:
        return self._merged().items()


def add_other(b: Breakdown, label: str, n: int) -> Breakdown:
    """``b`` with ``n`` more bytes of "other" under ``label``."""
    rows = {(c, lab): v for c, lab, v in b.detail}
    for c in b:
        covered = sum(v for (cc, _), v in rows.items() if cc == c)
        if b[c] - covered:
            rows[(c, "")] = rows.get((c, ""), 0) + b[c] - covered
    rows[("other", label)] = rows.get(("other", label), 0) + n
    return Breakdown.from_rows(rows)


def snapshot(device: str, namespace: Mapping[str, Any] | None,
             registry: LiveStorages) -> tuple[Breakdown, DeviceStats | None, tuple[str, ...]]:
    """The memory of ``device`` now, split by category (no tracking: a scan of the namespace), with the
    scan's notes."""
    scan = scan_namespace(namespace, registry)
    rows: dict[tuple[str, str], int] = {}
    for key, entry in registry.live(device):
        cat = scan.category(key)
        rows[cat] = rows.get(cat, 0) + entry.size
    now = Breakdown.from_rows(rows)
    stats = cuda.device_stats(device) if device.startswith("cuda") else None
    if stats is not None and stats.allocated > now.total:
        now = add_other(now, "allocator: workspaces and untracked", stats.allocated - now.total)
    return now, stats, tuple(scan.notes)
