"""Everything about vram_magic that only a CUDA GPU can settle, in one run that prints a PASS/FAIL table per check.

    python benchmarks/gpu_check.py                  # on a machine with a CUDA GPU (under 8 minutes on one)
    python benchmarks/gpu_check.py --wheels DIR     # ... installing missing packages from local wheels only
    python benchmarks/gpu_check.py --dry-run        # anywhere: its own plumbing, no device step
    python benchmarks/gpu_check.py --download-wheels DIR   # fetch the wheels a GPU box without an index needs

1. **setup**: the project installed from this checkout (``pip install --no-deps -e .``; without a build backend,
   ``PYTHONPATH``), its dependencies and pytest (from ``--wheels DIR`` if given, else the package index), and a
   CUDA build of PyTorch if the machine has an NVIDIA driver but PyTorch was built without CUDA;
2. **GPU tests**: only the ``cuda``-marked tests (``pytest -m cuda``), one table row per check they settle;
3. **estimate vs CUDA**: ``vram_magic.estimate`` with the detected GPU's constants against
   ``max_memory_allocated`` and ``max_memory_reserved`` of the same two AdamW steps, per model of
   ``tests/support/zoo.py`` (one process each, target 5 %);
4. **overhead** of a measured cell on a launch-bound model (a 2 x 256 MLP, batch 32, 200 AdamW steps in one
   cell: tiny ops, the worst case), both backends;
5. **a compiled model** (inductor, warmed up) stepped in a ``%%vram`` cell: the allocator backend is chosen,
   nothing recompiles, and the cell's peak matches ``max_memory_allocated`` of the same step unmeasured;
6. **cuDNN's workspace** beyond each convolution's tensors, forward and backward, per distinct convolution of the
   zoo's conv models, with ``cudnn.benchmark`` off and on: the figures that should replace the estimator's
   constant (``CUDNN_WORKSPACE``, 64 MiB per convolution);
7. **the planner's time model**: a small GPT-2 (transformers, 6 × 768, batch 8 × 1024, AdamW) as it is, with
   checkpointing and under bf16 autocast, each plan's predicted step time (the detected GPU's catalogue figures,
   uncalibrated) beside the median of 10 real steps; the fastest-to-slowest order must agree.

``--report FILE`` writes the tables to a file too. The exit status is 1 if any check failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUDGET_S = 7.5 * 60  # the whole run stays under 8 minutes: steps left when this is spent are skipped
TARGET = 5.0  # % error of the estimate
#: import name -> requirement, for what the engine, its magics and the tests import
NEEDS = {"IPython": "ipython>=8.0", "ipywidgets": "ipywidgets>=7.7", "matplotlib": "matplotlib>=3.5",
         "pandas": "pandas>=1.5", "pytest": "pytest>=7",
         # the JupyterLab route's GPU tests: a real Jupyter server, NVML
         "pytest_jupyter": "pytest-jupyter[server]>=0.10", "pynvml": "nvidia-ml-py>=12"}
#: the checks named for the GPU run, and the tests that settle each
CHECKS = {
    "cell peak in block sizes, user's max_memory_allocated untouched": [
        "test_gpu_peak_in_block_sizes_without_touching_the_users_counter",
        "test_cuda_cell_peak_without_resetting_the_users_counter"],
    "user already records history (all / state-only)": ["test_gpu_users_history_is_read_and_left_on",
                                                        "test_gpu_state_only_recording_is_said"],
    "a wrapped history buffer": ["test_gpu_wrapped_buffer_is_said"],
    "recording turned on inside a cell is left on": ["test_gpu_history_turned_on_inside_the_cell_is_left_on"],
    "cudaMallocAsync backend (subprocess)": ["test_gpu_cuda_malloc_async"],
    "OOM request size: < 1 MiB, 1-10 MiB, above": ["test_gpu_oom_sizes_from_the_trace"],
    "--budget restores the fraction (tracker, allocator)": [
        "test_gpu_budget_puts_the_users_fraction_back",
        "test_cuda_budget_limits_the_allocator_and_restores_the_fraction"],
    "%vram, %vram all, default %%vram, measure() create no context": ["test_gpu_looking_creates_no_context"],
    "first context counted as the cell's": ["test_gpu_first_context_counts_as_the_cells"],
    "cuda:1 when there are two GPUs": ["test_gpu_second_device"],
    "before reconciled with the allocator": ["test_gpu_before_is_reconciled_with_the_allocator"],
    "record_stream: frees count when requested": ["test_gpu_record_stream_frees_count_when_requested"],
    "%vram --device cuda reconciles with the driver": ["test_cuda_device_now_reconciles_with_the_driver"],
    "JupyterLab route: the kernel's process in NVML within 5 % of reserved + context": [
        "test_gpu_nvml_lists_this_process_within_5_percent",
        "test_gpu_route_lists_the_kernels_process_within_5_percent"],
    "SDPA and dropout as CUDA runs them: a GPT-2 step's estimate within 5 % of max_memory_allocated": [
        "test_gpu_gpt2_step_estimate_matches_max_memory_allocated"],
    "autocast as CUDA runs it: GPT-2, Llama, Linear-LayerNorm-Softmax, bf16 and fp16, within 5 %": [
        "test_gpu_autocast_step_estimate_matches_max_memory_allocated"],
    "OOM cell: allocator read after its frames are released": [
        "test_gpu_out_of_memory_cell_reads_the_allocator_after_releasing_its_frames"],
    "peak counter reset inside the cell: the replay is the peak": [
        "test_gpu_peak_reset_inside_the_cell_keeps_the_cells_peak"],
    "--budget: current device kept; no fraction under a GC threshold": [
        "test_gpu_budget_keeps_the_current_device", "test_gpu_budget_leaves_the_allocator_alone_under_a_gc_threshold"],
    "looking never calls torch.cuda.is_available (cuInit)": ["test_gpu_nothing_that_looks_calls_is_available"],
    "allocator model = real allocator: default, expandable, max_split, roundup": [
        "test_gpu_allocator_model_matches_under_each_setting"],
    "expandable_segments: cell blocks and the estimate (5 %)": [
        "test_gpu_expandable_segments_in_a_measured_cell_and_the_estimate"],
    "history recorded with skip_actions is said": ["test_gpu_skip_actions_recording_is_said"],
    "NVML's total vs CUDA's total_memory, like with like": [
        "test_gpu_nvml_lists_this_process_within_5_percent",
        "test_gpu_route_lists_the_kernels_process_within_5_percent"],
}


class Table:
    """Rows of (check, result, detail), printed as a fixed-width table."""

    def __init__(self, title: str, out: list[str]) -> None:
        self.title, self.rows, self.out = title, [], out

    def add(self, check: str, result: str, detail: str = "") -> None:
        self.rows.append((check, result, detail))

    @property
    def failed(self) -> bool:
        return any(r == "FAIL" for _, r, _ in self.rows)

    def print(self) -> None:
        width = max([len(c) for c, _, _ in self.rows] + [len("check")])
        lines = [f"== {self.title}", f"   {'check':<{width}}  {'result':<6}  detail",
                 f"   {'-' * width}  ------  ------"]
        for check, result, detail in self.rows:
            lines.append(f"   {check:<{width}}  {result:<6}  {detail}")
        text = "\n".join(lines)
        print(text, flush=True)
        self.out.append(text)


def run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout, 1), cwd=ROOT,
                          env={**os.environ, **(env or {})})


def pythonpath_env() -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)}


def pip(args: list[str], dry: bool, timeout: float = 300) -> tuple[bool, str]:
    cmd = [sys.executable, "-m", "pip", *args]
    if dry:
        return True, "would run: " + " ".join(cmd[2:])
    done = run(cmd, timeout)
    return done.returncode == 0, (done.stderr or done.stdout).strip().splitlines()[-1:][0] if (
        done.stderr or done.stdout).strip() else ""


# --- 1. setup --------------------------------------------------------------------------------------------
def setup(args: argparse.Namespace, out: list[str]) -> tuple[Table, dict[str, str]]:
    t = Table("setup", out)
    env = pythonpath_env()
    dry = args.dry_run
    site = None
    if args.wheels:
        site = os.path.join(tempfile.gettempdir(), "vram_magic_site")
    missing = [req for mod, req in NEEDS.items() if importlib.util.find_spec(mod) is None]
    if missing:
        if args.wheels:
            wheels = sorted(os.path.join(args.wheels, f) for f in os.listdir(args.wheels) if f.endswith(".whl"))
            ok, msg = pip(["install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade",
                           "--target", site, *wheels], dry)
            env["PYTHONPATH"] = os.pathsep.join([site, env["PYTHONPATH"]])
            sys.path.insert(0, site)
        else:
            ok, msg = pip(["install", "-q", *missing], dry)
        t.add("dependencies " + ", ".join(missing), "PASS" if ok else "FAIL", msg)
    else:
        t.add("dependencies", "PASS", "ipython, ipywidgets, matplotlib, pandas, pytest importable")
    try:
        import torch

        cuda_build = torch.version.cuda is not None
        t.add("PyTorch", "PASS", f"{torch.__version__}, CUDA {torch.version.cuda}, "
              f"{torch.cuda.device_count() if cuda_build else 0} GPU(s)")
    except ImportError:
        cuda_build = False
        t.add("PyTorch", "INFO", "not installed")
    if not cuda_build and shutil.which("nvidia-smi"):  # an NVIDIA driver, but no CUDA build: PyPI's Linux wheel is one
        ok, msg = pip(["install", "-q", "--upgrade", "torch"], dry, timeout=900)
        t.add("CUDA build of PyTorch", "PASS" if ok else "FAIL", msg)
    ok, msg = pip(["install", "-q", "--no-deps", "--no-build-isolation", "-e", ROOT], dry)
    t.add("project installed from this checkout", "PASS" if ok else "INFO",
          msg if ok else f"pip could not install it ({msg}): imported through PYTHONPATH")
    done = run([sys.executable, "-c", "import vram_magic, os; print(os.path.dirname(vram_magic.__file__))"], 120, env)
    where = done.stdout.strip()
    ok = done.returncode == 0 and os.path.abspath(where) == os.path.join(ROOT, "vram_magic")
    t.add("vram_magic imports from this checkout", "PASS" if ok else "FAIL",
          where if done.returncode == 0 else done.stderr.strip().splitlines()[-1:])
    return t, env


# --- 2. the cuda-marked tests ------------------------------------------------------------------------------
def cuda_test_files() -> list[str]:
    files = []
    for folder, _, names in sorted(os.walk(os.path.join(ROOT, "tests"))):
        for name in sorted(names):
            if name.startswith("test_") and name.endswith(".py"):
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    text = f.read()
                if "mark.cuda" in text or "needs a CUDA GPU" in text:
                    files.append(os.path.relpath(os.path.join(folder, name), ROOT))
    return files


def junit_results(path: str) -> dict[str, tuple[str, str]]:
    """test name -> (PASS / FAIL / SKIP, first line of the message)."""
    out: dict[str, tuple[str, str]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "").split("[")[0]
        result, detail = "PASS", ""
        for tag, res in (("failure", "FAIL"), ("error", "FAIL"), ("skipped", "SKIP")):
            node = case.find(tag)
            if node is not None:
                result = res
                detail = (node.get("message") or "").strip().splitlines()[0][:100] if node.get("message") else ""
                break
        prev = out.get(name)
        if prev is None or prev[0] != "FAIL":
            out[name] = (result, detail)
    return out


def gpu_tests(env: dict[str, str], out: list[str], timeout: float) -> Table:
    t = Table("GPU tests (pytest -m cuda)", out)
    files = cuda_test_files()
    xml = os.path.join(tempfile.mkdtemp(), "cuda.xml")
    try:
        done = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", "-rfs",
                    f"--junitxml={xml}", *files], timeout, env)
    except subprocess.TimeoutExpired:
        t.add("pytest -m cuda", "FAIL", f"did not finish in {timeout:.0f} s")
        return t
    tail = done.stdout.strip().splitlines()[-1:] or done.stderr.strip().splitlines()[-1:]
    if not os.path.exists(xml):
        t.add("pytest -m cuda", "FAIL", f"exit {done.returncode}: {tail}")
        return t
    results = junit_results(xml)
    seen: set[str] = set()
    for check, names in CHECKS.items():
        got = [results[n] for n in names if n in results]
        seen.update(names)
        if not got:
            t.add(check, "FAIL", "its tests were not collected")
        elif any(r == "FAIL" for r, _ in got):
            t.add(check, "FAIL", next(d for r, d in got if r == "FAIL"))
        elif all(r == "SKIP" for r, _ in got):
            t.add(check, "SKIP", got[0][1])
        else:
            t.add(check, "PASS")
    for name, (result, detail) in sorted(results.items()):
        if name not in seen:
            t.add(name, result, detail)
    t.add("pytest -m cuda (all)", "PASS" if done.returncode in (0, 5) else "FAIL", tail[0] if tail else "")
    return t


# --- 3. estimate vs the real run ---------------------------------------------------------------------------
def detected_gpu():
    import torch

    from vram_magic.estimator.device.gpus import GPU, find_gpu

    name = torch.cuda.get_device_name(0)
    try:
        return find_gpu(name)
    except ValueError:
        props = torch.cuda.get_device_properties(0)
        return GPU(name, int(props.total_memory), "detected", capability=(props.major, props.minor))


def estimate_one(name: str, dry: bool) -> None:
    """One model in this (fresh) process: the real two steps first, then the estimate; prints a JSON line."""
    sys.path.insert(0, ROOT)  # tests.support
    import torch

    import vram_magic
    from tests.support.zoo import ZOO, train_steps

    build, make_inputs = ZOO[name]
    real = reserved = None
    gpu = None
    if not dry:
        torch.manual_seed(0)
        torch.cuda.reset_peak_memory_stats()  # our own process: nobody else's peak counter to spoil
        base = torch.cuda.memory_allocated()
        with torch.device("cuda"):
            model = build()
        x = make_inputs().cuda()
        train_steps(model, x, 2)
        torch.cuda.synchronize()
        real = torch.cuda.max_memory_allocated() - base
        reserved = torch.cuda.max_memory_reserved()
        gpu = detected_gpu()
    est = vram_magic.estimate(build, make_inputs, device="cuda", gpu=gpu)
    print(json.dumps({"real": real, "reserved": reserved, "estimate": est.peak.total, "est_reserved": est.reserved,
                      "gpu": gpu.name if gpu is not None else None,
                      "workspace": dict(est.modelled).get("cuBLAS workspaces")}))


def estimate_vs_cuda(env: dict[str, str], out: list[str], dry: bool, deadline: float) -> Table:
    sys.path.insert(0, ROOT)  # tests.support
    from tests.support.zoo import ZOO

    t = Table(f"estimate vs CUDA: max_memory_allocated / max_memory_reserved, AdamW, 2 steps (target ±{TARGET:g} %)",
              out)
    names = list(ZOO)
    for i, name in enumerate(names):
        if dry and i > 0:
            t.add(name, "SKIP", "dry run: one model exercises the plumbing")
            continue
        left = deadline - time.monotonic()
        if left < 20:
            t.add(name, "SKIP", "out of time")
            continue
        cmd = [sys.executable, os.path.abspath(__file__), "--estimate-one", name] + (["--dry-run"] if dry else [])
        try:
            done = run(cmd, min(left, 180), env)
        except subprocess.TimeoutExpired:
            t.add(name, "FAIL", "timed out")
            continue
        if done.returncode != 0:
            t.add(name, "FAIL", (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1][:100])
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        mib = 2**20
        if r["real"] is None:
            t.add(name, "SKIP", f"dry run: estimate {r['estimate'] / mib:.1f} MiB, reserved "
                  f"{r['est_reserved'] / mib:.1f} MiB (no device run)")
            continue
        err = 100.0 * (r["estimate"] - r["real"]) / r["real"]
        err_r = 100.0 * (r["est_reserved"] - r["reserved"]) / r["reserved"]
        ok = abs(err) <= TARGET and abs(err_r) <= TARGET
        t.add(name, "PASS" if ok else "FAIL",
              f"allocated {r['real'] / mib:.1f} vs {r['estimate'] / mib:.1f} MiB ({err:+.2f} %), reserved "
              f"{r['reserved'] / mib:.1f} vs {r['est_reserved'] / mib:.1f} MiB ({err_r:+.2f} %), {r['gpu']}, "
              f"cuBLAS {(r['workspace'] or 0) / mib:.3f} MiB")
    return t


# --- 4. overhead on a launch-bound model ---------------------------------------------------------------------
def overhead(out: list[str], dry: bool) -> Table:
    t = Table("overhead of a measured cell, launch-bound model (2 x Linear(256, 256), batch 32, AdamW, 200 steps)",
              out)
    if dry:
        t.add("plain / tracker / allocator", "SKIP", "dry run")
        return t
    import torch

    import vram_magic

    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(32, 256, device="cuda")
    ns = {"model": model, "opt": opt, "x": x}

    def steps() -> None:
        for _ in range(200):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()

    def measured(backend: str) -> None:
        with vram_magic.measure("cuda", namespace=ns, backend=backend):
            steps()

    variants = {"plain": steps, "tracker": lambda: measured("tracker"), "allocator": lambda: measured("allocator")}
    for fn in variants.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(5):
        for k, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    base = statistics.median(times["plain"])
    t.add("plain", "INFO", f"{base * 1000:.1f} ms for 200 steps")
    for k in ("tracker", "allocator"):
        ratio = statistics.median(a / b for a, b in zip(times[k], times["plain"]))
        t.add(f"measure(backend={k!r})", "INFO", f"x{ratio:.2f} (median of 5 paired runs)")
    return t


# --- 5. a compiled model in a measured cell ------------------------------------------------------------------
COMPILED_CHILD = """
import json, sys, torch
sys.path.insert(0, {here!r})
from tests.support.zoo import ZOO, train_steps
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output
torch.manual_seed(0)
DEV = {device!r}  # "cpu" in a dry run: the same code, checked without a device
build, make_inputs = ZOO["Transformer (tied)"]
model = build().to(DEV)
x = make_inputs().to(DEV)
opt = torch.optim.AdamW(model.parameters())
cm = torch.compile(model)
train_steps(cm, x, 2, opt)
from torch._dynamo.utils import counters
before_counts = json.dumps({{k: dict(v) for k, v in counters.items()}}, sort_keys=True)
real = None
if DEV == "cuda":
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()  # a process of its own: nobody else's counter to spoil
    train_steps(cm, x, 1, opt)
    torch.cuda.synchronize()
    real = torch.cuda.max_memory_allocated() - base
