"""The session's measured cells as tables (pandas), and export to CSV/JSON.

The frames hold bytes (numbers to compute with); they *display* in binary units, like a pandas ``Styler``
shows formatted numbers while the data stays raw. Frames derived from them (a selection, arithmetic) are
plain DataFrames, so a value that is no longer a byte count is never printed as one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..core.breakdown import shown_categories
from ..core.units import format_bytes
from ..measuring.report import CellReport

if TYPE_CHECKING:
    import pandas as pd


def _signed(n: Any) -> str:
    return format_bytes(n, signed=True)


def _with_formats(frame: pd.DataFrame, formats: dict[str, Any]) -> pd.DataFrame:
    from ..render.dataframe import BytesFrame

    out = BytesFrame(frame)
    object.__setattr__(out, "_formats", formats)
    return out


def history_frame(reports: list[CellReport], ooms: Sequence[Any] = ()) -> pd.DataFrame:
    """One row per measured cell: categories after the cell, total, peak, delta, wall time (bytes, seconds). A
    ``kv_cache`` column where some cell left a KV cache behind (a ``generate()`` output kept), and its peak's
    KV cache (``peak_kv_cache``) where some cell generated. ``ooms``: the out-of-memory reports of cells nobody
    measured, each a row in the cells' order with what was alive at the failure (``oom`` True; no peak, delta or
    wall time)."""
    import pandas as pd

    shown = shown_categories(*[r.after for r in reports], *[o.alive for o in ooms])
    peak_kv = any(r.peak["kv_cache"] for r in reports)
    rows = []
    for r in reports:
        row: dict[str, object] = {"cell": r.cell, "device": r.device}
        row.update({c: r.after[c] for c in shown})
        row.update({"total": r.after.total, "peak": r.peak.total, "delta": r.delta.total,
                    "wall_time_s": round(r.wall_time, 4), "oom": r.oom is not None, "error": r.error or ""})
        if peak_kv:
            row["peak_kv_cache"] = r.peak["kv_cache"]
        rows.append(row)
    for o in ooms:
        row = {"cell": o.cell, "device": o.device, **{c: o.alive[c] for c in shown}, "total": o.alive.total,
               "peak": None, "delta": None, "wall_time_s": None, "oom": True, "error": o.error}
        rows.append(row)
    rows.sort(key=lambda row: (row["cell"] is None, row["cell"] or 0))
    extra = ["peak_kv_cache"] if peak_kv else []
    columns = ["cell", "device", *shown, "total", "peak", *extra, "delta", "wall_time_s", "oom", "error"]
    frame = pd.DataFrame(rows, columns=columns)
    formats: dict[str, Any] = {c: format_bytes for c in (*shown, "total", "peak", *extra)}
    formats["delta"] = _signed
    return _with_formats(frame, formats)


def diff_frame(a: CellReport, b: CellReport) -> pd.DataFrame:
    """Memory after cell ``a``, after cell ``b``, and the change, per category (bytes)."""
    import pandas as pd

    delta = b.after - a.after
    data = {c: [a.after[c], b.after[c], delta[c]] for c in shown_categories(a.after, b.after)}
    data["total"] = [a.after.total, b.after.total, delta.total]
    frame = pd.DataFrame(data, index=[f"after cell {a.cell}", f"after cell {b.cell}", "change"])
    return _with_formats(frame, {"__rows__": {frame.index[0]: format_bytes, frame.index[1]: format_bytes,
                                              "change": _signed}})


def export_history(reports: list[CellReport], path: str) -> str:
    """Write the history as ``.csv`` or ``.json`` (by the file's extension)."""
    import pandas as pd

    frame = pd.DataFrame(history_frame(reports))
    if path.endswith(".csv"):
        frame.to_csv(path, index=False)
    elif path.endswith(".json"):
        frame.to_json(path, orient="records", indent=1)
    else:
        raise ValueError(f"cannot tell the format of {path!r}: end it in .csv or .json")
    return path
