"""How long one configuration's step takes: its traced ops timed on the device (``cost.py``, ``rates.py``), times the
micro-batches of an optimizer step, with what the layout adds — the data-parallel collectives over the network
between the GPUs, offload's transfers and the host's update.

The network is the GPU's own link (NVLink) for GPUs of one host, else what ``interconnect=`` names: ``"nvlink"``,
``"pcie"`` (GPUs that talk through the host), ``"ethernet-100g"``, ``"ethernet-25g"``, ``"infiniband-200g"``,
``"infiniband-400g"`` (one link per GPU, as DGX-class hosts have), or a bandwidth in bytes/s per GPU and direction. A
ring across hosts runs at its slowest link.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

from ..device.gpus import GPU
from ..options import Options
from ..tracing.oplog import OpLog
from ..tracing.traced import FakeRun
from .cost import (
    GPUS_PER_HOST,
    OpTimes,
    StepTime,
    activation_transfers,
    bubble_time,
    data_parallel,
    fsdp_traffic,
    offload,
    op_counts,
    tensor_parallel,
    time_ops,
)
from .rates import Rates, cpu_rates, gpu_rates

GB = 1e9
#: links between hosts, per GPU and direction, bytes/s (line rates: 100 Gb/s Ethernet is 12.5 GB/s)
NETWORKS = {"ethernet-25g": 25 / 8 * GB, "ethernet-100g": 100 / 8 * GB, "infiniband-200g": 200 / 8 * GB,
            "infiniband-400g": 400 / 8 * GB}
INTERCONNECTS = ("nvlink", "pcie", *NETWORKS)


@dataclass(frozen=True)
class Network:
    """Where the GPUs' collectives and the host's transfers go: ``link`` bytes/s per GPU and direction between
    ranks, ``pcie`` to the host, ``ranks_per_host`` sharing one host's CPUs, and what it is in words."""

    link: float
    pcie: float
    ranks_per_host: int
    name: str


def network_for(gpu: GPU | None, gpus: int, interconnect: Any = None, host: int = GPUS_PER_HOST) -> Network:
    """The network of ``gpus`` GPUs like ``gpu`` in hosts of ``host``; ``ValueError`` where one spanning hosts is not
    named."""
    if gpu is None:
        return Network(0.0, 0.0, 1, "none (one CPU)")
    pcie = gpu.host_link
    per_host = min(gpus, host)
    intra = gpu.link or pcie
    intra_name = "NVLink" if gpu.link and gpu.capability is not None else ("Infinity Fabric" if gpu.link else "PCIe")
    if interconnect is None:
        if gpus > host:
            raise ValueError(f"gpus={gpus} spans hosts ({host} GPUs a host): say how they are connected, "
                             f"e.g. interconnect='infiniband-400g' ({', '.join(INTERCONNECTS)}, or a bandwidth in "
                             "bytes/s per GPU)")
        return Network(intra, pcie, per_host, f"{intra_name} {intra / GB:.0f} GB/s per direction")
    if isinstance(interconnect, (int, float)) and not isinstance(interconnect, bool):
        if interconnect <= 0:
            raise ValueError(f"interconnect must be a positive bandwidth in bytes/s, not {interconnect!r}")
        link = float(interconnect)
        name = f"{link / GB:.1f} GB/s per GPU"
    elif interconnect == "nvlink":
        if not gpu.link:
            raise ValueError(f"{gpu.name} has no NVLink: use interconnect='pcie' or a network between hosts")
        link, name = gpu.link, f"NVLink {gpu.link / GB:.0f} GB/s per direction"
    elif interconnect == "pcie":
        link, name = pcie, f"PCIe gen {gpu.pcie} ({pcie / GB:.1f} GB/s per direction)"
    elif interconnect in NETWORKS:
        link = NETWORKS[interconnect]
        name = f"{interconnect} ({link / GB:.1f} GB/s per GPU)"
    else:
        raise ValueError(f"unknown interconnect {interconnect!r}; use one of {', '.join(INTERCONNECTS)}, or a "
                         "bandwidth in bytes/s per GPU")
    if gpus > host and interconnect not in ("nvlink", "pcie"):
        link = min(link, intra)  # the ring crosses the hosts' links and the GPUs' own
    return Network(link, pcie, per_host, name)


