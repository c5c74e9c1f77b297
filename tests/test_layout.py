"""The package's shape, as its import graph shows it: layers import downwards, with no circle even through imports
deferred into functions (a result calling its own renderer from ``__str__`` / ``_repr_*`` is the one exception;
counting those too, a renderer naming its result under ``TYPE_CHECKING`` is); no private name is imported from
another of its modules; modules stay under 600 lines, classes under 300 and functions under 120; three files of one
folder never share a name prefix (they are a folder); no module but a package's ``__init__`` only re-exports names."""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "vram_magic"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 120
MAX_CLASS_LINES = 300
PREFIX_FILES = 3  # this many files of one folder named ``<prefix>.py`` or ``<prefix>_*.py`` are a folder

# Today's offenders of the rules that came last, while their owners split them: each set only shrinks. A test fails
# for an offender missing here, and for one listed here that no longer offends (delete its line then).
KNOWN_LONG_CLASSES: set[str] = set()
KNOWN_PREFIX_FOLDERS: set[str] = set()
KNOWN_REEXPORTS: set[str] = set()
# circles when a result's render methods count, their renderers' type-only imports aside
KNOWN_RENDER_CIRCLES = {
    frozenset({"vram_magic.ranks.render", "vram_magic.ranks.result"}),
}
# a result's text, HTML, plot and snapshot file come from its renderer, imported when the result is shown or saved
# (``_text`` and ``_html`` are what a result gives vram_magic.rendered.Rendered)
RENDER_METHODS = {"__str__", "__repr__", "_repr_html_", "_repr_mimebundle_", "_repr_pretty_", "_text", "_html",
                  "timeline", "figure", "save_snapshot"}


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


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def imports(module: str, *, type_only: bool = False) -> list[tuple[str, str | None, bool]]:
    """``(imported module, imported name or None, inside a render method)`` for every import of ``module``; with
    ``type_only``, ``(…, under TYPE_CHECKING)`` instead."""
    tree = ast.parse(MODULES[module].read_text())
    found: list[tuple[str, str | None, bool]] = []

    def visit(node: ast.AST, in_render: bool, typing: bool) -> None:
        for child in ast.iter_child_nodes(node):
            render = in_render or (isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                                   and child.name in RENDER_METHODS)
            flag = typing or _type_checking(child)
            mark = flag if type_only else render
            if isinstance(child, ast.Import):
                found.extend((a.name, None, mark) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                target = _target(module, child)
                for a in child.names:
                    sub = f"{target}.{a.name}"
                    found.append((sub, None, mark) if sub in MODULES else (target, a.name, mark))
            visit(child, render, flag)

    visit(tree, False, False)
    return [(t, n, r) for t, n, r in found if t.split(".")[0] == "vram_magic"]


def graph(*, render_methods_count: bool = False) -> dict[str, set[str]]:
    """Who imports whom. By default an import in a render method is no edge; with ``render_methods_count`` it is,
    and an import under ``TYPE_CHECKING`` (a name for annotations, never imported at run time) is none."""
    edges: dict[str, set[str]] = {}
    for module in MODULES:
        for target, _, skip in imports(module, type_only=render_methods_count):
            owner = _owner(target)
            if owner and owner != module and not skip:
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


def assert_only_known(found: Iterable, known: set, what: str) -> None:
    """Every offender of a rule is a known one, and every known one still offends (the list only shrinks)."""
    found = set(found)
    new = sorted(map(str, found - known))
    gone = sorted(map(str, known - found))
    assert not new, f"{what}: {new}"
    assert not gone, f"no longer {what}, so no longer known offenders (delete them from the list): {gone}"


def test_known_offenders_only_shrink() -> None:
    assert_only_known({"a"}, {"a"}, "x")
    with pytest.raises(AssertionError, match=r"x: \['b'\]"):
        assert_only_known({"a", "b"}, {"a"}, "x")  # a new offender
    with pytest.raises(AssertionError, match=r"no longer x.*\['a'\]"):
        assert_only_known(set(), {"a"}, "x")  # a listed one that was fixed: the list must lose it


def test_no_circle_counting_render_methods_type_only_imports_aside() -> None:
    # the report and its renderers: render/*.py take Breakdown and CATEGORIES from breakdown.py and name CellReport
    # only for annotations, so report -> render (its render methods) -> report is no circle
    edges = graph(render_methods_count=True)
    assert "vram_magic.render.timeline" in edges["vram_magic.report"]
    assert "vram_magic.report" not in edges.get("vram_magic.render.text", ())
    assert_only_known(map(frozenset, cycles(edges)), KNOWN_RENDER_CIRCLES, "import circles")


def long_classes(source: str, module: str) -> list[str]:
    return [f"{module}.{node.name}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES]


def test_classes_stay_small() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES))
    assert long_classes(f"class Long:\n{body}\n", "m") == ["m.Long"]  # 301 lines
    assert long_classes(f"class Fits:\n{body[:body.rindex(chr(10))]}\n", "m") == []  # 300 lines
    found = [c for m, p in MODULES.items() for c in long_classes(p.read_text(), m)]
    assert_only_known(found, KNOWN_LONG_CLASSES, f"classes over {MAX_CLASS_LINES} lines")


def prefix_folders(paths: Iterable[Path]) -> list[str]:
    """``folder/prefix*`` where :data:`PREFIX_FILES` or more modules of a folder share the part of their names
    before the first underscore (``generate.py``, ``generate_cache.py``, ``generate_loop.py``)."""
    groups: dict[tuple[str, str], list[str]] = defaultdict(list)
    for p in paths:
        if p.name != "__init__.py":
            groups[(p.parent.as_posix(), p.stem.split("_")[0])].append(p.name)
    return sorted(f"{folder}/{prefix}*" for (folder, prefix), names in groups.items() if len(names) >= PREFIX_FILES)


def test_files_sharing_a_prefix_are_a_folder() -> None:
    sample = [Path("p/generate.py"), Path("p/generate_loop.py"), Path("p/generate_cache.py"), Path("p/gen.py"),
              Path("p/cuda.py"), Path("p/cuda_oom.py"), Path("q/cuda_model.py"), Path("p/__init__.py")]
    assert prefix_folders(sample) == ["p/generate*"]
    found = prefix_folders(p.relative_to(PACKAGE.parent) for p in MODULES.values())
    assert_only_known(found, KNOWN_PREFIX_FOLDERS, f"{PREFIX_FILES} or more files sharing a prefix (make a folder)")


def only_reexports(source: str) -> bool:
    """A module that imports names and does nothing else: no definition, no statement but imports, ``__all__`` and
    aliases of names it imported (a docstring and type-only imports aside)."""
    imported, other = False, False
    for node in ast.parse(source).body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imported = True
        elif _type_checking(node):
            continue
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, (ast.Name, ast.Attribute,
                                                                                       ast.List, ast.Tuple)):
            # __all__ = [...], or X = imported.X
            continue
        else:
            other = True
    return imported and not other


def test_no_module_only_reexports_another_s_names() -> None:
    assert only_reexports('"""Doc."""\nfrom __future__ import annotations\nfrom .a import B as B\n__all__ = ["B"]\n')
    assert only_reexports("import x\nY = x.Y\n")
    assert not only_reexports("from .a import B\n\ndef f():\n    return B\n")
    assert not only_reexports('"""Only a docstring."""\n')
    found = [m for m, p in MODULES.items() if p.name != "__init__.py" and only_reexports(p.read_text())]
    assert_only_known(found, KNOWN_REEXPORTS, "modules that only re-export another's names")
