"""The plain numbers a fake run leaves (no tensors): every storage's size, owner and module, the order of
allocations and frees, marks in that order, FLOPs by stage and the op log, and what the run learnt of the model.
A workload's trace; the replay turns it into an estimate for a device and a layout."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

from .oplog import OpLog


@dataclass
class FakeRun:
    """Plain numbers from one fake run (no tensors)."""

    sizes: dict[int, int]
    owner: dict[int, tuple[str, str]]
    module: dict[int, str]
    events: array
    initial: tuple[int, ...]
    marks: dict[str, int]
    flops: dict[str, int]
    convs: list[tuple[int, Any, Any]]
    copies: list[tuple[int, int]]
    rnns: list[tuple[int, Any, Any, int]]
    host_scalars: set[int]
    problem: str | None = None
    fused: bool = False
    uses_matmul: bool = False
    batch: int | None = None
    seq: int | None = None
    micro_batch: int | None = None
    param_count: int = 0
    param_bytes: int = 0
    grad_bytes: int = 0
    state_bytes: int = 0
    unit_param_bytes: list[int] = field(default_factory=list)  # per checkpoint/sharding unit (largest blocks)
    gemms: list[tuple[int, Any, Any]] = field(default_factory=list)  # half-precision GEMMs (scratch measured)
    wall: float = 0.0
    loss: str = ""  # which loss the step trained on
    notes: list[str] = field(default_factory=list)  # what was modelled and how (checkpointing, compiled)
    answered: int = 0  # value reads answered from the inputs' real values
    ops: OpLog = field(default_factory=OpLog)  # every op, for the time model (oplog.py)
    ops_start: int = 0  # the op log's row where the last step starts (the one the peak and the time are of)
    micro_steps: int = 1  # micro-batches the last step ran (two stand for any gradient accumulation)
    op_marks: dict[str, int] = field(default_factory=dict)  # generate(): event -> the op log's row (prefill, steps)
    paged: int = 0  # optimizer state in CUDA managed memory (bitsandbytes' paged optimizers): not in the device's bytes
    context: Any = None  # context parallelism's ring attention shapes (layouts/context.py), or None
    # the recipes (step/recipes/): the step in words (what stays alive when), the pinned host memory that activations
    # saved on the host held at their peak, and the bytes they crossed PCIe in one micro-batch (down and up)
    step: str = ""
    host_pinned: int = 0
    offloaded: int = 0
