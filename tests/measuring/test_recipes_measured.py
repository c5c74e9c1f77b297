"""``%%vram`` on the recipes' steps: an optimizer per parameter stepping inside backward is an optimizer to PyTorch's
global step hooks, so its state is optimizer state and the gradient it steps on a gradient, although that gradient is
freed inside backward; a loss computed outside the model after its forward is the loss's activations.

The model: Linear(1024, 1024) → Linear(1024, 1024), 2 × (1,048,576 + 1,024) fp32 parameters = 8,396,800 bytes.
"""

from __future__ import annotations

from tests.support import run_ok

SETUP = """import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
x = torch.randn(64, 1024)
opts = {p: torch.optim.AdamW([p], foreach=False) for p in model.parameters()}
def step(p):
    opts[p].step()
    opts[p].zero_grad(set_to_none=True)
hooks = [p.register_post_accumulate_grad_hook(step) for p in model.parameters()]
"""

PARAMS = 2 * (1024 * 1024 + 1024) * 4


def test_an_optimizer_in_backward_is_seen(shell):
    run_ok(shell, SETUP)
    run_ok(shell, "%%vram -q -o r\nfor _ in range(2):\n    model(x).square().mean().backward()")
    r = shell.user_ns["r"]
    # AdamW's two fp32 moments of every parameter and a 4-byte step counter each, kept by the four optimizers
    assert r.after["optimizer_state"] == 2 * PARAMS + 4 * 4 == 16_793_616
    assert r.after["gradients"] == 0  # each freed by its hook as soon as its optimizer stepped
    # at the peak one weight's gradient is alive (being stepped on), never all of them
    assert r.peak["gradients"] == 1024 * 1024 * 4
    # a dict of optimizers keyed by parameters is named by the parameters' shapes, not their values
    assert set(r.after.details("optimizer_state")) == {"opts[<Parameter 1024×1024>]", "opts[<Parameter 1024>]"}
    assert set(r.peak.details("gradients")) == {"opts[<Parameter 1024×1024>]"}
    run_ok(shell, "for h in hooks:\n    h.remove()")


def test_the_loss_outside_the_model_is_an_activation(shell):
    run_ok(shell, "import torch\nfrom torch import nn\nmodel = nn.Linear(1024, 1024)\nx = torch.randn(4096, 1024)")
    run_ok(shell, "%%vram -q -o r\nout = model(x)\nloss = out.square().mean()\ndel out")
    r = shell.user_ns["r"]
    # the square (4096 × 1024 fp32) is made outside the model after its forward and freed once the mean has it: the
    # loss's own activation at the peak, not the cell's temporaries ("other")
    assert r.peak.details("activations")["loss (outside modules)"] == 4096 * 1024 * 4
    assert "temporaries" not in r.peak.details("other")
    # after the cell: the linear's output, saved for the square's backward, held by the graph of `loss`
    assert r.after.details("activations") == {"graph held by loss": 4096 * 1024 * 4, "loss": 4}
