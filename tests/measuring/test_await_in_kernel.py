"""``%%vram`` in a real Jupyter kernel, where IPython's event loop is already running: a body that awaits at top
level runs in it (the cell becomes an async cell), its last value is the cell's ``Out[N]``."""

from __future__ import annotations

import pytest

pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")

from tests.support.kernel import Kernel  # noqa: E402

pytestmark = pytest.mark.slow


def test_top_level_await_in_a_kernel() -> None:
    k = Kernel()
    try:
        assert k.run("%load_ext vram_magic\nimport asyncio, torch")["reply"]["status"] == "ok"
        out = k.run("%%vram -q -o r\nawait asyncio.sleep(0)\nt = torch.zeros(1024)\nawait asyncio.sleep(0)\nt.numel()")
        assert out["reply"]["status"] == "ok", out["reply"]
        (result,) = [m["content"] for m in out["messages"] if m["msg_type"] == "execute_result"]
        assert result["data"]["text/plain"] == "1024"
        assert result["execution_count"] == out["reply"]["execution_count"] == k.value("r.cell")
        assert k.value("r.after.total - r.before.total") == 1024 * 4
        assert k.value(f"_{result['execution_count']}") == 1024
        # the same body without await: the magic runs it at once
        out = k.run("%%vram -q -o r\nu = torch.zeros(256)\nu.numel()")
        (result,) = [m["content"] for m in out["messages"] if m["msg_type"] == "execute_result"]
        assert result["data"]["text/plain"] == "256" and k.value("r.after.total - r.before.total") == 256 * 4
        out = k.run("%%vram -q -o r\nawait asyncio.sleep(0)\nraise ValueError('after await')")
        assert out["reply"]["status"] == "error" and out["reply"]["ename"] == "ValueError"
        tb = "\n".join(out["reply"]["traceback"])
        assert "vram_async" not in tb and "run_cell_magic" not in tb and "after await" in tb
        assert k.value("r.error") == "ValueError: after await"
    finally:
        k.close()
