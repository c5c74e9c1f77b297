"""The namespace scan: big containers read at C speed and remembered between cells, counted exactly whatever
changes in them; a module's plain tensor attributes. Bytes worked out by hand (float32: 4 bytes an element)."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.support import run_ok
from vram_magic.engine.scan import attribution, containers
from vram_magic.engine.scan.registry import LiveStorages

F32 = 4


def other(shell, name="r", when="after"):
    return getattr(shell.user_ns[name], when).details("other")


def measure(shell, body="pass"):
    run_ok(shell, f"%%vram -q -o r\n{body}")
    return shell.user_ns["r"]


# --- big containers: counted exactly, under their name -------------------------------------------------------
def test_a_dict_of_100k_small_tensors_is_counted_exactly_under_its_name(shell):
    run_ok(shell, "import torch\nbig = {i: torch.ones(256) for i in range(100_000)}")
    for _ in range(2):  # the first cell reads it, the second finds it unchanged
        r = measure(shell)
        assert r.before.details("other") == {"big": 100_000 * 256 * F32}
        assert r.after.details("other") == {"big": 100_000 * 256 * F32} and r.after.total == 100_000 * 256 * F32
        assert not [n for n in r.notes if "stopped" in n]


def test_a_dataset_of_tensor_label_pairs_and_a_list_of_paths(shell):
    run_ok(shell, "import torch\ndata = [(torch.ones(7, 4), i % 10) for i in range(1000)]\n"
                  "paths = [f'/data/{i:05d}.jpg' for i in range(5000)]")
    for _ in range(2):
        measure(shell)
        assert other(shell, when="before") == {"data": 1000 * 28 * F32}
    run_ok(shell, "paths[7] = torch.ones(5)")  # plain data gains a tensor
    measure(shell)
    assert other(shell, when="before") == {"data": 1000 * 28 * F32, "paths": 5 * F32}


@pytest.mark.parametrize("change, expected", [
    ("xs.append(torch.ones(100))", 300 * 16 * F32 + 100 * F32),
    ("xs[3] = torch.ones(100)", 299 * 16 * F32 + 100 * F32),  # the old tensor freed
    ("keep = xs[3]\nxs[3] = torch.ones(100)", 299 * 16 * F32 + 100 * F32),  # the old one alive elsewhere
    ("del xs[10:20]", 290 * 16 * F32),
    ("xs[5].set_(torch.ones(64).untyped_storage())", 299 * 16 * F32 + 64 * F32),
    ("xs[5].data = torch.ones(32)", 299 * 16 * F32 + 32 * F32),
    ("xs.sort(key=id)", 300 * 16 * F32),
])
def test_a_container_changed_between_cells_is_counted_again(shell, change, expected):
    run_ok(shell, "import torch\nxs = [torch.ones(16) for _ in range(300)]")
    measure(shell)
    assert other(shell) == {"xs": 300 * 16 * F32}
    run_ok(shell, change)
    measure(shell)
    assert other(shell)["xs"] == expected
    if "keep" in change:
        assert other(shell)["keep"] == 16 * F32


def test_a_container_changed_inside_the_measured_cell(shell):
    run_ok(shell, "import torch\nd = {i: torch.ones(8) for i in range(400)}")
    r = measure(shell, "d[0] = torch.ones(1000)\nd['new'] = torch.ones(10)")
    assert r.before.details("other") == {"d": 400 * 8 * F32}
    assert r.after.details("other") == {"d": (399 * 8 + 1000 + 10) * F32}
    assert r.delta.other == (1000 + 10 - 8) * F32


# --- a big unchanged container is counted by its sum: what a cell does to it is still counted exactly ---------
N, SIZE = 2000, 16 * F32  # a dict of 2,000 tensors of 16 floats


def _group_cell(shell, body, before_cells=1):
    run_ok(shell, f"import torch\nd = {{i: torch.ones(16) for i in range({N})}}")
    for _ in range(before_cells):
        measure(shell)
    return measure(shell, body)


def test_an_unchanged_container_is_one_constant_of_the_history(shell):
    r = _group_cell(shell, "x = torch.ones(100)\ndel x")
    assert r.before.details("other") == {"d": N * SIZE} and r.after.details("other") == {"d": N * SIZE}
    assert r.peak.total == N * SIZE + 100 * F32
    assert [row for row in r.trace.base if row[1] == "d"] == [("other", "d", N * SIZE)]
    assert not r.trace.initial  # none of its storages went one by one
    registry = shell.magics_manager.registry["VramMagics"].session.registry
    assert [len(list(registry.members(g, "cpu"))) for g in registry.groups()] == [N]  # one group, not loose
    assert len(list(registry.loose("cpu"))) == 0


@pytest.mark.parametrize("body, after, delta, peak", [
    ("del d[5]", (N - 1) * SIZE, -SIZE, N * SIZE),
    ("for i in range(100):\n    del d[i]", (N - 100) * SIZE, -100 * SIZE, N * SIZE),
    ("d[3] = torch.ones(64)", (N - 1) * SIZE + 64 * F32, 48 * F32, N * SIZE + 64 * F32),
    ("keep = d[3]\nd[3] = torch.ones(64)", N * SIZE + 64 * F32, 64 * F32, N * SIZE + 64 * F32),
    ("d[4].set_(torch.ones(40).untyped_storage())", (N - 1) * SIZE + 40 * F32, 24 * F32, N * SIZE + 40 * F32),
    # (a resize is counted as the old block freed, then the new one made)
    ("d[7].untyped_storage().resize_(32 * 4)", (N - 1) * SIZE + 32 * F32, 16 * F32, (N - 1) * SIZE + 32 * F32),
    ("del d", 0, -N * SIZE, N * SIZE),
])
def test_what_a_cell_does_to_a_counted_container(shell, body, after, delta, peak):
    r = _group_cell(shell, body)
    assert r.before.details("other") == {"d": N * SIZE}
    assert r.after.total == after and r.delta.total == delta and r.peak.total == peak
    assert r.trace.breakdown_at(len(r.trace.events)).total == after  # the history ends where the scan does
    if after and "keep" not in body:
        assert r.after.details("other") == {"d": after}
    following = measure(shell)  # and the next cell starts from there
    assert following.before.total == after and following.after.total == after


@pytest.mark.parametrize("inside", [True, False])
def test_a_dict_given_a_tensor_that_was_alive_elsewhere_nothing_freed(shell, inside):
    """No storage is made or freed: only the dict's items changed (its version says so, or its ids)."""
    run_ok(shell, f"import torch\nd = {{i: torch.ones(16) for i in range({N})}}\nspare = torch.ones(64)")
    measure(shell)
    change = "keep = d[3]\nd[3] = spare\ndel spare"
    if not inside:
        run_ok(shell, change)
    r = measure(shell, change if inside else "pass")
    assert r.after.details("other") == {"d": (N - 1) * SIZE + 64 * F32, "keep": SIZE}
    assert measure(shell).before.details("other") == {"d": (N - 1) * SIZE + 64 * F32, "keep": SIZE}


