"""``%vram_plan``: the shell over :func:`vram_magic.plan`, with the options ``python -m vram_magic plan`` reads
too (one list, ``estimator.arguments.PLAN_OPTIONS``)."""

from __future__ import annotations

import sys
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from ..estimator.arguments import PLAN_OPTIONS, QUOTING, build_plan, parse_error_hint
from .checks import check_name


def vram_plan(line: str) -> None:
    """Rank the combinations of strategies that make a training step fit, by predicted step time."""


_parser = vram_plan  # named for the usage line: %vram_plan MODEL [--input EXPR] ...
for _flags, _kwargs in reversed([*PLAN_OPTIONS, (("-o", "--output"), {"metavar": "NAME", "help": "store the plan in "
                                                                      "the variable NAME"}),
                                 (("-q", "--quiet"), {"action": "store_true", "help": "do not display the plan"})]):
    _parser = argument(*_flags, **_kwargs)(_parser)
_parser = magic_arguments()(_parser)


def help_text() -> str:
    return str(_parser.parser.format_help())


def parse(line: str) -> Any:
    try:
        return parse_argstring(_parser, line)
    except UsageError as err:
        raise UsageError(parse_error_hint(str(err))) from None
    except SystemExit as err:
        raise UsageError(f"cannot read the options of %vram_plan: {line!r}; {QUOTING}") from err
    except ValueError as err:
        raise UsageError(parse_error_hint(f"cannot read the options of %vram_plan: {err}")) from None


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
