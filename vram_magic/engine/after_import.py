"""Run something right after a module is first imported: a one-shot import hook (for a rank that imports
``torch.distributed`` or the pipelining package after its measurement began)."""

from __future__ import annotations

import importlib.machinery
import sys
from typing import Any


class AfterImport:
    """A one-shot import hook: runs ``then(module)`` right after ``name`` has been executed; what ``then`` raises is
    dropped (the import itself goes on as it would)."""

    def __init__(self, name: str, then: Any) -> None:
        self.name = name
        self.then = then

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        loader = getattr(spec, "loader", None)
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute, then = loader.exec_module, self.then

        def exec_module(module: Any) -> None:
            execute(module)
            try:
                then(module)
            except Exception:
                pass

        loader.exec_module = exec_module
        return spec


def after_import(name: str, then: Any) -> None:
    """``then(module)`` once ``name`` is imported (nothing more if a hook for ``name`` is already waiting)."""
    if not any(isinstance(f, AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, AfterImport(name, then))


def forget(name: str) -> None:
    """Take back a hook for ``name`` that is still waiting."""
    for finder in [f for f in sys.meta_path if isinstance(f, AfterImport) and f.name == name]:
        sys.meta_path.remove(finder)


__all__ = ["AfterImport", "after_import", "forget"]
