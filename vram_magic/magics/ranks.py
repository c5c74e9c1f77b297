"""``%%vram --ranks``: the cell runs as usual (unmeasured here); every process it starts that joins a
``torch.distributed`` job measures itself, and the per-rank view replaces the cell report."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from IPython.core.error import UsageError

from ..ranks import forks
from ..ranks.launch import LaunchedRanks
from ..ranks.result import RankReports
from .cell import cell_number, cell_run
from .checks import Host, check_name
from .display import wants_widget, with_view

_NOT_WITH_RANKS = ("budget", "timeline", "backend", "device")


def check_options(args: Any, ns: Mapping[str, Any]) -> Any:
    """The estimate ``--estimate NAME`` names (or None); a UsageError for options --ranks does not take."""
    if getattr(args, "rest", None):
        raise UsageError(f"unexpected {' '.join(args.rest)!r} after %%vram --ranks; options: -o NAME, -q, "
                         "--estimate NAME, --ranks-dir DIR")
    check_name(args.output, "-o")
    if not args.ranks:
        if args.estimate or args.ranks_dir:
            raise UsageError("--estimate and --ranks-dir go with --ranks (%%vram --ranks --estimate est)")
        return None
    given = [f"--{o}" for o in _NOT_WITH_RANKS if getattr(args, o, None)]
    if given:
        raise UsageError(f"{', '.join(given)} cannot be combined with --ranks: each rank measures itself on its own "
                         "device, with the tracker")
    if not args.estimate:
        return None
    if args.estimate not in ns:
        raise UsageError(f"--estimate {args.estimate}: no variable {args.estimate!r}; make one with "
                         f"%vram_estimate MODEL … --fsdp --world N -o {args.estimate}")
    est = ns[args.estimate]
    if not isinstance(getattr(est, "peak", None), Mapping):
        raise UsageError(f"--estimate {args.estimate}: {type(est).__name__} is not an estimate (make one with "
                         "%vram_estimate … -o NAME or vram_magic.estimate())")
    return est


def run_ranks_cell(host: Host, cell: str, args: Any) -> None:
    """Run ``cell`` with the ranks it starts armed; store (``-o``) and show their reports, also when it raised."""
    __tracebackhide__ = True  # noqa: F841
    shell = host.shell
    est = check_options(args, shell.user_ns)
    launched = LaunchedRanks(args.ranks_dir, title=f"%%vram cell {cell_number(shell)}",
                             fork_advice=forks.advice(args.estimate, args.output))
    run = cell_run(shell, cell)
    try:
        with launched:
            run.run_here()
    finally:
        reports = launched.reports
        if reports is not None and est is not None:
            reports = reports.with_estimate(est)
        if args.output and reports is not None:
            shell.user_ns[args.output] = reports
        run.show()
        if not args.quiet and reports is not None:
            show(host, reports)


def bundle(reports: RankReports, *, widget: bool = False) -> dict[str, Any]:
    """Static HTML and text; with ``widget``, the widget view in front of them (as a cell report's)."""
    from ..ranks.render import ranks_html, ranks_text

    return with_view(ranks_text(reports), ranks_html(reports), widget=widget)


def show(host: Host, reports: RankReports) -> None:
    from IPython.display import display

    display(bundle(reports, widget=wants_widget(host)), raw=True)