sh = InteractiveShell.instance()
sh.user_ns.update(cm=cm, x=x, opt=opt, train_steps=train_steps)
with capture_output():
    sh.run_cell("%load_ext vram_magic")
    sh.run_cell(f"%%vram -q -o r --device {{DEV}}\\ntrain_steps(cm, x, 1, opt)")
r = sh.user_ns["r"]
after_counts = json.dumps({{k: dict(v) for k, v in counters.items()}}, sort_keys=True)
print(json.dumps({{"real": real, "measured": r.peak.total - r.before.total, "backend": r.backend,
                  "recompiled": before_counts != after_counts, "notes": list(r.notes)}}))
"""


def compiled_model(out: list[str], dry: bool, deadline: float) -> Table:
    t = Table("a compiled model (inductor, warmed up) in a %%vram cell: Transformer (tied), AdamW", out)
    if time.monotonic() > deadline - 60:
        t.add("backend, recompiles, peak vs max_memory_allocated", "SKIP", "out of time")
        return t
    try:
        done = run([sys.executable, "-c", COMPILED_CHILD.format(here=ROOT, device="cpu" if dry else "cuda")],
                   deadline - time.monotonic(), pythonpath_env())
    except subprocess.TimeoutExpired:
        t.add("backend, recompiles, peak vs max_memory_allocated", "FAIL", "timed out")
        return t
    if done.returncode != 0:
        t.add("compiled step in a measured cell", "FAIL", (done.stderr.strip().splitlines() or ["?"])[-1][:150])
        return t
    r = json.loads(done.stdout.strip().splitlines()[-1])
    where = " (dry run: on the CPU)" if dry else ""
    t.add("auto picks the allocator backend" + where, "PASS" if r["backend"] == "allocator" else "FAIL",
          r["backend"])
    t.add("nothing recompiled inside the cell" + where, "FAIL" if r["recompiled"] else "PASS", "dynamo's counters")
    if r["real"] is None:
        t.add("peak vs max_memory_allocated, same step unmeasured", "SKIP",
              f"dry run: measured {r['measured'] / 2**20:.1f} MiB on the CPU")
        return t
    err = 100.0 * (r["measured"] - r["real"]) / max(r["real"], 1)
    t.add("peak vs max_memory_allocated, same step unmeasured", "PASS" if abs(err) <= 2.0 else "FAIL",
          f"{r['measured'] / 2**20:.1f} vs {r['real'] / 2**20:.1f} MiB ({err:+.2f} %)")
    return t


# --- 6. cuDNN's workspace per convolution ------------------------------------------------------------------
CUDNN_CHILD = """
import json, sys, torch
sys.path.insert(0, {here!r})
from tests.support.zoo import ZOO
DEV = {device!r}
torch.backends.cudnn.benchmark = {benchmark!r}
shapes = {{}}  # (in, out, kernel, stride, padding, dilation, groups, input shape) -> model
for name in ("ConvNet+BN", "U-Net"):
    build, make_inputs = ZOO[name]
    model = build()
    def seen(m, a, name=name):  # returns None: the input stays as it is
        shapes.setdefault((m.in_channels, m.out_channels, m.kernel_size, m.stride, m.padding, m.dilation, m.groups,
                           tuple(a[0].shape)), name)
    hooks = [m.register_forward_pre_hook(seen) for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    with torch.no_grad():
        model(make_inputs())
    for h in hooks:
        h.remove()
class NoDevice:  # a dry run: the same steps on the CPU, with every counter reading 0
    synchronize = reset_peak_memory_stats = staticmethod(lambda: None)
    max_memory_allocated = memory_allocated = staticmethod(lambda: 0)
M = torch.cuda if DEV == "cuda" else NoDevice
rows = []
for i, ((cin, cout, k, s, p, d, g, shape), name) in enumerate(shapes.items()):
    conv_name = f"{{cin}}->{{cout}} k{{k[0]}} s{{s[0]}} on {{list(shape)}}"
    row = {{"model": name, "conv": conv_name, "fwd": None, "bwd": None}}
    if DEV == "cuda" or i < 2:  # a dry run steps two of them on the CPU
        conv = torch.nn.Conv2d(cin, cout, k, s, p, d, g).to(DEV)
        x = torch.randn(shape, device=DEV, requires_grad=True)
        for _ in range(2):  # the first call chooses the algorithm (benchmark mode tries several)
            y = conv(x)
            y.backward(torch.ones_like(y))
        x.grad = None
        conv.zero_grad(set_to_none=True)
        del y
        M.synchronize()
        M.reset_peak_memory_stats()  # a process of its own: nobody else's counter to spoil
        y = conv(x)
        M.synchronize()
        row["fwd"] = M.max_memory_allocated() - M.memory_allocated()  # above input, weights and output
        g_out = torch.ones_like(y)
        M.synchronize()
        M.reset_peak_memory_stats()
        y.backward(g_out)
        M.synchronize()
        row["bwd"] = M.max_memory_allocated() - M.memory_allocated()  # above the gradients it made
        del y, g_out, x, conv
    rows.append(row)
print(json.dumps(rows))
"""


def cudnn_workspace(out: list[str], dry: bool, deadline: float) -> Table:
    """What cuDNN takes beyond a convolution's tensors, per distinct convolution of the zoo's conv models: the
    figure the estimator models as a constant (``cuda_model.CUDNN_WORKSPACE``), to be set from these numbers."""
    sys.path.insert(0, ROOT)
    from vram_magic.estimator.device.cuda_model import CUDNN_WORKSPACE

    mib = 2**20
    t = Table(f"cuDNN workspace per convolution, beyond its tensors (modelled: {CUDNN_WORKSPACE / mib:g} MiB each)",
              out)
    for benchmark in (False, True):
        label = f"cudnn.benchmark={benchmark}"
        if time.monotonic() > deadline - 30:
            t.add(label, "SKIP", "out of time")
            continue
        code = CUDNN_CHILD.format(here=ROOT, device="cpu" if dry else "cuda", benchmark=benchmark)
        try:
            done = run([sys.executable, "-c", code], min(deadline - time.monotonic(), 120), pythonpath_env())
        except subprocess.TimeoutExpired:
            t.add(label, "FAIL", "timed out")
            continue
        if done.returncode != 0:
            t.add(label, "FAIL", (done.stderr.strip().splitlines() or ["?"])[-1][:150])
            continue
        rows = json.loads(done.stdout.strip().splitlines()[-1])
        if dry:
            stepped = sum(r["fwd"] is not None for r in rows)
            t.add(label, "SKIP", f"dry run: {len(rows)} distinct convolutions found, {stepped} stepped on the CPU")
            continue
        for r in rows:
            t.add(f"{label} {r['model']} {r['conv']}", "INFO",
                  f"forward {r['fwd'] / mib:.2f} MiB, backward {r['bwd'] / mib:.2f} MiB")
        worst = max(max(r["fwd"], r["bwd"]) for r in rows)
        t.add(f"{label}: the largest", "INFO", f"{worst / mib:.2f} MiB (modelled {CUDNN_WORKSPACE / mib:g} MiB)")
    return t


# --- 7. the planner's time model against real steps -------------------------------------------------------------
#: three plans of one model: estimate()'s options, as a plan row carries them
TIME_PLANS = {"as it is (fp32)": {}, "checkpointing": {"checkpointing": True}, "bf16 autocast": {"amp": "bf16"}}


def plan_time_one(dry: bool) -> None:
    """A small GPT-2 (transformers), three plans: each one's predicted step time (its estimate's trace timed by the
    planner's own functions, as a plan row's time) and the median of its real steps; prints a JSON line. A dry run
    predicts for the H100 entry and steps a tiny one (vocabulary 512) on the CPU."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import vram_magic
    from vram_magic.estimator.device.gpus import find_gpu
    from vram_magic.estimator.timing.rates import gpu_rates
    from vram_magic.estimator.timing.step_time import micro_ops, network_for, step_time

    layers, batch, seq, rounds = (2, 2, 64, 1) if dry else (6, 8, 1024, 10)
    # a dry run's vocabulary is small: bf16 matmuls on a CPU without AVX-512 run at a fraction of a GFLOP/s
    config = GPT2Config(n_layer=layers, n_embd=768, n_head=12, n_positions=seq, **({"vocab_size": 512} if dry else {}))
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    gpu = find_gpu("H100-80GB") if dry else detected_gpu()
    if not gpu.peaks:
        print(json.dumps({"skip": f"{gpu.name} is not in the catalogue: no peaks to time with"}))
        return
    dev = "cpu" if dry else "cuda"
    out = {"gpu": gpu.name, "model": f"GPT-2 {layers} x 768, batch {batch} x {seq}, AdamW", "rows": {}}
    for name, opts in TIME_PLANS.items():
        est = vram_magic.estimate(lambda: GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids}, gpu=gpu, **opts)
        trace = est.rerun.trace(est.options)
        predicted = step_time(micro_ops(trace, gpu_rates(gpu)), est.options, trace, network_for(gpu, 1)).total
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config).to(dev)
        if opts.get("checkpointing"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        opt = torch.optim.AdamW(model.parameters())
        x = ids.to(dev)
        times = []
        for i in range(rounds + 2):  # two warm-up steps
            t0 = time.perf_counter()
            with torch.autocast(dev, dtype=torch.bfloat16, enabled="amp" in opts):
                loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if dev == "cuda":
                torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        out["rows"][name] = {"predicted": predicted, "measured": statistics.median(times)}
        del model, opt, loss
    print(json.dumps(out))


def plan_times(env: dict[str, str], out: list[str], dry: bool, deadline: float) -> Table:
    t = Table("the planner's time model: predicted vs measured step time, three plans (uncalibrated; the ranking "
              "must agree)", out)
    left = deadline - time.monotonic()
    if left < 30:
        t.add("three plans of a small GPT-2", "SKIP", "out of time")
        return t
    if importlib.util.find_spec("transformers") is None:
        t.add("three plans of a small GPT-2", "SKIP", "transformers is not installed")
        return t
    cmd = [sys.executable, os.path.abspath(__file__), "--plan-time-one"] + (["--dry-run"] if dry else [])
    try:
        done = run(cmd, min(left, 240), env)
    except subprocess.TimeoutExpired:
        t.add("three plans of a small GPT-2", "FAIL", "timed out")
        return t
    if done.returncode != 0:
        t.add("three plans of a small GPT-2", "FAIL", (done.stderr.strip().splitlines() or ["?"])[-1][:150])
        return t
    r = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in r:
        t.add("three plans of a small GPT-2", "SKIP", r["skip"])
        return t
    rows = r["rows"]
    for name, v in rows.items():
        t.add(f"{name}: {r['model']}", "INFO", f"predicted {v['predicted'] * 1e3:.1f} ms ({r['gpu']}), measured "
              f"{v['measured'] * 1e3:.1f} ms{' on the CPU (dry run)' if dry else ''} "
              f"(measured / predicted ×{v['measured'] / v['predicted']:.2f})")
    by_predicted = sorted(rows, key=lambda k: rows[k]["predicted"])
    by_measured = sorted(rows, key=lambda k: rows[k]["measured"])
    same = by_predicted == by_measured
    t.add("fastest to slowest", "SKIP" if dry else ("PASS" if same else "FAIL"),
          f"predicted {' < '.join(by_predicted)}; measured {' < '.join(by_measured)}")
    return t


# --- 8. a real out-of-memory error, explained ----------------------------------------------------------------
OOM_CHILD = """
import json, sys, torch
sys.path.insert(0, {here!r})
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output
import vram_magic
DEV = {device!r}
sh = InteractiveShell.instance()
shown = []
with capture_output():
    sh.run_cell("%load_ext vram_magic")  # armed before CUDA starts: the history covers every block
    sh._vram_magic_extension.black_box.show = shown.append
    sh.run_cell(f"import torch\\nkeep = [torch.empty(256 << 20, dtype=torch.uint8, device={{DEV!r}}) "
                "for _ in range(4)]")
    sh.run_cell("del keep[1], keep[2]")  # two 256 MiB holes
    if DEV == "cuda":
        free, total = torch.cuda.mem_get_info()
        big = free + (1 << 30)  # more than the device has free, with the cache given back
    else:
        big = 1 << 20
    sh.run_cell(f"x = torch.empty({{big}}, dtype=torch.uint8, device={{DEV!r}})")
r = vram_magic.last_oom()
snap = torch.cuda.memory._snapshot() if DEV == "cuda" else {{"segments": []}}
active = sum(b["size"] for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated")
print(json.dumps({{"shown": len(shown), "alive": r.alive.total if r else None,
                  "allocated": r.cuda.allocated if r and r.cuda else None, "active_after": active,
                  "requested": r.requested if r else None, "big": big,
                  "what_ifs": [list(w) for w in r.cuda.what_ifs] if r and r.cuda else []}}))
"""


def real_oom(out: list[str], dry: bool, deadline: float) -> Table:
    t = Table("a real out-of-memory error in a notebook cell nobody measured: the black box's report", out)
    if dry:
        t.add("report vs torch.cuda.memory._snapshot()", "SKIP", "dry run: needs a GPU to run out of memory")
        return t
    if time.monotonic() > deadline - 30:
        t.add("report vs torch.cuda.memory._snapshot()", "SKIP", "out of time")
        return t
    try:
        done = run([sys.executable, "-c", OOM_CHILD.format(here=ROOT, device="cuda")], deadline - time.monotonic(),
                   pythonpath_env())
    except subprocess.TimeoutExpired:
        t.add("report vs torch.cuda.memory._snapshot()", "FAIL", "timed out")
        return t
    if done.returncode != 0:
        t.add("the black box in a fresh process", "FAIL", (done.stderr.strip().splitlines() or ["?"])[-1][:150])
        return t
    r = json.loads(done.stdout.strip().splitlines()[-1])
    t.add("the report follows the failed cell", "PASS" if r["shown"] == 1 else "FAIL", f"{r['shown']} shown")
    ok = r["allocated"] == r["active_after"]
    t.add("allocated at the failure = the snapshot's active blocks", "PASS" if ok else "FAIL",
          f"{r['allocated']} vs {r['active_after']} B")
    t.add("the failed request", "PASS" if r["requested"] and r["requested"] >= r["big"] else "FAIL",
          f"{r['requested']} B asked, {r['big']} B in the cell")
    t.add("settings tried", "PASS" if r["what_ifs"] else "FAIL", "; ".join(str(w[:3]) for w in r["what_ifs"]))
    return t


def download_wheels(target: str) -> int:
    """Wheels for a Python 3.12 x86-64 Linux box with PyTorch but no package index (see docs/cuda.md)."""
    os.makedirs(target, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
           "--platform", "manylinux2014_x86_64", "--platform", "any", "-d", target, "ipython>=8.0", "ipywidgets>=7.7"]
    print(" ".join(cmd))
    return subprocess.call(cmd)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="exercise the script's own plumbing; no device step")
    p.add_argument("--wheels", metavar="DIR", help="install missing packages from these wheels only")
    p.add_argument("--download-wheels", metavar="DIR", help="download the wheels a GPU box needs, then exit")
    p.add_argument("--report", metavar="FILE", help="also write the tables to FILE")
    p.add_argument("--estimate-one", metavar="MODEL", help=argparse.SUPPRESS)
    p.add_argument("--plan-time-one", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sys.path.insert(0, ROOT)  # this checkout's vram_magic, installed or not
    if args.estimate_one:
        estimate_one(args.estimate_one, args.dry_run)
        return 0
    if args.plan_time_one:
        plan_time_one(args.dry_run)
        return 0
    if args.download_wheels:
        return download_wheels(args.download_wheels)
    start = time.monotonic()
    deadline = start + BUDGET_S
    out: list[str] = []
    tables = []
    t, env = setup(args, out)
    t.print()
    tables.append(t)
    import torch

    has_gpu = torch.cuda.is_available()
    if not has_gpu and not args.dry_run:
        print("no CUDA GPU here: the device steps need one (use --dry-run to check the script itself)")
        return 1
    tables.append(gpu_tests(env, out, max(deadline - time.monotonic() - 150, 60)))
    tables[-1].print()
    if has_gpu and not args.dry_run:
        props = torch.cuda.get_device_properties(0)
        print(f"device: {props.name} (compute capability {props.major}.{props.minor}), "
              f"{props.total_memory / 2**30:.1f} GiB, torch {torch.__version__}", flush=True)
    tables.append(estimate_vs_cuda(env, out, args.dry_run or not has_gpu, deadline))
    tables[-1].print()
    tables.append(overhead(out, args.dry_run or not has_gpu))
    tables[-1].print()
    tables.append(compiled_model(out, args.dry_run or not has_gpu, deadline))
    tables[-1].print()
    tables.append(cudnn_workspace(out, args.dry_run or not has_gpu, deadline))
    tables[-1].print()
    tables.append(plan_times(env, out, args.dry_run or not has_gpu, deadline))
    tables[-1].print()
    tables.append(real_oom(out, args.dry_run or not has_gpu, deadline))
    tables[-1].print()
    failed = [t.title for t in tables if t.failed]
    summary = f"== {'FAIL: ' + '; '.join(failed) if failed else 'all checks passed or skipped'} " \
              f"({time.monotonic() - start:.0f} s{', dry run' if args.dry_run else ''})"
    print(summary)
    out.append(summary)
    if args.report:
        with open(args.report, "w", encoding="utf-8") as f:
            f.write("\n\n".join(out) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