def test_a_dicts_version_changes_with_each_change_and_only_then():
    from vram_magic.engine.scan.dict_version import WORKS, version

    d = {i: torch.ones(1) for i in range(300)}
    if not WORKS:  # another Python: no version, the ids are compared
        assert version(d) is None
        return
    seen = [version(d)]
    assert version(d) == seen[0] and d[5] is not None and version(d) == seen[0]
    t = d[7]
    for change in ("d[7] = torch.ones(1)", "d[7] = t", "d['new'] = 1", "del d['new']", "d.update({1: t})",
                   "d.pop(2)", "d.setdefault(2, t)"):
        exec(change, {"d": d, "t": t, "torch": torch})
        seen.append(version(d))
    assert len(set(seen)) == len(seen), seen
    assert version(dict(d)) not in seen and version(list(d)) is None
    assert version(__import__("collections").OrderedDict(d)) is None  # exact dicts only


def test_a_counted_containers_tensor_taken_by_a_module_changes_category(shell):
    r = _group_cell(shell, "m = torch.nn.Linear(16, 1, bias=False)\nm.weight = torch.nn.Parameter(d[0].view(1, 16))")
    assert r.before.details("other") == {"d": N * SIZE}
    assert r.after.parameters == SIZE and r.after.details("other") == {"d": (N - 1) * SIZE}
    assert r.after.total == N * SIZE


