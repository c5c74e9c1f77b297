"""Write labextension/src/schema.ts, the front end's types of the JupyterLab extension's JSON, from
vram_magic/lab/schema.py: run it after changing the schema, then rebuild the front end
(``cd labextension && npm run build:prod``). ``--check`` says whether the committed file is up to date (exit 1 if not).
"""

from __future__ import annotations

import ast
import inspect
import sys
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints, is_typeddict

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vram_magic.lab import schema  # noqa: E402

TARGET = ROOT / "labextension" / "src" / "schema.ts"
CONSTANTS = ("FORMAT", "ROUTE")
HEADER = ("// The JSON of vram_magic's JupyterLab extension, generated from vram_magic/lab/schema.py by\n"
          "// scripts/lab_types.py: edit the schema and run the script, not this file.\n")


def ts_type(kind: Any) -> str:
    if is_typeddict(kind):
        return f"I{kind.__name__}"
    origin, args = get_origin(kind), get_args(kind)
    if origin in (Union, types.UnionType):
        return " | ".join(ts_type(a) for a in args)
    if origin is Literal:
        return " | ".join(f"'{a}'" for a in args)
    if origin is list:
        inner = ts_type(args[0])
        return f"({inner})[]" if get_origin(args[0]) in (Union, types.UnionType, Literal) else f"{inner}[]"
    if origin is tuple:
        return f"[{', '.join(ts_type(a) for a in args)}]"
    if origin is dict:
        return f"Record<{ts_type(args[0])}, {ts_type(args[1])}>"
    return {int: "number", float: "number", str: "string", bool: "boolean", type(None): "null"}[kind]


def comments() -> dict[str, str]:
    """``{"Class.field" or "CONSTANT": the comment after it}`` from the schema's source."""
    source = inspect.getsource(schema)
    lines = source.splitlines()
    out = {}

    def after(node: ast.stmt) -> str:
        rest = lines[node.end_lineno - 1][node.end_col_offset:]
        return rest.split("#", 1)[1].strip() if "#" in rest else ""

    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    out[f"{node.name}.{item.target.id}"] = after(item)
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            out[node.targets[0].id] = after(node)
    return out


def render() -> str:
    notes = comments()
    parts = [HEADER]
    for name in CONSTANTS:
        value = getattr(schema, name)
        literal = f"[{', '.join(repr(v) for v in value)}]" if isinstance(value, tuple) else repr(value)
        note = f" // {notes[name]}" if notes.get(name) else ""
        parts.append(f"export const {name} = {literal};{note}\n")
    for kind in vars(schema).values():
        if not (is_typeddict(kind) and kind.__module__ == schema.__name__):
            continue
        doc = inspect.cleandoc(kind.__doc__ or "").replace("``", "`")
        lines = [f"\n/** {doc} */\n" if doc else "\n", f"export interface I{kind.__name__} {{\n"]
        for field, sub in get_type_hints(kind).items():
            note = notes.get(f"{kind.__name__}.{field}")
            lines.append(f"  {field}: {ts_type(sub)};{f' // {note}' if note else ''}\n")
        lines.append("}\n")
        parts.append("".join(lines))
    return "".join(parts)


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        current = TARGET.read_text() if TARGET.exists() else ""
        if current != text:
            print(f"{TARGET.relative_to(ROOT)} is not the generation of vram_magic/lab/schema.py: run "
                  "python scripts/lab_types.py", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
