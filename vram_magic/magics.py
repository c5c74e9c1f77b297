"""The IPython shell: ``%%vram``, ``%vram …`` and ``%vram_estimate``. A thin layer over the Python API."""

from __future__ import annotations

import sys
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Bool, Enum, Float, Int

from .session import Session
from .units import parse_size

_LINE_HELP = (
    "%vram                 memory of the device now\n"
    "%vram all             memory of the CPU and of every visible GPU now (never initialises CUDA)\n"
    "%vram --device DEV    memory of one device now (cpu, cuda, cuda:N)\n"
    "%vram history         one row per measured cell (pandas DataFrame)\n"
    "%vram diff [A B]      compare two measured cells (default: the last two)\n"
    "%vram auto on|off     measure every cell\n"
    "%vram budget SIZE|off simulate a device of SIZE (e.g. 4GiB) for the following cells\n"
    "%vram save PATH [N]   write cell N's (default: last) allocation history as a PyTorch snapshot pickle\n"
    "%vram export PATH     write the history as .csv or .json\n"
    "%vram reset           forget the history\n"
    "%vram watch [DEV] [--interval S]  a standing monitor of the device's memory, updated while cells run\n"
    "%vram watch off       stop it"
)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except (TypeError, ValueError) as err:
        raise UsageError(str(err)) from None


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

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        from .cellrun import awaiting_cells
        from .engine.frames import refresh_shell_codes

        refresh_shell_codes()
        self.session = Session(shell.user_ns, history_size=self.history_size)
        # the files IPython compiles cells into, mapped to cell numbers: allocation sites read "cell 12:3"
        self.session.cell_files = getattr(shell.compile, "_filename_map", None)
        self._auto = False
        self._auto_skip = False
        # a %%vram cell whose body awaits runs as an async cell (cellrun.py)
        self._awaiting = awaiting_cells(shell)
        shell.input_transformers_post.append(self._awaiting)
        self.observe(lambda ch: self.session.resize(ch["new"]), names="history_size")

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
    @argument("rest", nargs="*", help="%%vram subcommand (line magic only)")
    @line_cell_magic
    def vram(self, line: str, cell: str | None = None) -> Any:
        """Measure a cell's memory (``%%vram``) or inspect the session (``%vram …``)."""
        __tracebackhide__ = True  # noqa: F841
        if cell is None:
            return self._line(line)
        prepared = self._prepare(line, cell)
        if prepared is None:
            return None
        run, args = prepared
        measured = self._measured(run, args)
        if run.awaits:
            return self.shell.loop_runner(measured)
        try:
            measured.send(None)
        except StopIteration:
            return None
        measured.close()
        raise RuntimeError("the cell's body awaited without a top-level await")

    async def vram_async(self, line: str, cell: str) -> None:
        """``%%vram`` for a cell whose body awaits at top level: IPython awaits this in its own loop (the
        input transformer of cellrun.py writes the call)."""
        __tracebackhide__ = True  # noqa: F841
        prepared = self._prepare(line, cell)
        if prepared is not None:
            await self._measured(*prepared)

    def _prepare(self, line: str, cell: str) -> tuple[Any, Any] | None:
        """Parse the options, ready the body (cellrun.CellRun) and start measuring; None where the cell was run
        already (by --ranks, or unmeasured where measuring could not start)."""
        __tracebackhide__ = True  # noqa: F841
        args = parse_argstring(self.vram, line)
        if args.ranks or args.estimate or args.ranks_dir:  # the processes the cell starts, each measuring itself
            from .ranks.magic import run_ranks_cell

            run_ranks_cell(self, cell, args)
            return None
        if args.rest:
            raise UsageError(f"unexpected {' '.join(args.rest)!r} after %%vram; options: -o NAME, -q, --device DEV, "
                             "--budget SIZE, --timeline, --no-trace, --backend auto|tracker|allocator")
        budget = _size(args.budget) if args.budget else None
        if self.session.active is not None:
            raise UsageError("%%vram cannot run inside another measured cell (nested %%vram, or %vram auto on): "
                             "measure the outer cell only")
        _check_name(args.output, "-o")
        run = self.cell_run(cell)
        try:
            self.session.record_sites = self.record_sites and not args.no_trace
            self.session.start(args.device, budget=budget, cell=self._cell_number(), source=cell,
                               backend=args.backend or self.backend)
        except ValueError as err:
            raise UsageError(str(err)) from None
        except Exception as err:  # measuring cannot start here: the cell still runs, unmeasured
            _warn(f"vram_magic could not measure this cell ({type(err).__name__}: {err}); it ran unmeasured")
            run.run_here()
            run.show()
            return None
        finally:
            self.session.record_sites = self.record_sites
        return run, args

    def cell_run(self, cell: str) -> Any:
        """A cell's body ready to run as IPython runs a cell (cellrun.CellRun), under this cell's number."""
        from .cellrun import CellRun

        return CellRun(self.shell, cell, self._cell_number())

    async def _measured(self, run: Any, args: Any) -> None:
        """Run the body, measured (the session has started); store (``-o``) and show the report, also when the
        body raised (IPython has shown its traceback and holds the error as the cell's)."""
        __tracebackhide__ = True  # noqa: F841  (IPython hides this frame in tracebacks)
        error: BaseException | None = None
        live = None if args.quiet else _start_live(self)
        try:
            error = await run.run()
        except BaseException as exc:  # one of ours: the body's own exceptions are IPython's to show
            error = exc
            raise
        finally:
            if live is not None:
                live.stop()  # before the measurement ends: the report is built as without it
            report = self.session.finish(error)
            if args.output and report is not None:
                self.shell.user_ns[args.output] = report
            error = None  # its traceback holds frames; do not keep it in this frame
            run.show()  # the cell's own result, as without the magic
            if live is not None and (args.quiet or report is None):
                live.finish(None)
            if not args.quiet and report is not None:
                try:
                    self._show(report, timeline=args.timeline, live=live)
                except Exception as err:  # a display that fails must not fail the cell
                    _warn(f"vram_magic could not display this cell's report ({type(err).__name__}: {err}); "
                          f"it is stored{' in ' + args.output if args.output else ''} and in %vram history")

    def _cell_number(self) -> int:
        """The number in the cell's ``In [N]`` prompt (IPython 9 has already counted the next cell by now)."""
        result = getattr(self.shell.displayhook, "exec_result", None)
        count = getattr(result, "execution_count", None)
        return int(count) if count is not None else int(self.shell.execution_count)

    def _show(self, report: Any, timeline: bool = False, live: Any = None) -> None:
        from .live import show_report

        show_report(self, report, timeline=timeline, live=live)

    # --- %vram subcommands -----------------------------------------------------------------------
    def _line(self, line: str) -> Any:
        words = line.split()
        if not words:
            return self.session.now()
        cmd, rest = words[0], words[1:]
        try:
            if cmd == "all":  # every device: the CPU and each visible GPU
                return [self.session.now(dev) for dev in _devices()]
            if cmd == "history":
                return self.session.history_frame()
            if cmd == "diff":
                if len(rest) not in (0, 2):
                    raise UsageError("usage: %vram diff [A B] (two measured cell numbers)")
                return self.session.diff(*rest) if rest else self.session.diff()
            if cmd == "auto":
                if rest not in (["on"], ["off"]):
                    raise UsageError("usage: %vram auto on|off")
                self.set_auto(rest[0] == "on")
                print(f"%vram auto {rest[0]}: {'every cell is measured' if self._auto else 'cells are not measured'}")
                return None
            if cmd == "watch":
                from .watch import watch_command

                message = watch_command(self, rest)
                if message:
                    print(message)
                return None
            if cmd == "reset":
                self.session.reset()
                print("%vram: history cleared")
                return None
            if cmd == "budget":
                if len(rest) != 1:
                    raise UsageError("usage: %vram budget SIZE|off (e.g. %vram budget 4GiB)")
                self.session.budget = None if rest[0] == "off" else _size(rest[0])
                return None
            if cmd == "save":
                if len(rest) not in (1, 2):
                    raise UsageError("usage: %vram save PATH [CELL]")
                report = self.session.report(rest[1] if len(rest) == 2 else -1)
                _check_path(rest[0])
                try:
                    path = report.save_snapshot(rest[0])
                except OSError as err:
                    raise UsageError(f"cannot write {rest[0]!r}: {err.strerror or err}") from None
                print(f"%vram: wrote {path} (open it at PyTorch's memory viewer)")
                return None
            if cmd == "export":
                if len(rest) != 1:
                    raise UsageError("usage: %vram export PATH.csv|PATH.json")
                from .history import export_history

                _check_path(rest[0])
                try:
                    written = export_history(list(self.session.history), rest[0])
                except OSError as err:
                    raise UsageError(f"cannot write {rest[0]!r}: {err.strerror or err}") from None
                print(f"%vram: wrote {written}")
                return None
            if cmd.startswith("-") or cmd in ("cpu",) or cmd.startswith("cuda"):
                dev = rest[0] if cmd == "--device" and rest else (cmd if not cmd.startswith("-") else None)
                if dev is None:
                    raise UsageError("usage: %vram [--device DEV]")
                return self.session.now(dev)
        except ValueError as err:
            raise UsageError(str(err)) from None
        raise UsageError(f"unknown %vram subcommand {cmd!r}. Use:\n{_LINE_HELP}")

    # --- auto mode -------------------------------------------------------------------------------
    def set_auto(self, on: bool) -> None:
        events = self.shell.events
        if on and not self._auto:
            events.register("pre_run_cell", self._pre_run_cell)
            events.register("post_run_cell", self._post_run_cell)
        elif not on and self._auto:
            events.unregister("pre_run_cell", self._pre_run_cell)
            events.unregister("post_run_cell", self._post_run_cell)
        self._auto = on

    def _pre_run_cell(self, info: Any) -> None:
        raw = (getattr(info, "raw_cell", "") or "").lstrip()
        self._auto_skip = raw.startswith("%%vram") or raw.startswith("%vram") or self.session.active is not None
        if not self._auto_skip:
            try:
                self.session.start(cell=self._cell_number(), source=raw, backend=self.backend)
                self._auto_live = _start_live(self)
            except Exception as err:
                self._auto_skip = True
                _warn(f"vram_magic could not measure this cell ({type(err).__name__}: {err}); it runs unmeasured")

    def _post_run_cell(self, result: Any) -> None:
        if self._auto_skip or self.session.active is None:
            return
        count = getattr(result, "execution_count", None)
        if count is not None:  # exact here; in pre_run_cell IPython 9 has already counted the next cell
            self.session.active.cell = count
        live, self._auto_live = getattr(self, "_auto_live", None), None
        if live is not None:
            live.stop()
        report = self.session.finish(result.error_in_exec)
        if report is None and live is not None:
            live.finish(None)
        if report is not None:
            try:
                self._show(report, live=live)
            except Exception as err:
                _warn(f"vram_magic could not display this cell's report ({type(err).__name__}: {err})")

    # --- %vram_estimate --------------------------------------------------------------------------
    @line_magic
    def vram_estimate(self, line: str) -> Any:
        """Predict a training or inference step's memory without a GPU. See ``%vram_estimate?``."""
        from .estimator.magic import run_estimate_magic

        return run_estimate_magic(self, line)

    def close(self) -> None:
        from .watch import stop_watch

        if self._awaiting in self.shell.input_transformers_post:
            self.shell.input_transformers_post.remove(self._awaiting)
        stop_watch(self)
        self.set_auto(False)
        self.session.close()


