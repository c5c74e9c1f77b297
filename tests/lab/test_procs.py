"""The route's process facts on this machine's real ``/proc``: NSpid, RSS, parents, and NVML's pids joined to
kernels (the device lists are built here, with real pids: there is no GPU on the CPU runners)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from vram_magic.engine.host import procs
from vram_magic.lab.collect import foreign_pids, join_processes, namespace_notes
from vram_magic.lab.nvml import GpuProcess, Nvml, NvmlDevice, same_device

MiB = 2**20
linux = pytest.mark.skipif(not procs.has_proc(), reason="needs Linux's /proc")


def _spawn(code: str) -> subprocess.Popen:
    """A Python child that prints one line when ready (then sleeps until killed)."""
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def _free_pid() -> int:
    """A pid that is no process now: one of a child that has exited and been reaped."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


@linux
def test_nspid_of_real_processes():
    own = procs.nspid("self")
    assert own and own[0] == os.getpid()
    assert procs.nspid(os.getpid()) == own
    assert procs.parse_nspid("Name:\tpython\nNSpid:\t6653\t2\nNSgid:\t1\n") == (6653, 2)
    assert procs.parse_nspid("Name:\tpython\n") == ()
    assert procs.parse_nspid("NSpid:\tx y\n") == ()
    assert procs.nspid(_free_pid()) == ()


