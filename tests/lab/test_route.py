"""``GET vram-magic/kernels`` on a real Jupyter server with real kernels (pytest-jupyter's ``jp_fetch``)."""

from __future__ import annotations

import json
import os

import pytest

from tests.support.lab_server import *  # noqa: F403
from tests.support.lab_server import kernel
from vram_magic.lab.schema import KernelsReply, problems

pytestmark = pytest.mark.slow

TENSOR = 100 * 2**20 * 4  # torch.ones(100 * 2**20): float32, 400 MiB


def test_two_kernels_the_one_holding_a_tensor_reads_more(lab, jp_runtime_dir):
    sa, ka = lab.open("work/a.ipynb")
    sb, kb = lab.open("b.ipynb")
    try:
        for k in (ka, kb):
            lab.execute(k, "import torch")
        pid_a = int(lab.execute(ka, "import os", "os.getpid()"))
        base = kernel(lab.get(), ka)["rss"]
        lab.execute(ka, "%load_ext vram_magic")
        lab.execute(ka, "%%vram -q\nx = torch.ones(100 * 2**20)")
        data = lab.wait(lambda d: (kernel(d, ka)["vram_magic"] or {}).get("last_cell") is not None)
        assert problems(data, KernelsReply) == []  # the answer is what the front end's types say
        a, b = kernel(data, ka), kernel(data, kb)
        assert {a["path"], b["path"]} == {"work/a.ipynb", "b.ipynb"}
        assert a["pid"] == pid_a and a["pid_source"] == "kernel" and a["local_pid"] == pid_a
        assert a["name"] == "python3" and a["session"] == sa and b["session"] == sb
        # the 400 MiB the tensor holds, as resident memory of its kernel only
        assert a["rss"] - base >= 0.85 * TENSOR, (a["rss"], base)
        assert a["rss"] - b["rss"] >= 0.85 * TENSOR, (a["rss"], b["rss"])
        # the kernel's own figures: the measured cell's categories, x under "other", exactly
        own = a["vram_magic"]
        assert own["pid"] == pid_a and own["kernel_id"] == ka and own["notebook"].endswith("/work/a.ipynb")
        assert own["last_cell"]["after"]["other"] == TENSOR
        assert sum(own["last_cell"]["after"].values()) == TENSOR and own["devices"] == []
        assert os.path.isfile(os.path.join(jp_runtime_dir, "vram-magic", f"{pid_a}.json"))
        assert b["vram_magic"] is None
        # no GPU and no NVML here: no GPU figures, and a note that says why
        assert a["gpu"] == [] and data["devices"] == []
        assert any("NVML" in n or "nvidia-ml-py" in n for n in data["notes"])
        # sorted by GPU memory, then resident memory: the kernel holding the tensor first
        assert [k["id"] for k in data["kernels"]] == [ka, kb]
        # the report's categories, in its order and palette, for the panel's bars
        from vram_magic import CATEGORIES
        from vram_magic.render import COLORS

        assert [c["name"] for c in data["categories"]] == list(CATEGORIES)
        assert data["categories"][0]["color"] == COLORS["parameters"]
        # a shut-down kernel disappears
        lab.close(sb)
        data = lab.get()
        assert kernel(data, kb) is None and kernel(data, ka) is not None
        # unloading the extension removes the kernel's figures file
        lab.execute(ka, "%unload_ext vram_magic")
        assert not os.path.exists(os.path.join(jp_runtime_dir, "vram-magic", f"{pid_a}.json"))
        assert kernel(lab.get(), ka)["vram_magic"] is None
    finally:
        lab.stop_clients()


def test_pid_asked_once_per_start_and_again_after_a_restart(lab, jp_serverapp):
    _, k = lab.open("c.ipynb")
    try:
        pid = int(lab.execute(k, "import os", "os.getpid()"))
        collector = jp_serverapp.web_app.settings["vram_magic_collector"]
        first = lab.get()
        asked = collector.pids.asked
        for _ in range(3):
            again = lab.get()
        assert collector.pids.asked == asked  # never asked again while the kernel runs
        assert kernel(first, k)["pid"] == kernel(again, k)["pid"] == pid
        # the history: one sample per call at most every 2 s, (time, rss, gpu)
        h = kernel(again, k)["history"]
        assert 1 <= len(h) <= 2 and h[0][1] == kernel(first, k)["rss"] and h[0][2] == 0
        lab.stop_clients()
        lab.run(jp_serverapp.kernel_manager.restart_kernel(k))
        data = lab.wait(lambda d: kernel(d, k)["pid_source"] == "kernel" and kernel(d, k)["pid"] != pid)
        new = kernel(data, k)["pid"]
        assert new != pid and collector.pids.asked == asked + 1
        assert new == int(lab.execute(k, "import os", "os.getpid()"))
    finally:
        lab.stop_clients()


def test_403_without_a_token(lab, jp_serverapp, http_server_client, jp_base_url):
    assert lab.get()["kernels"] == []
    url = jp_base_url + "vram-magic/kernels"
    r = lab.run(http_server_client.fetch(url, raise_error=False))
    assert r.code == 403
    r = lab.run(http_server_client.fetch(url, raise_error=False, headers={"Authorization": "token wrong"}))
    assert r.code == 403
    token = jp_serverapp.identity_provider.token
    r = lab.run(http_server_client.fetch(url, raise_error=False, headers={"Authorization": f"token {token}"}))
    assert r.code == 200 and json.loads(r.body)["kernels"] == []


def test_asking_for_the_pid_takes_no_reply_from_other_clients(lab, jp_serverapp):
    # Another client made by the kernel manager (as jupyter-resource-usage makes them) shares its Session and
    # so its zmq identity; the route's usage_request must not use that identity too, or the kernel's replies to
    # the other client go astray (seen: lost execute_replies within 10 requests).
    from vram_magic.lab.pids import usage_request

    _, k = lab.open("d.ipynb")
    km = jp_serverapp.kernel_manager.get_kernel(k)
    other = km.client()
    other.start_channels(iopub=False, stdin=False, hb=False, control=False)
    try:
        async def execute(code):
            msg_id = other.execute(code, allow_stdin=False)
            while True:
                msg = await other.get_shell_msg(timeout=20)
                if msg["parent_header"].get("msg_id") == msg_id:
                    return msg["content"]["status"]

        assert lab.run(execute("x = 0")) == "ok"
        pids = set()
        for i in range(20):
            pids.add(lab.run(usage_request(km, 10))["pid"])
            assert lab.run(execute(f"x = {i}")) == "ok"
        assert pids == {km.provisioner.pid}
    finally:
        other.stop_channels()
