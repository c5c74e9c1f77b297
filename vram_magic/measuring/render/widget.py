"""Display bundles: what ``%%vram`` puts in the notebook.

The report is static HTML and text (``text/html`` + ``text/plain``): a saved notebook shows it with no
kernel and no saved widget state, in JupyterLab, Notebook 7, nbconvert, VS Code and viewers that sanitize
HTML. The opt-in ipywidgets view (``%config VramMagics.widget = True``) is the magics' (``vram_magic.magics.
display``): it goes in front of this bundle, which stays as its fallback.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .html import report_html
from .text import report_text

if TYPE_CHECKING:
    from ..report import CellReport


def report_bundle(report: CellReport, *, session_scale: int | None = None) -> dict[str, Any]:
    """What ``%%vram`` displays: static HTML and text."""
    return {"text/plain": report_text(report), "text/html": report_html(report, session_scale=session_scale)}
