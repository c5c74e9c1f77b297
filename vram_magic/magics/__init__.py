"""The IPython shell: ``%%vram``, ``%vram …``, ``%vram_estimate`` and ``%vram_plan``; a thin layer over the Python API.

One module per magic family — ``cell`` (``%%vram`` and auto mode, the body run by ``cellrun``), ``line``
(``%vram …``), ``estimate`` (``%vram_estimate``), ``ranks`` (``%%vram --ranks``), ``watch`` (``%vram watch``) —
with ``checks`` (names, paths, sizes) and ``display`` (reports, the live view, the one widget view) shared.
Here: the ``VramMagics`` class IPython registers (its traitlets are ``%config VramMagics.…``), loading and
unloading. Nothing below this package imports it.
"""

from __future__ import annotations

import sys
from typing import Any

from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Bool, Enum, Float, Int

from ..session.state import Session
from . import cell as cells
from .cellrun import CellRun, awaiting_cells


@magics_class
class VramMagics(Magics):
    """Settings (``%config VramMagics.history_size = 50``) are traitlets."""

    history_size = Int(200, help="How many measured cells the history keeps.").tag(config=True)
    widget = Bool(False, help="Also show reports as an ipywidgets view (its saved output needs the notebook's widget "
                  "state; the static HTML report is always there).").tag(config=True)
    live = Float(1.0, help="Seconds a measured cell runs before its live view appears (negative: no live view)."
                 ).tag(config=True)
    live_interval = Float(0.25, help="Seconds between two updates of the live view and of %vram watch.").tag(
        config=True)
    backend = Enum(("auto", "tracker", "allocator"), default_value="auto",
                   help="How %%vram measures: auto (the tracker, or the allocator when the cell runs compiled code), "
                   "tracker (dispatch level: lines, modules, --budget on the CPU) or allocator (the allocator's own "
                   "record: compiled code runs compiled)").tag(config=True)
    record_sites = Bool(True, help="Record the user code line of each allocation (timeline, peak sites).").tag(
        config=True)
    oom = Bool(True, help="Explain every out-of-memory error under its traceback, in any cell (%vram oom on|off); "
               "costs nothing per op").tag(config=True)

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        from ..engine.tracker.frames import refresh_shell_codes

        refresh_shell_codes()
        self.session = Session(shell.user_ns, history_size=self.history_size)
        # the files IPython compiles cells into, mapped to cell numbers: allocation sites read "cell 12:3"
        self.session.cell_files = getattr(shell.compile, "_filename_map", None)
        self.figures: Any = None  # the figures JupyterLab's panel reads (lab.figures), in a Jupyter kernel
        # a %%vram cell whose body awaits runs as an async cell (cellrun.py)
        self._awaiting = awaiting_cells(shell)
        shell.input_transformers_post.append(self._awaiting)
        self.observe(lambda ch: self.session.resize(ch["new"]), names="history_size")
        from ..oom.black_box import BlackBox

        self.black_box = BlackBox(shell, self.session)
        if self.oom:
            self.black_box.arm()
        self.observe(lambda ch: self.black_box.arm() if ch["new"] else self.black_box.disarm(), names="oom")

    # --- %%vram ----------------------------------------------------------------------------------
    @magic_arguments()
    @argument("-o", "--output", metavar="NAME", help="store the report in the variable NAME (also on error)")
    @argument("-q", "--quiet", action="store_true", help="do not display the report")
    @argument("--device", help="cpu, cuda or cuda:N (default: the current CUDA device if any, else cpu)")
    @argument("--budget", metavar="SIZE", help="simulated device size, e.g. 48MiB or 4GiB")
    @argument("--timeline", action="store_true", help="also plot memory over the cell's allocations")
    @argument("--no-trace", action="store_true", help="do not record the code line of each allocation")
    @argument("--backend", choices=("auto", "tracker", "allocator"),
              help="auto (default: the tracker, or the allocator for compiled code), tracker or allocator")
    @argument("--ranks", action="store_true", help="measure every rank the cell starts (torchrun, "
              "torch.multiprocessing, accelerate.notebook_launcher): one bar per rank")
    @argument("--estimate", metavar="NAME", help="with --ranks: an estimate (%%vram_estimate … -o NAME) to show "
              "beside each rank's peak")
    @argument("--ranks-dir", metavar="DIR", help="with --ranks: keep the per-rank reports in DIR")
    @argument("--plan", metavar="NAME[:ROW]", help="set the cell beside a plan's row (%%vram_plan … -o NAME): memory "
              "by category and time, predicted and measured")
    @argument("rest", nargs="*", help="%%vram subcommand (line magic only)")
    @line_cell_magic
    def vram(self, line: str, cell: str | None = None) -> Any:
        """Measure a cell's memory (``%%vram``) or inspect the session (``%vram …``)."""
        __tracebackhide__ = True  # noqa: F841
        if cell is None:
            from .line import line_command

            return line_command(self, line)
        prepared = self._prepare(line, cell)
        if prepared is None:
            return None
        return cells.run_measured(self, *prepared)

    async def vram_async(self, line: str, cell: str) -> None:
        """``%%vram`` for a cell whose body awaits at top level: IPython awaits this in its own loop (the
        input transformer of cellrun.py writes the call)."""
        __tracebackhide__ = True  # noqa: F841
        prepared = self._prepare(line, cell)
        if prepared is not None:
            await cells.measured(self, *prepared)

    def _prepare(self, line: str, cell: str) -> tuple[CellRun, Any] | None:
        """Parse the options, ready the body and start measuring; None where the cell was run already (by
        --ranks, or unmeasured where measuring could not start)."""
        __tracebackhide__ = True  # noqa: F841
        args = parse_argstring(self.vram, line)
        if args.ranks or args.estimate or args.ranks_dir:  # the processes the cell starts, each measuring itself
            from .ranks import run_ranks_cell

            run_ranks_cell(self, cell, args)
            return None
        run = cells.prepare(self, cell, args)
        return None if run is None else (run, args)

    # --- auto mode -------------------------------------------------------------------------------
    def set_auto(self, on: bool) -> None:
        events = self.shell.events
        if on and not self.session.auto:
            events.register("pre_run_cell", self._pre_run_cell)
            events.register("post_run_cell", self._post_run_cell)
        elif not on and self.session.auto:
            events.unregister("pre_run_cell", self._pre_run_cell)
            events.unregister("post_run_cell", self._post_run_cell)
        self.session.auto = on

    def _pre_run_cell(self, info: Any) -> None:
        cells.pre_run_cell(self, info)

    def _post_run_cell(self, result: Any) -> None:
        cells.post_run_cell(self, result)

    # --- %vram_estimate --------------------------------------------------------------------------
    @line_magic
    def vram_estimate(self, line: str) -> Any:
        """Predict a training or inference step's memory without a GPU. See ``%vram_estimate?``."""
        from .display import wants_widget
        from .estimate import run_estimate

        return run_estimate(line, self.shell.user_ns, widget=wants_widget(self))

    # --- %vram_plan ------------------------------------------------------------------------------
    @line_magic
    def vram_plan(self, line: str) -> Any:
        """Rank the combinations of strategies that make a training step fit, by predicted step time. See
        ``%vram_plan?``."""
        from .plan import run_plan

        return run_plan(line, self.shell.user_ns)

    def close(self) -> None:
        if self._awaiting in self.shell.input_transformers_post:
            self.shell.input_transformers_post.remove(self._awaiting)
        self.set_auto(False)
        self.black_box.disarm()
        self.session.close()  # the %vram watch monitor stops with it


_EXT_KEY = "_vram_magic_extension"


def load(ipython: Any) -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        print("vram_magic needs PyTorch, which this kernel cannot import. Install it (e.g. `%pip install torch`) "
              "and run `%load_ext vram_magic` again.", file=sys.stderr)
        return
    if getattr(ipython, _EXT_KEY, None) is not None:
        return
    magics = VramMagics(ipython)
    ipython.register_magics(magics)
    setattr(ipython, _EXT_KEY, magics)
    from ..lab.figures import start_figures  # in a Jupyter kernel: the figures JupyterLab's panel reads

    magics.figures = start_figures(ipython, magics.session)


def unload(ipython: Any) -> None:
    magics = getattr(ipython, _EXT_KEY, None)
    if magics is None:
        return
    if getattr(magics, "figures", None) is not None:
        magics.figures.stop()
    magics.close()
    table = ipython.magics_manager.magics
    for kind, names in (("line", ("vram", "vram_estimate", "vram_plan")), ("cell", ("vram",))):
        for name in names:
            table[kind].pop(name, None)
    ipython.magics_manager.registry.pop("VramMagics", None)
    setattr(ipython, _EXT_KEY, None)


__all__ = ["VramMagics", "load", "unload"]
