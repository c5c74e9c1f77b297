"""%%vram in a real InteractiveShell: a training loop split over cells, with bytes computed by hand."""

from __future__ import annotations

import gc
import weakref

import torch
from IPython.core.error import UsageError

from tests.support import run, run_ok
from vram_magic import CATEGORIES, CellReport

F32 = 4
# Linear(1024, 4096) + Linear(4096, 10), float32: weights and biases
PARAMS = (1024 * 4096 + 4096 + 4096 * 10 + 10) * F32  # 16,957,480
BATCH = 64
X = BATCH * 1024 * F32  # the input
HIDDEN = BATCH * 4096 * F32  # one (64, 4096) activation: 1 MiB
ADAM_STEPS = 4 * F32  # AdamW keeps one float32 `step` scalar per parameter tensor (4 tensors)

BUILD = """%%vram -o r_build
import torch
model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 10))
opt = torch.optim.AdamW(model.parameters())
x = torch.randn(64, 1024)
"""


def _cells(sh) -> dict[str, CellReport]:
    run_ok(sh, BUILD)
    run_ok(sh, "%%vram -o r_fwd\nloss = model(x).sum()")
    run_ok(sh, "%%vram -o r_bwd\nloss.backward()")
    run_ok(sh, "%%vram -o r_step\nopt.step()")
    run_ok(sh, "%%vram -o r_zero\nopt.zero_grad(set_to_none=True)\ndel loss")
    run_ok(sh, "%%vram -o r_del\ndel model, opt, x")
    return {k: sh.user_ns[f"r_{k}"] for k in ("build", "fwd", "bwd", "step", "zero", "del")}


def test_training_loop_split_over_cells(shell):
    r = _cells(shell)
    # build: parameters by hand, the input in "other"
    assert r["build"].before.total == 0
    assert r["build"].after.as_dict() == {"parameters": PARAMS, "gradients": 0, "optimizer_state": 0,
                                          "activations": 0, "kv_cache": 0, "other": X}
    assert r["build"].after.details("other") == {"x": X}
    # forward: the graph held by `loss` saved ReLU's output (addmm saves x, a named input, and the weights)
    fwd = r["fwd"]
    # and `loss` itself, a forward output, is an activation too (4 bytes); x stays an input ("other")
    assert fwd.after.activations == HIDDEN + F32
    assert fwd.after.details("activations") == {"graph held by loss": HIDDEN, "loss": F32}
    assert fwd.after.other == X
    assert fwd.delta.as_dict() == {"parameters": 0, "gradients": 0, "optimizer_state": 0,
                                   "activations": HIDDEN + F32, "kv_cache": 0, "other": 0}
    # at the forward's peak the first Linear's output and ReLU's output were both alive
    assert fwd.peak.activations == 2 * HIDDEN
    assert fwd.peak.total == fwd.before.total + 2 * HIDDEN
    # backward: gradients equal the parameters, activations freed
    bwd = r["bwd"]
    assert bwd.after.gradients == PARAMS
    assert bwd.after.activations == F32  # only the loss scalar; its graph's saved tensors are freed
    assert bwd.delta.gradients == PARAMS and bwd.delta.activations == -HIDDEN
    # AdamW's step: two states per parameter (exp_avg, exp_avg_sq) plus its step counters
    step = r["step"]
    assert step.after.optimizer_state == 2 * PARAMS + ADAM_STEPS
    assert step.delta.optimizer_state == 2 * PARAMS + ADAM_STEPS
    assert step.peak.total > step.after.total  # the update's temporaries
    # zero_grad(set_to_none=True) and del loss
    zero = r["zero"]
    assert zero.after.gradients == 0
    assert zero.delta.gradients == -PARAMS and zero.delta.activations == -F32
    # everything gone after del
    assert r["del"].after.total == 0
    assert r["del"].delta.as_dict() == {"parameters": -PARAMS, "gradients": 0,
                                        "optimizer_state": -(2 * PARAMS + ADAM_STEPS),
                                        "activations": 0, "kv_cache": 0, "other": -X}
    # the six keys (the KV cache at zero in a cell that does not generate) always add up to the total
    for rep in r.values():
        for b in (rep.before, rep.after, rep.peak, rep.delta):
            assert sum(b[c] for c in CATEGORIES) == b.total
            assert set(b) == set(CATEGORIES)