def test_a_counted_container_named_twice_or_inside_another(shell):
    run_ok(shell, f"import torch\nd = {{i: torch.ones(16) for i in range({N})}}\ne = dict(d)")
    measure(shell)
    r = measure(shell, "del e[0]")
    assert r.before.total == N * SIZE and r.after.total == N * SIZE  # e shares d's tensors: counted once
    assert sum(r.after.details("other").values()) == N * SIZE


def test_the_live_view_of_a_cell_that_frees_a_counted_containers_tensors(shell):
    run_ok(shell, f"import torch\nd = {{i: torch.ones(16) for i in range({N})}}")
    measure(shell)
    session = shell.magics_manager.registry["VramMagics"].session
    seen = []
    shell.user_ns["_look"] = lambda: seen.append(session.active.status())
    measure(shell, "for i in range(10):\n    del d[i]\n_look()")
    status = [s for s in seen if s is not None][-1]
    assert status.breakdown.details("other") == {"d": (N - 10) * SIZE}
    assert status.now == (N - 10) * SIZE


@pytest.mark.parametrize("build, change, expected", [
    # a list of dicts: the dicts are mutable, their items are compared too
    ("[{'x': torch.ones(4), 'y': 1} for _ in range(300)]", "c[7]['x'] = torch.ones(40)", (299 * 4 + 40) * F32),
    ("[{'x': torch.ones(4), 'y': 1} for _ in range(300)]", "c[7]['z'] = torch.ones(40)", (300 * 4 + 40) * F32),
    # a list of lists of numbers (kept as a copy): a tensor put in an inner list
    ("[[1, 2, 3] for _ in range(300)]", "c[5].append(torch.ones(4))", 4 * F32),
    # a number replaced by a one-element tensor equal to it: a change, not an equal value
    ("[float(i) for i in range(1000)]", "c[3] = torch.tensor(3.0)", F32),
    ("{str(i): i for i in range(1000)}", "c['3'] = torch.tensor([3])", 8),
    # tuples of (tensor, label): one replaced by another tuple
    ("[(torch.ones(4), i) for i in range(300)]", "c[0] = (torch.ones(400), 0)", (299 * 4 + 400) * F32),
])
def test_nested_containers_changed_between_cells(shell, build, change, expected):
    run_ok(shell, f"import torch\nc = {build}")
    measure(shell)
    run_ok(shell, change)
    measure(shell)
    assert other(shell).get("c", 0) == expected


def test_fast_and_item_by_item_reads_count_the_same(monkeypatch):
    """Every structure the fast read takes, against the walker's own item-by-item read (FAST_MIN out of reach):
    the same bytes in each category, tensors past the walker's depth left out by both."""
    t = torch.ones(3)
    structures = {
        "tensors": [torch.ones(i % 7 + 1) for i in range(300)],
        "pairs": [(torch.ones(2), "a", None, 1.5) for _ in range(300)],
        "dicts": {i: {"a": torch.ones(2), "b": [torch.ones(1), 3]} for i in range(300)},
        "shared": [t] * 300,
        "deep": [[[torch.ones(5)]] for _ in range(300)],  # found: the walker's depth 3 reaches it
        "deeper": [[[[torch.ones(5)]]] for _ in range(300)],  # not found, by either
        "mixed": [torch.ones(1), "x", 2, (torch.ones(2), [torch.ones(3)])] * 100,
        "sparse": [torch.eye(3).to_sparse() for _ in range(300)],
    }
    totals = {}
    for fast in (True, False):
        monkeypatch.setattr(containers, "FAST_MIN", 256 if fast else 10**9)
        containers.forget()
        reg = LiveStorages()
        scan = attribution.scan_namespace(structures, reg)
        found: dict[str, int] = {}
        for key, entry in reg.entries():
            cat, label = scan.category(key)
            root = label.split("[")[0]
            found[root] = found.get(root, 0) + entry.size
        totals[fast] = found
    assert totals[True] == totals[False]
    assert totals[True]["deep"] == 300 * 5 * F32 and "deeper" not in totals[True]
    assert totals[True]["shared"] == 3 * F32


