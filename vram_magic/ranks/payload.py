"""A rank's report as plain JSON and back: what crosses a process boundary (a gather, a file per rank).

Everything in a :class:`~vram_magic.measuring.report.CellReport` is plain numbers and strings except its allocation
trace,
which stays in the rank (it can hold millions of events); what the trace answers that a per-rank view shows —
the lines and modules alive at the peak — travels precomputed instead.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, fields
from typing import Any

from ..core.breakdown import breakdown_from_dict, breakdown_to_dict
from ..core.device_stats import DeviceStats
from ..measuring.report import Advice, CellReport, OomInfo

FORMAT = "vram_magic.rank/1"


def report_to_dict(report: CellReport, *, detail: bool = True) -> dict[str, Any]:
    """Every field of the report but its trace, as JSON-ready values (the breakdowns without their detail rows
    where ``detail`` is false: what JupyterLab's figures file keeps of a report)."""
    oom = report.oom
    return {
        "device": report.device,
        "before": breakdown_to_dict(report.before, detail),
        "after": breakdown_to_dict(report.after, detail),
        "peak": breakdown_to_dict(report.peak, detail),
        "delta": breakdown_to_dict(report.delta, detail),
        "cell": report.cell,
        "previous": report.previous,
        "wall_time": report.wall_time,
        "capacity": report.capacity,
        "budget": report.budget,
        "stats": asdict(report.stats) if report.stats is not None else None,
        "error": report.error,
        "oom": None if oom is None else {
            "message": oom.message, "requested": oom.requested, "capacity": oom.capacity,
            "live": breakdown_to_dict(oom.live, detail), "holders": [list(h) for h in oom.holders],
            "site": [list(f) for f in oom.site], "phase": oom.phase},
        "advice": [asdict(a) for a in report.advice],
        "notes": list(report.notes),
        "source": report.source,
        "backend": report.backend,
    }


def report_from_dict(d: Mapping[str, Any]) -> CellReport:
    oom = d.get("oom")
    stats = d.get("stats")
    stat_fields = {f.name for f in fields(DeviceStats)}
    advice_fields = {f.name for f in fields(Advice)}
    return CellReport(
        device=str(d.get("device", "cpu")),
        before=breakdown_from_dict(d.get("before", {})),
        after=breakdown_from_dict(d.get("after", {})),
        peak=breakdown_from_dict(d.get("peak", {})),
        delta=breakdown_from_dict(d.get("delta", {})),
        cell=d.get("cell"),
        previous=d.get("previous"),
        wall_time=float(d.get("wall_time") or 0.0),
        capacity=d.get("capacity"),
        budget=d.get("budget"),
        stats=DeviceStats(**{k: v for k, v in stats.items() if k in stat_fields}) if stats else None,
        error=d.get("error"),
        oom=None if not oom else OomInfo(
            message=str(oom.get("message", "")), requested=oom.get("requested"), capacity=oom.get("capacity"),
            live=breakdown_from_dict(oom.get("live", {})),
            holders=tuple((str(n), int(b)) for n, b in oom.get("holders", ())),
            site=tuple((str(f), int(line), str(fn)) for f, line, fn in oom.get("site", ())),
            phase=str(oom.get("phase", ""))),
        advice=tuple(Advice(**{k: v for k, v in a.items() if k in advice_fields}) for a in d.get("advice", ())),
        notes=tuple(str(n) for n in d.get("notes", ())),
        source=str(d.get("source", "")),
        backend=str(d.get("backend", "tracker")),
    )


def dumps(data: Mapping[str, Any]) -> bytes:
    return json.dumps(data, separators=(",", ":"), allow_nan=False).encode()


def loads(raw: bytes | str) -> dict[str, Any]:
    data = json.loads(raw)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"not a vram_magic rank report (expected format {FORMAT!r})")
    return data
