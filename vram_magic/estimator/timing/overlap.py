"""A step across a mesh of GPUs, collective by collective, each overlapped with compute as the runtime overlaps it.

A rank's step is its micro-batches' forwards and backwards (``RankWork``: one micro-batch's, per block and in all), its
update, the pipeline's bubble, and what each collective leaves exposed:

* **FSDP / ZeRO-3** (``fully_shard``): each block's all-gather is prefetched while the block before it computes
  (FSDP2's implicit forward prefetch, and the backward's prefetch of the block before), and each block's reduce-scatter
  runs while the next block's backward computes. Exposed per micro-batch: the first all-gather of the forward, then
  ``max(0, all-gather − block forward)`` for each further block; in the backward the first all-gather, ``max(0,
  all-gather + reduce-scatter − block backward)`` for each further block and the last reduce-scatter. Every
  micro-batch gathers again (the blocks are resharded after the forward) and reduce-scatters its gradients.
* **DDP**: the gradients are all-reduced in buckets of 25 MiB (``bucket_cap_mb``) while the backward of the step's
  last micro-batch (``no_sync`` before it) still computes: exposed, the last bucket and whatever of the rest
  outlasts that backward. **ZeRO-1** reduce-scatters the gradients the same way and all-gathers the updated
  parameters after the update (exposed); **ZeRO-2** reduce-scatters each micro-batch's gradients during its backward.
  **HSDP** adds DDP's all-reduce of each shard's gradients across the replicas, overlapped the same way.
* **Tensor parallelism**: Megatron's all-reduces (or, with sequence parallelism, all-gathers and reduce-scatters) sit
  between a block's matmuls, which wait for them: exposed whole.
* **Pipeline**: each micro-batch's activations go to the next stage and their gradients come back: exposed whole
  (a stage waits for its input), twice over for the V schedules (two stages a rank, the sail-sg table), and the
  bubble: ``(p − 1)/m`` of the stage's work for 1F1B (Narayanan et al. 2021), ``(p − 1)/(v m)`` for the interleaved
  schedule of ``v`` = 2 stages a rank, none for ZB-V when forward, input-gradient and weight-gradient passes take
  alike and the micro-batches are at least the V's ``2p`` stages (fewer leave its warm-up unfilled: the interleaved
  schedule's bubble then) (Qi et al. 2024; sail-sg/zero-bubble-pipeline-parallelism's comparison, ``T_F = T_B = T_W``).
* **Context parallelism** (PyTorch's ring attention with K/V all-gathered, the default rotation): each attention's K
  and V all-gathered in the forward and again in the backward, with their fp32 gradients reduce-scattered; exposed.

Each collective is a ring (``cost.ring``), over NVLink when its group lies inside one host and over the interconnect
when it spans hosts (``Links``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .cost import COLLECTIVE_LATENCY, LINK_EFFICIENCY, StepTime, ring

#: DDP's bucket (``DistributedDataParallel(bucket_cap_mb=25)``)
DDP_BUCKET = 25 * 2**20
#: pipeline schedules and the bubble each leaves, as a fraction of a stage's work: ``(p − 1) / (m × this)``
BUBBLE_DIVISOR = {"1f1b": 1.0, "gpipe": 1.0, "interleaved": 2.0}
#: schedules whose ranks hold two stages (their pipeline sends twice as much)
V_SCHEDULES = ("zbv", "dualpipev")


@dataclass(frozen=True)
class Collective:
    """One kind of communication of a step: ``seconds`` it takes in all, ``exposed`` of them the step waits for,
    over ``link`` (in words) among ``group`` ranks; ``rule`` says how it overlaps."""

    name: str
    group: int
    link: str
    seconds: float
    exposed: float
    rule: str

    def text(self) -> str:
        hidden = self.seconds - self.exposed
        return (f"{self.name} × {self.group} over {self.link}: {self.seconds:.3g} s, {self.exposed:.3g} s exposed"
                + (f" ({hidden:.3g} s hidden: {self.rule})" if hidden > 1e-12 else f" ({self.rule})"))


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s per GPU and direction
    name: str


@dataclass(frozen=True)
class RankWork:
    """One rank's work in one micro-batch: ``forward`` and ``backward`` seconds (checkpointing's recompute in the
    backward), their split into ``compute``, ``memory`` and ``recompute``, its ``blocks``; ``optimizer`` the update of
    what it holds (before any sharding of it); the bytes its data-parallel collectives move — ``gather`` (the
    parameters an all-gather returns, in their all-gather dtype), ``reduce`` (its gradients, in their reduction dtype),
    ``root`` of which outside the blocks; ``tp`` the bytes its tensor-parallel collectives return by kind and
    ``tp_count`` how many; ``p2p`` the bytes of one micro-batch's activations a pipeline stage sends; ``ring`` one
    attention's local K and V bytes under context parallelism, over ``attentions`` attention calls."""

    forward: float
    backward: float
    compute: float
    memory: float
    recompute: float
    optimizer: float
    blocks: int
    gather: float
    reduce: float
    root: float = 0.0
    tp: dict[str, float] = field(default_factory=dict)
    tp_count: int = 0
    p2p: float = 0.0
    ring: float = 0.0
    attentions: int = 0


