"""A ``%%vram`` cell's body, run as IPython runs a cell.

IPython's own steps, in its order: ``transform_cell`` (IPython syntax: ``!ls``, ``%time …``, ``obj?``), the cell
cached under its execution count (tracebacks and allocation sites name ``cell N``), ``compile.ast_parse``,
``transform_ast`` (the user's ``shell.ast_transformers``), then ``run_ast_nodes`` with the shell's
``ast_node_interactivity`` and compiler (its ``__future__`` flags, top-level ``await``). An exception in the body
is caught, shown and stored by IPython's ``run_code``, as in any cell — traceback from the cell's own code,
``sys.last_traceback``, the cell's ``ExecutionResult.error_in_exec`` — and handed back here, so the measurement
ends with it.

What the body's last expression is worth reaches IPython's display hook only after the measurement (its
formatting is no memory of the cell's): ``Out[N]``, ``_N`` and ``_`` with the cell's own number, nothing after a
trailing ``;``.

A body that awaits at top level is a coroutine to run: IPython runs such a cell in its event loop — a Jupyter
kernel's own — when the cell itself awaits, so :func:`awaiting_cells` (an input transformer) makes a ``%%vram``
cell whose body awaits an awaited call of the magic's ``vram_async``. Called any other way, the body runs in the
shell's ``loop_runner``.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable
from typing import Any


class CellRun:
    """``raw``, transformed and parsed as IPython would (raises ``SyntaxError`` and IPython's ``InputRejected``
    as it would); :meth:`run` runs it."""

    def __init__(self, shell: Any, raw: str, count: int) -> None:
        self.shell = shell
        self.raw = raw
        transformed = shell.transform_cell(raw)
        self.name = shell.compile.cache(transformed, count, raw_code=raw)
        self.tree = shell.transform_ast(shell.compile.ast_parse(transformed, filename=self.name))
        self.awaits = bool(shell.should_run_async(raw, transformed_cell=transformed))
        self.quiet = bool(shell.displayhook.semicolon_at_end_of_expression(transformed))
        self.values: list[Any] = []  # what the display hook was given, in order
        self.error: BaseException | None = None

    async def run(self) -> BaseException | None:
        """Run the body; the exception it raised (already shown), if any."""
        from IPython.core.interactiveshell import ExecutionInfo, ExecutionResult

        shell = self.shell
        result = shell.displayhook.exec_result  # the cell's own: its error_in_exec is the body's
        if result is None:
            result = ExecutionResult(ExecutionInfo(self.raw, False, False, False, None))
        before = result.error_in_exec, result.error_before_exec
        values = self.values
        hook = sys.displayhook

        def keep(value: Any) -> None:
            if value is not None:
                values.append(value)

        sys.displayhook = keep
        try:
            await shell.run_ast_nodes(self.tree.body, self.name, interactivity=shell.ast_node_interactivity,
                                      compiler=shell.compile, result=result)
        finally:
            sys.displayhook = hook
        if result.error_in_exec is not before[0]:
            self.error = result.error_in_exec
        elif result.error_before_exec is not before[1]:
            self.error = result.error_before_exec
        return self.error

    def run_here(self) -> BaseException | None:
        """:meth:`run`, from code that is not a coroutine: a body that does not await runs to its end at once;
        one that does runs in the shell's loop runner."""
        coro = self.run()
        if self.awaits:
            return self.shell.loop_runner(coro)
        try:
            coro.send(None)
        except StopIteration as done:
            return done.value
        coro.close()
        raise RuntimeError("the cell's body awaited without a top-level await")

    def show(self) -> None:
        """The values the body's expressions gave, through IPython's display hook (``Out[N]``, ``_N``)."""
        values, self.values = self.values, []
        if self.quiet:
            return
        for value in values:
            self.shell.displayhook(value)


_CALL = "get_ipython().run_cell_magic('vram', "


def awaiting_cells(shell: Any) -> Callable[[list[str]], list[str]]:
    """An input transformer (``shell.input_transformers_post``) for ``%%vram`` cells whose body awaits at top
    level: ``get_ipython().run_cell_magic('vram', LINE, BODY)`` becomes ``await …vram_async(LINE, BODY)``, which
    IPython then runs as the async cell it is."""

    def transform(lines: list[str]) -> list[str]:
        if not lines or not lines[0].startswith(_CALL):
            return lines
        try:
            (stmt,) = ast.parse("".join(lines)).body
            call = stmt.value  # type: ignore[attr-defined]
            line, body = (ast.literal_eval(a) for a in call.args[1:])
            if call.args[0].value != "vram" or not isinstance(body, str) or not isinstance(line, str) or \
                    not shell.should_run_async(body, transformed_cell=shell.transform_cell(body)):
                return lines
        except Exception:  # not the one-line call IPython writes: left as it is
            return lines
        return [f"await get_ipython().magics_manager.registry['VramMagics'].vram_async({line!r}, {body!r})\n"]

    return transform


__all__ = ["CellRun", "awaiting_cells"]
