"""Per-rank memory of distributed jobs.

Inside each rank: ``vram_magic.measure()`` as anywhere, then :func:`gather` collects every rank's report on one
rank through the job's own process group. From a notebook: ``%%vram --ranks`` on a cell that launches ranks
(:mod:`.launch` arms the children, :mod:`.child` measures each of them and writes one JSON file per rank).
From a terminal: ``python -m vram_magic ranks DIR`` (:mod:`.cli`).
"""

from __future__ import annotations

from .gather import gather
from .result import Imbalance, RankReport, RankReports

__all__ = ["Imbalance", "RankReport", "RankReports", "gather"]
