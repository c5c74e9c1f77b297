"""The package's shape, as its import graph shows it: layers import downwards, with no circle even through imports
deferred into functions (a result calling its own renderer from ``__str__`` / ``_repr_*`` is the one exception); no
private name is imported from another of its modules; modules stay under 600 lines and functions under 120."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "vram_magic"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 120
# a result's text, HTML, plot and snapshot file come from its renderer, imported when the result is shown or saved
# (``_text`` and ``_html`` are what a result gives vram_magic.rendered.Rendered)
RENDER_METHODS = {"__str__", "__repr__", "_repr_html_", "_repr_mimebundle_", "_repr_pretty_", "_text", "_html",
                  "timeline", "save_snapshot"}


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = modules()


def _target(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if MODULES[module].name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _owner(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str) -> list[tuple[str, str | None, bool]]:
    """``(imported module, imported name or None, inside a render method)`` for every import of ``module``."""
    tree = ast.parse(MODULES[module].read_text())
    found: list[tuple[str, str | None, bool]] = []

    def visit(node: ast.AST, in_render: bool) -> None:
        for child in ast.iter_child_nodes(node):
            render = in_render or (isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                                   and child.name in RENDER_METHODS)
            if isinstance(child, ast.Import):
                found.extend((a.name, None, render) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                target = _target(module, child)
                for a in child.names:
                    sub = f"{target}.{a.name}"
                    found.append((sub, None, render) if sub in MODULES else (target, a.name, render))
            visit(child, render)

    visit(tree, False)
    return [(t, n, r) for t, n, r in found if t.split(".")[0] == "vram_magic"]


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for module in MODULES:
        for target, _, in_render in imports(module):
            owner = _owner(target)
            if owner and owner != module and not in_render:
                edges.setdefault(module, set()).add(owner)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            strong(v)
    return groups


def test_the_finder_sees_a_deferred_circle() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_even_through_deferred_imports() -> None:
    edges = graph()
    assert sum(map(len, edges.values())) > 50, "the graph was read"
    assert cycles(edges) == []


def test_no_private_name_is_imported_from_another_module() -> None:
    crossing = [(module, target, name) for module in MODULES for target, name, _ in imports(module)
                if name and name.startswith("_") and not name.startswith("__") and _owner(target) != module]
    assert crossing == []


def test_modules_and_functions_stay_small() -> None:
    long_modules = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    long_functions = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long_functions.append((module, node.name, n))
    assert long_modules == {} and long_functions == []