def test_diff_is_against_previous_measured_cell(shell):
    r = _cells(shell)
    assert r["bwd"].previous == r["fwd"].cell
    assert r["fwd"].delta.total == r["fwd"].after.total - r["build"].after.total
    frame = shell.run_line_magic("vram", f"diff {r['fwd'].cell} {r['step'].cell}")
    assert frame.loc["change", "optimizer_state"] == 2 * PARAMS + ADAM_STEPS
    assert frame.loc["change", "gradients"] == PARAMS
    assert frame.loc["change", "activations"] == -HIDDEN


def test_history_table(shell):
    r = _cells(shell)
    frame = shell.run_line_magic("vram", "history")
    assert list(frame["cell"]) == [rep.cell for rep in r.values()]
    assert list(frame["parameters"]) == [PARAMS] * 5 + [0]
    assert list(frame["gradients"]) == [0, 0, PARAMS, PARAMS, 0, 0]
    assert list(frame["delta"]) == [rep.delta.total for rep in r.values()]
    assert (frame["wall_time_s"] >= 0).all()


def test_report_holds_no_tensor(shell):
    run_ok(shell, BUILD)
    run_ok(shell, "%%vram -o r2\nloss = model(x).sum()\nloss.backward()")
    ref = weakref.ref(shell.user_ns["model"][0].weight)
    run_ok(shell, "del model, opt, loss, x")
    gc.collect()
    assert ref() is None, "a parameter outlived `del model`: something holds a reference"
    now = shell.run_line_magic("vram", "")
    assert now.breakdown.total == 0


def test_last_expression_is_displayed_and_cached(shell):
    res = run_ok(shell, "%%vram -q\n6 * 7")
    assert shell.user_ns["_"] == 42
    assert res.result is None or res.result == 42


def test_ipython_syntax_inside_the_cell(shell):
    run_ok(shell, "%%vram -q -o r\nimport torch\nt = torch.zeros(256)\n%time u = torch.ones(128)\n")
    assert shell.user_ns["r"].after.other == 256 * F32 + 128 * F32


def test_exception_propagates_and_report_is_stored(shell):
    result = run(shell, "%%vram -q -o r\nimport torch\nkeep = torch.zeros(1000)\nraise ValueError('boom')")
    assert isinstance(result.error_in_exec, ValueError)
    rep = shell.user_ns["r"]
    assert rep.error == "ValueError: boom"
    assert rep.after.other == 1000 * F32
    assert torch._C._len_torch_dispatch_stack() == 0


def test_keyboard_interrupt_keeps_report(shell):
    result = run(shell, "%%vram -q -o r\nimport torch\nk = torch.zeros(10)\nraise KeyboardInterrupt")
    assert isinstance(result.error_in_exec, KeyboardInterrupt)
    assert shell.user_ns["r"].error.startswith("KeyboardInterrupt")
    assert torch._C._len_torch_dispatch_stack() == 0


def test_bad_input_is_a_usage_error(shell):
    for line in ("%%vram --budget 12XB\n1", "%%vram --device tpu\n1", "%%vram --bogus\n1",
                 "%%vram -o 1abc\n1", "%vram frobnicate", "%vram diff 1", "%vram auto maybe", "%vram diff 998 999"):
        result = run(shell, line)
        err = result.error_in_exec or result.error_before_exec
        assert isinstance(err, UsageError), (line, err)
    result = run(shell, "%%vram --device cuda:0\n1")
    if not torch.cuda.is_available():
        assert isinstance(result.error_in_exec, UsageError)
        assert "CUDA is not available" in str(result.error_in_exec)


def test_nested_vram_is_refused(shell):
    result = run(shell, "%%vram -q\nget_ipython().run_cell_magic('vram', '-q', 'y = 1')")
    assert isinstance(result.error_in_exec, UsageError)
    assert "nested" in str(result.error_in_exec)
    # the outer measurement was finished and the session works again
    run_ok(shell, "%%vram -q -o r\nz = 2")
    assert shell.user_ns["r"].after.total == 0


def test_history_is_bounded(shell):
    run_ok(shell, "%config VramMagics.history_size = 3")
    for i in range(5):
        run_ok(shell, f"%%vram -q\nv{i} = {i}")
    assert len(shell.run_line_magic("vram", "history")) == 3


