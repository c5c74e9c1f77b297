"""The what-if table: each change a workload offers, estimated again from the same trace where it can be (and traced
anew where it must), its peak, what it saves against the baseline, and its price — FLOPs per sample counted on the
fake run (checkpointing's recomputed forward shows as extra FLOPs) and the sequential steps it takes (accumulation,
a smaller batch)."""

from __future__ import annotations

import math

from ..fake.quantize import NotApplicable
from ..result import Estimate, Strategy, Workload
from ..tracing.errors import EstimateError


def what_if(workload: Workload, base: Estimate) -> list[Strategy]:
    """The baseline's row, then one row per candidate of ``workload`` (a candidate that does not apply to the model,
    quantizing a model without linear layers say, has none; one that fails says why)."""
    opts = base.options
    if opts is None:
        raise ValueError("this estimate cannot be re-run for what-ifs (make it with vram_magic.estimate)")
    per_sample = workload.compute_per_sample(base)
    rows = [Strategy("baseline: " + base.description, base.peak.total, base.needed, 0, 1.0, 1.0, base.fits,
                     workload.remark(base).lstrip("; "), partial=base.partial)]
    for candidate in workload.candidates(base):
        try:
            est = workload.evaluate(opts.with_(**candidate.changes))
        except NotApplicable:
            continue
        except (EstimateError, ValueError, TypeError) as err:
            rows.append(Strategy(candidate.name, 0, 0, 0, math.nan, candidate.steps, None, f"could not run: {err}"))
            continue
        compute = workload.compute_per_sample(est) / per_sample if per_sample else 1.0
        rows.append(Strategy(candidate.name, est.peak.total, est.needed, est.needed - base.needed, compute,
                             candidate.steps, est.fits, candidate.note + workload.remark(est), partial=est.partial))
    return rows
