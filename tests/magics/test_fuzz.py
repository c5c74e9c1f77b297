"""Fuzz suite: what users type and keep in their notebooks, and the exact outcome of each.

Bad input is a ``UsageError`` (magics) or a ``ValueError``/``TypeError`` (API) naming what was wrong; hostile
objects in the namespace never fail a cell or change its exception; the lifecycle (unload inside a measured
cell, the user's own dispatch modes and profilers, threads, compiled functions) leaves no state behind.
"""

from __future__ import annotations

import gc
import os
import threading

import pytest
import torch
from IPython.core.error import UsageError

import vram_magic
from tests.support import run, run_ok
from vram_magic.core.units import parse_size

F32 = 4


def _usage_error(sh, source: str) -> str:
    result = run(sh, source)
    err = result.error_in_exec or result.error_before_exec
    assert isinstance(err, UsageError), (source, repr(err))
    return str(err)


def _dispatch_stack() -> list:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return _get_current_dispatch_mode_stack()


# --- sizes -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("48MiB", 48 * 2**20), ("4 GiB", 4 * 2**30), ("1.5GB", 1_500_000_000), ("4096", 4096), (" 2k ", 2048),
    ("1e3", 1000), ("0.5KiB", 512), ("1TiB", 2**40), ("3mb", 3_000_000), (4096, 4096), ("1B", 1),
])
def test_sizes_people_type(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text, fragment", [
    ("1e400GiB", "more than any device has"), ("1e30", "more than any device has"), ("2EiB", "cannot read"),
    ("0.4", "less than one byte"), ("0", "less than one byte"), ("0.0001KiB", "less than one byte"),
    ("-1", "cannot read"), ("nan", "cannot read"), ("inf", "cannot read"), ("4 gigs", "cannot read"),
    ("", "cannot read"), ("GiB", "cannot read"), (0, "at least 1 byte"), (-5, "at least 1 byte"),
    (2**61, "more than any device has"),
])
def test_sizes_that_are_not_sizes(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_size(text)


@pytest.mark.parametrize("value", [True, 1.5, None, [4096], b"4GiB"])
def test_sizes_of_the_wrong_type(value):
    with pytest.raises(TypeError, match="size"):
        parse_size(value)


# --- %%vram options ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("line, fragment", [
    ("--budget 1e400GiB", "more than any device has"), ("--budget 0.4", "less than one byte"),
    ("--budget 0", "less than one byte"), ("--budget lots", "cannot read"), ("--budget nan", "cannot read"),
    ("-o class", "not a Python keyword"), ("-o None", "not a Python keyword"), ("-o 1x", "variable name"),
    ("-o a-b", "variable name"), ("-o lambda", "not a Python keyword"),
    ("--device tpu", "device"), ("--device cuda:9", "CUDA is not available"), ("--device cuda", "CUDA"),
    ("--device nonsense", "unknown device"), ("--backend fast", "invalid choice"), ("extra words", "unexpected"),
])
def test_cell_magic_options_that_are_refused(shell, line, fragment):
    msg = _usage_error(shell, f"%%vram {line}\nx = 1")
    assert fragment in msg
    assert "x" not in shell.user_ns  # the cell did not run
    assert _dispatch_stack() == []


@pytest.mark.parametrize("line, fragment", [
    ("budget 1e400GiB", "more than any device has"), ("budget 0.4", "less than one byte"),
    ("budget", "usage: %vram budget"), ("auto maybe", "usage: %vram auto"), ("diff 1", "usage: %vram diff"),
    ("diff a b", "cell must be a number"), ("sideways", "unknown %vram subcommand"),
    ("save", "usage: %vram save"), ("export", "usage: %vram export"), ("--device", "usage: %vram [--device"),
])
def test_line_magic_input_that_is_refused(shell, line, fragment):
    assert fragment in _usage_error(shell, f"%vram {line}")


