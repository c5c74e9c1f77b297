"""The planner across GPUs in hosts: the whole product of layouts — tensor × pipeline × context × data parallelism
(DDP, ZeRO-1/2, FSDP/ZeRO-3, HSDP) × micro-batches × pipeline schedule × checkpointing (none, every block, every
second block, op-level) × precision (bf16 autocast; FSDP2's ``MixedPrecisionPolicy`` where FSDP shards alone) — each
axis placed on the mesh where it belongs (``mesh.py``) and its collectives timed over that link with the overlap the
runtime gives them (``timing/overlap.py``).

The screen scores every combination from two shallow traces of its trace class (``screen.py``: the model cut to one
and two blocks, so the cost does not grow with the depth); checkpointed classes are traced only when their bound
comes up, as in the single-host search. The fastest the screen says fit are then estimated exactly, on the whole
model, until ``top`` fit: every row shown is ``estimate(model, inputs, **row.options)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..device import Target
from ..fake.request import Request
from ..options import Options, fsdp2_available
from ..timing.overlap import Collective, Link, MeshTiming, RankWork, mesh_step
from ..timing.step_time import Network, rates_for
from ..tracing.errors import EstimateError
from .choices import Choice, describe
from .depth import Survey
from .mesh import SCHEDULES, Mesh, meshes
from .screen import Memory, Stage, Work, memory_fit, scaled_work, stage_bytes, stages, trace_work, work_fit

#: a combination the model cannot run: never fits
UNFIT = 1 << 62
#: the shallow depths the screen traces (blocks)
DEPTHS = (1, 2)
#: an exact estimate traces at most this many times the model's blocks (forward and backward)
EXACT_PASSES = 2


@dataclass(frozen=True)
class _Unfit:
    """The exact estimate of a combination the estimator could not make: it does not fit."""

    needed: int = UNFIT
    fits: bool = False


@dataclass
class _Anchor:
    """A trace class at the shallow depths: its options at one sample, its work's fits, the parameter bytes a block
    adds, and the memory fits replayed per ZeRO stage and sharding degree."""

    opts: Options
    work: Work
    param_per_block: float
    memory: dict[tuple[int, int], Memory]


class LayoutPlanner:
    """One plan's search over layouts (module documentation); the interface the ranking reads (``screen``,
    ``lazy``, ``bound``, ``exact``, ``options``) is the single-host planner's."""

    def __init__(self, request: Request, base: Options, target: Target, gpus: int, net: Network, host: int,
                 survey: Survey, seq: int | None, progress: Callable[[str], None] | None) -> None:
        from ..step.workload import StepWorkload

        self.base, self.target, self.gpus, self.net, self.host = base, target, gpus, net, host
        self.survey, self.seq, self.progress = survey, seq, progress
        self.rates = rates_for(base.device, target.gpu)
        self.depths = tuple(d for d in DEPTHS if d < survey.blocks) or (survey.blocks,)
        self.workloads = {d: StepWorkload(survey.shallow(d), target) for d in self.depths}
        self.whole = StepWorkload(request, target)
        self.anchors: dict[Any, _Anchor | None] = {}
        self.screens: dict[Choice, tuple[int, Any]] = {}
        self.comms: dict[Choice, tuple[Collective, ...]] = {}
        self.failures: dict[str, str] = {}  # what could not be traced, and why
        self.understated: dict[Any, float] = {}  # a class's largest exact ÷ screened bytes so far (above 1)
        gpu = target.gpu
        self.intra = Link(gpu.link or gpu.host_link, ("NVLink" if gpu.link else "PCIe")
                          + f" {(gpu.link or gpu.host_link) / 1e9:.0f} GB/s") if gpu is not None else Link(0.0, "-")

    @property
    def traced(self) -> int:
        return self.whole.traced + sum(w.traced for w in self.workloads.values())

    def say(self, text: str) -> None:
        if self.progress is not None:
            self.progress(text)

    def options(self, c: Choice) -> Options:
        return c.options(self.base, self.gpus)

    def mesh(self, c: Choice) -> Mesh:
        dp = c.data_parallel(self.gpus)
        return Mesh(c.tp, c.cp, c.pp, dp, self.host, hsdp=c.replicas > 1)

    # --- the anchors ----------------------------------------------------------------------------------------------
    def _key(self, c: Choice) -> tuple[Any, ...]:
        ck = False if c.checkpointing is False else ("ops" if c.checkpointing == "ops" else True)
        world = c.shards(self.gpus) if c.param_dtype is not None else None
        return (ck, c.amp, c.param_dtype, c.tp, world, c.lora, c.quantize, c.optimizer, c.master)

    def anchor(self, c: Choice) -> _Anchor | None:
        """``c``'s trace class at the shallow depths (``None`` where the model does not run that way)."""
        key = self._key(c)
        if key not in self.anchors:
            one = replace(c, micro=1, accumulate=1, pp=1, cp=1, schedule="1f1b", offload=False, replicas=1,
                          checkpointing=key[0], zero=3 if c.param_dtype is not None else None, global_batch=0)
            gpus = c.tp * (c.shards(self.gpus) if c.param_dtype is not None else 1)
            opts = one.options(self.base, gpus).with_(world=gpus)
            self.say(f"tracing {describe(one, self.base, gpus=gpus).name} at {' and '.join(map(str, self.depths))} "
                     "blocks")
            try:
                works = [trace_work(self.workloads[d].trace(opts), opts, self.rates) for d in self.depths]
                low, high = self.depths[0], self.depths[-1]
                traces = [self.workloads[d].trace(opts) for d in self.depths]
                if any(t.problem for t in traces):
                    raise EstimateError(next(t.problem for t in traces if t.problem))
                per_block = (traces[-1].param_bytes - traces[0].param_bytes) / max(high - low, 1)
                self.anchors[key] = _Anchor(opts, work_fit(works[0], works[-1], low, max(high, low + 1)), per_block,
                                            {})
            except (ValueError, TypeError, EstimateError, RuntimeError) as err:
                self.failures[describe(one, self.base, gpus=gpus).name] = str(err)
                self.say(f"{describe(one, self.base, gpus=gpus).name}: {err}")
                self.anchors[key] = None
        return self.anchors[key]

    def memory(self, a: _Anchor, c: Choice) -> Memory:
        """The anchor's memory fits with ``c``'s ZeRO stage over its sharding degree (replays of the shallow traces)."""
        zero, shards = (c.zero or 0), c.shards(self.gpus)
        key = (zero, shards)
        if key not in a.memory:
            opts = a.opts if c.param_dtype is not None else \
                a.opts.with_(zero=c.zero, world=c.tp * shards if (c.zero or shards > 1) else a.opts.world)
            if opts.zero and opts.world // opts.tp < 2:
                opts = opts.with_(zero=None, world=opts.tp)
            ests = [self.workloads[d].evaluate(opts) for d in self.depths]
            low, high = self.depths[0], self.depths[-1]
            a.memory[key] = memory_fit(ests[0], ests[-1], low, max(high, low + 1))
        return a.memory[key]

    # --- the screen -----------------------------------------------------------------------------------------------
    def screen(self, c: Choice) -> tuple[int, Any]:
        if c not in self.screens:
            self.screens[c] = self._screen(c)
        return self.screens[c]

    def _screen(self, c: Choice) -> tuple[int, Any]:
        from ..timing.cost import StepTime

        a = self.anchor(c)
        if a is None:
            return UNFIT, StepTime()
        mem, work = self.memory(a, c), a.work
        if c.checkpointing == 2:  # every second block: halfway between none and every block
            b = self.anchor(replace(c, checkpointing=False))
            if b is None:
                return UNFIT, StepTime()
            mem, work = self.memory(b, c).mixed(mem, 0.5), b.work.mixed(work, 0.5)
        scale = c.micro / c.cp
        survey, tp = self.survey, c.tp
        parts = stages(survey.blocks, c.pp, c.accumulate, c.schedule)
        shards = c.shards(self.gpus)
        held = 0.0
        if c.accumulate > 1:  # the gradients kept into the next micro-batch (a ZeRO-2/3 rank's shard)
            held = max(work.reduce.per_block, 0.0) / (shards if (c.zero or 0) >= 2 else 1)
        ring = self._ring(c)
        # autocast's cache keeps a half-precision copy of every weight (every gathered one under FSDP) until the
        # forward's end, where a deep model's peak then lies (the loss beside them all); at one and two blocks the
        # peak lies in the backward, so the anchor's phases do not show it: added to the forward's phase
        cached = a.param_per_block / 2 if c.amp is not None and c.param_dtype is None else 0.0
        needed = max(stage_bytes(mem, s, scale, (survey.first / tp, survey.last / tp), a.param_per_block,
                                 (held + cached) * s.blocks, ring[1]) for s in parts)
        t, comms = self._time(c, scaled_work(work, parts[-1], scale), parts[-1])
        self.comms[c] = comms
        return int(needed), t

    def _ring(self, c: Choice) -> tuple[float, float]:
        """``(bytes, buffers)``: one attention's local K and V bytes under context parallelism, and the ring's
        largest buffers (``layouts/context.py``'s ``RingShapes``), for ``c``'s micro-batch and TP shard of heads."""
        if c.cp < 2 or self.seq is None:
            return 0.0, 0.0
        from ..layouts.context import RingShapes

        config = self.survey.config
        heads, kv_heads = self.survey.heads
        heads, kv_heads = (heads or 1) // c.tp, (kv_heads or heads or 1) // c.tp
        head_dim = getattr(config, "head_dim", None) or self.survey.hidden // max(self.survey.heads[0] or 1, 1)
        itemsize = 2 if c.half_compute else 4
        tokens = c.micro * (self.seq // c.cp) * head_dim * itemsize
        ring = RingShapes(c.cp, self.survey.blocks, heads * tokens, kv_heads * tokens, itemsize)
        return float(ring.kv), float(max(ring.forward(), ring.backward()))

    def _mesh_timing(self, c: Choice) -> MeshTiming:
        mesh = self.mesh(c)
        links = mesh.links(self.net, self.intra.bandwidth, self.intra.name)
        return MeshTiming(c.tp, c.pp, c.cp, c.shards(self.gpus), c.zero or 0, c.accumulate, c.schedule,
                          c.replicas, links, sharded_update=c.param_dtype is None)

    def _time(self, c: Choice, work: RankWork, stage: Stage) -> tuple[Any, tuple[Collective, ...]]:
        """``c``'s step from one rank's work (the busiest stage's): the pipeline's sends and the ring's bytes added."""
        itemsize = 2 if c.half_compute else 4
        p2p = c.micro * ((self.seq or 1) // c.cp) * self.survey.hidden * itemsize / c.tp if c.pp > 1 else 0.0
        ring = self._ring(c)[0]
        work = replace(work, p2p=p2p, ring=ring, attentions=int(round(stage.blocks)) if ring else 0)
        return mesh_step(work, self._mesh_timing(c))

    def lazy(self, c: Choice) -> bool:
        return bool(c.checkpointing)

    def bound(self, c: Choice) -> float:
        return self.screen(replace(c, checkpointing=False))[1].total

    # --- the exact estimates ----------------------------------------------------------------------------------------
    def _class(self, c: Choice) -> tuple[Any, ...]:
        return (self._key(c), c.pp > 1)

    def still_fits(self, c: Choice) -> bool:
        """Whether ``c`` still fits once its screened bytes are scaled by what the exact estimates of its class (the
        same trace class, pipeline or not) found the screen to understate: a combination
        the screen's extrapolation to the whole depth misjudges is then estimated once, not once per micro-batch."""
        capacity = self.target.capacity
        if capacity is None or c not in self.screens:
            return True
        return self.screens[c][0] * self.understated.get(self._class(c), 1.0) <= capacity

    @property
    def exact_limit(self) -> int:
        """The blocks' forwards and backwards one exact estimate may trace: a pipeline's estimate traces every
        micro-batch of every stage (``m ×`` the model), the others one or two micro-batches of the model."""
        return max(EXACT_PASSES * self.survey.blocks, 64)

    def affordable(self, c: Choice) -> bool:
        """Whether ``c``'s exact estimate traces at most :attr:`exact_limit` blocks' passes."""
        passes = self.survey.blocks * (c.accumulate if c.pp > 1 else min(c.accumulate, 2))
        return passes <= self.exact_limit

    def exact(self, c: Choice) -> tuple[Any, Any]:
        """``c`` estimated on the whole model (what ``estimate(**row.options)`` gives), its time from its own traces:
        every pipeline rank's, the slowest taken. A combination the estimator refuses or cannot trace does not fit,
        and the plan says why."""
        from ..timing.cost import StepTime

        opts = self.options(c)
        try:
            est = self.whole.evaluate(opts)
            if est.partial:
                raise EstimateError(est.problem or "partial")
        except (ValueError, TypeError, EstimateError, RuntimeError) as err:
            name = describe(c, self.base, gpus=self.gpus).name
            self.failures[name] = str(err)
            self.say(f"{name}: {err}")
            return _Unfit(), StepTime()
        screened = self.screens.get(c, (0, None))[0]
        if 0 < screened < est.needed:
            k = self._class(c)
            self.understated[k] = max(self.understated.get(k, 1.0), est.needed / screened)
        best: tuple[Any, tuple[Collective, ...]] | None = None
        for r in range(max(c.pp, 1)):
            o = opts.with_(pp_rank=r) if c.pp > 1 else opts
            trace = self.whole.trace(o)
            work = trace_work(trace, o, self.rates)
            stage = Stage(max(work.blocks, 1), r == 0, r == c.pp - 1, 1.0)
            t = self._time(c, work, stage)
            if best is None or t[0].total > best[0].total:
                best = t
        assert best is not None
        self.comms[c] = best[1]
        return est, best[0]


def layout_space(base: Options, meshes_: list[Mesh], global_batch: int, blocks: int, half: Any) -> list[Choice]:
    """Every combination the layout search scores (module documentation)."""
    from ..layouts.pipeline import RUNTIME, buffers_per_use, check_micro_batches

    fp32 = base.dtype not in (torch.bfloat16, torch.float16)
    ckpts: list[Any] = [False, True, "ops"] + ([2] if blocks >= 4 else [])
    # the zero-bubble schedules where this PyTorch's pipelining runtime is modelled for them (estimates refuse it else)
    schedules = [s for s in SCHEDULES if not (s in RUNTIME and buffers_per_use())]
    out: list[Choice] = []
    for mesh in meshes_:
        per = global_batch // mesh.dp
        divisors = [d for d in range(1, per + 1) if per % d == 0]
        zeros: list[int | None] = [3] if mesh.hsdp else ([None, 1, 2, 3] if mesh.shard > 1 else [None])
        if mesh.pp > 1:
            splits = []
            for schedule in schedules:
                stages_ = mesh.pp * (2 if schedule != "1f1b" else 1)
                if blocks % stages_:
                    continue
                for m in divisors:
                    try:
                        if m < mesh.pp:
                            continue
                        check_micro_batches(schedule, m, mesh.pp, stages_, per)
                    except ValueError:
                        continue
                    splits.append((per // m, m, schedule))
        else:
            splits = [(d, per // d, "1f1b") for d in divisors]
        for micro, acc, schedule in splits:
            for zero in zeros:
                precisions: list[tuple[Any, Any, Any]] = [(half if fp32 else None, None, None)]
                if fp32 and zero == 3 and mesh.tp == 1 and mesh.pp == 1 and fsdp2_available():
                    precisions.append((None, half, None))  # FSDP2's MixedPrecisionPolicy
                elif fp32 and (mesh.tp > 1 or mesh.pp > 1) and base.lora is None and base.quantize is None:
                    precisions.append((None, None, half))  # half-precision weights, fp32 master (the ZeRO paper's)
                for amp, param_dtype, master in precisions:
                    for ck in ckpts:
                        out.append(Choice(micro, acc, ck, zero, False, amp, base.lora, base.quantize, None,
                                          global_batch, tp=mesh.tp, pp=mesh.pp, param_dtype=param_dtype,
                                          cp=mesh.cp, schedule=schedule, replicas=mesh.replicas, master=master))
    return out


def search_space(base: Options, survey: Survey, gpus: int, host: int, global_batch: int, seq: int | None, half: Any,
                 fixed: dict[str, Any]) -> list[Choice]:
    """The meshes of ``gpus`` GPUs (``fixed`` degrees held) and every combination on them."""
    found = meshes(gpus, host, survey.blocks, survey.heads, seq, survey.attention_error, global_batch, **fixed)
    return layout_space(base, found, global_batch, survey.blocks, half)


__all__ = ["DEPTHS", "LayoutPlanner", "UNFIT", "layout_space", "search_space"]
