"""Where each parallel axis goes on GPUs in hosts, which layouts a plan searches, and the layouts it refuses.

The mesh is torchtitan's (``ParallelDims``: ``pp, dp_replicate, dp_shard, cp, tp``, the last varying fastest): tensor
parallelism over neighbouring GPUs, inside a host, where NVLink carries its per-matmul collectives; context
parallelism next; data parallelism (ZeRO/FSDP shard over ``dp × cp`` ranks, as torchtitan's FSDP mesh does) and the
pipeline's stages across hosts. A group's collectives run over NVLink when the group lies inside one host and over the
interconnect between hosts when it spans several.

HSDP (FSDP sharding inside a host, replicas across hosts, as fms-fsdp trains) shards over the data-parallel ranks one
host holds and adds an all-reduce of each shard's gradients across the hosts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..timing.overlap import Link
from ..timing.step_time import Network

#: tensor-parallel degrees tried (each dividing the host and the model's heads)
TP_DEGREES = (1, 2, 4, 8, 16)
#: context-parallel degrees tried (the sequence a multiple of 2 × cp)
CP_DEGREES = (1, 2, 4, 8)
#: pipeline depths tried (dividing the blocks)
PP_DEGREES = (1, 2, 4, 8, 16, 32)
#: pipeline schedules tried: 1F1B, the interleaved 1F1B (two stages a rank) and ZB-V (zero bubble, two stages a rank)
SCHEDULES = ("1f1b", "interleaved", "zbv")


@dataclass(frozen=True)
class Mesh:
    """``tp × cp × dp × pp`` GPUs in hosts of ``host``; ``hsdp``: the data-parallel ranks shard inside a host and
    replicate across hosts."""

    tp: int
    cp: int
    pp: int
    dp: int
    host: int
    hsdp: bool = False

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def shard(self) -> int:
        """The ranks a ZeRO stage shards over: ``dp × cp`` (torchtitan's FSDP mesh), or a host's under HSDP."""
        if self.hsdp:
            return max(1, min(self.dp, self.host // (self.tp * self.cp))) * self.cp
        return self.dp * self.cp

    @property
    def replicas(self) -> int:
        """HSDP's replicas (1 without it)."""
        return self.dp * self.cp // self.shard if self.hsdp else 1

    def inside(self, size: int, stride: int) -> bool:
        """Whether a group of ``size`` ranks ``stride`` apart lies inside one host."""
        return size * stride <= self.host

    def links(self, net: Network, intra: float, intra_name: str) -> dict[str, Link]:
        """The link of each axis's groups: NVLink inside a host, ``net`` across hosts."""
        inner, outer = Link(intra, intra_name), Link(net.link, net.name)
        tp, cp, shard = self.tp, self.cp, self.shard
        return {"tp": inner if self.inside(tp, 1) else outer,
                "cp": inner if self.inside(cp, tp) else outer,
                "dp": inner if self.inside(shard, tp) else outer,
                "replicas": inner if self.inside(self.replicas, tp * shard) else outer,
                "pp": inner if self.inside(self.pp, tp * cp * self.dp) else outer}

    def describe(self) -> str:
        parts = [f"{n} {v}" for n, v in (("TP", self.tp), ("CP", self.cp), ("PP", self.pp)) if v > 1]
        if self.dp > 1 or not parts:
            parts.append(f"DP {self.dp}" + (f" (HSDP: {self.shard // self.cp} a host × {self.replicas})"
                                            if self.hsdp else ""))
        return " × ".join(parts)


def check_layout(gpus: int, host: int, blocks: int, heads: tuple[int | None, int | None], seq: int | None,
                 attention_error: str | None, *, tp: Any = None, pp: Any = None, cp: Any = None) -> None:
    """``ValueError`` naming the value and what would do for a layout asked of ``plan()`` that cannot run: hosts that
    do not hold the GPUs, a tensor-parallel degree a host or the heads do not take, more stages than blocks, context
    parallelism on attention it cannot shard or a sequence it cannot split, degrees whose product does not divide the
    GPUs."""
    if gpus > host and gpus % host:
        raise ValueError(f"gpus={gpus} is no whole number of hosts of host_size={host} GPUs: give a multiple of "
                         f"{host}, or the host_size the machines have")
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a whole number ≥ 1, not {value!r}")
    q, kv = heads
    if tp is not None and tp > 1:
        if tp > host or host % tp:
            fits = [t for t in TP_DEGREES if t <= host and host % t == 0]
            raise ValueError(f"tp={tp} does not fit a host of {host} GPUs: tensor parallelism's collectives run "
                             f"between every pair of matmuls and need NVLink, inside one host; give tp in "
                             f"{', '.join(map(str, fits))}, or host_size= if the hosts hold more GPUs")
        for what, n in (("attention heads", q), ("key/value heads", kv)):
            if n is not None and n % tp:
                good = [t for t in TP_DEGREES if (q is None or q % t == 0) and (kv is None or kv % t == 0)
                        and t <= host and host % t == 0]
                raise ValueError(f"tp={tp} does not divide the model's {n} {what}: each rank computes whole heads; "
                                 f"give tp in {', '.join(map(str, good))}")
    if pp is not None and pp > 1:
        if not blocks:
            raise ValueError("pp: the model has no list of like blocks to cut into stages (a transformers decoder, a "
                             "torchtitan model or an nn.Sequential); plan it with pp=1")
        if pp > blocks:
            raise ValueError(f"pp={pp} is more stages than the model's {blocks} blocks: give pp ≤ {blocks}")
    if cp is not None and cp > 1:
        if attention_error is not None:
            raise ValueError(f"cp={cp}: {attention_error}")
        if seq is None or seq % (2 * cp):
            raise ValueError(f"cp={cp} shards the sequence into 2 × cp = {2 * cp} chunks; its length {seq} is not a "
                             f"multiple of {2 * cp}: give another cp or sequence length")
    ranks = (tp or 1) * (pp or 1) * (cp or 1)
    if gpus % ranks:
        raise ValueError(f"tp × pp × cp = {tp or 1} × {pp or 1} × {cp or 1} = {ranks} does not divide gpus={gpus}: the "
                         f"data-parallel degree is gpus / (tp × pp × cp); give degrees whose product divides {gpus}")


def meshes(gpus: int, host: int, blocks: int, heads: tuple[int | None, int | None], seq: int | None,
           attention_error: str | None, global_batch: int, *, tp: Any = None, pp: Any = None,
           cp: Any = None) -> list[Mesh]:
    """Every mesh of ``gpus`` GPUs a plan scores: tensor parallelism inside a host dividing the heads, context
    parallelism where the attention shards and the sequence splits, pipelines whose stages the blocks fill, a
    data-parallel degree dividing the global batch; HSDP beside plain sharding where the data-parallel ranks span
    hosts. ``tp``, ``pp``, ``cp`` fix a degree (checked by :func:`check_layout`)."""
    check_layout(gpus, host, blocks, heads, seq, attention_error, tp=tp, pp=pp, cp=cp)
    q, kv = heads
    tps = [tp] if tp else [t for t in TP_DEGREES if t <= min(host, gpus) and host % t == 0
                            and (q is None or q % t == 0) and (kv is None or kv % t == 0)]
    cps = [cp] if cp else [c for c in CP_DEGREES if c == 1 or (attention_error is None and seq is not None
                                                             and seq % (2 * c) == 0)]
    pps = [pp] if pp else [p for p in PP_DEGREES if p == 1 or (blocks and p <= blocks and blocks % p == 0)]
    out = []
    for t in tps:
        for c in cps:
            for p in pps:
                if gpus % (t * c * p):
                    continue
                dp = gpus // (t * c * p)
                if global_batch % dp:
                    continue
                out.append(Mesh(t, c, p, dp, host))
                if not Mesh(t, c, p, dp, host).inside(dp * c, t) and host % (t * c) == 0 and host // (t * c) >= 1:
                    hsdp = Mesh(t, c, p, dp, host, hsdp=True)
                    if hsdp.replicas > 1:
                        out.append(hsdp)
    return out


__all__ = ["CP_DEGREES", "Mesh", "PP_DEGREES", "SCHEDULES", "TP_DEGREES", "check_layout", "meshes"]