def test_auto_mode_measures_every_cell(shell):
    run_ok(shell, "import torch")
    run_ok(shell, "%vram auto on")
    first = run_ok(shell, "a = torch.zeros(1024)").execution_count
    second = run_ok(shell, "b = torch.zeros(2048)").execution_count
    run_ok(shell, "%vram auto off")
    assert list(shell.run_line_magic("vram", "history")["cell"]) == [first, second]
    run_ok(shell, "c = torch.zeros(4096)")
    frame = shell.run_line_magic("vram", "history")
    assert list(frame["delta"]) == [1024 * F32, 2048 * F32]
    assert shell.run_line_magic("vram", "history")["other"].iloc[-1] == 3072 * F32


def test_unload_leaves_nothing_behind(shell):
    import torch.nn.modules.module as mod
    import torch.optim.optimizer as optmod

    run_ok(shell, "%vram auto on")
    run_ok(shell, "import torch\nm = torch.nn.Linear(4, 4)")
    run_ok(shell, "%unload_ext vram_magic")
    assert "vram" not in shell.magics_manager.magics["cell"]
    assert "vram" not in shell.magics_manager.magics["line"]
    assert not any("vram_magic" in repr(cb) for cb in shell.events.callbacks["pre_run_cell"])
    assert not any("vram_magic" in repr(cb) for cb in shell.events.callbacks["post_run_cell"])
    assert torch._C._len_torch_dispatch_stack() == 0
    assert not mod._global_forward_hooks and not mod._global_forward_pre_hooks
    assert not optmod._global_optimizer_pre_hooks and not optmod._global_optimizer_post_hooks
    run_ok(shell, "%load_ext vram_magic")
    run_ok(shell, "%%vram -q -o r\nn = torch.nn.Linear(4, 4)")
    assert shell.user_ns["r"].after.parameters == 2 * (16 + 4) * F32
    run_ok(shell, "%reload_ext vram_magic")
    run_ok(shell, "%%vram -q -o r\nq = 1")
    assert shell.user_ns["r"].after.parameters == 2 * (16 + 4) * F32


def test_tied_weights_counted_once(shell):
    run_ok(shell, """%%vram -q -o r
import torch
emb = torch.nn.Embedding(1000, 64)
head = torch.nn.Linear(64, 1000, bias=False)
head.weight = emb.weight
model = torch.nn.ModuleDict({"emb": emb, "head": head})
""")
    assert shell.user_ns["r"].after.parameters == 1000 * 64 * F32


def test_output_cache_is_reported(shell):
    run_ok(shell, "import torch\nt = torch.zeros(300_000)")
    run_ok(shell, "t * 2")  # the result lives on in Out and _
    run_ok(shell, "del t")
    now = shell.run_line_magic("vram", "")
    cell = shell.execution_count - 2
    assert now.breakdown.details("other") == {f"output cache _{cell}": 300_000 * F32}


def test_widget_bundle_carries_view_and_text(shell):
    from vram_magic.magics.display import report_view

    run_ok(shell, BUILD)
    bundle = report_view(shell.user_ns["r_build"], widget=True)
    view = bundle["application/vnd.jupyter.widget-view+json"]
    assert view["version_major"] == 2 and len(view["model_id"]) > 0
    assert "parameters" in bundle["text/plain"] and "16.2 MiB" in bundle["text/plain"]
    assert 'class="vram-seg vram-parameters"' in bundle["text/html"]


def test_measure_api_without_ipython():
    import vram_magic

    def step():
        lin = torch.nn.Linear(256, 256)
        with vram_magic.measure() as m:
            out = lin(torch.randn(32, 256)).relu().sum()
            out.backward()
        return m

    m = step()
    assert m.after.parameters == (256 * 256 + 256) * F32
    assert m.after.gradients == (256 * 256 + 256) * F32
    assert m.report.device == "cpu"
    assert "parameters" in str(m)


