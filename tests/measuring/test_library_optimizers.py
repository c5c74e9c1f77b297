"""``%%vram`` on a step of bitsandbytes' and torchao's optimizers on the CPU: their state is optimizer state, to the
byte, at the cell's peak and after it, and their update's temporaries are seen.

bitsandbytes' AdamW8bit on Linear(1024, 1024): uint8 moments of the 1,048,576 weights with an fp32 absmax a block of
256 (2 × 1,048,576 + 8 × 4,096), two fp32 moments of the 1,024 biases (8,192) and its two 256-value fp32 code books,
made with the optimizer (2,048): 2,140,160 bytes. Its CPU kernel works in fp32 inside one op (both moments
dequantized, the gradient, a square root and a quotient: 20 bytes a weight, 20,971,520, and 12 bytes of scalars): kernel
scratch, which a dispatch mode sees only through the allocator. torchao's AdamW8bit keeps a code book a moment
(2 × 1,024 bytes) and an fp32 step counter a tensor on top of the same codes and scales; its 4-bit one half a byte a
weight, an fp32 scale a block of 128 and a 16-value code book a moment. torchao compiles each tensor's update, which
the tracker would run eagerly: the cell is measured at the allocator."""

from __future__ import annotations

import pytest

from tests.support import run_ok

SETUP = ("import torch, torch.nn as nn, warnings\nwarnings.simplefilter('ignore')\ntorch.manual_seed(0)\n"
         "m = nn.Linear(1024, 1024)\nx = torch.randn(8, 1024)\n")
STEPS = ("%%vram -q -o r\nfor _ in range(2):\n    m(x).sum().backward()\n    opt.step()\n"
         "    opt.zero_grad(set_to_none=True)")
W = 1024 * 1024
BNB_8BIT = 2 * W + 8 * W // 256 + 8 * 1024 + 2 * 1024


def _state(shell) -> int:
    """The bytes of the optimizer's state, each storage once (torchao's tensors through their parts)."""
    run_ok(shell, "from vram_magic.engine.tensors import storage_parts\n"
                  "seen = {s.data_ptr(): s.nbytes() for st in opt.state.values() for v in st.values() "
                  "if isinstance(v, torch.Tensor) for s, _ in storage_parts(v)}\n"
                  "state_bytes = sum(seen.values())")
    return shell.user_ns["state_bytes"]


def test_bitsandbytes_8bit_state_and_its_kernels_temporaries(shell):
    pytest.importorskip("bitsandbytes")
    run_ok(shell, SETUP + "import bitsandbytes as bnb\nopt = bnb.optim.AdamW8bit(m.parameters())")
    run_ok(shell, STEPS)
    r = shell.user_ns["r"]
    assert r.backend == "tracker"
    assert _state(shell) == BNB_8BIT == 2_140_160
    assert r.before["optimizer_state"] == 2 * 1024  # the code books, made with the optimizer
    assert r.peak["optimizer_state"] == r.after["optimizer_state"] == BNB_8BIT
    scratch = dict(((c, label), n) for c, label, n in r.peak.detail)[("other", "kernel scratch (inside ops)")]
    assert scratch == 20 * W + 12


@pytest.mark.slow
@pytest.mark.parametrize(("cls", "state"), [
    ("AdamW8bit", 2 * W + 8 * W // 256 + 2 * 1024 + 8 * 1024 + 2 * 4),  # codes, scales, code books; biases; steps
    ("AdamW4bit", W + 8 * W // 128 + 2 * 64 + 8 * 1024 + 2 * 4),
])
def test_torchao_state_is_optimizer_state(shell, cls, state):
    pytest.importorskip("torchao.optim")
    run_ok(shell, SETUP + f"import torchao.optim\nopt = torchao.optim.{cls}(m.parameters())")
    run_ok(shell, STEPS)
    r = shell.user_ns["r"]
    assert r.backend == "allocator"  # its update is compiled: the tracker would run it eagerly (6.6 times the bytes)
    assert _state(shell) == state
    assert r.peak["optimizer_state"] == r.after["optimizer_state"] == state
