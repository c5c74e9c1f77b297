"""The package's shape, as its import graph shows it: layers import downwards, with no circle even through imports
deferred into functions (a result calling its own renderer from ``__str__`` / ``_repr_*`` is the one exception;
counting those too, a renderer naming its result under ``TYPE_CHECKING`` is); no private name is imported from
another of its modules; modules stay under 600 lines, classes under 300 and functions under 120; three files of one
folder never share a name prefix (they are a folder); no module but a package's ``__init__`` only re-exports names."""

from __future__ import annotations

import ast
import re
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
# (``_text`` and ``_html`` are what a result gives vram_magic.core.rendered.Rendered)
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
    # the report and its renderers: render/*.py take Breakdown and CATEGORIES from core/breakdown.py and name CellReport
    # only for annotations, so report -> render (its render methods) -> report is no circle
    edges = graph(render_methods_count=True)
    assert "vram_magic.measuring.render.timeline" in edges["vram_magic.measuring.report"]
    assert "vram_magic.measuring.report" not in edges.get("vram_magic.measuring.render.text", ())
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
    before the first underscore (``generate``, ``generate_cache``, ``generate_loop``)."""
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


# --- the map of the house: folders introduced by their __init__, paths named that exist ------------------------------
FEATURES = ("measuring", "session", "render", "estimator", "magics", "ranks", "lab")


def test_the_engine_imports_no_feature_and_the_core_no_torch() -> None:
    edges = graph(render_methods_count=True)
    engine_up = sorted((m, t) for m, ts in edges.items() if m.startswith("vram_magic.engine")
                       for t in ts if t.split(".")[1] in FEATURES)
    assert engine_up == []
    for module in (m for m in MODULES if m.startswith("vram_magic.core")):
        tree = ast.parse(MODULES[module].read_text())
        imported = {t for t, _, _ in imports(module)} | {a.name for n in ast.walk(tree) if isinstance(n, ast.Import)
                                                         for a in n.names}
        imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}
        outside = sorted(t for t in imported if t.split(".")[0] == "torch"
                         or (t.startswith("vram_magic") and not t.startswith("vram_magic.core")))
        assert outside == [], (module, outside)


def introduction(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def test_every_folder_is_introduced_by_its_init() -> None:
    """A package's ``__init__`` says what its folder holds, in more words than its own name."""
    thin = sorted(str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("__init__.py")
                  if "labextension" not in p.parts and len(introduction(p).split()) < 12)
    assert thin == []


#: names of files that a docstring or doc mentions but that are not this checkout's: others' code, by a path
#: under its own package (``torch/...``, ``transformers/...``), and files a user or a test writes
EXTERNAL_ROOTS = ("torch/", "transformers/", "IPython/", "ipykernel/", "bitsandbytes/", "torchao/", "peft/",
                  "diffusers/", "torchtitan/", "torchtune/", "megatron/", "jupyter_server/", "jupyter_resource_usage/",
                  "jupyterlab_nvdashboard/", "line_profiler/", "accelerate/", "deepspeed/", "vllm/", "c10/", "aten/",
                  "test/", "src/")
WRITTEN_BY_USERS = {"script.py", "train.py", "fsdp_job.py", "tp_pp_job.py", "tp_pp_models.py", "rankjob.py",
                    "sitecustomize.py", "setup.py"}
MENTION = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w-]+\.py)\b")
CHECKOUT = PACKAGE.parent


def _checkout_files() -> list[str]:
    return [p.relative_to(CHECKOUT).as_posix() for top in ("vram_magic", "tests", "benchmarks", "scripts", "ci", "docs")
            for p in (CHECKOUT / top).rglob("*") if p.is_file() and "__pycache__" not in p.parts]


def named_paths(text: str) -> list[tuple[int, str]]:
    return [(i, m.group(1)) for i, line in enumerate(text.splitlines(), 1) for m in MENTION.finditer(line)]


