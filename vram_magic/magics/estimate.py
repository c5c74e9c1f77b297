"""``%vram_estimate``: the shell over :func:`vram_magic.estimate`, with the options ``python -m vram_magic
estimate`` reads too (one list, ``estimator.arguments.OPTIONS``)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from IPython.core.error import UsageError

from ..estimator.cli.arguments import OPTIONS, build
from .checks import check_name
from .display import WIDGET_VIEW, with_view
from .options import help_text as options_help
from .options import magic_parser
from .options import parse as parse_options

if TYPE_CHECKING:
    from ..estimator.result import Estimate


def vram_estimate(line: str) -> None:
    """Predict a training or inference step's memory without a GPU."""


_parser = magic_parser(vram_estimate, OPTIONS, "estimate")  # named for the usage line: %vram_estimate ...


def help_text() -> str:
    """``%vram_estimate --help``: the usage line and every option."""
    return options_help(_parser)


def parse(line: str) -> Any:
    return parse_options(_parser, line, "vram_estimate")


def build_kwargs(args: Any, ns: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """``(model, inputs, keyword arguments)`` for :func:`vram_magic.estimate` from parsed magic options."""
    try:
        return build(args, ns)
    except ValueError as err:
        raise UsageError(str(err)) from None


def run_estimate(line: str, ns: dict[str, Any], *, widget: bool = False) -> Estimate | None:
    """``%vram_estimate LINE`` over the namespace ``ns``: store (``-o``) and display the estimate; with
    ``widget``, the widget view in front of its HTML."""
    from ..estimator import EstimateError, estimate

    if {"-h", "--help"} & set(line.split()):
        print(help_text())
        return None
    args = parse(line)
    check_name(args.output, "-o")
    model, inputs, kwargs = build_kwargs(args, ns)
    if args.model.isidentifier():  # named as the user wrote it: module paths read "model.1", not "Sequential.1"
        kwargs["name"] = args.model
    if not args.quiet and (args.max_batch or args.max_seq):
        search = "max-seq" if args.max_seq and not args.max_batch else "max-batch"
        kwargs["progress"] = lambda msg: print(f"{search}: trying {msg}", file=sys.stdout, flush=True)
    try:
        est = estimate(model, inputs, **kwargs)
    except (ValueError, TypeError, EstimateError) as err:
        raise UsageError(str(err)) from None
    if args.output:
        ns[args.output] = est
    if args.quiet:
        return None
    from IPython.display import display

    if widget:
        try:
            bundle = with_view(str(est), est._repr_mimebundle_()["text/html"], widget=True, max_width="56em",
                               css_class="vram-estimate-widget")
        except Exception:
            bundle = {}
        if WIDGET_VIEW in bundle:  # else (no ipywidgets): the estimate renders itself as HTML and text
            display(bundle, raw=True)
            return None
    display(est)  # shown wherever the magic stands in its cell, not only as the cell's last line
    return None