def test_measure_blocks_in_sequence_and_nested():
    import vram_magic

    lin = torch.nn.Linear(100, 100)
    ns = {"lin": lin}
    for _ in range(2):  # the second block finds the storages the first one registered: same figures
        with vram_magic.measure(namespace=ns) as m:
            y = torch.ones(1000) * 2  # a 4,000-byte temporary and the 4,000-byte result
        assert m.before.parameters == (100 * 100 + 100) * F32
        assert m.peak.total - m.before.total == 8000
        assert m.after.total - m.before.total == 4000
        del y
    with vram_magic.measure(namespace=ns) as outer:
        a = torch.ones(1000)
        with vram_magic.measure(namespace=ns) as inner:  # a block inside a block: both count
            b = torch.ones(2000)
        del a
    assert inner.before.parameters == (100 * 100 + 100) * F32
    assert inner.after.total - inner.before.total == inner.peak.total - inner.before.total == 8000
    assert outer.peak.total - outer.before.total == 12000
    assert outer.after.total - outer.before.total == 8000
    assert b.numel() == 2000 and torch._C._len_torch_dispatch_stack() == 0
    gc.collect()
    with vram_magic.measure(namespace={}) as m1:
        z = torch.ones(1000)  # held by no namespace the blocks look at
    with vram_magic.measure(namespace={}) as m2:
        pass
    assert m1.after.total - m1.before.total == 4000
    assert m2.before.total == m1.after.total and m2.before["other"] >= 4000  # z is still known, as "other"
    del z


def test_gradients_freed_in_the_same_cell_stay_gradients_at_the_peak(shell):
    run_ok(shell, BUILD)
    run_ok(shell, "%%vram -q -o r\nloss = model(x).sum()\nloss.backward()\nopt.step()\n"
                  "opt.zero_grad(set_to_none=True)\ndel loss")
    r = shell.user_ns["r"]
    # AdamW's step reads every gradient while they are all alive: at its peak they are gradients, not activations
    assert r.peak.gradients == PARAMS
    assert r.peak.details("gradients") == {"opt": PARAMS}
    assert r.after.gradients == 0 and r.after.optimizer_state == 2 * PARAMS + ADAM_STEPS


def test_report_is_numbered_like_the_prompt(shell):
    res = run_ok(shell, "%%vram -q -o r\nz = 1")
    assert shell.user_ns["r"].cell == res.execution_count
    res2 = run_ok(shell, "%%vram -q -o r2\nz = 2")
    assert shell.user_ns["r2"].previous == res.execution_count and shell.user_ns["r2"].cell == res2.execution_count


def test_storages_resized_in_place_are_counted(shell):
    run_ok(shell, "import torch\na = torch.zeros(1000)\nout = torch.empty(0)\nb = torch.empty(0)")
    run_ok(shell, "%%vram -q -o r\ntorch.add(a, 1, out=out)\nb.resize_(2000)")
    r = shell.user_ns["r"]
    assert r.before.total == 1000 * F32
    assert r.after.total == (1000 + 1000 + 2000) * F32
    assert r.after.details("other") == {"a": 1000 * F32, "out": 1000 * F32, "b": 2000 * F32}
    assert r.peak.total == r.after.total and r.delta.total == 3000 * F32


def test_objects_whose_attributes_raise_do_not_break_measuring(shell):
    run_ok(shell, """
import torch
class Weird:
    def __init__(self):
        self.t = torch.zeros(100)
    def __getattribute__(self, name):
        if name == "__dict__":
            raise ValueError("no peeking")
        return object.__getattribute__(self, name)
w = Weird()
""")
    run_ok(shell, "%%vram -q -o r\nu = torch.zeros(10)")
    assert shell.user_ns["r"].delta.total == 40


def test_scanned_classes_are_not_kept_alive(shell):
    # the scan remembers what to do with each class; a class made in a cell (here holding a tensor) must
    # still go away with the user's last reference to it
    run_ok(shell, "import gc, weakref, torch\nclass Holder:\n    table = torch.zeros(1000)\n"
                  "h = Holder()\nref = weakref.ref(Holder.table)")
    run_ok(shell, "%%vram -q\npass")  # scans `h`, an object of class Holder
    run_ok(shell, "del Holder, h\ngc.collect()")
    assert shell.user_ns["ref"]() is None


def test_tensors_made_without_dispatch_are_counted(shell):
    run_ok(shell, "import numpy as np, torch")
    run_ok(shell, "%%vram -q -o r\narr = np.ones(1000, dtype=np.float32)\nt = torch.from_numpy(arr)")
    r = shell.user_ns["r"]
    assert r.after.details("other") == {"t": 4000} and r.peak.total == r.after.total == 4000


