"""The route on a GPU: the kernel's process in NVML, joined to its notebook, next to its own figures."""

from __future__ import annotations

import pytest

pytest.importorskip("pytest_jupyter", reason="needs pytest-jupyter[server]")
pytest.importorskip("pynvml", reason="needs nvidia-ml-py")

from tests.support.lab_server import *  # noqa: E402,F403
from tests.support.lab_server import kernel  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.slow]
GiB = 2**30


def nvml_total(index: int) -> int:
    """NVML's own total for device ``index`` (NVML's order), read directly rather than through the route."""
    import pynvml

    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).total)
    finally:
        pynvml.nvmlShutdown()


def test_gpu_route_lists_the_kernels_process_within_5_percent(lab):
    _, k = lab.open("gpu.ipynb")
    try:
        lab.execute(k, "import torch\ntorch.zeros(1, device='cuda')\ntorch.cuda.synchronize()\n%load_ext vram_magic")
        r0 = int(lab.execute(k, "", "torch.cuda.memory_reserved()"))
        uuid = lab.execute(k, "", "str(torch.cuda.get_device_properties(0).uuid)").strip("'")
        total = int(lab.execute(k, "", "torch.cuda.get_device_properties(0).total_memory"))
        data = lab.wait(lambda d: kernel(d, k)["pid_source"] == "kernel" and kernel(d, k)["gpu"])
        me = kernel(data, k)
        dev = next(d for d in data["devices"] if d["uuid"].lower().endswith(uuid.lower()))
        # like with like: the route's device total is NVML's, which counts memory the driver reserves; CUDA's
        # total_memory (totalGlobalMem) is what it can allocate, at most that
        assert dev["total"] == nvml_total(dev["index"]) and total <= dev["total"]
        assert dev["used"] <= dev["total"]
        if me["gpu"][0]["source"] != "nvml":
            # NVML's pids are not this namespace's (a container without --pid=host) or MIG: said, and the
            # kernel's own reserved bytes are shown instead
            assert any("--pid=host" in n or "per-process" in n or "not among" in n for n in data["notes"])
            assert me["gpu"][0]["used"] == r0
            pytest.skip("NVML gives no figure for the kernel's process here; its own figures are shown")
        context = me["gpu"][0]["used"] - r0
        assert 0 < context < 4 * GiB, context
        lab.execute(k, "x = torch.empty(2**30, dtype=torch.uint8, device='cuda')\ntorch.cuda.synchronize()")
        r1 = int(lab.execute(k, "", "torch.cuda.memory_reserved()"))
        a1 = int(lab.execute(k, "", "torch.cuda.memory_allocated()"))
        data = lab.wait(lambda d: kernel(d, k)["gpu"][0]["used"] >= r1)
        me = kernel(data, k)
        g = me["gpu"][0]
        assert g["index"] == dev["index"] and g["total"] == dev["total"]  # NVML's figures, NVML's total
        assert abs(g["used"] - (r1 + context)) <= 0.05 * (r1 + context), (g["used"], r1, context)
        dev = next(d for d in data["devices"] if d["index"] == g["index"])
        assert dev["kernels"] >= g["used"]
        own = me["vram_magic"]["devices"][0]
        assert own["device"] == "cuda:0" and own["reserved"] == r1 and own["allocated"] == a1
        assert own["total"] == total  # the kernel's own figures: CUDA's total_memory
        assert own["uuid"] == uuid
    finally:
        lab.stop_clients()