def rates_for(device: str, gpu: GPU | None) -> Rates:
    """The device's rates: a catalogued GPU's, or this CPU's as measured."""
    if device == "cuda":
        if gpu is None:
            raise ValueError("a time needs the GPU's figures: give gpu='A100-80GB' (or another known GPU)")
        return gpu_rates(gpu)
    from .cpu_profile import cpu_profile

    return cpu_rates(cpu_profile())


def micro_ops(trace: FakeRun, rates: Rates) -> OpTimes:
    """The traced last step's ops timed, their forward and backward per micro-batch (the trace ran one, or two for
    accumulation), the optimizer's once."""
    t = time_ops(trace.ops, rates, trace.ops_start)
    n = max(trace.micro_steps, 1)
    return OpTimes(t.compute / n, t.memory / n, t.recompute / n, t.optimizer, t.ops)


def scaled_micro_ops(trace: FakeRun, rates: Rates, share: float) -> OpTimes:
    """:func:`micro_ops` of a micro-batch ``share`` times the traced one's: each op's FLOPs and bytes scaled, each
    op still paying the device's floor and launch cost (a linear scaling of the totals would scale those too and
    make small micro-batches look cheap). The optimizer's ops, which do not depend on the batch, as traced. On a
    device with rules of its own per op (the CPU: matmul shapes, which a scaled row does not have), each part's total
    less its ops' fixed cost (``rates.per_op`` each) scaled, the fixed cost kept: a CPU plan's screen then ranks a
    class's micro-batches largest first, as their exact estimates do (scaled whole, every micro-batch of a class
    screened alike, and a tiny MLP's plan showed 1 × 64, 2 × 32 and 4 × 16 where the whole batch fitted: 143, 74 and
    39 ms a step against 7)."""
    ops = micro_ops(trace, rates)
    if share == 1:
        return ops
    if rates.op_time is not None:
        n = max(trace.micro_steps, 1)
        counts = op_counts(trace.ops, trace.ops_start)
        fixed = rates.per_op

        def part(total: float, count: float) -> float:
            kept = count / n * fixed
            return max(total - kept, 0.0) * share + kept

        return OpTimes(part(ops.compute, counts.compute), part(ops.memory, counts.memory),
                       part(ops.recompute, counts.recompute), ops.optimizer, ops.ops)
    log, start = trace.ops, trace.ops_start
    scaled = OpLog(log.stage[start:], log.kind[start:], log.dtype[start:], log.recompute[start:],
                   array("d", (f * share for f in log.flops[start:])),
                   array("d", (b * share for b in log.bytes[start:])))
    t = time_ops(scaled, rates)
    n = max(trace.micro_steps, 1)
    return OpTimes(t.compute / n, t.memory / n, t.recompute / n, ops.optimizer, t.ops)


def step_time(ops: OpTimes, opts: Options, trace: FakeRun, net: Network) -> StepTime:
    """An optimizer step (or one inference forward) of ``opts``: ``ops`` of one micro-batch times the micro-batches,
    the update (sharded by ZeRO; on the host with offload), the collectives and the transfers."""
    micro = 1 if opts.inference else opts.accumulate
    world = opts.dp if opts.parallel else (opts.world if opts.world > 1 else 1)  # data parallelism over dp ranks
    if opts.fsdp_traced and not opts.inference:
        return fsdp_step_time(ops, opts, trace, net)
    optimizer = ops.optimizer / world if opts.zero else ops.optimizer
    transfers = 0.0
    if opts.offload and not opts.inference:
        shard = world if opts.zero else 1
        transfers, optimizer = offload(trace.param_bytes / shard, trace.grad_bytes / shard, net.pcie,
                                       net.ranks_per_host, trace.param_count / shard)
    if opts.offload_activations and not opts.inference:  # save_on_cpu's copies, each micro-batch (the trace's: one)
        transfers += activation_transfers(trace.offloaded * micro, net.pcie)
    collectives = 0.0 if opts.inference else data_parallel(opts.zero, world, trace.param_bytes, trace.grad_bytes,
                                                           micro, net.link)
    bubble = 0.0
    if opts.parallel and not opts.inference:  # the rank's trace holds its stage's micro-batches and its shards'
        collectives += model_parallel_time(trace, opts, net.link)
        bubble = bubble_time((ops.compute + ops.memory + ops.recompute) * micro, opts.pp, opts.micro_batches or opts.pp)
    return StepTime(compute=ops.compute * micro, memory=ops.memory * micro, recompute=ops.recompute * micro,
                    optimizer=optimizer, transfers=transfers, collectives=collectives, bubble=bubble)


