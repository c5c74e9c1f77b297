"""The time model: a traced step's ops timed on a device, and what a layout adds to them.

**Ops.** Each op of the traced step takes ``max(FLOPs ÷ the matmul rate for its dtype and size, bytes moved ÷
bandwidth, the device's floor) + its fixed cost`` (``rates.py``). FLOPs are PyTorch's own formulas
(``torch.utils.flop_counter``); bytes are the op's tensor arguments and results; views move nothing. Checkpointing's
recomputed forward is in the trace (counted as *recompute*), and so is the optimizer step (mostly bandwidth-bound).

**Accumulation.** The trace runs one micro-batch, or two for gradient accumulation; an optimizer step of ``K``
micro-batches is ``K`` times one micro-batch's forward and backward, and one update.

**Communication** (ring algorithms, each rank moving ``(N − 1) / N`` of a buffer per pass; ``bandwidth`` is the link's
per direction, at :data:`LINK_EFFICIENCY`; at least :data:`COLLECTIVE_LATENCY` per collective):

* DDP all-reduces the gradients once per optimizer step (``no_sync`` during accumulation): ``2 (N − 1)/N × G``;
* ZeRO-1 reduce-scatters the gradients and all-gathers the updated parameters: ``(N − 1)/N × (G + P)``;
* ZeRO-2 reduce-scatters each micro-batch's gradients (the unsharded ones are not kept) and all-gathers the
  parameters once: ``(N − 1)/N × (K G + P)``;
* ZeRO-3 / FSDP all-gathers the parameters for each micro-batch's forward and again for its backward and
  reduce-scatters its gradients: ``(N − 1)/N × K (2 P + G)``; with FSDP2's ``MixedPrecisionPolicy`` ``P`` is the
  parameters' bytes in ``param_dtype`` (bf16: half the fp32 weights'), ``G`` the gradients' in ``reduce_dtype``
  (:func:`fsdp_traffic`).

**Offload.** Optimizer state on the host: the gradients go down and the parameters come back over PCIe each step
(at :data:`PCIE_EFFICIENCY`), and the host runs the update at :data:`HOST_ADAM_RATE` parameters per second, shared by
the ranks of one host. FSDP2's ``CPUOffloadPolicy`` copies a rank's fp32 shards to the device for every all-gather
(``2 K`` per step) and its gradients back after every reduce-scatter (``K``). Activations on the host
(``offload_activations``, ``save_on_cpu``): every tensor saved for backward goes down in the forward and comes back in
the backward, each micro-batch, at the same efficiency, synchronously (:func:`activation_transfers`).

**Overlap.** None is assumed: communication, transfers and the host's update add to the GPU's time (an upper
bound; FSDP and DDP overlap much of their communication with compute, and the result says so).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

from ...engine.phases import Phase
from ..tracing.oplog import ATTENTION, CONV, DTYPES, MATMUL, OpLog
from .rates import Rates

#: fraction of the link's per-direction bandwidth a ring collective reaches: nccl-tests' bus bandwidth on 8-GPU
#: NVLink nodes is 78 % (A100) to 82 % (H100, H200) of it (NVIDIA/nccl-tests#212; stas00/ml-engineering)
LINK_EFFICIENCY = 0.8
#: fraction of PCIe x16's bandwidth a host transfer reaches (an H200's measured host-to-device copy: 88 %)
PCIE_EFFICIENCY = 0.85
#: seconds a collective takes at least (llm-analysis's minimum message latency within a node)
COLLECTIVE_LATENCY = 8e-6
#: parameters per second one host's CPUs update with Adam (DeepSpeed's CPU-Adam: 11.6 B parameters in 8.2 s,
#: deepspeedai/DeepSpeed#735)
HOST_ADAM_RATE = 1.4e9
#: GPUs one host holds, sharing its CPUs (an 8-GPU node)
GPUS_PER_HOST = 8

_OPTIMIZER_STAGES = frozenset({int(Phase.OPTIMIZER), int(Phase.ZERO_GRAD)})
_BACKWARD = int(Phase.BACKWARD)
_COMPUTE_KINDS = frozenset({MATMUL, ATTENTION, CONV})


@dataclass(frozen=True)
class OpTimes:
    """A traced stretch of ops timed: matmul-like ops, memory-bound ops, the recompute, the optimizer, in seconds."""

    compute: float = 0.0
    memory: float = 0.0
    recompute: float = 0.0
    optimizer: float = 0.0
    ops: int = 0


def time_ops(log: OpLog, rates: Rates, start: int = 0, end: int | None = None) -> OpTimes:
    """Every op of ``log`` from row ``start`` on (to row ``end``), timed on ``rates``: by the device's own rules
    (``rates.op_time``) where it has them and the log has every column, else by the generic formula."""
    return _sorted(_timed(log, rates, start, end))


def forward_backward(log: OpLog, rates: Rates, start: int = 0) -> tuple[float, float]:
    """``(forward, backward)`` seconds of ``log``'s ops from row ``start`` on: the forward's and the loss's ops, and
    the backward's with checkpointing's recompute (it runs inside the backward); the optimizer's in neither."""
    forward = backward = 0.0
    for stage, _kind, again, t in _timed(log, rates, start, None):
        if stage in _OPTIMIZER_STAGES:
            continue
        if again or stage == _BACKWARD:
            backward += t
        else:
            forward += t
    return forward, backward


