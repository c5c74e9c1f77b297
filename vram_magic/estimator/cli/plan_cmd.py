"""``python -m vram_magic plan package.module:build --input "torch.randint(0, 32000, (8, 2048))" --gpu L4``.

The same options as ``%vram_plan`` (one list, ``arguments.PLAN_OPTIONS``), read the same way. Exit status: 0 when a
row fits, 1 when none does, 2 on bad input.
"""

from __future__ import annotations

import argparse
from typing import Any

from .arguments import PLAN_OPTIONS, build_plan
from .estimate_cmd import parser_for, run_command


def parser() -> argparse.ArgumentParser:
    return parser_for("python -m vram_magic plan", __doc__, PLAN_OPTIONS, "print the rows as JSON instead of the "
                      "table")


def main(argv: list[str]) -> int:
    from .. import plan

    def build_call(args: Any, namespace: dict[str, Any]) -> tuple[Any, ...]:
        return (plan, *build_plan(args, namespace))

    return run_command("plan", parser().parse_args(argv), build_call, lambda args: "plan: ", as_json,
                       lambda result: 0 if result.best is not None else 1)


def as_json(p: Any) -> dict[str, Any]:
    return {
        "model": p.model, "step": p.step, "gpu": p.gpu, "gpus": p.gpus, "capacity": p.capacity,
        "global_batch": p.global_batch,
        "unit": p.unit, "calibration": p.calibration, "assumptions": list(p.assumptions), "notes": list(p.notes),
        "scored": len(p.scored), "bounded": p.bounded, "traced": p.traced,
        "rows": [{"name": r.name, "options": {k: (v if isinstance(v, (int, float, str, bool)) or v is None else str(v))
                                              for k, v in r.options.items()},
                  "needed": r.needed, "peak": r.peak.as_dict(), "fits": r.fits, "step_time": r.step_time,
                  "partial": r.fits is None,  # stopped early: needed is a lower bound, the fit not known
                  "throughput": r.throughput, "time": dict(r.time), "numerics": list(r.numerics),
                  "tradeoffs": list(r.tradeoffs), "code": list(r.code)} for r in p.rows],
    }