@linux
def test_rss_and_parent_of_a_child_holding_200_mib():
    child = _spawn("import sys, time\nb = bytearray(200 * 2**20)\nfor i in range(0, len(b), 4096): b[i] = 1\n"
                   "print('ready', flush=True)\ntime.sleep(60)")
    try:
        assert child.stdout.readline().strip() == "ready"
        held = procs.rss(child.pid)
        assert held >= 200 * MiB, held
        import psutil

        assert abs(held - psutil.Process(child.pid).memory_info().rss) <= 64 * 4096
        assert procs.parent(child.pid) == os.getpid()
        assert procs.alive(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not procs.alive(child.pid) and procs.rss(child.pid) is None and procs.parent(child.pid) is None


@linux
def test_a_grandchild_counts_for_the_kernel_that_started_it():
    # a "kernel" (child) that starts a worker (grandchild), as a DataLoader or a forked rank does
    kernel = _spawn("import subprocess, sys, time\n"
                    "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                    "print(w.pid, flush=True)\ntime.sleep(60)")
    try:
        worker = int(kernel.stdout.readline())
        assert procs.parent(worker) == kernel.pid
        assert procs.descendants(kernel.pid) == [worker]
        foreign = _free_pid()
        assert procs.owners([worker, kernel.pid, os.getpid(), foreign], {kernel.pid: "k1"}) == {
            worker: "k1", kernel.pid: "k1"}
        # NVML's view: the kernel's own context, its worker's, and a process that is not a kernel (this test)
        dev = NvmlDevice(index=0, name="GPU", uuid="GPU-0a1b", total=16 * 2**30, used=5 * 2**30, free=11 * 2**30,
                     mig=False, processes=(GpuProcess(kernel.pid, 900 * MiB), GpuProcess(worker, 300 * MiB),
                                           GpuProcess(os.getpid(), 700 * MiB)))
        per_kernel, other, by_kernels = join_processes([dev], {kernel.pid: "k1"})
        assert per_kernel == {"k1": {0: 1200 * MiB}}
        assert other == {0: 700 * MiB} and by_kernels == {0: 1200 * MiB}
        assert foreign_pids([dev]) == []
        # a process with no per-process figure (MIG): the rest is unknown, not zero
        mig = NvmlDevice(index=1, name="GPU", uuid="MIG-2c", total=10, used=5, free=5, mig=True,
                     processes=(GpuProcess(os.getpid(), None),))
        _, other, _ = join_processes([dev, mig], {kernel.pid: "k1"})
        assert other == {0: 700 * MiB, 1: None}
        notes = namespace_notes([dev, mig], [], [])
        assert len(notes) == 1 and "MIG" in notes[0] and "per-process" in notes[0]
    finally:
        kernel.kill()
        kernel.wait()


@linux
def test_nvml_pids_from_another_namespace_are_noticed():
    gone = _free_pid()
    dev = NvmlDevice(index=0, name="GPU", uuid="GPU-0a1b", total=16 * 2**30, used=3 * 2**30, free=13 * 2**30, mig=False,
                 processes=(GpuProcess(gone, 2 * 2**30), GpuProcess(os.getpid(), MiB)))
    assert foreign_pids([dev]) == [gone]
    notes = namespace_notes([dev], foreign_pids([dev]), [])
    assert len(notes) == 1 and str(gone) in notes[0] and "--pid=host" in notes[0]
    # a kernel that holds the device by its own figures, while NVML lists other pids only
    k = {"id": "k1", "path": "a.ipynb", "local_pid": os.getpid() + 0, "nspid": None, "gpu": [],
         "vram_magic": {"devices": [{"device": "cuda:0", "uuid": "0a1b", "reserved": 2 * 2**30}]}}
    notes = namespace_notes([dev], [], [k])
    assert len(notes) == 1 and "a.ipynb" in notes[0] and "not among the 2 NVML lists" in notes[0]
    k["gpu"] = [{"index": 0, "source": "nvml", "used": MiB}]
    assert namespace_notes([dev], [], [k]) == []


@linux
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux's unshare")
def test_a_kernel_in_a_nested_pid_namespace():
    # unshare forks a child in a new pid namespace: there it is pid 1, here it has an ordinary pid
    launcher = subprocess.Popen(["unshare", "--pid", "--fork", sys.executable, "-c",
                                 "import os, time; print(os.getpid(), flush=True); time.sleep(60)"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = launcher.stdout.readline()
        if not line:
            pytest.fail(f"unshare --pid could not start here: {launcher.stderr.read().strip()}")
        inner = int(line)
        assert inner == 1  # what the kernel would report for itself (os.getpid() in usage_reply)
        deadline = time.monotonic() + 5
        while not procs.descendants(launcher.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        (child,) = procs.descendants(launcher.pid)
        chain = procs.nspid(child)
        assert chain == (child, 1)
        assert procs.local_pid(inner, launcher.pid) == (child, chain)
        # without a reported pid, the launcher's; a kernel started directly is its own launcher
        assert procs.local_pid(None, launcher.pid) == (launcher.pid, procs.nspid(launcher.pid))
        assert procs.local_pid(os.getpid(), os.getpid()) == (os.getpid(), procs.nspid("self"))
        # a remote kernel (no local process): its reported pid is not this machine's
        assert procs.local_pid(os.getpid(), None) == (None, ())
        k = {"id": "k1", "path": "n.ipynb", "nspid": list(chain), "gpu": [], "vram_magic": None}
        (note,) = namespace_notes([], [], [k])
        assert "nested pid namespace" in note and f"pid 1 is {child} here" in note
    finally:
        launcher.kill()
        launcher.wait()


def test_without_a_driver_nvml_says_why():
    # nvidia-ml-py is installed with the test extra; this machine has no NVIDIA driver
    devices, notes = Nvml().read()
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        assert devices and notes == []
        return
    assert devices == [] and len(notes) == 1 and "NVML is not available" in notes[0]


def test_without_nvidia_ml_py_nvml_says_what_to_install():
    code = ("import sys; sys.modules['pynvml'] = None\n"
            "from vram_magic.lab.nvml import Nvml\nprint(Nvml().read())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "nvidia-ml-py is not installed" in out.stdout and "vram_magic[lab]" in out.stdout


def test_device_uuids_of_nvml_and_torch_match():
    assert same_device("GPU-58b3a2a1-0f6e-11ee-be56-0242ac120002", "58b3a2a1-0f6e-11ee-be56-0242ac120002")
    assert not same_device("GPU-58b3a2a1", "0a1b") and not same_device("GPU-58b3a2a1", None)


@pytest.mark.cuda
def test_gpu_nvml_lists_this_process_within_5_percent():
    # NVML's figure for this process is PyTorch's reserved memory plus the CUDA context, within 5 %; in a
    # container whose pids NVML does not share, or on MIG, the notes say so instead
    pytest.importorskip("pynvml", reason="needs nvidia-ml-py")
    import torch

    index = torch.cuda.current_device()
    torch.zeros(1, device=f"cuda:{index}")
    torch.cuda.synchronize()
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    nvml = Nvml()

    def mine() -> tuple[NvmlDevice, GpuProcess | None]:
        devices, notes = nvml.read()
        assert notes == [], notes
        dev = next(d for d in devices if same_device(d.uuid, uuid))
        return dev, next((p for p in dev.processes if p.pid == os.getpid()), None)

    dev, p0 = mine()
    # like with like: NVML's total counts memory the driver reserves, CUDA's total_memory is what it can allocate
    assert torch.cuda.get_device_properties(index).total_memory <= dev.total
    assert torch.cuda.mem_get_info(index)[1] == torch.cuda.get_device_properties(index).total_memory
    if p0 is None or p0.used is None:
        notes = namespace_notes([dev], foreign_pids([dev]), [])
        assert notes and ("--pid=host" in notes[0] or "per-process" in notes[0]), (dev, notes)
        pytest.skip(f"NVML gives no figure for this process here: {notes[0]}")
    context = p0.used - torch.cuda.memory_reserved(index)
    assert 0 < context < 4 * 2**30, context
    x = torch.empty(2**30, dtype=torch.uint8, device=f"cuda:{index}")
    torch.cuda.synchronize()
    _, p1 = mine()
    want = torch.cuda.memory_reserved(index) + context
    assert abs(p1.used - want) <= 0.05 * want, (p1.used, want)
    assert p1.used - p0.used >= 2**30 * 0.95
    del x
    nvml.close()


def test_a_kernels_resident_memory_counts_its_children():
    """The panel's RAM of a kernel is its own resident memory and its children's (data-loader workers, forked ranks):
    a child holding 100 MiB is found through /proc/<pid>/task/*/children and counted at its own RSS."""
    from vram_magic.lab.collect import _with_children

    code = ("import sys, time\nb = bytearray(100 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\n"
            "print('ready', flush=True)\ntime.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        me = os.getpid()
        assert child.pid in procs.children(me)
        own, theirs = procs.rss(me), procs.rss(child.pid)
        assert theirs >= 100 << 20
        total = _with_children(me)
        assert abs(total - own - sum(procs.rss(c) or 0 for c in procs.children(me))) < 8 << 20
        assert total >= own + theirs - (8 << 20)
    finally:
        child.kill()
        child.wait()
    time.sleep(0.1)
    assert child.pid not in procs.children(os.getpid())
