"""``%vram_plan``: the shell over :func:`vram_magic.plan`, with the options ``python -m vram_magic plan`` reads
too (one list, ``estimator.arguments.PLAN_OPTIONS``)."""

from __future__ import annotations

import sys
from typing import Any

from IPython.core.error import UsageError

from ..estimator.cli.arguments import PLAN_OPTIONS, build_plan
from .checks import check_name
from .options import help_text as options_help
from .options import magic_parser
from .options import parse as parse_options


def vram_plan(line: str) -> None:
    """Rank the combinations of strategies that make a training step fit, by predicted step time."""


_parser = magic_parser(vram_plan, PLAN_OPTIONS, "plan")  # named for the usage line: %vram_plan MODEL ...


def help_text() -> str:
    return options_help(_parser)


def parse(line: str) -> Any:
    return parse_options(_parser, line, "vram_plan")


def run_plan(line: str, ns: dict[str, Any]) -> None:
    """``%vram_plan LINE`` over the namespace ``ns``: store (``-o``) and display the plan, with a line of progress
    for each fake run while it searches."""
    from ..estimator import EstimateError, plan

    if {"-h", "--help"} & set(line.split()):
        print(help_text())
        return None
    args = parse(line)
    check_name(args.output, "-o")
    try:
        model, inputs, kwargs = build_plan(args, ns)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if args.model.isidentifier():
        kwargs["name"] = args.model
    if not args.quiet:
        kwargs["progress"] = lambda msg: print(f"vram_plan: {msg}", file=sys.stdout, flush=True)
    try:
        result = plan(model, inputs, **kwargs)
    except (ValueError, TypeError, EstimateError) as err:
        raise UsageError(str(err)) from None
    if args.output:
        ns[args.output] = result
    if args.quiet:
        return None
    from IPython.display import display

    display(result)
    return None