@pytest.mark.parametrize("options, fragment", [
    ("--input 'torch.randn(4, 8)' --batch 0", "--batch must be a whole number of at least 1"),
    ("--input 'torch.randn(4, 8)' --batch -3", "--batch must be a whole number of at least 1"),
    ("--shape 8 --batch 0", "--batch must be a whole number of at least 1"),
    ("--shape 8 --batch 2 --vocab 0", "--vocab must be a whole number of at least 1"),
    ("--input 'torch.randn(4, 8)' --budget 1e400GiB", "more than any device has"),
    ("--input 'torch.randn(4, 8)' --budget 0.4", "less than one byte"),
    ("--input 'torch.randn(4, 8)' --accumulate 0", "accumulate must be a whole number"),
    ("--input 'torch.randn(4, 8)' --world 0", "world must be a whole number"),
    ("--input 'torch.randn(4, 8)' -o class", "not a Python keyword"),
    ("--input 'torch.randn(4, 8)' --gpu H900", "unknown GPU"),
    ("--input 'torch.randn(4, 8)' --dtype int3", "dtype must be one of"),
    ("--input torch.randn(4, 8)", "quote"),
    ("--input 'undefined_name'", "undefined_name"),
])
def test_estimate_magic_input_that_is_refused(shell, options, fragment):
    run_ok(shell, "import torch\nm = torch.nn.Linear(8, 8)")
    assert fragment in _usage_error(shell, f"%vram_estimate m --device cpu {options}")


@pytest.mark.parametrize("make_path, fragment", [
    (lambda tmp: os.path.join(tmp, "missing", "x.pickle"), "does not exist"),
    (lambda tmp: tmp, "it is a folder"),
])
def test_saving_where_nothing_can_be_written(shell, tmp_path, make_path, fragment):
    run_ok(shell, "%%vram -q\nimport torch\nt = torch.ones(4)")
    path = make_path(str(tmp_path))
    assert fragment in _usage_error(shell, f"%vram save {path}")
    assert fragment in _usage_error(shell, f"%vram export {path}")


def test_saving_into_a_read_only_folder(shell, tmp_path):
    if os.geteuid() == 0:  # root writes anywhere: the check is then the OS error, also a UsageError
        folder = "/proc/self"
        target = f"{folder}/x.pickle"
    else:
        folder = tmp_path / "ro"
        folder.mkdir()
        folder.chmod(0o500)
        target = str(folder / "x.pickle")
    run_ok(shell, "%%vram -q\nimport torch\nt = torch.ones(4)")
    assert "cannot write" in _usage_error(shell, f"%vram save {target}")


def test_export_needs_a_known_extension(shell, tmp_path):
    run_ok(shell, "%%vram -q\nx = 1")
    assert ".csv or .json" in _usage_error(shell, f"%vram export {tmp_path / 'h.txt'}")


def test_save_with_no_measured_cell(shell, tmp_path):
    assert "measured cell" in _usage_error(shell, f"%vram save {tmp_path / 'x.pickle'}")


def test_backend_setting_is_checked(shell):
    magics = shell._vram_magic_extension
    run(shell, "%config VramMagics.backend = 'fastest'")  # %config logs the trait's error, keeps the old value
    assert magics.backend == "auto"
    run_ok(shell, "%config VramMagics.backend = 'allocator'")
    run_ok(shell, "%%vram -q -o r\nimport torch\nt = torch.ones(8)")
    assert shell.user_ns["r"].backend == "allocator"


# --- the API -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, error, fragment", [
    ({"budget": "1e400GiB"}, ValueError, "more than any device has"),
    ({"budget": "0.4"}, ValueError, "less than one byte"),
    ({"budget": True}, TypeError, "budget"),
    ({"budget": 1.5}, TypeError, "budget"),
    ({"budget": 0}, ValueError, "at least 1 byte"),
    ({"backend": "fast"}, ValueError, "backend must be one of"),
    ({"backend": None}, ValueError, "backend must be one of"),
    ({"device": "tpu"}, ValueError, "device"),
    ({"device": 3.5}, ValueError, "device"),
])
def test_measure_refuses_bad_arguments(kwargs, error, fragment):
    with pytest.raises(error, match=fragment):
        vram_magic.measure(**kwargs)
    assert _dispatch_stack() == []