def fsdp_step_time(ops: OpTimes, opts: Options, trace: FakeRun, net: Network) -> StepTime:
    """A step of one FSDP2 rank traced for real (``layouts/fsdp.py``): its update is the rank's own already (on the
    host with ``offload="params"``), its all-gathers move the parameters in ``param_dtype`` and its reduce-scatters
    the gradients in ``reduce_dtype`` (``cost.fsdp_traffic``), and with ``CPUOffloadPolicy`` the fp32 shards cross
    PCIe for each all-gather and the gradients come back."""
    micro = opts.accumulate
    t = fsdp_traffic(opts, trace)
    collectives = data_parallel(3, opts.world, t.gather, t.reduce, micro, net.link)
    transfers, optimizer = 0.0, ops.optimizer
    if opts.offload_params or opts.offload:
        down = micro * t.to_host if opts.offload_params else trace.grad_bytes
        up = micro * t.to_device if opts.offload_params else trace.param_bytes
        transfers, optimizer = offload(up, down, net.pcie, net.ranks_per_host, trace.param_count / opts.world)
    return StepTime(compute=ops.compute * micro, memory=ops.memory * micro, recompute=ops.recompute * micro,
                    optimizer=optimizer, transfers=transfers, collectives=collectives)


def model_parallel_time(trace: FakeRun, opts: Options, link: float) -> float:
    """Seconds of a tensor- and pipeline-parallel rank's own communication per step: the tensor-parallel
    collectives its trace made (``cost.tensor_parallel``); a pipeline's sends of one micro-batch's activations
    overlap the next micro-batch's compute and are not counted."""
    if opts.tp < 2:
        return 0.0
    from ..layouts.tensor import collective_volumes

    volumes, count = collective_volumes(trace)
    return tensor_parallel({k: float(v) for k, v in volumes.items()}, opts.tp, link, count)


def _rows(log: OpLog, start: int, end: int) -> OpLog:
    """The rows ``start`` … ``end - 1`` of ``log``, as an op log of their own."""
    return log.slice(start, end)


def _seconds(t: OpTimes) -> float:
    return t.compute + t.memory + t.recompute + t.optimizer


def generate_time(trace: FakeRun, rates: Rates, new_tokens: int) -> StepTime:
    """A ``generate()`` call of ``new_tokens`` tokens from its fake run: the prefill's ops (everything before the
    first token is chosen), then the ``new_tokens - 1`` decoding steps, each step's ops timed where it was traced
    and the steps between (jumped over) taken as growing linearly from the first traced to the last (their cache
    grows a token a step). Matmuls, attention and convolutions are *compute*, the rest *memory* (decoding is mostly
    that: each step reads the weights and the cache)."""
    marks, log = trace.op_marks, trace.ops
    first = marks.get("step0", len(log))
    prefill = time_ops(_rows(log, 0, first), rates)
    stops = sorted(v for k, v in marks.items() if k.startswith(("step", "jump_start", "loop_end")))
    traced: list[tuple[int, OpTimes]] = []
    for key, at in marks.items():
        if key.startswith("step") and key[4:].isdigit() and int(key[4:]) > 0:
            end = min((v for v in stops if v > at), default=len(log))
            traced.append((int(key[4:]), time_ops(_rows(log, at, end), rates)))
    traced.sort()
    compute, memory = prefill.compute + prefill.recompute, prefill.memory + prefill.optimizer
    steps = max(new_tokens - 1, 0)
    if traced and steps:
        (s0, t0), (s1, t1) = traced[0], traced[-1]
        for s in range(1, steps + 1):
            w = (s - s0) / (s1 - s0) if s1 != s0 else 0.0
            w = min(max(w, 0.0), 1.0)
            compute += t0.compute + (t1.compute - t0.compute) * w
            memory += (_seconds(t0) - t0.compute) + ((_seconds(t1) - t1.compute) - (_seconds(t0) - t0.compute)) * w
    return StepTime(compute=compute, memory=memory)


__all__ = ["INTERCONNECTS", "NETWORKS", "Network", "fsdp_step_time", "generate_time", "micro_ops",
           "model_parallel_time", "network_for", "rates_for", "step_time"]
