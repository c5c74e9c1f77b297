"""A DataFrame of byte counts that displays them in binary units (imported only when a table is made)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pandas as pd

_SCROLL = '<div class="vram-table" style="overflow-x:auto;max-width:100%">{}</div>'


def _nbsp(text: str) -> str:
    """``12.5 MiB`` with a no-break space: a narrow column never splits a number from its unit."""
    return text.replace(" ", "\u00a0")


class BytesFrame(pd.DataFrame):
    """Holds bytes; shows KiB/MiB/GiB (``_formats``: column → formatter, ``"__rows__"``: row label → formatter).

    Frames derived from it are plain DataFrames: a computed value is no longer a byte count."""

    _metadata = ["_formats"]

    @property
    def _constructor(self) -> Any:
        return pd.DataFrame

    def _shown(self, nbsp: bool = False) -> pd.DataFrame:
        shown = pd.DataFrame(self).astype(object)
        formats: dict[str, Any] = getattr(self, "_formats", None) or {}
        for col, fmt in formats.items():
            if col in shown.columns:
                shown[col] = [_nbsp(fmt(v)) if nbsp else fmt(v) for v in self[col]]
        rows: dict[Any, Callable[[Any], str]] | None = formats.get("__rows__")
        if rows is not None:
            for i, label in enumerate(shown.index):
                fmt = rows.get(label)
                if fmt is not None:
                    shown.iloc[i] = [_nbsp(fmt(v)) if nbsp else fmt(v) for v in self.iloc[i]]
        return shown

    def __repr__(self) -> str:
        return self._shown().to_string()

    def _repr_html_(self) -> str:
        return frame_html(self._shown(nbsp=True))


def frame_html(shown: pd.DataFrame) -> str:
    """A frame of strings as the reports' tables are drawn: readable in both themes, scrolling sideways in a
    narrow window, and aligned monospace text where a viewer strips styles (no ``<table>`` to escape)."""
    import html

    from .bars import Cell, grid_html
    from .theme import NUM, SMALL

    index = [str(i) for i in shown.index]
    columns = [str(c) for c in shown.columns]
    index_w = max([len(i) for i in index] + [1])
    widths = [max([len(str(v)) for v in shown[c]] + [len(name)]) for c, name in zip(shown.columns, columns)]
    bold = "font-weight:bold;white-space:nowrap"
    head = [Cell("", "", index_w)] + [Cell(html.escape(n), n, w, "right", f"{NUM};{bold}")
                                      for n, w in zip(columns, widths)]
    rows = [("vram-frame-head", head)]
    for label, (_, values) in zip(index, shown.iterrows()):
        cells = [Cell(html.escape(label), label, index_w, style=bold)]
        cells += [Cell(html.escape(str(v)), str(v), w, "right", NUM) for v, w in zip(values, widths)]
        rows.append(("vram-frame-row", cells))
    grid = grid_html(rows, cls="vram-frame", style=SMALL,
                     row_styles={"vram-frame-head": "border-bottom:1px solid rgba(128,128,128,0.55)"})
    return _SCROLL.format(grid)
