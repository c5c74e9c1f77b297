"""The JupyterLab extension's server part: ``GET {base_url}vram-magic/kernels`` and the kernels' figures files.

Jupyter finds the extension through the hooks below (the names Jupyter looks for). Importing this package
imports nothing from jupyter_server; the route's modules do, when the server loads the extension. The front
end (status bar item and side panel) is prebuilt into ``labextension/`` here and installed with the wheel
under ``share/jupyter/labextensions/vram-magic``.
"""

from __future__ import annotations

from typing import Any

#: the npm package name of the front end, which is also its folder under share/jupyter/labextensions
LABEXTENSION = "vram-magic"


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    return [{"src": "labextension", "dest": LABEXTENSION}]


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "vram_magic.lab"}]


def _load_jupyter_server_extension(server_app: Any) -> None:
    from .handlers import setup_handlers

    setup_handlers(server_app)
