"""Every estimate the test suite makes, as plain numbers, to compare two versions of the estimator.

Record (a pytest plugin: each estimate that ``vram_magic.estimate()``, ``%vram_estimate`` or ``vram_magic.plan()``
returns, keyed by the test that made it and its order there)::

    VRAM_ESTIMATES_OUT=before.jsonl .venv/bin/python -m pytest -p estimate_numbers -q tests/estimator/test_*.py ...

(with ``PYTHONPATH=scripts``), then the same after a change into ``after.jsonl``, and compare::

    .venv/bin/python scripts/estimate_numbers.py before.jsonl after.jsonl

which prints every estimate whose numbers, notes or text differ, field by field, and exits 1 if any does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

_OUT = os.environ.get("VRAM_ESTIMATES_OUT")
_COUNTS: dict[str, int] = {}
_CURRENT: list[str] = [""]


def _plain(value: Any) -> Any:
    """Numbers, strings and containers of them; anything else as its repr."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                if f.name not in ("options", "rerun")}
    return repr(value)


def numbers(est: Any) -> dict[str, Any]:
    """What an estimate says, as plain data: its fields (breakdowns as category → bytes with their detail rows),
    and its text."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(est):
        if f.name in ("options", "rerun", "wall_time"):  # the time a fake run took differs run by run
            continue
        value = getattr(est, f.name)
        if hasattr(value, "as_dict") and hasattr(value, "detail"):
            out[f.name] = {"bytes": value.as_dict(), "detail": _plain(value.detail)}
        else:
            out[f.name] = _plain(value)
    for name in ("ranks",):  # per-rank estimates, where an estimate has them
        value = getattr(est, name, None)
        if value:
            out[name] = [numbers(r) if dataclasses.is_dataclass(r) else _plain(r) for r in value]
    try:
        out["text"] = str(est)
    except Exception as err:  # a renderer that raises is a difference worth seeing
        out["text"] = f"<str() raised {type(err).__name__}: {err}>"
    return out


def _record(kind: str, est: Any) -> None:
    if _OUT is None or not dataclasses.is_dataclass(est):
        return
    test = _CURRENT[0]
    n = _COUNTS.get(test, 0)
    _COUNTS[test] = n + 1
    with open(_OUT, "a") as f:
        f.write(json.dumps({"key": f"{test}#{n}", "kind": kind, "numbers": numbers(est)}) + "\n")


def _wrap(module: Any, name: str, kind: str) -> None:
    original = getattr(module, name, None)
    if original is None or getattr(original, "_recorded", False):
        return

    def recorded(*args: Any, **kwargs: Any) -> Any:
        depth = _DEPTH[0]
        _DEPTH[0] += 1
        try:
            result = original(*args, **kwargs)
        finally:
            _DEPTH[0] -= 1
        if depth == 0:  # the outermost call only: an estimate made inside another is part of it
            _record(kind, result)
        return result

    recorded._recorded = True  # type: ignore[attr-defined]
    recorded.__wrapped__ = original  # type: ignore[attr-defined]
    recorded.__doc__ = original.__doc__
    setattr(module, name, recorded)


_DEPTH = [0]


def pytest_configure(config: Any) -> None:  # the plugin's entry: wrap the public entry points
    if _OUT is None:
        return
    import vram_magic.estimator as est_pkg

    _wrap(est_pkg, "estimate", "estimate")
    for module_name, name in (("vram_magic.estimator.cli.arguments", "estimate_with_batch"),
                              ("vram_magic.estimator", "plan"), ("vram_magic.estimator.planning.planner", "plan")):
        try:
            module = __import__(module_name, fromlist=["_"])
        except ImportError:
            continue
        _wrap(module, name, name)


def pytest_runtest_setup(item: Any) -> None:
    _CURRENT[0] = item.nodeid


def _load(path: str) -> dict[str, Any]:
    with open(path) as f:
        return {row["key"]: row for row in map(json.loads, f) if row}


def _diff(a: Any, b: Any, where: str, out: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            _diff(a.get(k, "<absent>"), b.get(k, "<absent>"), f"{where}.{k}", out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _diff(x, y, f"{where}[{i}]", out)
    elif a != b and not (isinstance(a, float) and isinstance(b, float) and a != a and b != b):  # NaN is NaN
        out.append(f"  {where}: {a!r}\n    -> {b!r}")


def compare(before: str, after: str) -> int:
    a, b = _load(before), _load(after)
    differ = 0
    for key in sorted(set(a) | set(b)):
        if key not in b or key not in a:
            print(f"{key}: only {'before' if key in a else 'after'}")
            differ += 1
            continue
        lines: list[str] = []
        _diff(a[key]["numbers"], b[key]["numbers"], "", lines)
        if lines:
            differ += 1
            print(f"{key}:")
            print("\n".join(lines))
    both = len(set(a) & set(b))
    print(f"{len(a)} estimates before, {len(b)} after; {differ} differ or are missing, "
          f"{both - (differ - len(set(a) ^ set(b)))} identical")
    return 1 if differ else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__)
        sys.exit(2)
    sys.exit(compare(sys.argv[1], sys.argv[2]))
