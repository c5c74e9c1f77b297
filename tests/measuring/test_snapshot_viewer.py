"""The snapshot export against what PyTorch's memory viewer (``torch/utils/viz/MemoryViz.js``) reads on its
data path: ``annotate_snapshot`` (streams, versions, categories — it throws when a trace names categories but
not ``'unknown'``), the segment view (``segments`` and their ``blocks``) and ``process_alloc_data`` (allocs and
frees paired by address, frames printed as ``filename:line:name``)."""

from __future__ import annotations

import pickle

import torch
from torch import nn

import vram_magic

TRACE_KEYS = {"action", "addr", "size", "stream", "frames"}
ACTIONS = {"alloc", "free_requested", "free_completed", "free", "segment_alloc", "segment_free", "segment_map",
           "segment_unmap", "oom", "snapshot"}


def check_viewer_data_path(snap: dict) -> None:
    """Walk the snapshot the way the viewer does; fail where the viewer would throw or misdraw."""
    traces = snap["device_traces"]
    assert isinstance(traces, list) and all(isinstance(t, list) for t in traces)
    categories: list[str] = []
    for trace in traces:
        for e in trace:
            assert TRACE_KEYS <= set(e), e
            assert e["action"] in ACTIONS, e
            assert isinstance(e["addr"], int) and isinstance(e["size"], int) and e["size"] >= 0
            for f in e["frames"]:  # format_frames and frameFilter read these as strings
                assert isinstance(f["filename"], str) and isinstance(f["name"], str) and "line" in f
            if "category" in e and e["category"] not in categories:
                categories.append(e["category"])
    # annotate_snapshot: categories present but no 'unknown' -> `snapshot.categores.push` (a TypeError)
    assert not categories or "unknown" in categories, categories
    for seg in snap["segments"]:
        assert {"device", "address", "total_size", "stream", "blocks"} <= set(seg)
        addr = seg["address"]
        for b in seg["blocks"]:
            assert {"size", "state"} <= set(b)
            assert "frames" in b and "requested_size" in b  # else the legacy path reads b.history[0]
            addr += b["size"]
        assert addr - seg["address"] <= seg["total_size"]
    # process_alloc_data: every free pairs with an alloc before it, or with a block alive before the trace
    for device, trace in enumerate(traces):
        live: dict[int, int] = {}
        for e in trace:
            if e["action"] == "alloc":
                assert e["addr"] not in live, "two live blocks at one address"
                live[e["addr"]] = e["size"]
            elif e["action"] in ("free_completed", "free") and e["addr"] in live:
                assert live.pop(e["addr"]) == e["size"], "a free's size differs from its alloc's"
        alive_at_end = {b_addr for seg in snap["segments"] if seg["device"] == device
                        for b_addr in _block_addresses(seg)}
        assert set(live) <= alive_at_end, "a block allocated and never freed is missing from the segments"


def _block_addresses(seg: dict) -> list[int]:
    out, addr = [], seg["address"]
    for b in seg["blocks"]:
        if b["state"] == "active_allocated":
            out.append(addr)
        addr += b["size"]
    return out


def test_cell_snapshot_is_readable_by_pytorchs_viewer(tmp_path):
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    x = torch.randn(16, 64)
    opt = torch.optim.AdamW(model.parameters())
    with vram_magic.measure(namespace={"model": model, "x": x, "opt": opt}) as m:
        loss = model(x).sum()
        loss.backward()
        opt.step()
        keep = model(x)  # alive at the end of the block: a segment
    path = m.save_snapshot(str(tmp_path / "cell.pickle"))
    with open(path, "rb") as f:
        snap = pickle.load(f)
    check_viewer_data_path(snap)
    events = snap["device_traces"][0]
    categories = {e.get("category") for e in events}
    assert {"activations", "gradients", "optimizer_state", "unknown"} <= categories
    assert sum(1 for e in events if e["action"] == "alloc") > 0
    # the marker that carries 'unknown' changes no memory: the export replays to the same peak
    from vram_magic.measuring.snapshot import replay

    without_marker = {**snap, "device_traces": [[e for e in events if e["action"] != "snapshot"]]}
    assert replay(snap) == replay(without_marker)
    del keep, loss


def test_the_check_catches_the_crash():
    broken = {"segments": [], "device_traces": [[{"action": "alloc", "addr": 512, "size": 4, "stream": 0,
                                                  "frames": [], "category": "activations"}]]}
    try:
        check_viewer_data_path(broken)
    except AssertionError as err:
        assert "activations" in str(err)
    else:  # pragma: no cover
        raise AssertionError("a trace with categories but no 'unknown' must fail the check")