def test_a_scan_bound_no_longer_drops_a_big_containers_tensors(shell, monkeypatch):
    monkeypatch.setattr(attribution, "MAX_OBJECTS", 1000)
    run_ok(shell, "import torch, types\nbig = {i: torch.ones(4) for i in range(5000)}\n"
                  "objs = [types.SimpleNamespace(t=torch.ones(2)) for _ in range(3000)]")
    r = measure(shell)
    assert r.before.details("other")["big"] == 5000 * 4 * F32
    notes = " ".join(r.notes)
    assert "did not look into objs" in notes and "big" not in notes  # what the bound leaves out is named


def test_a_long_list_of_paths_no_longer_hides_the_tensors_after_it(shell):
    # the bound counted every item read: 250,000 paths used it up, and the dict after them went uncounted
    run_ok(shell, "import torch\npaths = [f'/data/{i:07d}.jpg' for i in range(250_000)]\n"
                  "weights = {f'w{i}': torch.ones(64) for i in range(1000)}")
    r = measure(shell)
    assert r.before.details("other") == {"weights": 1000 * 64 * F32} and r.notes == ()


def test_legacy_kv_caches_in_a_big_list_stay_kv_caches(shell):
    run_ok(shell, "import torch\ncaches = [tuple((torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4)) for _ in range(2))"
                  " for _ in range(300)]")
    r = measure(shell)
    assert r.before["kv_cache"] == 300 * 2 * 2 * 24 * F32 and r.before.other == 0


def test_no_user_tensor_is_kept_alive_by_what_the_scan_remembers(shell):
    run_ok(shell, "import torch, weakref\nxs = [torch.ones(16) for _ in range(300)]\nref = weakref.ref(xs[0])\n"
                  "ys = [(torch.ones(2), 1) for _ in range(300)]\nref2 = weakref.ref(ys[0][0])")
    measure(shell)
    run_ok(shell, "del xs, ys")
    gc.collect()
    assert shell.user_ns["ref"]() is None and shell.user_ns["ref2"]() is None
    assert measure(shell).before.total == 0


def test_the_remembered_containers_of_a_namespace_are_forgotten_when_it_drops_them():
    reg = LiveStorages()
    ns = {"xs": [torch.ones(2) for _ in range(300)], "paths": [str(i) for i in range(1000)]}
    attribution.scan_namespace(ns, reg)
    held = {id(ns["xs"]), id(ns["paths"])}
    assert held <= set(containers.remembered())
    del ns["paths"]
    attribution.scan_namespace(ns, reg)
    assert id(ns["xs"]) in containers.remembered() and len(held & set(containers.remembered())) == 1


def test_a_cleared_registry_is_read_again():
    reg = LiveStorages()
    ns = {"xs": [torch.ones(2) for _ in range(300)]}
    attribution.scan_namespace(ns, reg)
    reg.clear()
    scan = attribution.scan_namespace(ns, reg)
    assert sum(e.size for k, e in reg.entries() if scan.category(k) == ("other", "xs")) == 300 * 2 * F32


# --- a module's plain tensor attributes -----------------------------------------------------------------------
MODEL = """
import torch
class Scaled(torch.nn.Module):
    def __init__(self, grad):
        super().__init__()
        self.scale = torch.ones(9, requires_grad=grad)  # a plain attribute: not a Parameter, not a buffer
    def forward(self, x):
        return x * self.scale
model = Scaled({grad})
x = torch.ones(9)
"""


