"""vram_magic: see what fills GPU memory, cell by cell, and predict it before you run.

Importing this package has no side effects: IPython, ipywidgets and matplotlib are imported only when
needed, and CUDA is not touched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .report import CATEGORIES, Advice, Breakdown, CellReport, DeviceStats, OomInfo
from .units import format_bytes, parse_size

if TYPE_CHECKING:
    from .engine.cell import Measurement

__version__ = "0.1.0"

__all__ = [
    "CATEGORIES",
    "Advice",
    "Breakdown",
    "CellReport",
    "DeviceStats",
    "OomInfo",
    "estimate",
    "format_bytes",
    "gather",
    "load_ipython_extension",
    "measure",
    "parse_size",
    "unload_ipython_extension",
]


def measure(device: Any = None, **kwargs: Any) -> Measurement:
    """``with vram_magic.measure() as m: ...`` — see :func:`vram_magic.engine.cell.measure`."""
    import sys

    from .engine.cell import measure as _measure
    from .engine.namespace import FrameNamespace

    if kwargs.get("namespace") is None:
        kwargs["namespace"] = FrameNamespace(sys._getframe(1))
    return _measure(device, **kwargs)


def estimate(*args: Any, **kwargs: Any) -> Any:
    """Predict a training or inference step's memory on fake tensors; see :func:`vram_magic.estimator.estimate`."""
    from .estimator import estimate as _estimate

    return _estimate(*args, **kwargs)


def gather(*args: Any, **kwargs: Any) -> Any:
    """Every rank's report of a distributed job, on rank 0 (``None`` elsewhere); see :func:`vram_magic.ranks.gather`."""
    from .ranks.gather import gather as _gather

    return _gather(*args, **kwargs)


def load_ipython_extension(ipython: Any) -> None:
    from .magics import load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    from .magics import unload

    unload(ipython)
