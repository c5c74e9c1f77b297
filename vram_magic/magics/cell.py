"""``%%vram`` on a cell, and auto mode (``%vram auto on``: every cell measured).

The body runs as IPython runs a cell (``cellrun.CellRun``), between the session's ``start`` and ``finish``; the
report is stored (``-o``) and shown in place of the live view, also when the body raised.
"""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError

from .cellrun import CellRun
from .checks import Host, check_name, size, warn
from .display import show_report, start_live

CELL_OPTIONS = ("-o NAME, -q, --device DEV, --budget SIZE, --timeline, --no-trace, --backend auto|tracker|allocator, "
                "--plan NAME[:ROW]")


def cell_number(shell: Any) -> int:
    """The number in the cell's ``In [N]`` prompt (IPython 9 has already counted the next cell by now)."""
    result = getattr(shell.displayhook, "exec_result", None)
    count = getattr(result, "execution_count", None)
    return int(count) if count is not None else int(shell.execution_count)


def cell_run(shell: Any, cell: str) -> CellRun:
    """A cell's body ready to run as IPython runs a cell, under this cell's number."""
    return CellRun(shell, cell, cell_number(shell))


def prepare(host: Host, cell: str, args: Any) -> CellRun | None:
    """Check the options, ready the body and start measuring; None where the cell was run already (unmeasured,
    where measuring could not start)."""
    __tracebackhide__ = True  # noqa: F841
    session = host.session
    if args.rest:
        raise UsageError(f"unexpected {' '.join(args.rest)!r} after %%vram; options: {CELL_OPTIONS}")
    budget = size(args.budget) if args.budget else None
    if session.active is not None:
        raise UsageError("%%vram cannot run inside another measured cell (nested %%vram, or %vram auto on): "
                         "measure the outer cell only")
    check_name(args.output, "-o")
    args.planned = planned(host, args.plan) if getattr(args, "plan", None) else None
    run = cell_run(host.shell, cell)
    try:
        session.record_sites = host.record_sites and not args.no_trace
        session.start(args.device, budget=budget, cell=cell_number(host.shell), source=cell,
                      backend=args.backend or host.backend)
    except ValueError as err:
        raise UsageError(str(err)) from None
    except Exception as err:  # measuring cannot start here: the cell still runs, unmeasured
        warn(f"vram_magic could not measure this cell ({type(err).__name__}: {err}); it ran unmeasured", 4)
        run.run_here()
        run.show()
        return None
    finally:
        session.record_sites = host.record_sites
    return run


def planned(host: Host, text: str) -> Any:
    """``(plan, row)`` that ``--plan NAME[:ROW]`` names, checked before the cell runs."""
    from ..estimator.planning.result import plan_row

    name = text.partition(":")[0]
    if name not in host.shell.user_ns:
        raise UsageError(f"--plan {text}: no variable {name!r} (make a plan with %vram_plan … -o {name})")
    try:
        return plan_row(host.shell.user_ns[name], text)
    except ValueError as err:
        raise UsageError(str(err)) from None


async def measured(host: Host, run: CellRun, args: Any) -> None:
    """Run the body, measured (the session has started); store (``-o``) and show the report, also when the
    body raised (IPython has shown its traceback and holds the error as the cell's)."""
    __tracebackhide__ = True  # noqa: F841  (IPython hides this frame in tracebacks)
    shell, session = host.shell, host.session
    error: BaseException | None = None
    live = None if args.quiet else start_live(host)
    try:
        error = await run.run()
    except BaseException as exc:  # one of ours: the body's own exceptions are IPython's to show
        error = exc
        raise
    finally:
        if live is not None:
            live.stop()  # before the measurement ends: the report is built as without it
        report = session.finish(error)
        if args.output and report is not None:
            shell.user_ns[args.output] = report
        error = None  # its traceback holds frames; do not keep it in this frame
        run.show()  # the cell's own result, as without the magic
        if live is not None and (args.quiet or report is None):
            live.finish(None)
        if not args.quiet and report is not None:
            try:
                show_report(host, report, timeline=args.timeline, live=live)
                if getattr(args, "planned", None) is not None:
                    from IPython.display import display

                    from ..estimator.planning.result import check

                    display(check(*args.planned, report))
            except Exception as err:  # a display that fails must not fail the cell
                warn(f"vram_magic could not display this cell's report ({type(err).__name__}: {err}); "
                     f"it is stored{' in ' + args.output if args.output else ''} and in %vram history", 4)


def run_measured(host: Host, run: CellRun, args: Any) -> None:
    """:func:`measured` from code that is not a coroutine: a body that awaits runs in the shell's loop runner."""
    __tracebackhide__ = True  # noqa: F841
    coro = measured(host, run, args)
    if run.awaits:
        return host.shell.loop_runner(coro)
    try:
        coro.send(None)
    except StopIteration:
        return None
    coro.close()
    raise RuntimeError("the cell's body awaited without a top-level await")


# --- auto mode ------------------------------------------------------------------------------------------------
def pre_run_cell(host: Host, info: Any) -> None:
    """Before each cell (``pre_run_cell``): start measuring it, unless it measures itself or one is running."""
    session = host.session
    raw = (getattr(info, "raw_cell", "") or "").lstrip()
    session.auto_skip = raw.startswith("%%vram") or raw.startswith("%vram") or session.active is not None
    if not session.auto_skip:
        try:
            session.start(cell=cell_number(host.shell), source=raw, backend=host.backend)
            session.auto_live = start_live(host)
        except Exception as err:
            session.auto_skip = True
            warn(f"vram_magic could not measure this cell ({type(err).__name__}: {err}); it runs unmeasured", 4)


def post_run_cell(host: Host, result: Any) -> None:
    """After each cell (``post_run_cell``): end its measurement and show the report."""
    session = host.session
    if session.auto_skip or session.active is None:
        return
    count = getattr(result, "execution_count", None)
    if count is not None:  # exact here; in pre_run_cell IPython 9 has already counted the next cell
        session.active.cell = count
    live, session.auto_live = session.auto_live, None
    if live is not None:
        live.stop()
    report = session.finish(result.error_in_exec)
    if report is None and live is not None:
        live.finish(None)
    if report is not None:
        try:
            show_report(host, report, live=live)
        except Exception as err:
            warn(f"vram_magic could not display this cell's report ({type(err).__name__}: {err})", 4)
