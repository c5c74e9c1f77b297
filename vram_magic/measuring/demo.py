"""``python -m vram_magic demo``: a small training loop split like notebook cells, each measured."""

from __future__ import annotations

import sys
from typing import Any

from ..session.state import Session

CELLS = [
    ("build a model and its optimizer", """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randn(256, 1024)
"""),
    ("forward pass to a loss (the graph keeps activations alive)", "loss = model(x).square().mean()\n"),
    ("backward (activations freed, gradients appear)", "loss.backward()\n"),
    ("optimizer step (AdamW keeps two states per parameter)", "opt.step()\n"),
    ("zero_grad(set_to_none=True) and del loss", "opt.zero_grad(set_to_none=True)\ndel loss\n"),
    ("the same step again, with a batch 16x larger, on a simulated 128 MiB device", """
big = torch.randn(4096, 1024)
loss = model(big).square().mean()
loss.backward()
"""),
]


def run_demo(out: Any = None) -> Session:
    out = out or sys.stdout
    namespace: dict[str, Any] = {}
    session = Session(namespace)
    session.cell_files = {f"<demo cell {i}>": i for i in range(1, len(CELLS) + 1)}  # sites read "cell 2:1"
    for i, (title, code) in enumerate(CELLS, 1):
        print(f"\n[{i}] {title}", file=out)
        print("".join(f"    {line}\n" for line in code.strip().splitlines()), file=out, end="")
        budget = "128MiB" if "simulated" in title else None
        session.start("cpu", budget=budget, cell=i, source=code)
        error: BaseException | None = None
        try:
            exec(compile(code, f"<demo cell {i}>", "exec"), namespace)
        except Exception as exc:  # the OOM of the last cell is part of the demo
            error = exc
        report = session.finish(error)
        assert report is not None
        if error is not None:
            print(f"    -> {type(error).__name__}: {error}", file=out)
        error = None
        print(report, file=out)
    print("\nhistory (bytes):", file=out)
    print(session.history_frame().drop(columns=["error"]).to_string(index=False), file=out)
    return session