# --- hostile namespaces --------------------------------------------------------------------------------------
HOSTILE = {
    "raising __getattribute__": """
class Hostile:
    def __init__(self):
        self.t = torch.ones(256)
    def __getattribute__(self, name):
        raise RuntimeError("no attributes for you")
h = Hostile()
""",
    "raising __class__": """
class Liar:
    @property
    def __class__(self):
        raise RuntimeError("what am I")
h = Liar()
""",
    "raising __dict__": """
class NoDict:
    @property
    def __dict__(self):
        raise RuntimeError("no dict")
h = NoDict()
""",
    "raising items()": """
from collections.abc import Mapping
class BadMap(Mapping):
    def __getitem__(self, k): raise KeyError(k)
    def __iter__(self): raise RuntimeError("cannot iterate")
    def __len__(self): return 3
h = BadMap()
""",
    "raising __iter__ list": """
class BadList(list):
    def __iter__(self): raise RuntimeError("cannot iterate")
h = BadList([torch.ones(4)])
""",
    "raising __len__ list": """
class BadLen(list):
    def __len__(self): raise RuntimeError("no length")
h = BadLen([torch.ones(4)])
""",
    "NotImplementedError subclass": """
class Picky(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"Picky does not support {func}")
h = torch.ones(4).as_subclass(Picky)
""",
    "ValueError subclass": """
class Grumpy(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise ValueError("Grumpy says no")
h = torch.ones(4).as_subclass(Grumpy)
""",
    "raising module": """
class BadModule(torch.nn.Module):
    def named_modules(self, *a, **k):
        raise RuntimeError("no modules")
h = BadModule()
h.lin = torch.nn.Linear(4, 4)
""",
    "raising optimizer": """
class BadOpt(torch.optim.SGD):
    @property
    def state(self):
        raise RuntimeError("no state")
    @state.setter
    def state(self, value):
        pass
h = BadOpt([torch.nn.Parameter(torch.ones(4))], lr=0.1)
""",
    "dead weakref proxy": """
import weakref
class Thing: pass
_thing = Thing()
h = weakref.proxy(_thing)
del _thing
""",
    "cycle": """
h = [torch.ones(4)]
h.append(h)
""",
    "generator": """
h = (torch.ones(4) for _ in range(3))
""",
    "class holding tensors": """
class Holder:
    t = torch.ones(4)
h = Holder
""",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_objects_never_fail_a_cell(shell, name):
    run_ok(shell, "import torch\n" + HOSTILE[name])
    run_ok(shell, "%%vram -q -o r\ny = torch.ones(1024)")  # the cell runs and is measured
    r = shell.user_ns["r"]
    assert r.after.details("other")["y"] == 1024 * F32
    assert r.peak.total >= r.after.total >= 1024 * F32
    run_ok(shell, "%vram")  # and the memory now
    assert _dispatch_stack() == []


def test_a_subclass_that_raises_is_named_in_the_notes(shell):
    run_ok(shell, "import torch\n" + HOSTILE["NotImplementedError subclass"])
    run_ok(shell, "%%vram -q -o r\npass")
    assert any("h" in n and "could not read" in n for n in shell.user_ns["r"].notes)


@pytest.mark.parametrize("name", ["raising __getattribute__", "raising __class__", "NotImplementedError subclass"])
def test_hostile_locals_do_not_replace_an_out_of_memory_error(shell, name):
    run_ok(shell, "import torch\n" + HOSTILE[name])
    src = ("%%vram -q -o r --budget 8MiB\n"
           "def grow():\n"
           "    hostile = h\n"
           "    keep = [torch.ones(2**20) for _ in range(4)]\n"
           "    return keep\n"
           "grow()")
    result = run(shell, src)
    assert isinstance(result.error_in_exec, torch.OutOfMemoryError)
    r = shell.user_ns["r"]
    assert r.oom and r.oom.requested == 2**20 * F32
    gc.collect()
    run_ok(shell, "%%vram -q -o after\npass")
    assert shell.user_ns["after"].before.total < 2**20  # the failed cell's memory was released


def test_a_dict_of_many_tensors_is_counted_in_full(shell):
    run_ok(shell, "import torch\nbig = {i: torch.ones(256) for i in range(100_000)}")
    run_ok(shell, "%%vram -q -o r\npass")
    r = shell.user_ns["r"]
    assert r.before.total == 100_000 * 256 * F32
    assert not [n for n in r.notes if "stopped" in n]


def test_what_a_scan_bound_leaves_out_is_named(shell, monkeypatch):
    from vram_magic.engine.scan import attribution

    monkeypatch.setattr(attribution, "MAX_OBJECTS", 2000)  # objects are visited one by one (plain data is not)
    run_ok(shell, "import types\nrecords = [types.SimpleNamespace(i=i) for i in range(3000)]")
    run_ok(shell, "%%vram -q -o r\npass")
    notes = " ".join(shell.user_ns["r"].notes)
    assert "did not look into records" in notes


def test_memory_shared_by_two_tensors_counts_once(shell):
    run_ok(shell, "import numpy as np, torch\narr = np.ones(1000, dtype=np.float32)")
    run_ok(shell, "%%vram -q -o r\na = torch.from_numpy(arr)\nb = torch.from_numpy(arr)")
    r = shell.user_ns["r"]
    assert r.after.total == 4000 and r.peak.total == 4000


# --- the cell's own exceptions -----------------------------------------------------------------------------
@pytest.mark.parametrize("exc", ["ValueError('bad')", "KeyError('k')", "torch.OutOfMemoryError('real one')",
                                 "RuntimeError('CUDA error: device-side assert triggered')", "SystemExit(3)"])
def test_the_cells_exception_propagates_as_the_same_object(shell, exc):
    run_ok(shell, "import torch")
    result = run(shell, f"%%vram -q -o r\nerr = {exc}\nraise err")
    assert result.error_in_exec is shell.user_ns["err"]
    assert shell.user_ns["r"].error.startswith(type(shell.user_ns["err"]).__name__)
    assert _dispatch_stack() == []


def test_keyboard_interrupt_propagates_and_the_report_is_kept(shell):
    result = run(shell, "%%vram -q -o r\nimport torch\nt = torch.ones(10)\nraise KeyboardInterrupt")
    assert isinstance(result.error_in_exec, KeyboardInterrupt)
    assert shell.user_ns["r"].after.details("other")["t"] == 40


# --- lifecycle ----------------------------------------------------------------------------------------------
def test_unloading_inside_a_measured_cell(shell):
    import torch.nn.modules.module as mod

    run_ok(shell, "%%vram\nimport torch\nt = torch.ones(8)\n%unload_ext vram_magic")
    assert _dispatch_stack() == []
    assert not mod._global_forward_hooks and not mod._global_forward_pre_hooks
    assert "vram" not in shell.magics_manager.magics["cell"]
    run_ok(shell, "%load_ext vram_magic")
    run_ok(shell, "%%vram -q -o r\nu = torch.ones(4)")
    assert shell.user_ns["r"].after.details("other")["u"] == 16


def test_unloading_twice_and_loading_twice(shell):
    run_ok(shell, "%load_ext vram_magic")
    run_ok(shell, "%unload_ext vram_magic")
    run_ok(shell, "%unload_ext vram_magic")
    run_ok(shell, "%load_ext vram_magic")
    run_ok(shell, "%%vram -q -o r\nimport torch\nt = torch.ones(2)")
    assert shell.user_ns["r"].after.total == 8


USER_MODE = """
import torch
from torch.utils._python_dispatch import TorchDispatchMode
class Counting(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))
mine = Counting()
"""


def test_the_users_dispatch_mode_left_on_inside_a_measured_cell(shell):
    import torch.utils._python_dispatch as pd

    run_ok(shell, USER_MODE)
    run_ok(shell, "%%vram -q -o r --budget 1MiB\nmine.__enter__()\nx = torch.ones(8)")
    mine = shell.user_ns["mine"]
    assert _dispatch_stack() == [mine]  # the user's mode, and only it
    run_ok(shell, "big = torch.ones(2**20)")  # 4 MiB: no stale budget in an unmeasured cell
    assert mine.n > 0
    run_ok(shell, "mine.__exit__(None, None, None)")
    assert _dispatch_stack() == [] and not pd._is_in_torch_dispatch_mode


def test_the_users_dispatch_mode_entered_and_left_inside_a_measured_cell(shell):
    run_ok(shell, USER_MODE)
    run_ok(shell, "%%vram -q -o r\nwith mine:\n    x = torch.ones(8)\ny = torch.ones(4)")
    assert _dispatch_stack() == []
    assert shell.user_ns["r"].after.details("other") == {"x": 32, "y": 16}


def test_a_cell_started_under_the_users_dispatch_mode(shell):
    run_ok(shell, USER_MODE)
    run_ok(shell, "mine.__enter__()")
    run_ok(shell, "%%vram -q -o r\nx = torch.ones(8)")
    assert shell.user_ns["r"].backend == "allocator"
    assert _dispatch_stack() == [shell.user_ns["mine"]]
    run_ok(shell, "mine.__exit__(None, None, None)")
    assert _dispatch_stack() == []


def test_the_users_function_mode_is_left_alone(shell):
    run_ok(shell, "import torch\nfrom torch.overrides import TorchFunctionMode\n"
                  "class F(TorchFunctionMode):\n"
                  "    def __torch_function__(self, func, types, args=(), kwargs=None):\n"
                  "        return func(*args, **(kwargs or {}))\nf = F()")
    run_ok(shell, "%%vram -q\nf.__enter__()\nx = torch.ones(8)")
    from torch.overrides import _get_current_function_mode_stack

    assert _get_current_function_mode_stack() == [shell.user_ns["f"]]
    run_ok(shell, "f.__exit__(None, None, None)")
    assert _get_current_function_mode_stack() == []


def test_the_users_profiler_inside_a_measured_cell(shell):
    run_ok(shell, "import torch\nfrom torch.profiler import profile")
    run_ok(shell, "%%vram -q -o r --backend allocator\n"
                  "with profile(profile_memory=True) as prof:\n    x = torch.ones(1000)\n"
                  "names = {e.name for e in prof.events()}")
    assert "aten::ones" in shell.user_ns["names"]  # the user's profiler recorded what it should
    r = shell.user_ns["r"]
    assert any("profiler was started inside the block" in n for n in r.notes)
    assert r.after.details("other")["x"] == 4000


def test_the_users_profiler_running_when_the_cell_starts(shell):
    run_ok(shell, "import torch\nfrom torch.profiler import profile\nprof = profile()\nprof.start()")
    run_ok(shell, "%%vram -q -o r --backend allocator\nx = torch.ones(10)")
    r = shell.user_ns["r"]
    assert r.backend == "tracker" and any("already recording" in n for n in r.notes)
    run_ok(shell, "prof.stop()\nnames = {e.name for e in prof.events()}")
    assert "aten::ones" in shell.user_ns["names"]


def test_nested_cell_magic_is_refused(shell):
    result = run(shell, "%%vram -q\nget_ipython().run_cell_magic('vram', '-q', 'x = 1')")
    assert isinstance(result.error_in_exec, UsageError)
    assert _dispatch_stack() == []


def test_auto_mode_measures_and_skips_vram_cells(shell):
    run_ok(shell, "%vram auto on")
    run_ok(shell, "import torch\na = torch.ones(16)")
    run_ok(shell, "%%vram -q -o r\nb = torch.ones(8)")
    run_ok(shell, "%vram auto off")
    run_ok(shell, "history = get_ipython().run_line_magic('vram', 'history')")
    r = shell.user_ns["r"]
    # the auto-measured cell, then the %%vram cell once (auto mode stepped aside for it)
    assert list(shell.user_ns["history"]["cell"]) == [r.cell - 1, r.cell]


# --- threads ------------------------------------------------------------------------------------------------
def test_tensors_made_in_another_thread_are_counted(shell):
    run_ok(shell, "import threading, torch\nout = {}\n"
                  "def work():\n    out['t'] = torch.ones(1000)\n")
    run_ok(shell, "%%vram -q -o r\nth = threading.Thread(target=work)\nth.start()\nth.join()")
    r = shell.user_ns["r"]
    assert r.after.details("other") == {"out['t']": 4000} and r.after.total == 4000


def test_measuring_in_a_thread_while_the_main_thread_works():
    results = {}

    def work():
        ns = {}
        with vram_magic.measure(namespace=ns) as m:
            ns["t"] = torch.ones(2048)
        results["m"] = m

    th = threading.Thread(target=work)
    th.start()
    keep = [torch.ones(100) for _ in range(50)]  # the main thread allocates meanwhile
    th.join()
    assert results["m"].after.details("other") == {"t": 2048 * F32}
    assert len(keep) == 50 and _dispatch_stack() == []


def test_status_from_another_thread_does_not_change_the_numbers():
    def block(poll: bool):
        model = torch.nn.Linear(256, 256)
        x = torch.randn(64, 256)
        ns = {"model": model, "x": x}
        seen = []
        with vram_magic.measure(namespace=ns) as m:
            stop = threading.Event()

            def poller():
                while not stop.is_set():
                    s = m.status()
                    if s is not None:
                        seen.append(s)

            th = threading.Thread(target=poller) if poll else None
            if th:
                th.start()
            for _ in range(20):
                model(x).sum().backward()
            stop.set()
            if th:
                th.join()
        return m, seen

    torch.manual_seed(0)
    quiet, _ = block(False)
    torch.manual_seed(0)
    polled, seen = block(True)
    assert seen and all(s.backend == "tracker" for s in seen)
    assert quiet.peak.as_dict() == polled.peak.as_dict() and quiet.after.as_dict() == polled.after.as_dict()


# --- compiled functions (dynamo's eager backend: no C++ compiler needed) ------------------------------------
@pytest.mark.parametrize("setup, reason", [
    ("f = torch.compile(lambda t: (t * 2).sum(), backend='eager')", "f is a compiled function"),
    ("m = torch.nn.Linear(8, 8)\nm.compile(backend='eager')\nf = lambda t: m(t).sum()", "m was compiled"),
    ("m = torch.nn.Sequential(torch.nn.Linear(8, 8))\nm[0] = torch.compile(m[0], backend='eager')\n"
     "f = lambda t: m(t).sum()", "m holds a compiled submodule"),
])
def test_compiled_code_in_the_namespace_picks_the_allocator(shell, setup, reason):
    run_ok(shell, "import torch\nx = torch.ones(4, 8)\n" + setup)
    run_ok(shell, "%%vram -q -o r\ny = f(x)")
    r = shell.user_ns["r"]
    assert r.backend == "allocator" and any(reason in n for n in r.notes)
    assert r.after.details("activations").get("y", 0) + r.after.details("other").get("y", 0) == F32


@pytest.mark.parametrize("source, backend", [
    ("# torch.compile(model) later\ny = x + 1", "tracker"),
    ("g = torch.compile(lambda t: t + 1, backend='eager')\ny = g(x)", "allocator"),
    ("y = x + 1", "tracker"),
])
def test_the_cells_own_text_tells_whether_it_compiles(shell, source, backend):
    run_ok(shell, "import torch\nx = torch.ones(4)")
    run_ok(shell, "%%vram -q -o r\n" + source)
    assert shell.user_ns["r"].backend == backend
    assert shell.user_ns["r"].after.details("other").get("y", 0) + shell.user_ns["r"].after.details(
        "activations").get("y", 0) == 16
