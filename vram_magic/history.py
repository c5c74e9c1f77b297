"""The session's measured cells as tables (pandas), and export to CSV/JSON."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .report import CATEGORIES, CellReport

if TYPE_CHECKING:
    import pandas as pd


def history_frame(reports: list[CellReport]) -> pd.DataFrame:
    """One row per measured cell: categories after the cell, total, peak, delta, wall time (bytes, seconds)."""
    import pandas as pd

    rows = []
    for r in reports:
        row: dict[str, object] = {"cell": r.cell, "device": r.device}
        row.update({c: r.after[c] for c in CATEGORIES})
        row.update({"total": r.after.total, "peak": r.peak.total, "delta": r.delta.total,
                    "wall_time_s": round(r.wall_time, 4), "oom": r.oom is not None, "error": r.error or ""})
        rows.append(row)
    columns = ["cell", "device", *CATEGORIES, "total", "peak", "delta", "wall_time_s", "oom", "error"]
    return pd.DataFrame(rows, columns=columns)


def diff_frame(a: CellReport, b: CellReport) -> pd.DataFrame:
    """Memory after cell ``a``, after cell ``b``, and the change, per category (bytes)."""
    import pandas as pd

    delta = b.after - a.after
    data = {c: [a.after[c], b.after[c], delta[c]] for c in CATEGORIES}
    data["total"] = [a.after.total, b.after.total, delta.total]
    return pd.DataFrame(data, index=[f"after cell {a.cell}", f"after cell {b.cell}", "change"])


def export_history(reports: list[CellReport], path: str) -> str:
    """Write the history as ``.csv`` or ``.json`` (by the file's extension)."""
    frame = history_frame(reports)
    if path.endswith(".csv"):
        frame.to_csv(path, index=False)
    elif path.endswith(".json"):
        frame.to_json(path, orient="records", indent=1)
    else:
        raise ValueError(f"cannot tell the format of {path!r}: end it in .csv or .json")
    return path