def test_torch_compile_inside_a_measured_cell(shell):
    run_ok(shell, "import torch\nlin = torch.nn.Linear(64, 64)\nx = torch.randn(8, 64)\n"
                  "f = torch.compile(lambda t: lin(t).relu().sum(), backend='eager')")
    run_ok(shell, "%%vram -q -o r\ny = f(x)")
    r = shell.user_ns["r"]
    assert shell.user_ns["y"].item() == shell.user_ns["lin"](shell.user_ns["x"]).relu().sum().item()
    # compiled code allocates outside the dispatch the tracker sees: y is found at the end all the same
    # (y and the ReLU output its graph saved: 4 + 8 x 64 x 4 bytes)
    assert r.after.details("activations") == {"y": 4, "graph held by y": 8 * 64 * F32}
    assert r.delta.total == 4 + 8 * 64 * F32
    assert torch._C._len_torch_dispatch_stack() == 0


def test_first_measured_cell_does_not_import_dynamo():
    import subprocess
    import sys

    code = ("import sys, torch, vram_magic\n"
            "with vram_magic.measure() as m:\n    t = torch.ones(10) + 1\n"
            "print('torch._dynamo' in sys.modules, m.after.total)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "40"], out.stderr  # `t`; the ones tensor was a temporary


def test_composite_ops_under_inference_mode_are_seen_inside(shell):
    # Under inference_mode, cross_entropy reaches the tracker whole; its log-softmax (as large as the logits) is
    # made and freed inside it. The peak must include it: 4096 x 1000 float32 = 16,384,000 B.
    run_ok(shell, "import torch\nlogits = torch.randn(4096, 1000)\ny = torch.randint(0, 1000, (4096,))")
    run_ok(shell, "%%vram -q -o r\nwith torch.inference_mode():\n"
                  "    loss = torch.nn.functional.cross_entropy(logits, y)")
    r = shell.user_ns["r"]
    assert r.peak.total - r.before.total >= 4096 * 1000 * F32
    assert r.after.total - r.before.total == F32  # the loss itself


# --- the cell runs as IPython runs it -------------------------------------------------------------------------
class _FortyOneIsFortyTwo:
    """An AST transformer (``shell.ast_transformers``) that turns the constant 41 into 42."""

    def visit(self, node):
        import ast

        class T(ast.NodeTransformer):
            def visit_Constant(self, c):
                return ast.copy_location(ast.Constant(42), c) if c.value == 41 else c

        return T().visit(node)


def test_the_users_ast_transformers_run(shell):
    run_ok(shell, "import torch")
    shell.ast_transformers.append(_FortyOneIsFortyTwo())
    try:
        run_ok(shell, "a = 41")
        result = run_ok(shell, "%%vram -q -o r\nb = 41\nt = torch.zeros(41)")
        assert shell.user_ns["a"] == shell.user_ns["b"] == 42
        assert shell.user_ns["r"].after.total - shell.user_ns["r"].before.total == 42 * F32
        assert result.error_in_exec is None
    finally:
        shell.ast_transformers.pop()


def test_the_last_expression_is_the_cells_output(shell, capsys):
    run_ok(shell, "import torch")
    result = run_ok(shell, "%%vram -q -o r\nt = torch.ones(256)\nt.sum().item() + 1")
    n = result.execution_count
    assert shell.user_ns["r"].cell == n
    assert result.result == 257.0 and shell.user_ns[f"_{n}"] == 257.0 and shell.user_ns["Out"][n] == 257.0
    assert shell.user_ns["_"] == 257.0
    assert f"Out[{n}]: 257.0" in capsys.readouterr().out
    # the value is shown once the measurement has ended: its formatting and the output cache are no memory of the
    # cell's (t stays, 1 KiB)
    assert shell.user_ns["r"].after.total - shell.user_ns["r"].before.total == 256 * F32
    result = run_ok(shell, "%%vram -q\n2 * 21;")  # a trailing semicolon keeps it quiet, as in any cell
    assert result.result is None and f"_{result.execution_count}" not in shell.user_ns
    assert f"Out[{result.execution_count}]" not in capsys.readouterr().out


def test_top_level_await(shell):
    run_ok(shell, "import asyncio, torch")
    cell = ("%%vram -q -o r\nasync def make(n):\n    await asyncio.sleep(0)\n    return torch.zeros(n)\n"
            "t = await make(1024)\nawait asyncio.sleep(0)\nt.numel()")
    result = run_ok(shell, cell)
    r = shell.user_ns["r"]
    assert result.result == 1024 and r.cell == result.execution_count
    assert r.after.total - r.before.total == 1024 * F32
    # a body that awaits, reached by run_cell_magic itself (no input transformer): the shell's loop runner runs it
    run_ok(shell, "get_ipython().run_cell_magic('vram', '-q -o r2', 'u = await make(512)')")
    assert shell.user_ns["r2"].after.total - shell.user_ns["r2"].before.total == 512 * F32
    assert shell.user_ns["u"].numel() == 512


def test_ipython_syntax_inside_a_measured_cell(shell, capfd):
    run_ok(shell, "import torch")
    result = run_ok(shell, "%%vram -q -o r\n!echo from-the-shell\n%time t = torch.zeros(100)\nlisting = !echo a b\n"
                           "len(listing)")
    assert "from-the-shell" in capfd.readouterr().out
    assert result.result == 1 and shell.user_ns["listing"] == ["a b"]
    assert shell.user_ns["r"].after.total - shell.user_ns["r"].before.total == 100 * F32


def test_an_exception_is_the_cells_own(shell, capsys):
    import sys

    run_ok(shell, "import torch")
    result = run(shell, "%%vram -o r\nt = torch.zeros(10)\ndef f():\n    raise KeyError('from f')\nf()")
    assert isinstance(result.error_in_exec, KeyError) and not result.success
    assert sys.last_value is result.error_in_exec
    printed = capsys.readouterr().out
    assert "run_cell_magic" not in printed and "CellRun" not in printed and "raise KeyError('from f')" in printed
    assert printed.index("KeyError") < printed.index("%%vram cell")  # the traceback, then the report
    r = shell.user_ns["r"]
    assert r.error == "KeyError: 'from f'" and r.after.total - r.before.total == 10 * F32
    # a syntax error runs nothing, measures nothing
    result = run(shell, "%%vram -q -o r3\nx = (")
    assert isinstance(result.error_in_exec, SyntaxError) and "r3" not in shell.user_ns


MOE = """%%vram -o r_moe_build
import torch

class MoE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(64, 4, bias=False)  # the router: dense
        self.experts = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))

    def forward(self, x):
        w = self.gate(x).softmax(-1)
        return sum(w[:, i:i + 1] * e(x) for i, e in enumerate(self.experts))

model = torch.nn.Sequential(MoE(), torch.nn.Linear(64, 10))
opt = torch.optim.AdamW(model.parameters())
x = torch.randn(8, 64)
"""


def test_a_mixture_of_experts_shows_the_experts_share(shell):
    """The routed experts' parameters, gradients and optimizer state apart from the dense ones ("of which experts"),
    by hand: 4 experts of Linear(64, 64), a router Linear(64, 4) and a head Linear(64, 10), all float32."""
    experts = 4 * (64 * 64 + 64) * F32  # 66,560
    dense = (4 * 64 + 64 * 10 + 10) * F32
    run_ok(shell, MOE)
    build = shell.user_ns["r_moe_build"]
    assert build.after.experts == {"parameters": experts, "gradients": 0, "optimizer_state": 0}
    assert build.after.parameters == experts + dense
    assert build.after.details("parameters") == {"model (experts)": experts, "model": dense}
    run_ok(shell, "%%vram -o r_moe_step\nmodel(x).sum().backward()\nopt.step()")
    step = shell.user_ns["r_moe_step"]
    state = 2 * experts + 8 * F32  # AdamW's two moments, and a step counter for each of the 8 tensors
    assert step.after.experts == {"parameters": experts, "gradients": experts, "optimizer_state": state}
    assert step.experts == step.peak.experts == step.after.experts
    assert step.after.gradients == experts + dense
    assert step.after.optimizer_state == state + 2 * dense + 3 * F32
    text = str(step)
    assert "mixture of experts at the peak: parameters" in text and "of which experts 65.0 KiB" in text
    assert "of which experts" in step._html()
    run_ok(shell, "del model, opt")
    run_ok(shell, "%%vram -o r_dense\ny = torch.nn.Linear(4, 4)(torch.randn(2, 4)).sum()")
    assert "of which experts" not in str(shell.user_ns["r_dense"])
