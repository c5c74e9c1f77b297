"""A Hugging Face model's training step saved as a PyTorch memory snapshot and opened by PyTorch's own
``torch.cuda._memory_viz`` tools, on CPU, in a real shell."""

from __future__ import annotations

import pickle

import pytest

from tests.support import run_ok, skip_module_without_transformers_5
from vram_magic.measuring.snapshot import replay

skip_module_without_transformers_5()
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
memory_viz = pytest.importorskip("torch.cuda._memory_viz")

F32, I64 = 4, 8
D, LAYERS, VOCAB, POSITIONS, B, S = 128, 4, 1000, 64, 2, 32
# GPT-2's parameters by hand: token and position embeddings (the head is tied to the first), per block two
# LayerNorms, the fused qkv projection, the output projection and the MLP's two layers; the last LayerNorm
PER_BLOCK = 2 * D + (D * 3 * D + 3 * D) + (D * D + D) + 2 * D + (D * 4 * D + 4 * D) + (4 * D * D + D)
PARAMS = VOCAB * D + POSITIONS * D + LAYERS * PER_BLOCK + 2 * D
TENSORS = 2 + LAYERS * 12 + 2  # parameter tensors: AdamW keeps exp_avg, exp_avg_sq and a float32 step for each

GPT2 = f"""import torch
import transformers
transformers.logging.set_verbosity_error()
torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer={LAYERS}, n_embd={D}, n_head=4,
                                                             vocab_size={VOCAB}, n_positions={POSITIONS}))
opt = torch.optim.AdamW(model.parameters())
ids = torch.randint(0, {VOCAB}, ({B}, {S}))
"""
# The forward builds a DynamicCache whose layers start as torch.tensor([]): empty storages made and freed
# inside the cell, which the history must not free without having allocated.
STEP = """loss = model(ids, labels=ids).loss
loss.backward()
opt.step()
opt.zero_grad()
"""


def _entries(snap):
    (trace,) = snap["device_traces"]
    return trace


def _check_opened_by_pytorch(snap, r):
    """The numbers PyTorch's tools read from the snapshot are the report's."""
    entries = _entries(snap)
    allocs = [e for e in entries if e["action"] == "alloc"]
    frees = [e for e in entries if e["action"] == "free_completed"]
    assert allocs and frees
    # every free pairs with an allocation of the same address and size, or with a block alive before the cell
    made = {}
    for e in entries:
        if e["action"] == "alloc":
            made[e["addr"]] = e["size"]
        elif e["action"] == "free_completed":
            assert made.pop(e["addr"], e["size"]) == e["size"]
    assert sum(e["size"] for e in allocs) - sum(e["size"] for e in frees) == r.after.total - r.before.total
    start, peak, _ = replay(snap)
    assert (start, peak) == (r.before.total, r.peak.total)
    # memory(): one flame-graph line per block alive at the end, "frames size" (format_flamegraph is the
    # flamegraph.pl step, which would download a script: the lines themselves are what it is given)
    lines = memory_viz.memory(snap, format_flamegraph=lambda text: text).splitlines()
    assert sum(int(line.rsplit(" ", 1)[1]) for line in lines) == r.after.total
    lines = memory_viz.segments(snap, format_flamegraph=lambda text: text).splitlines()
    assert sum(int(line.rsplit(" ", 1)[1]) for line in lines) == r.after.total
    text = memory_viz.trace(snap)
    assert f"{len(entries)} entries" in text
    assert text.count("# free completed for") == len(frees)
    assert f"total_allocated: {memory_viz.Bytes(r.after.total)}" in memory_viz.segsum(snap)
    for html in (memory_viz.trace_plot(snap), memory_viz.segment_plot(snap)):
        assert html.lstrip().startswith("<!DOCTYPE html>")


@pytest.mark.parametrize("backend", ["tracker", "allocator"])
def test_gpt2_training_step_snapshot_opens_in_pytorchs_tools(shell, tmp_path, backend):
    run_ok(shell, GPT2)
    run_ok(shell, f"%%vram -q -o r --backend {backend}\n{STEP}")
    r = shell.user_ns["r"]
    assert r.backend == backend
    assert r.before.total == PARAMS * F32 + B * S * I64
    # after the step: the parameters, the ids, AdamW's two moments and steps, the loss; the gradients are gone
    assert r.after.total == PARAMS * F32 + B * S * I64 + 2 * PARAMS * F32 + TENSORS * F32 + F32
    path = tmp_path / "gpt2.pickle"
    assert r.save_snapshot(str(path)) == str(path)
    snap = pickle.loads(path.read_bytes())
    _check_opened_by_pytorch(snap, r)
    saved = tmp_path / "saved.pickle"
    run_ok(shell, f"%vram save {saved}")
    assert pickle.loads(saved.read_bytes())["device_traces"] == snap["device_traces"]


def test_empty_tensor_made_and_freed_in_the_cell(shell, tmp_path):
    run_ok(shell, "import torch\nkeep = torch.zeros(256)")
    run_ok(shell, "%%vram -q -o r\nempty = torch.tensor([])\nx = torch.ones(1024)\ndel empty, x")
    r = shell.user_ns["r"]
    assert all(abs(ev) in r.trace.blocks for ev in r.trace.events)
    assert [r.trace.blocks[abs(ev)].size * (1 if ev > 0 else -1) for ev in r.trace.events] == \
        [1024 * F32, -1024 * F32]
    assert r.peak.total == 256 * F32 + 1024 * F32 and r.after.total == r.before.total == 256 * F32
    totals = r.trace.totals()  # the timeline's series: one value before the events and one after each
    assert [sum(v[i] for v in totals.values()) for i in range(3)] == [256 * F32, 1280 * F32, 256 * F32]
    path = tmp_path / "empty.pickle"
    r.save_snapshot(str(path))
    _check_opened_by_pytorch(pickle.loads(path.read_bytes()), r)
