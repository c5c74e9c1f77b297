"""The user's lines the tracker names for each allocation, and what naming them costs per step.

A site is the user's frames above an allocation (engine/tracker/frames.py). The tracker takes it once for all that a
module of PyTorch's own allocates in its forward, and once per ``backward()`` call for what autograd's engine runs
(engine/tracker/sites.py): these tests check that the lines are still each allocation's own, where the user's code runs
inside (a module of theirs, a forward hook, a forward set on an instance, a custom ``autograd.Function``), and
count the walks up the stack a training step makes."""

from __future__ import annotations

import torch
from torch import nn

import vram_magic
from vram_magic.engine.tracker import counts as counting
from vram_magic.engine.tracker import scratch_ops, step_hooks

HERE = __file__


def _line(marker: str) -> int:
    with open(HERE) as f:
        return next(i for i, text in enumerate(f, 1) if text.rstrip().endswith(f"# <{marker}>"))


class Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        scratch = torch.empty(100)  # <custom backward>
        del scratch
        return g * 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.seq = nn.Sequential(nn.Linear(8, 8), nn.ReLU())

    def forward(self, x):
        h = self.fc(x)  # <fc>
        h = Double.apply(h)
        return self.seq(h)  # <seq>


def _own_forward(x):
    return torch.zeros(7) + x.sum()  # <instance forward>


def _innermost(m, size: int, phase: str | None = None) -> set[int]:
    """The lines of this file that made the block's allocations of ``size`` bytes (in ``phase``)."""
    return {b.site[0][1] for b in m.trace.blocks.values() if b.size == size and phase in (None, b.phase) and b.site
            and b.site[0][0] == HERE}


def test_each_allocation_keeps_its_own_line():
    torch.manual_seed(0)
    net, x = Net(), torch.randn(4, 8)
    hooked = nn.Linear(8, 8)
    hooked.register_forward_hook(lambda mod, i, o: (torch.zeros(11), None)[1])  # <hook>
    replaced = nn.Linear(8, 8)
    replaced.forward = _own_forward
    with vram_magic.measure(namespace={"net": net}) as m:
        out = hooked(net(x))  # <call>
        out = out + replaced(out).sum()
        out.sum().backward()  # <backward>
        xg = x.detach().requires_grad_()
        torch.autograd.grad(net(xg).sum(), xg)  # <grad>
    f4 = 4 * 8 * 4  # a (4, 8) float32 activation
    assert _innermost(m, f4, "forward") >= {_line("fc"), _line("seq")}
    assert _line("call") in _innermost(m, f4, "forward")  # the hooked Linear's own output
    assert _innermost(m, 11 * 4) == {_line("hook")}  # after the module's forward: in the cell's phase
    assert _innermost(m, 7 * 4) == {_line("instance forward")}
    assert _innermost(m, 100 * 4, "backward") == {_line("custom backward")}
    assert _innermost(m, 8 * 8 * 4, "backward") == {_line("backward")}  # the weight gradients
    assert _innermost(m, f4, "backward") >= {_line("backward"), _line("grad")}


def _mlp_steps(steps: int) -> tuple[int, int]:
    """(walks up the stack, GEMM layouts worked out) of ``steps`` AdamW steps of a small MLP in one block."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))
    opt = torch.optim.AdamW(model.parameters())
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    walks, layouts = [0], [0]
    site, copies = counting.user_site, getattr(scratch_ops, "_copies", None)

    def counted_site(*a, **k):
        walks[0] += 1
        return site(*a, **k)

    def counted_copies(*a, **k):
        layouts[0] += 1
        return copies(*a, **k)

    getattr(scratch_ops, "_COPIES", {}).clear()
    counting.user_site = step_hooks.user_site = counted_site
    scratch_ops._copies = counted_copies
    try:
        with vram_magic.measure(namespace={"model": model, "opt": opt}) as m:
            for _ in range(steps):
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    finally:
        counting.user_site = step_hooks.user_site = site
        scratch_ops._copies = copies
    assert m.peak.total > 0
    return walks[0], layouts[0]


def test_a_step_walks_the_stack_a_few_times():
    """Per step: the model's forward (one module of PyTorch's), the loss's three ops outside any module, the
    implicit gradient and the backward pass, the optimizer's step: 7. It was once per allocation outside the
    optimizer's step (22 of the step's 33)."""
    walks, _ = _mlp_steps(1)
    more, _ = _mlp_steps(11)
    assert (more - walks) / 10 <= 7


def test_a_gemms_copies_are_worked_out_once_per_layout():
    _, few = _mlp_steps(1)
    _, many = _mlp_steps(6)
    assert 0 < few == many <= 8  # the forward's three addmm, the backward's mm: the same layouts every step


def test_no_frame_of_the_package_is_the_users_wherever_its_module_lies():
    """The package's own folders, at any depth, are never the user's code (a site, or the frame a traceback ends at)."""
    import vram_magic.engine.tracker.frames as frames
    import vram_magic.estimator.run as run
    from vram_magic.measuring import measurement
    from vram_magic.session import state

    for code in (measurement.measure.__code__, run.run_estimate.__code__, state.Session.__init__.__code__,
                 frames.user_site.__code__):
        assert not frames.is_user_code(code)
    assert frames.is_user_code(test_no_frame_of_the_package_is_the_users_wherever_its_module_lies.__code__)
