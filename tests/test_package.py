"""Package-level promises: importing has no side effects, a kernel without torch gets a message, units."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vram_magic import format_bytes, parse_size


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_import_has_no_side_effects():
    out = _python("import sys, vram_magic\n"
                  "print(sorted(m for m in ('IPython', 'ipywidgets', 'matplotlib', 'torch') if m in sys.modules))")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_kernel_without_torch_gets_a_clear_message():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from IPython.core.interactiveshell import InteractiveShell\n"
            "sh = InteractiveShell.instance()\n"
            "r = sh.run_cell('%load_ext vram_magic')\n"
            "print('ok', r.success)")
    out = _python(code)
    assert out.returncode == 0, out.stderr
    assert "vram_magic needs PyTorch" in out.stderr
    assert "ok True" in out.stdout


def test_parse_size():
    assert parse_size("48MiB") == 48 * 1024**2
    assert parse_size("4 GiB") == 4 * 1024**3
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("4096") == 4096
    assert parse_size("2k") == 2048
    assert parse_size(512) == 512
    for bad in ("", "12XB", "-3MiB", "GiB", "0"):
        with pytest.raises(ValueError, match="size"):
            parse_size(bad)
    with pytest.raises(TypeError):
        parse_size(1.5)  # type: ignore[arg-type]


def test_format_bytes_binary_units():
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(16_957_480) == "16.2 MiB"
    assert format_bytes(3 * 1024**3) == "3.00 GiB"
    assert format_bytes(-2048, signed=True) == "−2.00 KiB"
    assert format_bytes(-5) == "−5 B"
    assert format_bytes(2048, signed=True) == "+2.00 KiB"


def test_device_now_for_every_device(shell):
    import torch

    shell.run_cell("import torch\nt = torch.zeros(1000)", store_history=True)
    nows = shell.run_line_magic("vram", "all")
    assert [n.device for n in nows][0] == "cpu"
    assert len(nows) == 1 + (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert nows[0].breakdown.other == 4000
    assert "3.91 KiB" in str(nows[0])  # 4000 bytes in binary units


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_device_now_reconciles_with_the_driver(shell):
    import torch

    shell.run_cell("import torch\ng = torch.zeros(2**20, device='cuda')", store_history=True)
    now = shell.run_line_magic("vram", "--device cuda")
    s = now.stats
    assert s.allocated >= 4 * 2**20 and s.reserved >= s.allocated
    assert s.total == torch.cuda.get_device_properties(0).total_memory
    assert s.outside_allocator is not None and s.outside_allocator >= 0
    assert now.breakdown.other >= 4 * 2**20


def test_no_lower_layer_imports_the_magics():
    """The IPython shell (``vram_magic/magics/``) sits on top: no other module imports it, even inside a function,
    but the package's ``load_ipython_extension`` / ``unload_ipython_extension``."""
    import ast
    from pathlib import Path

    import vram_magic

    root = Path(vram_magic.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] == "magics" or rel == Path("__init__.py"):
            continue
        package = ["vram_magic", *rel.parts[:-1]]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                names = [".".join([*base, node.module or ""]).strip(".")]
                names += [f"{names[0]}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if any(n == "vram_magic.magics" or n.startswith("vram_magic.magics.") for n in names):
                found.append(f"{rel}:{node.lineno}")
    assert found == []
    assert sum(1 for _ in root.rglob("*.py")) > 50  # the walk saw the package