@dataclass(frozen=True)
class MeshTiming:
    """What a step's collectives depend on: the degrees (``dp`` the data-parallel ranks a ZeRO stage shards over —
    all of them, or a host's under HSDP — and ``replicas`` the HSDP replicas), the ZeRO stage (0: DDP, 3: FSDP), the
    micro-batches of a step, the pipeline schedule, and the link of each group."""

    tp: int
    pp: int
    cp: int
    dp: int
    zero: int
    micro_batches: int
    schedule: str = "1f1b"
    replicas: int = 1
    links: dict[str, Link] = field(default_factory=dict)  # "tp", "cp", "dp", "replicas", "pp"
    sharded_update: bool = True  # the update of a ZeRO stage's shard only (False: the trace's already is a shard)


def _ring(nbytes: float, group: int, link: Link, passes: float = 1.0) -> float:
    return ring(nbytes, group, link.bandwidth, passes=passes) if group > 1 else 0.0


def bucketed(total: float, bucket: float, overlap: float) -> float:
    """What a bucketed collective of ``total`` seconds leaves exposed behind ``overlap`` seconds of backward: the last
    bucket (``bucket`` seconds) and whatever of the rest outlasts the backward."""
    return min(total, bucket + max(0.0, total - bucket - overlap))


def data_parallel_collectives(w: RankWork, m: MeshTiming) -> list[Collective]:
    """The data-parallel collectives of one step (module documentation)."""
    out: list[Collective] = []
    k, link = m.micro_batches, m.links.get("dp", Link(0.0, "-"))
    if m.dp > 1 and m.zero >= 3:
        per_block = max(w.blocks, 1)
        g = _ring(w.gather / per_block, m.dp, link)
        r = _ring(w.reduce / per_block, m.dp, link)
        tf, tb = w.forward / per_block, w.backward / per_block
        late = max(0.0, g + r - tb)  # what a block's gather and reduce-scatter outlast of its backward's neighbour
        share = g / (g + r) if g + r > 0 else 0.0
        gather = k * (2 * g + (per_block - 1) * (max(0.0, g - tf) + late * share))
        reduce = k * (r + (per_block - 1) * late * (1 - share))
        out.append(Collective("FSDP all-gather", m.dp, link.name, k * 2 * per_block * g, gather,
                              "each block's gather prefetched while the block before computes; the first of the "
                              "forward and of the backward exposed"))
        out.append(Collective("FSDP reduce-scatter", m.dp, link.name, k * per_block * r, reduce,
                              "each block's gradients reduced during the next block's backward; the last exposed"))
    elif m.dp > 1:
        bucket_passes = 2.0 if m.zero == 0 else 1.0
        bucket = _ring(min(DDP_BUCKET, w.reduce), m.dp, link, passes=bucket_passes)
        if m.zero == 0:
            t = _ring(w.reduce, m.dp, link, passes=2.0)
            out.append(Collective("DDP all-reduce", m.dp, link.name, t, bucketed(t, bucket, w.backward),
                                  "25 MiB buckets during the last micro-batch's backward; the last bucket exposed"))
        else:
            t = _ring(w.reduce, m.dp, link)
            times = k if m.zero == 2 else 1
            out.append(Collective(f"ZeRO-{m.zero} reduce-scatter", m.dp, link.name, times * t,
                                  times * bucketed(t, bucket, w.backward),
                                  "bucketed during the backward" + (" of every micro-batch" if m.zero == 2 else
                                                                    " of the last micro-batch")))
            g = _ring(w.gather, m.dp, link)
            out.append(Collective(f"ZeRO-{m.zero} all-gather", m.dp, link.name, g, g,
                                  "the updated parameters, after the update"))
    if m.replicas > 1:
        rl = m.links.get("replicas", link)
        shard = w.reduce / max(m.dp, 1)
        t = _ring(shard, m.replicas, rl, passes=2.0)
        bucket = _ring(min(DDP_BUCKET, shard), m.replicas, rl, passes=2.0)
        out.append(Collective("HSDP all-reduce", m.replicas, rl.name, t, bucketed(t, bucket, w.backward),
                              "each shard's gradients across the replicas, bucketed during the last backward"))
    return out


