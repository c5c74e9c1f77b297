"""``%%vram --ranks``: the cell runs as usual (unmeasured here); every process it starts that joins a
``torch.distributed`` job measures itself, and the per-rank view replaces the cell report."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from IPython.core.error import UsageError

from . import forks
from .launch import LaunchedRanks
from .result import RankReports

_NOT_WITH_RANKS = ("budget", "timeline", "backend", "device")


def check_options(args: Any, ns: Mapping[str, Any]) -> Any:
    """The estimate ``--estimate NAME`` names (or None); a UsageError for options --ranks does not take."""
    if getattr(args, "rest", None):
        raise UsageError(f"unexpected {' '.join(args.rest)!r} after %%vram --ranks; options: -o NAME, -q, "
                         "--estimate NAME, --ranks-dir DIR")
    if args.output is not None and not args.output.isidentifier():
        raise UsageError(f"-o needs a variable name, got {args.output!r}")
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


def run_ranks_cell(magics: Any, cell: str, args: Any) -> None:
    """Run ``cell`` with the ranks it starts armed; store (``-o``) and show their reports, also when it raised."""
    __tracebackhide__ = True  # noqa: F841
    shell = magics.shell
    est = check_options(args, shell.user_ns)
    launched = LaunchedRanks(args.ranks_dir, title=f"%%vram cell {magics._cell_number()}",
                             fork_advice=forks.advice(args.estimate, args.output))
    run = magics.cell_run(cell)
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
            show(magics, reports)


def bundle(reports: RankReports, *, widget: bool = False) -> dict[str, Any]:
    """Static HTML and text; with ``widget``, an ipywidgets view in front of them (as a cell report's)."""
    from .render import ranks_html, ranks_text

    text, html = ranks_text(reports), ranks_html(reports)
    if widget:
        try:
            import ipywidgets as widgets

            from ..render.widget import widget_bundle

            view = widgets.HTML(value=html, layout=widgets.Layout(width="100%"))
            box = widgets.VBox([view], layout=widgets.Layout(max_width="64em"))
            box.add_class("vram-widget")
            return widget_bundle(box, text, html)
        except Exception:  # no ipywidgets, or no kernel: the static view shows everything
            pass
    return {"text/plain": text, "text/html": html}


def show(magics: Any, reports: RankReports) -> None:
    from IPython.display import display

    widget = bool(getattr(magics, "widget", False)) and getattr(magics.shell, "kernel", None) is not None
    display(bundle(reports, widget=widget), raw=True)