def prose(path: Path) -> str:
    """What a reader reads in a file: a module's docstrings and comments, a document's text outside its code blocks,
    a notebook's markdown cells (code that names a file it writes is code, not prose)."""
    text = path.read_text()
    if path.suffix == ".py":
        import io
        import tokenize

        tree = ast.parse(text)
        docs = [ast.get_docstring(n) or "" for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        comments = [t.string for t in tokenize.generate_tokens(io.StringIO(text).readline)
                    if t.type == tokenize.COMMENT]
        return "\n".join(docs + comments)
    if path.suffix == ".ipynb":
        import json

        cells = json.loads(text)["cells"]
        return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def resolves(name: str, where: str, files: list[str]) -> bool:
    if name.startswith(EXTERNAL_ROOTS) or name in WRITTEN_BY_USERS:
        return True
    if "/" in name:
        return any(f == name or f.endswith("/" + name) for f in files)
    folder = Path(where).parent  # a bare name: a file of the mentioning file's folder, or of a folder above it
    while True:
        if (CHECKOUT / folder / name).exists():
            return True
        if folder == Path("."):
            return False
        folder = folder.parent


def test_the_path_finder_reads_prose_only() -> None:
    assert named_paths("see ``engine/cuda/device.py`` and history.py.") == [(1, "engine/cuda/device.py"),
                                                                          (1, "history.py")]
    files = ["vram_magic/engine/cuda/device.py", "vram_magic/engine/cuda/history.py"]
    assert resolves("engine/cuda/device.py", "docs/x.md", files)
    assert not resolves("engine/cell.py", "docs/x.md", files)
    assert resolves("torch/utils/viz/MemoryViz.py", "docs/x.md", files)


def test_every_python_path_named_in_prose_exists() -> None:
    """Every ``*.py`` a docstring, a comment, a document or a notebook's text names is a file of this checkout (or
    someone else's, named by its own package's path)."""
    files = _checkout_files()
    sources = [CHECKOUT / f for f in files if f.endswith((".py", ".md"))]
    sources += [CHECKOUT / "README.md", *sorted((CHECKOUT / "notebooks").glob("*.ipynb"))]
    stale = [f"{p.relative_to(CHECKOUT)}:{i}: {name}" for p in sources for i, name in named_paths(prose(p))
             if not resolves(name, p.relative_to(CHECKOUT).as_posix(), files)]
    assert stale == []


# --- a class counted with the classes of this package it is made of -----------------------------------------------
MAX_CLASS_WITH_BASES = 400
KNOWN_LONG_COMPOSITE_CLASSES: set[str] = set()


def _classes() -> dict[str, tuple[int, list[str]]]:
    """``module.Class`` -> (its lines, the ``module.Class`` of each base defined in this package)."""
    out: dict[str, tuple[int, list[str]]] = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        names = {a.asname or a.name: f"{target}.{a.name}" for target, a in
                 ((_target(module, n), a) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names)}
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                bases = []
                for b in node.bases:
                    name = ast.unparse(b)
                    bases.append(names.get(name, f"{module}.{name}"))
                out[f"{module}.{node.name}"] = (node.end_lineno - node.lineno + 1, bases)
    return out


def composite_size(name: str, classes: dict[str, tuple[int, list[str]]], seen: set[str] | None = None) -> int:
    seen = set() if seen is None else seen
    if name in seen or name not in classes:
        return 0
    seen.add(name)
    own, bases = classes[name]
    return own + sum(composite_size(b, classes, seen) for b in bases)


def test_a_class_counts_with_its_bases_in_the_package() -> None:
    toy = {"m.A": (250, ["m.B", "torch.X"]), "m.B": (200, []), "m.C": (100, ["m.B", "m.B"])}
    assert composite_size("m.A", toy) == 450 and composite_size("m.C", toy) == 300
    classes = _classes()
    found = [c for c in classes if composite_size(c, classes) > MAX_CLASS_WITH_BASES]
    assert_only_known(found, KNOWN_LONG_COMPOSITE_CLASSES,
                      f"classes over {MAX_CLASS_WITH_BASES} lines with their bases")


def test_the_readme_is_short_and_every_link_of_the_docs_resolves() -> None:
    readme = CHECKOUT / "README.md"
    assert len(readme.read_bytes()) <= 12 * 1024
    broken = []
    for page in [readme, *sorted((CHECKOUT / "docs").glob("*.md"))]:
        for link in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            path = link.split("#")[0]
            if path and not link.startswith(("http://", "https://", "mailto:")) and not (page.parent / path).exists():
                broken.append(f"{page.name}: {link}")
    assert broken == []
