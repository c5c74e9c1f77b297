"""Display bundles: what ``%%vram`` puts in the notebook.

The report is static HTML and text (``text/html`` + ``text/plain``): a saved notebook shows it with no
kernel and no saved widget state, in JupyterLab, Notebook 7, nbconvert, VS Code and viewers that sanitize
HTML. An ipywidgets view is opt-in (``%config VramMagics.widget = True``) and carries the same HTML and text
as fallbacks; ipywidgets 7 has no ``_repr_mimebundle_`` on widgets, so its bundle is built here.
"""

from __future__ import annotations

from typing import Any

from ..report import CellReport
from .html import report_html
from .text import report_text

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def report_widget(report: CellReport, *, session_scale: int | None = None) -> Any:
    import ipywidgets as widgets

    view = widgets.HTML(value=report_html(report, session_scale=session_scale), layout=widgets.Layout(width="100%"))
    box = widgets.VBox([view], layout=widgets.Layout(max_width="64em"))
    box.add_class("vram-widget")
    return box


def widget_bundle(widget: Any, text: str, html: str) -> dict[str, Any]:
    """The view of ``widget`` with ``text`` and ``html`` as fallbacks (for ipywidgets 7 and 8)."""
    return {
        WIDGET_VIEW: {"model_id": widget.model_id, "version_major": 2, "version_minor": 0},
        "text/plain": text,
        "text/html": html,
    }


def report_bundle(report: CellReport, *, widget: bool = False, session_scale: int | None = None) -> dict[str, Any]:
    """What ``%%vram`` displays: static HTML and text; with ``widget``, an ipywidgets view in front of them."""
    text, html = report_text(report), report_html(report, session_scale=session_scale)
    if widget:
        try:
            return widget_bundle(report_widget(report, session_scale=session_scale), text, html)
        except Exception:  # no ipywidgets, or no kernel to talk to: the static report shows everything
            pass
    return {"text/plain": text, "text/html": html}
