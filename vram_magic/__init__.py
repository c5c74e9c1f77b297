"""vram_magic: see what fills GPU memory, cell by cell, and predict it before you run.

Importing this package has no side effects: IPython, ipywidgets and matplotlib are imported only when
needed, and CUDA is not touched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .core.breakdown import CATEGORIES, Breakdown
from .core.device_stats import DeviceStats
from .core.units import format_bytes, parse_size
from .measuring.report import Advice, CellReport, OomInfo

if TYPE_CHECKING:
    from .measuring.measurement import Measurement

__version__ = "0.1.0"

__all__ = [
    "CATEGORIES",
    "Advice",
    "Breakdown",
    "CellReport",
    "DeviceStats",
    "OomInfo",
    "estimate",
    "plan",
    "format_bytes",
    "gather",
    "last_oom",
    "load_ipython_extension",
    "measure",
    "parse_size",
    "read_oom",
    "unload_ipython_extension",
]


def measure(device: Any = None, **kwargs: Any) -> Measurement:
    """``with vram_magic.measure() as m: ...`` — see :func:`vram_magic.measuring.measurement.measure`."""
    import sys

    from .engine.scan.frame_namespace import FrameNamespace
    from .measuring.measurement import measure as _measure

    if kwargs.get("namespace") is None:
        kwargs["namespace"] = FrameNamespace(sys._getframe(1))
    return _measure(device, **kwargs)


def __getattr__(name: str) -> Any:
    # estimate() and plan() are the estimator's own (one signature, one docstring); the estimator is imported when
    # they are first asked for, and torch only when they are called
    if name in ("estimate", "plan"):
        from . import estimator

        return getattr(estimator, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | {"estimate", "plan"})


def last_oom() -> Any:
    """The report of the latest out-of-memory error this process explained (a notebook cell's, measured or not, with
    ``%load_ext vram_magic``; a script's under ``python -m vram_magic run``), or ``None``."""
    from .oom.black_box import last_oom as _last

    return _last()


def read_oom(folder: str = "vram-oom") -> Any:
    """The out-of-memory reports ``python -m vram_magic run --out FOLDER`` wrote (one per rank), one bar each."""
    from .oom.readback import read_oom as _read

    return _read(folder)


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