def _timed(log: OpLog, rates: Rates, start: int, end: int | None) -> Iterable[tuple[int, int, bool, float]]:
    """``(stage, kind, recomputed, seconds)`` of each op of ``log`` from row ``start`` (to ``end``)."""
    if rates.op_time is not None and log.full():
        op_time = rates.op_time
        timed = ((row[0], row[1], row[3], op_time(*row)) for row in log.rows_full(start, end))
    else:
        matmul, bandwidth, per_op, floor = rates.matmul, rates.bandwidth, rates.per_op, rates.floor

        def generic(dtype: int, flops: float, nbytes: float) -> float:
            t = nbytes / bandwidth
            if flops:
                t = max(t, flops / matmul(DTYPES[dtype], flops))
            return max(t, floor) + per_op

        rows = log.rows(start) if end is None else log.slice(start, end).rows()
        timed = ((stage, kind, again, generic(dtype, flops, nbytes))
                 for stage, kind, dtype, again, flops, nbytes in rows)
    return timed


def op_counts(log: OpLog, start: int = 0) -> OpTimes:
    """How many ops of ``log`` from row ``start`` on go to each of :class:`OpTimes`' parts (each op counted as one)."""
    return _sorted((stage, kind, again, 1.0) for stage, kind, _dtype, again, _flops, _bytes in log.rows(start))


def _sorted(timed: Iterable[tuple[int, int, bool, float]]) -> OpTimes:
    """(stage, kind, recomputed, seconds) of each op, summed by where its time goes."""
    compute = memory = recompute = optimizer = 0.0
    n = 0
    for stage, kind, again, t in timed:
        n += 1
        if stage in _OPTIMIZER_STAGES:
            optimizer += t
        elif again:
            recompute += t
        elif kind in _COMPUTE_KINDS:
            compute += t
        else:
            memory += t
    return OpTimes(compute, memory, recompute, optimizer, n)


@dataclass(frozen=True)
class StepTime:
    """Where a step's time goes, in seconds: ``compute`` (matmuls, attention, convolutions), ``memory`` (memory-bound
    ops), ``recompute`` (checkpointing's second forward), ``optimizer`` (the update, on the device or the host),
    ``transfers`` (offload's PCIe traffic), ``collectives`` (data-, tensor- and pipeline-parallel communication),
    ``bubble`` (a pipeline's idle stages)."""

    compute: float = 0.0
    memory: float = 0.0
    recompute: float = 0.0
    optimizer: float = 0.0
    transfers: float = 0.0
    collectives: float = 0.0
    bubble: float = 0.0

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def scaled(self, factor: float) -> StepTime:
        return StepTime(**{k: v * factor for k, v in self.as_dict().items()})


def ring(volume: float, world: int, bandwidth: float, passes: float = 1.0, count: int = 1) -> float:
    """Seconds for ``count`` ring collectives moving ``volume`` bytes in all, ``passes`` times over (an all-reduce is
    two: a reduce-scatter, then an all-gather), across ``world`` ranks."""
    if world < 2 or volume <= 0:
        return 0.0
    moved = passes * (world - 1) / world * volume
    return max(moved / (bandwidth * LINK_EFFICIENCY), COLLECTIVE_LATENCY * count)


def data_parallel(stage: int | None, world: int, params: float, grads: float, micro: int, bandwidth: float) -> float:
    """Seconds of data-parallel communication per optimizer step: DDP (``stage`` None) or ZeRO-1/2/3 across ``world``
    ranks, with ``params`` and ``grads`` the bytes of the whole model's parameters and gradients and ``micro`` the
    micro-batches of the step (module documentation)."""
    if world < 2:
        return 0.0
    if not stage:
        return ring(grads, world, bandwidth, passes=2)
    if stage == 1:
        return ring(grads + params, world, bandwidth, count=2)
    if stage == 2:
        return ring(micro * grads + params, world, bandwidth, count=micro + 1)
    return ring(micro * (2 * params + grads), world, bandwidth, count=3 * micro)


