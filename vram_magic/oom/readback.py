"""Reports written to a folder (``python -m vram_magic run --out DIR``: one per rank), read back: ``read_oom(DIR)``
draws one bar per rank on one scale."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ..core.rendered import Rendered
from .report import OomReport

PREFIX = "oom-"


@dataclass(frozen=True)
class OomReports(Rendered):
    """The out-of-memory reports of a folder, by rank (then by time); ``skipped``: files that are not reports."""

    folder: str
    reports: tuple[OomReport, ...]
    skipped: tuple[str, ...] = ()

    def __getitem__(self, i: int) -> OomReport:
        return self.reports[i]

    def __len__(self) -> int:
        return len(self.reports)

    def _text(self) -> str:
        from .render import ranks_text

        return ranks_text(self)

    def _html(self) -> str:
        from .render import ranks_html

        return ranks_html(self)


def read_oom(folder: str = "vram-oom") -> OomReports:
    """The reports ``python -m vram_magic run`` left in ``folder`` (``oom-<rank or pid>.json``)."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"no folder {folder!r}: `python -m vram_magic run --out DIR script.py` writes one "
                                "report per rank there when a rank runs out of memory")
    reports, skipped = [], []
    for name in sorted(os.listdir(folder)):
        if not (name.startswith(PREFIX) and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                reports.append(OomReport.from_dict(json.load(f)))
        except (OSError, ValueError, KeyError, TypeError) as err:
            skipped.append(f"{name} ({type(err).__name__}: {err})")
    reports.sort(key=lambda r: (r.rank is None, r.rank if r.rank is not None else 0, r.time))
    return OomReports(folder, tuple(reports), tuple(skipped))


__all__ = ["OomReports", "read_oom"]
