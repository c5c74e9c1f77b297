"""The ipywidgets view of a report, and a display bundle that works with ipywidgets 7 and 8.

ipywidgets 7 has no ``_repr_mimebundle_`` on widgets, so the bundle is built here: the widget view plus
``text/plain`` and ``text/html`` fallbacks for terminals, GitHub and nbconvert without widget state.
"""

from __future__ import annotations

from typing import Any

from ..report import CellReport
from .html import bars_html, diff_html, legend_html, notes_html, report_html
from .text import report_text, title


def report_widget(report: CellReport) -> Any:
    import ipywidgets as widgets

    scale = max(report.capacity or 0, report.peak.total, report.before.total, report.after.total, 1)
    rows = [("before", report.before), ("after", report.after), ("peak", report.peak)]
    children = [
        widgets.HTML(value=f"<b>{title(report)}</b>"),
        widgets.HTML(value=bars_html(rows, scale, report.capacity), layout=widgets.Layout(width="100%")),
        widgets.HTML(value=legend_html()),
        widgets.HTML(value=diff_html(report)),
    ]
    notes = notes_html(report)
    if notes:
        children.append(widgets.HTML(value=notes))
    box = widgets.VBox(children, layout=widgets.Layout(max_width="56em"))
    box.add_class("vram-widget")
    return box


def widget_bundle(widget: Any, text: str, html: str) -> dict[str, Any]:
    return {
        "application/vnd.jupyter.widget-view+json": {
            "model_id": widget.model_id,
            "version_major": 2,
            "version_minor": 0,
        },
        "text/plain": text,
        "text/html": html,
    }


def report_bundle(report: CellReport, *, widget: bool = True) -> dict[str, Any]:
    """What ``%%vram`` displays: the widget (when asked and possible) with text and HTML fallbacks."""
    text, html = report_text(report), report_html(report)
    if widget:
        try:
            return widget_bundle(report_widget(report), text, html)
        except Exception:  # no ipywidgets, or no kernel to talk to: the fallbacks still show everything
            pass
    return {"text/plain": text, "text/html": html}