@dataclass(frozen=True)
class FsdpTraffic:
    """Bytes one FSDP2 rank moves per micro-batch: ``gather`` the whole model's parameters as all-gathered (per
    all-gather), ``reduce`` its gradients as reduce-scattered, and with ``CPUOffloadPolicy`` ``to_device`` (the rank's
    shards, for the forward's and the backward's all-gathers) and ``to_host`` (its sharded gradients)."""

    gather: float
    reduce: float
    to_device: float = 0.0
    to_host: float = 0.0


def fsdp_traffic(opts: Any, trace: Any) -> FsdpTraffic:
    """What a traced FSDP2 rank (``trace``: rank 0's, whose shards are padded) moves: its shards' elements times the
    ranks, in ``param_dtype`` for the all-gathers and ``reduce_dtype`` for the reduce-scatters (each defaulting to the
    one before, then to the parameters' own dtype)."""
    import torch

    def size(dtype: Any) -> int:
        return torch.empty((), dtype=dtype or torch.float32).element_size()

    own = size(opts.dtype)
    gather = trace.param_bytes / own * opts.world * size(opts.param_dtype or opts.dtype)
    reduce = trace.grad_bytes / own * opts.world * size(opts.reduce_dtype or opts.param_dtype or opts.dtype)
    if not opts.offload_params:
        return FsdpTraffic(gather, reduce)
    return FsdpTraffic(gather, reduce, to_device=2.0 * trace.param_bytes, to_host=float(trace.grad_bytes))


def activation_transfers(nbytes: float, pcie: float) -> float:
    """Seconds of ``nbytes`` of saved activations crossing PCIe (down and back up, summed in ``nbytes``): no overlap,
    as ``save_on_cpu`` copies in the autograd hooks (torchtune's ``OffloadActivations`` overlaps them on a stream of
    their own: an upper bound for it)."""
    return nbytes / (pcie * PCIE_EFFICIENCY) if pcie > 0 else 0.0


def offload(params: float, grads: float, pcie: float, ranks_per_host: int, parameters: float) -> tuple[float, float]:
    """``(transfers, host update)`` in seconds per step for optimizer state on the host: one rank's ``grads`` bytes down
    and ``params`` bytes up over ``pcie`` bytes/s, and its ``parameters`` updated by a host shared with
    ``ranks_per_host`` ranks."""
    transfers = (params + grads) / (pcie * PCIE_EFFICIENCY) if pcie > 0 else 0.0
    update = parameters / (HOST_ADAM_RATE / max(ranks_per_host, 1))
    return transfers, update


def pipeline_bubble(stages: int, micro_batches: int) -> float:
    """The idle fraction of a pipeline of ``stages`` stages over ``micro_batches`` micro-batches, GPipe's and 1F1B's
    alike: ``(p − 1) / (m + p − 1)``."""
    if stages < 2:
        return 0.0
    return (stages - 1) / (micro_batches + stages - 1)


def tensor_parallel(volumes: dict[str, float], tp: int, bandwidth: float, count: int = 1) -> float:
    """Seconds of a step's tensor-parallel collectives across ``tp`` ranks: ``volumes`` the bytes each kind returns
    on a rank over the step (``"all-reduce"``: two ring passes, Megatron's 2 per block forward and 2 backward of the
    b·s·h activations for its plan, each moving 2(t − 1)/t of them; ``"all-gather"``, ``"reduce-scatter"``: one pass
    of the gathered or scattered whole); ``count`` collectives in all (each at least the latency)."""
    if tp < 2:
        return 0.0
    seconds = 0.0
    for kind, volume in volumes.items():
        passes = 2.0 if kind == "all-reduce" else 1.0
        whole = volume * tp if kind == "reduce-scatter" else volume  # a reduce-scatter returns 1/t of what it moves
        seconds += ring(whole, tp, bandwidth, passes=passes)
    return max(seconds, COLLECTIVE_LATENCY * count if volumes else 0.0)


def bubble_time(busy: float, stages: int, micro_batches: int) -> float:
    """Seconds a pipeline stage idles in a step whose own work takes ``busy`` seconds: the bubble's share of the
    step, ``(p − 1)/(m + p − 1)``, of a step that lasts ``busy / (1 − share)``."""
    share = pipeline_bubble(stages, micro_batches)
    return busy * share / (1 - share) if share < 1 else 0.0


def summed(times: Iterable[StepTime]) -> StepTime:
    out = StepTime()
    for t in times:
        out = StepTime(**{k: getattr(out, k) + v for k, v in t.as_dict().items()})
    return out