def model_parallel_collectives(w: RankWork, m: MeshTiming) -> list[Collective]:
    """Tensor-, context- and pipeline-parallel communication of one step: exposed whole."""
    out: list[Collective] = []
    k = m.micro_batches
    if m.tp > 1 and w.tp:
        link = m.links.get("tp", Link(0.0, "-"))
        t = 0.0
        for kind, volume in w.tp.items():
            whole = volume * m.tp if kind == "reduce-scatter" else volume
            t += _ring(whole, m.tp, link, passes=2.0 if kind == "all-reduce" else 1.0)
        t = max(t, COLLECTIVE_LATENCY * w.tp_count) * k
        out.append(Collective("TP collectives", m.tp, link.name, t, t, "between a block's matmuls: exposed"))
    if m.cp > 1 and w.ring:
        link = m.links.get("cp", Link(0.0, "-"))
        gather = _ring(m.cp * 2 * w.ring, m.cp, link)
        grads = _ring(m.cp * 2 * 2 * w.ring, m.cp, link)  # dK and dV in fp32 (twice bf16's bytes)
        t = k * w.attentions * (2 * gather + grads)
        out.append(Collective("CP ring K/V", m.cp, link.name, t, t, "K and V gathered before each attention: exposed"))
    if m.pp > 1 and w.p2p:
        link = m.links.get("pp", Link(0.0, "-"))
        sends = 2 * (2 if m.schedule in V_SCHEDULES else 1)
        one = w.p2p / (link.bandwidth * LINK_EFFICIENCY) if link.bandwidth > 0 else 0.0
        t = k * sends * max(one, COLLECTIVE_LATENCY)
        out.append(Collective("PP send/recv", 2, link.name, t, t, "a stage waits for its input: exposed"))
    return out


def bubble(busy: float, m: MeshTiming, w: RankWork | None = None) -> float:
    """Seconds a pipeline stage idles in a step whose own work takes ``busy`` seconds (module documentation)."""
    if m.pp < 2:
        return 0.0
    if m.schedule in V_SCHEDULES:  # the V's 2p stages filled only when the micro-batches are at least as many
        return 0.0 if m.micro_batches >= 2 * m.pp else busy * (m.pp - 1) / (m.micro_batches * 2.0)
    return busy * (m.pp - 1) / (m.micro_batches * BUBBLE_DIVISOR.get(m.schedule, 1.0))


def mesh_step(w: RankWork, m: MeshTiming) -> tuple[StepTime, tuple[Collective, ...]]:
    """One optimizer step of the rank ``w`` describes on the mesh ``m``: its micro-batches' work, its update (a
    ZeRO stage's shard of it), the bubble and every collective's exposed part; and the collectives."""
    k = m.micro_batches
    comms = data_parallel_collectives(w, m) + model_parallel_collectives(w, m)
    busy = (w.compute + w.memory + w.recompute) * k
    optimizer = w.optimizer / m.dp if m.zero and m.sharded_update and m.dp > 1 else w.optimizer
    step = StepTime(compute=w.compute * k, memory=w.memory * k, recompute=w.recompute * k, optimizer=optimizer,
                    collectives=sum(c.exposed for c in comms), bubble=bubble(busy, m, w))
    return step, tuple(comms)


__all__ = ["BUBBLE_DIVISOR", "Collective", "DDP_BUCKET", "Link", "MeshTiming", "RankWork", "V_SCHEDULES",
           "bubble", "bucketed", "data_parallel_collectives", "mesh_step", "model_parallel_collectives"]
