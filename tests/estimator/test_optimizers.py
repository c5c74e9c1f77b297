"""The optimizers of fine-tuning recipes: bitsandbytes' 8-bit and paged AdamW, torchao's 8-bit, 4-bit and fp8 AdamW
(their state made from the parameters' shapes) and Muon (with AdamW for what is not a matrix). Each one's state is
counted by hand, and checked against the library's own optimizer stepped for real on the CPU.

The model: Linear(1024, 1024) → Linear(1024, 10) → Linear(10, 10). Its tensors: W1 1,048,576 elements, b1 1,024,
W2 10,240, b2 10, W3 100, b3 10 (1,059,960 in all, 4,239,840 bytes in fp32). W1 and W2 are at least 4,096 elements and
multiples of 256 (and 128): low-bit state; the others keep full-precision moments. W1 alone is at least 100,000
elements: bitsandbytes pages its moments on CUDA.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import vram_magic
from vram_magic.engine.tensors import storage_parts

SMALL = 1024 + 10 + 100 + 10  # b1, b2, W3, b3: under 4,096 elements
W1, W2 = 1_048_576, 10_240

# bitsandbytes 8-bit: uint8 moments and an fp32 absmax a 256-block for W1 and W2, two fp32 moments (8 bytes an element,
# whatever the weights' dtype) for the small tensors, two 256-value fp32 code books for the optimizer
BNB_8BIT = (2 * W1 + 8 * W1 // 256) + (2 * W2 + 8 * W2 // 256) + 8 * SMALL + 2 * 1024
# bitsandbytes 32-bit: two fp32 moments for every tensor
BNB_32BIT = 8 * (W1 + W2 + SMALL)


def torchao_bytes(kind: str, block: int, itemsize: int) -> int:
    """torchao: per quantized tensor two moments of codes (uint8 n; 4 bits n/2; fp8 n), fp32 scales a block and a code
    book each (256 fp32; 4 bits 16; fp8 none); the small tensors' moments in the weights' dtype; an fp32 step counter a
    tensor (6)."""
    def moments(n: int) -> int:
        codes = n // 2 if kind == "4bit" else n
        book = {"8bit": 256 * 4, "4bit": 16 * 4, "fp8": 0}[kind]
        return 2 * (codes + 4 * (n // block) + book)
    return moments(W1) + moments(W2) + 2 * itemsize * SMALL + 6 * 4


def muon_bytes(itemsize: int) -> int:
    """Muon: a momentum buffer in the weights' dtype for each matrix (W1, W2, W3); AdamW for the biases: two moments in
    their dtype and an fp32 step counter each."""
    return itemsize * (W1 + W2 + 100) + 2 * itemsize * (1024 + 10 + 10) + 3 * 4


HAND = {
    ("adamw8bit", torch.float32): BNB_8BIT, ("adamw8bit", torch.bfloat16): BNB_8BIT,
    ("adam8bit", torch.float32): BNB_8BIT,
    ("paged_adamw8bit", torch.float32): BNB_8BIT,
    ("paged_adamw", torch.float32): BNB_32BIT, ("paged_adamw", torch.bfloat16): BNB_32BIT,
    ("torchao_adamw8bit", torch.float32): torchao_bytes("8bit", 256, 4),
    ("torchao_adamw8bit", torch.bfloat16): torchao_bytes("8bit", 256, 2),
    ("torchao_adamw4bit", torch.float32): torchao_bytes("4bit", 128, 4),
    ("torchao_adamw4bit", torch.bfloat16): torchao_bytes("4bit", 128, 2),
    ("torchao_adamw_fp8", torch.float32): torchao_bytes("fp8", 256, 4),
    ("muon", torch.float32): muon_bytes(4), ("muon", torch.bfloat16): muon_bytes(2),
}


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 10), nn.Linear(10, 10))


def _bnb():
    return pytest.importorskip("bitsandbytes")


def _needs(name: str) -> None:
    if name.startswith("torchao"):
        pytest.importorskip("torchao.optim")
    if name == "muon" and not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon is PyTorch 2.9's")


def test_the_hand_counts():
    assert BNB_8BIT == 2_161_920  # 2,129,920 + 20,800 + 9,152 + 2,048
    assert BNB_32BIT == 8_479_680
    assert torchao_bytes("8bit", 256, 4) == 2_163_992 and torchao_bytes("8bit", 256, 2) == 2_159_416
    assert torchao_bytes("4bit", 128, 4) == 1_134_424 and torchao_bytes("4bit", 256, 4) == 1_101_336
    assert torchao_bytes("fp8", 256, 4) == 2_159_896
    assert muon_bytes(4) == 4_244_028 and muon_bytes(2) == 2_122_020


@pytest.mark.parametrize(("name", "dtype"), list(HAND))
def test_state_is_counted_by_hand(name, dtype):
    _needs(name)
    est = vram_magic.estimate(model, torch.randn(8, 1024), optimizer=name, dtype=dtype, device="cpu")
    assert est.peak["optimizer_state"] == HAND[name, dtype]
    assert est.paged == 0  # a CPU never pages: bitsandbytes falls back to plain tensors
    assert name in est.description


def test_paged_state_is_kept_apart_on_cuda():
    """On CUDA the paged moments of W1 (≥ 100,000 elements) are managed memory, outside the device's allocated bytes:
    in ``paged`` and a note, not in the peak; W2's stay in PyTorch's allocator (under 100,000 elements)."""
    x = torch.randn(8, 1024)
    plain = vram_magic.estimate(model, x, optimizer="adamw8bit")
    paged = vram_magic.estimate(model, x, optimizer="paged_adamw8bit")
    assert plain.paged == 0 and paged.paged == 2 * W1  # state1 and state2 of W1, uint8
    assert plain.peak["optimizer_state"] - paged.peak["optimizer_state"] >= 2 * W1
    assert any("paged (managed) memory, not in the device's allocated bytes" in n for n in paged.notes)
    full = vram_magic.estimate(model, x, optimizer="paged_adamw")
    assert full.paged == 8 * W1  # two fp32 moments
    assert vram_magic.estimate(model, x, optimizer="paged_adamw", offload=True).paged == 0
    assert vram_magic.estimate(model, x, optimizer="paged_adamw", zero=2, world=4).paged == 2 * W1


def _state_bytes(*optimizers: torch.optim.Optimizer) -> int:
    """The bytes of every storage an optimizer's state holds, each once (torchao's subclasses through their parts,
    bitsandbytes' shared code books once)."""
    seen: dict[int, int] = {}
    for opt in optimizers:
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    for storage, _ in storage_parts(v) or ():
                        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _real_optimizers(name: str, m: nn.Module, **kwargs) -> list[torch.optim.Optimizer]:
    params = list(m.parameters())
    if name == "muon":
        return [torch.optim.Muon([p for p in params if p.ndim == 2]),
                torch.optim.AdamW([p for p in params if p.ndim != 2], foreach=False)]
    if name.startswith("torchao"):
        import torchao.optim as ao

        cls = {"torchao_adamw8bit": ao.AdamW8bit, "torchao_adamw4bit": ao.AdamW4bit,
               "torchao_adamw_fp8": ao.AdamWFp8}[name]
        return [cls(params, **kwargs)]
    bnb = _bnb()
    cls = {"adamw8bit": bnb.optim.AdamW8bit, "adam8bit": bnb.optim.Adam8bit,
           "paged_adamw8bit": bnb.optim.PagedAdamW8bit, "paged_adamw": bnb.optim.PagedAdamW}[name]
    return [cls(params, **kwargs)]