def _warn(message: str) -> None:
    import warnings

    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _check_name(name: str | None, option: str) -> None:
    """``-o NAME`` must be a name a variable can have."""
    import keyword

    if name is not None and (not name.isidentifier() or keyword.iskeyword(name)):
        raise UsageError(f"{option} needs a variable name (letters, digits and _; not a Python keyword), "
                         f"got {name!r}")


def _check_path(path: str) -> None:
    """A file can be written at ``path``: its folder exists and is writable (else a UsageError naming it)."""
    import os

    folder = os.path.dirname(os.path.abspath(os.path.expanduser(path)))
    if os.path.isdir(path):
        raise UsageError(f"cannot write {path!r}: it is a folder; give a file name inside it")
    if not os.path.isdir(folder):
        raise UsageError(f"cannot write {path!r}: the folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"cannot write {path!r}: the folder {folder!r} is not writable")


def _devices() -> list[str]:
    import torch

    return ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0)]


def _has_kernel(shell: Any) -> bool:
    return getattr(shell, "kernel", None) is not None


def _start_live(magics: VramMagics) -> Any:
    """The live view of the cell being measured (None where there is no frontend, or it is off)."""
    try:
        from .live import start_for_cell

        return start_for_cell(magics)
    except Exception as err:  # the cell runs and is measured without it
        import warnings

        warnings.warn(f"vram_magic could not start the live view ({type(err).__name__}: {err})", RuntimeWarning,
                      stacklevel=3)
        return None


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
    from .lab.figures import start_figures  # in a Jupyter kernel: the figures JupyterLab's panel reads

    magics.figures = start_figures(ipython, magics.session)


def unload(ipython: Any) -> None:
    magics = getattr(ipython, _EXT_KEY, None)
    if magics is None:
        return
    if getattr(magics, "figures", None) is not None:
        magics.figures.stop()
    magics.close()
    table = ipython.magics_manager.magics
    for kind, names in (("line", ("vram", "vram_estimate")), ("cell", ("vram",))):
        for name in names:
            table[kind].pop(name, None)
    ipython.magics_manager.registry.pop("VramMagics", None)
    setattr(ipython, _EXT_KEY, None)
