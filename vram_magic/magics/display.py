"""What the magics put in the notebook: the report (in place of the live view), the live view of a measured
cell, and the one ipywidgets view (``%config VramMagics.widget = True``) every magic's HTML can sit in.

The static HTML and text are always there: the widget view goes in front of them, so a saved notebook
without widget state still shows everything. ipywidgets 7 has no ``_repr_mimebundle_`` on widgets, so the
bundle is built here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .checks import Host, warn

if TYPE_CHECKING:
    from ..measuring.report import CellReport
    from ..session.live import LiveView

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def has_frontend(shell: Any) -> bool:
    """A kernel with a frontend that can update a display (not terminal IPython)."""
    return getattr(shell, "kernel", None) is not None


def wants_widget(host: Host) -> bool:
    """``VramMagics.widget`` is on and there is a frontend to show a widget."""
    return bool(getattr(host, "widget", False)) and has_frontend(host.shell)


def html_view(html: str, *, max_width: str = "64em", css_class: str = "vram-widget") -> Any:
    """The widget: ``html`` in a box ``max_width`` wide, marked with ``css_class``."""
    import ipywidgets as widgets

    view = widgets.HTML(value=html, layout=widgets.Layout(width="100%"))
    box = widgets.VBox([view], layout=widgets.Layout(max_width=max_width))
    box.add_class(css_class)
    return box


def with_view(text: str, html: str, *, widget: bool, max_width: str = "64em",
              css_class: str = "vram-widget") -> dict[str, Any]:
    """Static HTML and text; with ``widget``, the widget view of ``html`` in front of them (ipywidgets 7 and 8).
    Without ipywidgets, or without a kernel to talk to, the static view alone (it shows everything)."""
    if widget:
        try:
            box = html_view(html, max_width=max_width, css_class=css_class)
            return {WIDGET_VIEW: {"model_id": box.model_id, "version_major": 2, "version_minor": 0},
                    "text/plain": text, "text/html": html}
        except Exception:
            pass
    return {"text/plain": text, "text/html": html}


def report_view(report: CellReport, *, widget: bool = False, session_scale: int | None = None) -> dict[str, Any]:
    """What ``%%vram`` displays: the report's static HTML and text, with ``widget`` the widget view in front."""
    from ..measuring.render.widget import report_bundle

    bundle = report_bundle(report, session_scale=session_scale)
    return with_view(bundle["text/plain"], bundle["text/html"], widget=widget)


def show_report(host: Host, report: CellReport, *, timeline: bool = False, live: LiveView | None = None) -> None:
    """Display ``report`` (in place of the live view, if it appeared) and, if asked, its timeline."""
    from IPython.display import display

    from ..session.live import session_scale

    scale = session_scale(host.session.history, report.device)
    bundle = report_view(report, widget=wants_widget(host), session_scale=scale)
    if live is not None:
        live.finish(bundle)
    else:
        display(bundle, raw=True)
    if timeline:
        from ..measuring.render.timeline import timeline_bundle

        display(timeline_bundle(report), raw=True)


def start_live(host: Host) -> LiveView | None:
    """The live view of the cell ``host.session`` is measuring, started (None where there is no frontend, where
    it is off, or where it cannot start: the cell runs and is measured without it)."""
    try:
        delay = float(getattr(host, "live", 1.0))
        m = host.session.active
        if delay < 0 or m is None or not has_frontend(host.shell):
            return None
        from ..session.live import cell_view

        interval = float(getattr(host, "live_interval", 0.25))
        return cell_view(m, host.session.history, delay=delay, interval=interval).start()
    except Exception as err:
        warn(f"vram_magic could not start the live view ({type(err).__name__}: {err})", stacklevel=4)
        return None