def _real_steps(name: str, dtype: torch.dtype) -> tuple[int, object]:
    """Two real CPU steps measured by ``vram_magic.measure``: ``(state bytes, report)``. ``opt`` is in the block's
    namespace: a torchao optimizer there has the block measured at the allocator (its update is compiled)."""
    m = model().to(dtype)
    x = torch.randn(8, 1024, dtype=dtype)
    optimizers = _real_optimizers(name, m)
    opt = optimizers[0]  # noqa: F841 (measure() reads this frame's names)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bitsandbytes: "Paged optimizers are not supported on CPU"
        with vram_magic.measure(device="cpu") as measured:
            for _ in range(2):
                out = m(x)
                out.sum().backward()
                for each in optimizers:
                    each.step()
                    each.zero_grad(set_to_none=True)
                del out
    return _state_bytes(*optimizers), measured.report


REAL_FAST = [("adamw8bit", torch.float32), ("adamw8bit", torch.bfloat16), ("adam8bit", torch.float32),
             ("paged_adamw8bit", torch.float32), ("paged_adamw", torch.float32), ("paged_adamw", torch.bfloat16),
             ("muon", torch.float32), ("muon", torch.bfloat16)]
# torchao compiles each tensor's update on its first step (some 20 s each on two cores)
REAL_SLOW = [("torchao_adamw8bit", torch.float32), ("torchao_adamw8bit", torch.bfloat16),
             ("torchao_adamw4bit", torch.float32), ("torchao_adamw4bit", torch.bfloat16),
             ("torchao_adamw_fp8", torch.float32)]


