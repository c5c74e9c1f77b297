"""``python -m vram_magic estimate package.module:build_model --shape 3,224,224 --batch 32 --gpu T4``.

The same options as ``%vram_estimate`` (one list, ``arguments.OPTIONS``), read the same way: MODEL,
``--input``, ``--loss`` and ``--optimizer`` take ``module:attribute`` or an expression using ``torch``.
Exit status: 0 when the step fits (or no capacity was given), 1 when it does not, 2 on bad input, 3 when the
estimate is partial (the fake run stopped at an op it cannot run: what it needs is a lower bound, and whether it fits
is not known; 1 when even that lower bound does not fit).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .arguments import OPTIONS, build, parse_error_hint


class Parser(argparse.ArgumentParser):
    """A command line's parser whose errors carry the advice to quote an expression split at its spaces."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {parse_error_hint(message)}\n")


def parser_for(prog: str, doc: str | None, options: list[tuple[tuple[str, ...], dict[str, Any]]],
               json_help: str) -> argparse.ArgumentParser:
    """``python -m vram_magic PROG``'s parser: ``options`` (the list its magic reads too) and ``--json``."""
    p = Parser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flags, kwargs in options:
        p.add_argument(*flags, **kwargs)
    p.add_argument("--json", action="store_true", help=json_help)
    return p


def run_command(name: str, args: Any, build_call: Any, progress_label: Any, as_json: Any, status: Any) -> int:
    """What both commands do with their parsed ``args``: build the model and inputs (``build_call``: ``(args,
    namespace) -> (model, inputs, kwargs)``), call, print the result or its JSON, and return the exit status
    (``status(result)``; 2 for bad input, said on one line)."""
    import torch

    from .. import EstimateError

    try:
        call, model, inputs, kwargs = build_call(args, {"torch": torch})
        progress = None if args.json else (lambda msg: print(f"{progress_label(args)}{msg}", file=sys.stderr))
        result = call(model, inputs, progress=progress, **kwargs)
    except (ValueError, TypeError, EstimateError) as err:
        print(f"vram_magic {name}: {err}", file=sys.stderr)
        return 2
    print(json.dumps(as_json(result), indent=2) if args.json else result)
    return status(result)


def parser() -> argparse.ArgumentParser:
    return parser_for("python -m vram_magic estimate", __doc__, OPTIONS, "print the numbers as JSON instead of the "
                      "report")


def main(argv: list[str]) -> int:
    from .. import estimate

    def build_call(args: Any, namespace: dict[str, Any]) -> tuple[Any, ...]:
        return (estimate, *build(args, namespace))

    def searching(args: Any) -> str:  # what the progress lines search
        return "max-seq: trying " if args.max_seq and not args.max_batch else "max-batch: trying "

    return run_command("estimate", parser().parse_args(argv), build_call, searching, _as_json,
                       exit_status)


def exit_status(est: Any) -> int:
    """0: fits (or no capacity given); 1: does not fit; 3: partial, not known to fit (its figure a lower bound)."""
    return 1 if est.fits is False else 3 if est.partial else 0


def _as_json(est: Any) -> dict[str, Any]:
    """The estimate's numbers as JSON: every estimate's, then its workload's own (a step's model states, loss and
    longest sequence; a generate() call's facts and longest prompt)."""
    import dataclasses

    from ..render.common import verdict
    from ..result import GenerateEstimate

    out: dict[str, Any] = {
        "peak": est.peak.as_dict(), "peak_total": est.peak.total, "needed": est.needed,
        "after_forward": est.after_forward.as_dict(), "capacity": est.capacity, "fits": est.fits,
        "notes": list(est.notes), "max_batch": est.max_batch,
        "flops": dict(est.flops), "partial": est.partial, "problem": est.problem,
        # the verdict as the report says it: a partial estimate's is "at least … needed (partial …)", never "fits"
        "verdict": verdict(est),
        "what_if": [{"strategy": s.name, "peak": s.peak, "needed": s.needed, "compute": s.compute, "fits": s.fits,
                     "partial": s.partial} for s in est.strategies],
    }
    if isinstance(est, GenerateEstimate):
        out.update(generation=dataclasses.asdict(est.generation), max_prompt=est.max_prompt)
    else:
        out.update(model_states=est.model_states, loss=est.loss, max_seq=est.max_seq, paged=est.paged, generation=None)
        out.update(host=getattr(est, "host", 0), pinned=getattr(est, "pinned", 0))  # offloaded to the host
        out.update(step=getattr(est, "step", ""), host_pinned=getattr(est, "host_pinned", 0))  # the recipes'
    return out
