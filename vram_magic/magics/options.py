"""The option parsers of the magics that share their options with the command line (``%vram_estimate``,
``%vram_plan``): one list of argparse options each (``estimator/cli/arguments.py``), made into an IPython magic's parser
with ``-o`` and ``-q``, and read with errors that say what was wrong and how to quote."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from ..estimator.cli.arguments import QUOTING, parse_error_hint


def magic_parser(usage: Callable[..., Any], options: list[tuple[tuple[str, ...], dict[str, Any]]],
                 stored: str) -> Any:
    """``usage`` (a function named for the usage line) carrying ``options`` and ``-o NAME`` / ``-q`` for what the magic
    makes (``stored``: "estimate", "plan")."""
    parser = usage
    extra = [(("-o", "--output"), {"metavar": "NAME", "help": f"store the {stored} in the variable NAME"}),
             (("-q", "--quiet"), {"action": "store_true", "help": f"do not display the {stored}"})]
    for flags, kwargs in reversed([*options, *extra]):
        parser = argument(*flags, **kwargs)(parser)
    return magic_arguments()(parser)


def help_text(parser: Any) -> str:
    """The usage line and every option."""
    return str(parser.parser.format_help())


def parse(parser: Any, line: str, magic: str) -> Any:
    """``line`` read by ``parser``; a ``UsageError`` saying what could not be read (``None`` for ``--help``, which
    argparse prints itself)."""
    if {"-h", "--help"} & set(line.split()):
        return None
    try:
        return parse_argstring(parser, line)
    except UsageError as err:
        raise UsageError(parse_error_hint(str(err))) from None
    except SystemExit as err:  # argparse's own exit on bad input
        raise UsageError(f"cannot read the options of %{magic}: {line!r}; {QUOTING}") from err
    except ValueError as err:  # shlex: an unclosed quote
        raise UsageError(parse_error_hint(f"cannot read the options of %{magic}: {err}")) from None