@pytest.mark.parametrize("grad", [True, False])
def test_a_plain_tensor_attribute_of_a_module_is_other_from_the_start(shell, grad):
    run_ok(shell, MODEL.format(grad=grad))
    r = measure(shell)
    assert r.before.details("other") == {"model.scale": 9 * F32, "x": 9 * F32}
    assert r.before.parameters == 0
    r = measure(shell, "y = model(x)")
    assert r.after.parameters == 0 and r.peak.parameters == 0
    held = {"model.scale": 9 * F32, "x": 9 * F32}
    if grad:  # y holds a graph (which saves x, already counted): an activation
        assert r.after.details("other") == held and r.after.details("activations") == {"y": 9 * F32}
    else:
        assert r.after.details("other") == {**held, "y": 9 * F32} and r.after.activations == 0


def test_a_graph_leaf_only_the_graph_holds_is_other_unless_a_parameter(shell):
    run_ok(shell, "import torch\nw = torch.nn.Parameter(torch.ones(5))\n")
    r = measure(shell, "y = torch.ones(3, requires_grad=True) * torch.ones(3)\nz = (w * 2).sum()\ndel w")
    assert r.after.parameters == 5 * F32  # a Parameter whose only holder left is the graph: still a parameter
    assert r.after.details("parameters") == {"held by the graph of z": 5 * F32}
    assert r.after.details("other")["held by the graph of y"] == 3 * F32


def test_what_was_read_for_a_registry_goes_with_it():
    reg = LiveStorages()
    ns = {"paths": [str(i) for i in range(1000)]}
    attribution.scan_namespace(ns, reg)
    assert id(ns["paths"]) in containers.remembered()
    del reg
    gc.collect()
    assert id(ns["paths"]) not in containers.remembered()


def test_unloading_the_extension_forgets_the_containers_read(shell):
    run_ok(shell, "paths = [str(i) for i in range(1000)]")
    measure(shell)
    assert id(shell.user_ns["paths"]) in containers.remembered()
    run_ok(shell, "%unload_ext vram_magic")
    assert id(shell.user_ns["paths"]) not in containers.remembered()
    run_ok(shell, "%load_ext vram_magic")  # as the fixture expects to find it


def _measured_step(xs):
    import vram_magic

    with vram_magic.measure() as m:
        pass
    return m.report


def test_measure_blocks_in_a_function_reuse_what_they_read():
    containers.forget()
    xs = [torch.ones(8) for _ in range(300)]
    for _ in range(3):  # each block sees the frame afresh; what was read stays one entry, counted each time
        report = _measured_step(xs)
        assert report.before.details("other") == {"xs": 300 * 8 * F32}
    assert [e for e in containers.remembered().values() if e.keys] == [containers.remembered()[id(xs)]]


def test_a_group_loses_its_freed_storages_and_never_takes_a_new_one_with_the_same_id():
    """The registry's groups (containers counted by their sums): a freed storage leaves its group; a new storage
    that takes its id (Python reuses ids) is loose, never the old group's, so it is counted once."""
    reg = LiveStorages()
    tensors = [torch.ones(4) for _ in range(5)]
    entries = [reg.add(t.untyped_storage()) for t in tensors]
    keys = frozenset(e.key for e in entries)
    assert reg.group(7, keys) and not reg.group(8, keys)  # a key in a group is no longer loose
    assert sorted(k for k, _ in reg.members(7, "cpu")) == sorted(keys) and list(reg.loose("cpu")) == []
    freed = entries[2].key
    del tensors[2], entries
    gc.collect()
    assert freed not in {k for k, _ in reg.members(7, "cpu")}
    newcomer = torch.ones(3)
    reg.add_new(newcomer.untyped_storage(), freed, 12, "cpu")  # as if it had taken the freed storage's id
    assert freed not in {k for k, _ in reg.members(7, "cpu")}
    assert [k for k, _ in reg.loose("cpu")] == [freed]
    reg.ungroup(7)
    assert len(list(reg.loose("cpu"))) == 5 and reg.groups() == []