@pytest.mark.parametrize(("name", "dtype"), REAL_FAST + [pytest.param(*c, marks=pytest.mark.slow) for c in REAL_SLOW])
def test_a_real_cpu_step_has_the_estimated_state_and_peak(name, dtype):
    """The library's optimizer stepped twice for real: its state is the estimate's to the byte (and the hand count),
    its state is measured as optimizer state, and the measured peak is the CPU estimate's within 1 %."""
    _needs(name)
    real_state, report = _real_steps(name, dtype)
    est = vram_magic.estimate(model, torch.randn(8, 1024), optimizer=name, dtype=dtype, device="cpu")
    assert real_state == est.peak["optimizer_state"] == HAND[name, dtype]
    assert report.backend == ("allocator" if name.startswith("torchao") else "tracker")
    assert report.after["optimizer_state"] == real_state
    assert report.peak["optimizer_state"] == real_state
    assert est.peak.total == pytest.approx(report.peak.total, rel=0.01)


def test_objects_keep_their_settings():
    """bitsandbytes keeps ``min_8bit_size``, the bits and paging outside ``defaults``: an object's are read, not
    lost."""
    bnb = _bnb()
    m, x = model(), torch.randn(8, 1024)
    big = bnb.optim.AdamW8bit(m.parameters(), min_8bit_size=16_384)  # W2 (10,240) keeps fp32 moments now
    est = vram_magic.estimate(model, x, optimizer=big, device="cpu")
    assert est.peak["optimizer_state"] == BNB_8BIT - (2 * W2 + 8 * W2 // 256) + 8 * W2 == 2_223_040
    hf = bnb.optim.AdamW(m.parameters(), optim_bits=8, is_paged=True)  # Hugging Face's paged_adamw_8bit
    est = vram_magic.estimate(model, x, optimizer=hf)
    assert est.paged == 2 * W1 and "bitsandbytes.AdamW" in est.description
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m(x).sum().backward()
        big.step()
    assert _state_bytes(big) == 2_223_040


def test_a_parameters_override_is_read():
    """GlobalOptimManager's per-parameter settings (Hugging Face's Trainer keeps embeddings in 32 bits this way): W1
    in 32 bits costs 8 bytes an element."""
    bnb = _bnb()
    m, x = model(), torch.randn(8, 1024)
    manager = bnb.optim.GlobalOptimManager.get_instance()
    manager.override_config(m[0].weight, "optim_bits", 32)
    try:
        opt = bnb.optim.AdamW8bit(m.parameters())
        est = vram_magic.estimate(model, x, optimizer=opt, device="cpu")
        m(x).sum().backward()
        opt.step()
        real = _state_bytes(opt)
    finally:
        manager.pid2config.pop(id(m[0].weight), None)
    hand = BNB_8BIT - (2 * W1 + 8 * W1 // 256) + 8 * W1
    assert est.peak["optimizer_state"] == real == hand == 8_420_608


def test_torchao_block_size_is_read():
    ao = pytest.importorskip("torchao.optim")
    hf = ao.AdamW4bit(model().parameters(), block_size=256)  # Hugging Face's adamw_torch_4bit (the default is 128)
    est = vram_magic.estimate(model, torch.randn(8, 1024), optimizer=hf, device="cpu")
    assert est.peak["optimizer_state"] == torchao_bytes("4bit", 256, 4) == 1_101_336


@pytest.mark.slow
def test_torchao_block_size_matches_a_real_step():
    ao = pytest.importorskip("torchao.optim")
    m = model()
    opt = ao.AdamW4bit(m.parameters(), block_size=256)
    m(torch.randn(8, 1024)).sum().backward()
    opt.step()
    assert _state_bytes(opt) == 1_101_336


def test_classes_and_unmodelled_ones():
    bnb = _bnb()
    x = torch.randn(8, 1024)
    by_class = vram_magic.estimate(model, x, optimizer=bnb.optim.PagedAdamW8bit, device="cpu")
    assert by_class.peak["optimizer_state"] == BNB_8BIT
    with pytest.raises(TypeError, match="Lion8bit is not modelled.*AdamW8bit"):
        vram_magic.estimate(model, x, optimizer=bnb.optim.Lion8bit, device="cpu")


def test_bad_names_list_the_accepted_ones():
    with pytest.raises(ValueError, match="unknown optimizer 'adamw-8bit'.*adamw8bit, adam8bit, paged_adamw8bit, "
                                         "paged_adamw, torchao_adamw8bit, torchao_adamw4bit, torchao_adamw_fp8, muon"):
        vram_magic.estimate(model, torch.randn(8, 1024), optimizer="adamw-8bit", device="cpu")


def test_a_remade_first_step_gives_the_same_estimate(monkeypatch):
    """The modelled state is plain tensors: a later fake run of the workload remakes it to the byte
    (vram_magic/estimator/step/first_step.py)."""
    from vram_magic.estimator.device import make_target
    from vram_magic.estimator.fake.request import Request
    from vram_magic.estimator.options import make_options
    from vram_magic.estimator.step import first_step
    from vram_magic.estimator.step.workload import StepWorkload

    real_steps = []
    stand_in = first_step._stand_in_step
    monkeypatch.setattr(first_step, "_stand_in_step", lambda *a, **k: real_steps.append(1) or stand_in(*a, **k))
    m, x, target = model(), torch.randn(8, 1024), make_target(None, "1GiB")
    for name in ("adamw8bit", "torchao_adamw4bit"):
        shared = StepWorkload(Request(m, x), target)
        shared.evaluate(make_options(optimizer=name, device="cpu"))
        opts = make_options(optimizer=name, device="cpu", accumulate=2).with_(batch=4)
        real_steps.clear()
        reused = shared.evaluate(opts)
        assert not real_steps  # the state was remade, not stepped
        alone = StepWorkload(Request(m, x), target).evaluate(opts)
        assert reused.peak == alone.peak and reused.needed == alone.needed


def test_the_magic_and_the_command_line_take_the_names(shell, tmp_path):
    import json
    import subprocess
    import sys
    import textwrap

    from IPython.core.error import UsageError

    _bnb()
    shell.run_cell("import torch, torch.nn as nn\n"
                   "m = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 10), nn.Linear(10, 10))")
    r = shell.run_cell("%vram_estimate m --shape 1024 --batch 8 --optimizer adamw8bit --device cpu -o est -q")
    assert r.error_in_exec is None and shell.user_ns["est"].peak["optimizer_state"] == BNB_8BIT
    shell.run_cell("import bitsandbytes as bnb\nopt = bnb.optim.AdamW8bit(m.parameters(), min_8bit_size=16384)")
    r = shell.run_cell("%vram_estimate m --shape 1024 --batch 8 --optimizer opt --device cpu -o est -q")
    assert r.error_in_exec is None and shell.user_ns["est"].peak["optimizer_state"] == 2_223_040
    magics = shell.magics_manager.registry["VramMagics"]
    with pytest.raises(UsageError, match="paged_adamw8bit"):
        magics.vram_estimate("m --shape 1024 --batch 8 --optimizer adamw_8bit")
    (tmp_path / "toy_recipe.py").write_text(textwrap.dedent("""
        import torch.nn as nn

        def build_model():
            return nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 10), nn.Linear(10, 10))
    """))
    done = subprocess.run([sys.executable, "-m", "vram_magic", "estimate", "toy_recipe:build_model", "--shape", "1024",
                           "--batch", "8", "--optimizer", "paged_adamw8bit", "--json"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["paged"] == 2 * W1 and any("managed" in n for n in data["notes"])


def test_the_planner_offers_8bit_adamw():
    """With ``allow="optimizer"``, 8-bit AdamW is a row: a quarter of AdamW's state bytes, its trade-offs said, and its
    update timed as one pass over the 8-bit moments (less than foreach AdamW's)."""
    m = nn.Sequential(*[nn.Linear(512, 512) for _ in range(2)])
    plan = vram_magic.plan(m, torch.randn(16, 512), gpu="A100-80GB", allow="optimizer", top=100)
    eight = [r for r in plan.rows if r.options.get("optimizer") == "adamw8bit"]
    base = [r for r in plan.rows if r.name == "as it is"]
    assert eight and base
    row = min(eight, key=lambda r: r.step_time)
    assert "8-bit AdamW (bitsandbytes)" in row.name and "bnb.optim.AdamW8bit" in "".join(row.code)
    assert any("needs bitsandbytes and a CUDA GPU" in t for t in row.tradeoffs)
    assert any("8 bits, block-wise" in n for n in row.numerics)
    n = 2 * (512 * 512 + 512)
    assert base[0].peak["optimizer_state"] >= 8 * n > row.peak["optimizer_state"] >= 2 * n
    assert 0 < row.time["optimizer"] < base[0].time["optimizer"]


def test_muon_by_class_and_object_is_muon_with_adamw():
    """Muon takes matrices only: a class or an object of it means what the name does, Muon for W1, W2, W3 and AdamW
    for the biases, and the estimate says so."""
    _needs("muon")
    x = torch.randn(8, 1024)
    by_name = vram_magic.estimate(model, x, optimizer="muon", device="cpu")
    by_class = vram_magic.estimate(model, x, optimizer=torch.optim.Muon, device="cpu")
    obj = torch.optim.Muon([p for p in model().parameters() if p.ndim == 2], lr=0.02, nesterov=False)
    by_object = vram_magic.estimate(model, x, optimizer=obj, device="cpu")
    assert by_name.peak["optimizer_state"] == by_class.peak["optimizer_state"] == HAND["muon", torch.float32]
    assert by_object.peak["optimizer_state"] == HAND["muon", torch.float32]
    assert any("Muon for the 2-D parameters and AdamW for the others" in n for n in by_name.notes)
    # without Nesterov momentum the update is the buffer itself: no lerp result of W1's size (4 bytes an element)
    assert by_name.peak.total - by_object.peak.total == 4 * W1
