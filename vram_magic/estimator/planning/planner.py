"""The planner: the combinations of strategies that make a training step fit the GPUs asked for, ranked by their
predicted step time.

It searches only changes that keep the training's math — micro-batch × accumulation at the same global batch,
activation checkpointing (none, every block, every second block), ZeRO-1/2/3 or FSDP over the GPUs, the optimizer's
state on the host — plus mixed precision (bf16 autocast, or fp16 with loss scaling where the GPU has no bf16; with FSDP
also FSDP2's ``MixedPrecisionPolicy``, bf16 all-gathers of fp32 shards, traced as one FSDP2 rank), which its rows mark
as changing the numerics; LoRA and QLoRA, another optimizer and a smaller global batch only when
``allow`` names them.

Screen, then exact: each *trace class* (what changes the fake run: checkpointing, precision, adapters, the optimizer,
the tensor and pipeline degrees) is traced once, at the whole per-rank batch (its *anchor*); every combination is
scored from it — memory and time scaled to the micro-batch, the layout's share computed (``layouts/``), the
collectives and transfers from their formulas (``estimator/timing/cost.py``). The fastest that the screen says fit are
then estimated
exactly, one after another, until ``top`` of them fit: every row shown is an exact estimate
(``estimate(model, inputs, **row.options)``). A checkpointed class is traced only when its lower bound (the same
combination without checkpointing) comes up before then (``Plan.bounded`` counts the combinations left untraced).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..device import Target, make_target
from ..fake.request import Request
from ..layouts.zero import ZeroLayout
from ..options import Options, fsdp2_available, make_options, optimizer_name, short_dtype
from ..timing.cost import GPUS_PER_HOST, OpTimes, StepTime
from ..timing.step_time import Network, micro_ops, network_for, rates_for, scaled_micro_ops, step_time
from ..tracing.errors import EstimateError
from .choices import Choice, describe, searched_batches, searched_layouts
from .recipes import lever_choices, lever_kwargs
from .result import Plan, PlanRow, Scored
from .step_plan import check_step, step_choices, step_name

#: what ``allow=`` may name: LoRA/QLoRA (changes what is trained), weight quantization (with LoRA), another
#: optimizer, a smaller global batch, tensor and pipeline parallelism over the GPUs, the recipes' levers even when a
#: classic combination fits (recipes.py; without it they are searched only when none does)
ALLOWED = ("lora", "quantize", "optimizer", "batch", "parallel", "recipes")
#: a combination the model cannot run (no tensor-parallel plan, no stages to split): never fits
UNFIT = 1 << 62
#: micro-batch sizes tried per trace class at most
MAX_MICRO = 6
#: exact estimates made at most to fill the rows shown
MAX_EXACT = 30


def parse_allow(allow: Any) -> frozenset[str]:
    if allow is None:
        return frozenset()
    items = [a.strip().lower() for a in allow.split(",")] if isinstance(allow, str) else [str(a).lower() for a in allow]
    wrong = [a for a in items if a and a not in ALLOWED]
    if wrong:
        raise ValueError(f"allow names {', '.join(wrong)}; it takes {', '.join(ALLOWED)}")
    return frozenset(a for a in items if a)


def micro_sizes(per_rank: int) -> list[int]:
    """The micro-batches tried for ``per_rank`` samples a rank: its divisors, at most :data:`MAX_MICRO` of them (the
    smallest, the largest and the powers of two between)."""
    divisors = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
    if len(divisors) <= MAX_MICRO:
        return divisors
    keep = {divisors[0], divisors[-1]} | {d for d in divisors if d & (d - 1) == 0}
    chosen = sorted(keep)
    while len(chosen) > MAX_MICRO:
        chosen.pop(len(chosen) // 2)
    return chosen


@dataclass
class _Anchor:
    """A trace class estimated exactly at its largest micro-batch (one micro-batch a step, nothing sharded): what it
    needs, its activations at the peak, its model states, its ops' times."""

    micro: int
    needed: int
    activations: int
    model_states: int
    ops: OpTimes
    trace: Any


class Planner:
    """One plan's search: the workload that traces, the target, the network and the device's rates."""

    def __init__(self, request: Request, base: Options, target: Target, gpus: int, net: Network,
                 progress: Callable[[str], None] | None) -> None:
        from ..step.workload import StepWorkload

        self.workload = StepWorkload(request, target)
        self.base, self.target, self.gpus, self.net, self.progress = base, target, gpus, net, progress
        self.rates = rates_for(base.device, target.gpu)
        self.anchors: dict[Any, _Anchor] = {}
        self.timed: dict[Any, OpTimes] = {}
        self.screens: dict[Choice, tuple[int, StepTime]] = {}

    def say(self, text: str) -> None:
        if self.progress is not None:
            self.progress(text)

    @property
    def traced(self) -> int:
        return self.workload.traced

    def options(self, c: Choice) -> Options:
        return c.options(self.base, self.gpus)

    def anchor(self, c: Choice) -> _Anchor:
        """The anchor of ``c``'s trace class: traced at one micro-batch of the whole per-rank batch."""
        key = c.trace_class()
        if key not in self.anchors:
            # (an FSDP2 mixed-precision class is traced as one FSDP2 rank: its anchor keeps the sharding)
            whole = replace(c, micro=c.per_rank, accumulate=1, zero=3 if c.param_dtype else None, offload=False)
            if c.pp > 1:  # a pipeline's anchor: as many micro-batches as stages, the largest they can be
                whole = replace(whole, micro=c.per_rank // c.pp, accumulate=c.pp)
            self.say(f"tracing {describe(whole, self.base).name}")
            est = self.workload.evaluate(self.options(whole))
            trace = self.workload.trace(self.options(whole))
            self.anchors[key] = _Anchor(whole.micro, est.needed, est.peak["activations"], est.model_states,
                                        micro_ops(trace, self.rates), trace)
        return self.anchors[key]

    def screen(self, c: Choice) -> tuple[int, StepTime]:
        """``(needed, time)`` of ``c`` from its class's anchor: the activations and the ops' times scaled to the
        micro-batch (accumulation keeping every gradient alive into the next micro-batch), the layout's share of the
        model states and its buffers computed. Once per combination (a checkpointed one's :meth:`bound` is its
        sibling's screen)."""
        if c not in self.screens:
            self.screens[c] = self._screen(c)
        return self.screens[c]

    def _screen(self, c: Choice) -> tuple[int, StepTime]:
        if c.tp > 1 or c.pp > 1 or c.levers or c.param_dtype is not None:  # (FSDP2: DTensor refuses some ops)
            try:
                a = self.anchor(c)
            except (ValueError, TypeError, EstimateError) as err:  # the model does not split this way
                self.say(f"{describe(c, self.base).name}: {err}")
                return UNFIT, StepTime()
        a = self.anchor(c)
        share = c.micro / a.micro
        needed = a.needed - a.activations * (1 - share)
        opts = self.options(c)
        if c.param_dtype is not None:  # the anchor is one FSDP2 rank: its states and buffers are the rank's already
            needed += a.trace.grad_bytes if c.accumulate > 1 else 0  # the sharded gradients kept between micro-batches
            needed -= a.trace.state_bytes if c.offload and opts.device == "cuda" else 0
            return int(needed), step_time(self.scaled(c, a, share), opts, a.trace, self.net)
        layout = ZeroLayout.of(opts, a.trace)
        if c.accumulate > 1 and c.pp == 1:  # the gradients kept into the next micro-batch: a rank's shard with ZeRO-2/3
            needed += -(-a.trace.grad_bytes // layout.world) if layout.stage >= 2 else a.trace.grad_bytes
        ops = self.scaled(c, a, share)
        states = layout.model_states(a.trace, opts, a.trace.state_bytes)
        needed += states - a.model_states + sum(layout.buffers(True).values())
        return int(needed), step_time(ops, opts, a.trace, self.net)

    def lazy(self, c: Choice) -> bool:
        """Whether ``c``'s class is traced only when its turn comes (:meth:`bound`): checkpointing on one process or
        data-parallel ranks, whose class without checkpointing is traced already."""
        return bool(c.checkpointing) and c.tp == 1 and c.pp == 1

    def bound(self, c: Choice) -> float:
        """A lower bound of ``c``'s screened step time: the same combination's without checkpointing, whose trace's
        ops the checkpointed trace holds too (checkpointing adds the blocks' forward in the backward, and the rest
        of the step is the same)."""
        return self.screen(replace(c, checkpointing=False))[1].total

    def scaled(self, c: Choice, a: _Anchor, share: float) -> OpTimes:
        """The anchor's ops timed at ``share`` of its micro-batch (once per trace class and micro-batch)."""
        key = (c.trace_class(), c.micro)
        if key not in self.timed:
            self.timed[key] = scaled_micro_ops(a.trace, self.rates, share)
        return self.timed[key]

    def exact(self, c: Choice) -> tuple[Any, StepTime]:
        opts = self.options(c)
        est = self.workload.evaluate(opts)
        trace = self.workload.trace(opts)
        return est, step_time(micro_ops(trace, self.rates), opts, trace, self.net)


def choices(base: Options, per_rank: int, global_batch: int, gpus: int, allow: frozenset[str], half: Any,
            blocks: int) -> list[Choice]:
    """Every combination the plan scores."""
    ckpts: list[bool | int] = [False, True] + ([2] if blocks >= 4 else [])
    precisions: list[Any] = [None] if base.dtype in (torch.bfloat16, torch.float16) else [None, half]
    adapters: list[tuple[int | None, str | None]] = [(base.lora, base.quantize)]
    if "lora" in allow and not base.lora:
        adapters.append((16, None))
        if "quantize" in allow and not base.quantize:
            adapters.append((16, "nf4"))
    optimizers: list[Any] = [None]
    if "optimizer" in allow and optimizer_name(base.optimizer).lower() in ("adam", "adamw"):
        optimizers += ["sgd-momentum", "adafactor"] + (["adamw8bit"] if base.device == "cuda" else [])
    layouts = searched_layouts(base, gpus)
    out = model_parallel_choices(base, global_batch, gpus, "parallel" in allow)
    for g in searched_batches(global_batch, gpus, allow):
        rank_batch = g // gpus
        for m in micro_sizes(rank_batch):
            for ck in ckpts:
                for amp in precisions:
                    for lora, quant in adapters:
                        for opt in optimizers:
                            for zero, off in layouts:
                                out.append(Choice(m, rank_batch // m, ck, zero, off, amp, lora, quant, opt, g))
    # FSDP2's MixedPrecisionPolicy beside fp32 weights under autocast: each FSDP/ZeRO-3 row with autocast again, with
    # the precision FSDP2's (bf16 all-gathers of fp32 shards, no autocast cache of the weights' casts)
    if fsdp2_available():  # PyTorch 2.6 on
        out += [replace(c, amp=None, param_dtype=c.amp) for c in out if c.zero == 3 and c.amp is not None
                and c.tp == 1 and c.pp == 1 and c.optimizer is None]
    return out


def model_parallel_choices(base: Options, global_batch: int, gpus: int, allowed: bool) -> list[Choice]:
    """Tensor parallelism over 2, 4 or 8 of the GPUs and pipelines of 2 or 4 stages (1F1B with p, 2p or 4p
    micro-batches), DDP over the rest, with and without checkpointing (with ``allow="parallel"``)."""
    if not allowed or gpus < 2:
        return []
    out = []
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4):
            if tp * pp == 1 or gpus % (tp * pp):
                continue
            dp = gpus // (tp * pp)
            if global_batch % dp:
                continue
            rank_batch = global_batch // dp
            splits = [(m, rank_batch // m) for m in micro_sizes(rank_batch)] if pp == 1 else \
                [(rank_batch // m, m) for m in (pp, 2 * pp, 4 * pp) if rank_batch % m == 0]
            for micro, acc in splits:
                for ck in (False, True):
                    out.append(Choice(micro, acc, ck, None, False, None, base.lora, base.quantize, None,
                                      global_batch, tp=tp, pp=pp))
    return out


def plan(model: Any, inputs: Any, *, gpu: Any = None, gpus: int = 1, global_batch: int | None = None,
         device: str = "cuda", allow: Any = (), interconnect: Any = None, generate: int | None = None,
         top: int | None = 10,
         optimizer: Any = "adamw", loss_fn: Any = None, dtype: Any = None, budget: Any = None,
         name: str | None = None, progress: Callable[[str], None] | None = None, host_size: int = GPUS_PER_HOST,
         tp: int | None = None, pp: int | None = None, cp: int | None = None, step: Any = None) -> Plan:
    """:func:`vram_magic.plan`; see its documentation."""
    t0 = time.perf_counter()
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus must be a whole number ≥ 1, not {gpus!r}")
    if isinstance(host_size, bool) or not isinstance(host_size, int) or host_size < 1:
        raise ValueError(f"host_size must be a whole number ≥ 1 (the GPUs one host holds), not {host_size!r}")
    fixed = {k: v for k, v in (("tp", tp), ("pp", pp), ("cp", cp)) if v is not None}
    if device == "cuda" and gpu is None:
        raise ValueError("plan() needs the GPU to time the step on: give gpu='A100-80GB' (or another known GPU)")
    if device != "cuda" and gpus != 1:
        raise ValueError("device='cpu' plans one process: drop gpus=")
    allowed = parse_allow(allow)
    if step is not None:
        check_step(step, allowed, generate, loss_fn, fixed)
    top = 10 if top is None else top
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"top must be a whole number ≥ 1, not {top!r}")
    target = make_target(gpu, budget)
    if target.capacity is None:
        raise ValueError("plan() needs a capacity to fit: give gpu= or budget=")
    if generate is not None:
        if gpus != 1 or global_batch is not None:
            raise ValueError("generate= plans one GPU's generate() call: drop gpus= and global_batch=")
        from .generate_planner import plan_generate

        return plan_generate(model, inputs, new_tokens=generate, target=target, device=device, dtype=dtype,
                             allow=allowed, top=top, name=name, progress=progress)
    base = make_options(optimizer=optimizer, dtype=dtype, device=device, step=step)
    from ..fake.convert import check_inputs

    check_inputs(inputs)
    request = Request(model, inputs, loss_fn, name=name)
    batch, tokens = _inputs_batch(request)
    global_batch = batch if global_batch is None else global_batch
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch must be a whole number ≥ 1, not {global_batch!r}")
    if global_batch % gpus:
        raise ValueError(f"global batch {global_batch} does not split over {gpus} GPUs: give a multiple of {gpus}")
    net = network_for(target.gpu, gpus, interconnect, host_size)
    half = torch.bfloat16 if target.gpu is None or target.gpu.has_bf16 else torch.float16
    if fixed and (device != "cuda" or gpus < 2):
        raise ValueError(f"{', '.join(f'{k}={v}' for k, v in fixed.items())}: a layout across GPUs; give gpus= (≥ 2) "
                         "with it")
    if step is not None:
        return _plan_step(request, base, target, gpus, net, global_batch, tokens, top, allowed, progress, t0)
    if device == "cuda" and gpus > 1 and (gpus > host_size or "parallel" in allowed or fixed):
        return _plan_layouts(request, base, target, gpus, net, host_size, global_batch, tokens, top, half, fixed,
                             progress, t0)
    planner = Planner(request, base, target, gpus, net, progress)
    first = planner.anchor(Choice(global_batch // gpus, 1, False, None, False, None, base.lora, base.quantize, None,
                                  global_batch))
    blocks = len(first.trace.unit_param_bytes)
    space = choices(base, global_batch // gpus, global_batch, gpus, allowed, half, blocks)
    levers = lever_space(base, global_batch // gpus, global_batch, gpus, allowed, half)
    if "recipes" in allowed:
        space, levers = space + levers, []
    planner.say(f"screening {len(space)} combinations")
    result = _rank(planner, space, top, tokens, request, t0)
    if levers and not any(r.fits for r in result.rows):
        planner.say(f"nothing classic fits: screening {len(levers)} combinations with the recipes' levers")
        result = _rank(planner, space + levers, top, tokens, request, t0)
        result = replace(result, notes=(*result.notes, "nothing classic fits: the search added the recipes' levers "
                                        "(optimizer in backward, the loss in chunks, op-level checkpointing, "
                                        "activations on the host on CUDA), which keep the training's math"))
    return result


def _plan_step(request: Request, base: Options, target: Target, gpus: int, net: Network, global_batch: int,
               tokens: int, top: int, allowed: frozenset[str], progress: Callable[[str], None] | None,
               t0: float) -> Plan:
    """The plan of the user's step (``step=fn``): its trace as written, on :func:`step_choices` only."""
    planner = Planner(request, base, target, gpus, net, progress)
    space = step_choices(base, global_batch, gpus, allowed)
    planner.say(f"screening {len(space)} combinations of your step {step_name(base.step)}")
    result = _rank(planner, space, top, tokens, request, t0)
    note = (f"your step {step_name(base.step)}(model, batch, optimizer) is traced and timed as written; the plan "
            "searched only what it leaves to the planner (the sharding over the GPUs, the optimizer's state on the "
            "host): checkpointing, precision, accumulation, the loss and the recipes' levers are the step's")
    return replace(result, step=step_name(base.step), notes=(note, *result.notes))


def _plan_layouts(request: Request, base: Options, target: Target, gpus: int, net: Network, host: int,
                  global_batch: int, tokens: int, top: int, half: Any, fixed: dict[str, Any],
                  progress: Callable[[str], None] | None, t0: float) -> Plan:
    """The search over layouts across GPUs in hosts (``layout_planner.py``)."""
    from ..fake.frameworks import fake_run
    from .depth import survey
    from .layout_planner import LayoutPlanner, search_space

    with fake_run() as mode:
        found = survey(request, mode, base.dtype)
    seq = tokens or None
    space = search_space(base, found, gpus, host, global_batch, seq, half, fixed)
    if not space:
        raise ValueError(f"no layout of {gpus} GPUs splits a global batch of {global_batch}: give a global batch that "
                         "the data-parallel degree divides")
    planner = LayoutPlanner(request, base, target, gpus, net, host, found, seq, progress)
    planner.say(f"screening {len(space)} combinations")
    result = _rank(planner, space, top, tokens, request, t0)
    notes = list(result.notes)
    notes.append(f"the screen traced each trace class on the model's first {' and '.join(map(str, planner.depths))} "
                 f"of its {found.blocks} blocks and took what one block adds as every block's: its figures are "
                 "interpolated (Plan.scored[i].exact is False); every row shown is estimated exactly on the whole "
                 "model")
    for what, why in planner.failures.items():
        notes.append(f"not searched: {what} ({why})")
    return replace(result, notes=tuple(notes))


def lever_space(base: Options, per_rank: int, global_batch: int, gpus: int, allow: frozenset[str],
                half: Any) -> list[Choice]:
    """The combinations with the recipes' levers (``recipes.py``), on the classic search's axes: the layouts, the
    precisions, and 8-bit AdamW where ``allow`` has ``"optimizer"`` (torchtune's single-GPU recipe pairs it with an
    optimizer in backward)."""
    precisions: list[Any] = [None] if base.dtype in (torch.bfloat16, torch.float16) else [None, half]
    optimizers: list[Any] = [None]
    if "optimizer" in allow and base.device == "cuda" and optimizer_name(base.optimizer).lower() in ("adam", "adamw"):
        optimizers.append("adamw8bit")
    layouts = searched_layouts(base, gpus)

    def make(micro: int, acc: int, ck: Any, zero: Any, off: bool, amp: Any, opt: Any,
             levers: tuple[str, ...]) -> Choice:
        return Choice(micro, acc, ck, zero, off, amp, base.lora, base.quantize, opt, global_batch, levers=levers)

    return lever_choices(make, base, per_rank, layouts, precisions, optimizers, micro_sizes)


def _rank(planner: Any, space: list[Choice], top: int, tokens: int, request: Request, t0: float) -> Plan:
    """Screen, then estimate exactly the fastest that fit until ``top`` of them do. A checkpointed combination's class
    is traced only when its turn comes: until then its time is bounded below by the same combination without
    checkpointing (its trace's ops, and the checkpointed blocks' forward once more), and a class whose bound stays
    above the rows found is never traced (``Plan.bounded``)."""
    target = planner.target
    capacity = target.capacity
    assert capacity is not None
    scored: dict[Choice, tuple[int, StepTime]] = {}
    order = {c: i for i, c in enumerate(space)}
    queue: list[tuple[float, int, bool]] = []  # (time, place in space, screened): the fastest first
    waiting: dict[Any, list[Choice]] = {}  # trace class -> its combinations not screened yet

    def screened(c: Choice) -> None:
        scored[c] = planner.screen(c)
        if scored[c][0] <= capacity:
            heapq.heappush(queue, (scored[c][1].total, order[c], True))

    for c in space:
        if planner.lazy(c):
            waiting.setdefault(c.trace_class(), []).append(c)
            heapq.heappush(queue, (planner.bound(c), order[c], False))
        else:
            screened(c)
    rows: list[PlanRow] = []
    exact: dict[Choice, tuple[Any, StepTime]] = {}
    affordable = getattr(planner, "affordable", lambda c: True)
    still_fits = getattr(planner, "still_fits", lambda c: True)
    skipped: list[Choice] = []  # screened to fit, faster than rows shown, too dear to estimate exactly
    while queue and len(rows) < top and len(exact) < MAX_EXACT:  # the fastest the screen says fit, exactly
        _, i, known = heapq.heappop(queue)
        c = space[i]
        if not known:  # its bound's turn: its class traced, and every combination of the class screened
            for d in waiting.pop(c.trace_class(), []):
                screened(d)
            continue
        if not affordable(c):
            skipped.append(c)
            continue
        if not still_fits(c):  # its class's exact estimates so far need more than the screen said: not this one
            continue
        planner.say(f"estimating {describe(c, planner.base, gpus=planner.gpus).name} exactly")
        est, t = planner.exact(c)
        exact[c] = (est, t)
        if est.fits:
            rows.append(_row(c, est, t, planner, tokens, request))
    bounded = sum(len(v) for v in waiting.values())
    notes: list[str] = []
    if bounded and len(rows) >= top:
        notes.append(f"{bounded} checkpointed combinations were left untraced: each one's step without checkpointing, "
                     "which bounds its own from below, already screened slower than the rows chosen")
    elif bounded:
        notes.append(f"{bounded} checkpointed combinations were left untraced: the {MAX_EXACT} exact estimates a plan "
                     "makes at most were made first")
    if len(rows) < top:  # the screen can overstate what a combination needs (its anchor's peak may lie in another
        # phase than the combination's): the closest it ruled out, estimated exactly while too few rows fit
        ruled_out = sorted(((c, n) for c, (n, _t) in scored.items() if n > capacity), key=lambda s: (s[1], order[s[0]]))
        found, limit = len(rows), min(MAX_EXACT, len(exact) + top // 2 + 1)
        for c, _needed in ruled_out:
            if len(rows) >= top or len(exact) >= limit:
                break
            if not affordable(c):
                continue
            planner.say(f"estimating {describe(c, planner.base, gpus=planner.gpus).name} exactly")
            est, t = exact[c] = planner.exact(c)
            if est.fits:
                rows.append(_row(c, est, t, planner, tokens, request))
        if len(rows) > found:
            notes.append(f"{len(rows) - found} of the rows fit although the screen put them above the capacity: "
                         "they were estimated exactly as the closest it ruled out")
    rows.sort(key=lambda r: r.step_time)
    if not rows:  # nothing fits: the closest by the screen, estimated exactly
        closest_few = sorted(((c, n) for c, (n, _t) in scored.items() if affordable(c)),
                             key=lambda s: (s[1], order[s[0]]))[:top]
        for c, _n in closest_few:
            if c not in exact:
                planner.say(f"estimating {describe(c, planner.base, gpus=planner.gpus).name} exactly")
                exact[c] = planner.exact(c)
        closest = sorted(((c, e) for c, e in exact.items() if e[0].needed < UNFIT),
                         key=lambda kv: kv[1][0].needed)[:top]
        rows = [_row(c, est, t, planner, tokens, request) for c, (est, t) in closest]
        notes.append("nothing fits: the rows are the combinations that come closest, by what they need")
    notes += _skipped_notes(planner, skipped, scored)
    marks = {c: (est.needed, t.total) for c, (est, t) in exact.items()}
    screen = tuple(Scored(describe(c, planner.base, gpus=planner.gpus).name, marks.get(c, (n, t.total))[0],
                          marks.get(c, (n, t.total))[1], marks.get(c, (n, t.total))[0] <= capacity, c in marks)
                   for c, (n, t) in sorted(scored.items(), key=lambda kv: order[kv[0]]))
    gpu = target.gpu
    return Plan(model=request.name, device=planner.base.device, gpu=gpu.name if gpu is not None else None,
                gpus=planner.gpus, capacity=capacity, global_batch=space[0].global_batch if space else 0,
                unit="tokens/s" if tokens else "samples/s", rows=tuple(rows), scored=screen, bounded=bounded,
                assumptions=_assumptions(planner), notes=tuple(notes), traced=planner.traced,
                wall_time=time.perf_counter() - t0)


def _skipped_notes(planner: Any, skipped: list[Choice], scored: dict[Choice, tuple[int, StepTime]]) -> list[str]:
    """What the plan says of the combinations it screened to fit but did not estimate exactly (their exact estimates
    trace too many micro-batches of the whole model): the fastest few, with their screened figures."""
    if not skipped:
        return []
    from ...core.units import format_bytes

    shown = "; ".join(f"{describe(c, planner.base, gpus=planner.gpus).name} (screened {scored[c][1].total:.3g} s a "
                      f"step, {format_bytes(scored[c][0])})" for c in skipped[:3])
    return [f"{len(skipped)} combinations the screen puts faster than the rows were not estimated exactly: each "
            f"exact estimate traces every micro-batch of every stage of the whole model "
            f"({getattr(planner, 'exact_limit', 0):,} blocks' forward and backward at most a plan runs for one): "
            f"{shown}; estimate(**options) checks one"]


def _row(c: Choice, est: Any, t: StepTime, planner: Any, tokens: int, request: Request) -> PlanRow:
    facts = describe(c, planner.base, model=request.source, gpu=planner.target.gpu, gpus=planner.gpus,
                     keyed=isinstance(request.specs, dict))
    per_second = c.global_batch / t.total if t.total > 0 else 0.0
    comms = getattr(planner, "comms", {}).get(c, ())
    name = facts.name
    if planner.base.step is not None and not facts.changes:  # the user's step, nothing sharded or offloaded
        name = f"your {step_name(planner.base.step)} as written"
    return PlanRow(name=name, options=_kwargs(c, planner), changes=facts.changes, peak=est.peak,
                   needed=est.needed, fits=est.fits, step_time=t.total,
                   throughput=per_second * (tokens or 1), time=t.as_dict(), micro_batch=c.micro,
                   accumulate=c.accumulate, numerics=facts.numerics, code=facts.code,
                   tradeoffs=facts.tradeoffs + _host_pinned(est), collectives=tuple(comms))


def _host_pinned(est: Any) -> tuple[str, ...]:
    """The pinned host memory a row's activations on the host hold (``estimate.host_pinned``), said."""
    pinned = getattr(est, "host_pinned", 0)
    if not pinned:
        return ()
    from ...core.units import format_bytes

    return (f"{format_bytes(pinned)} of pinned host memory for the activations (the caching host allocator's blocks "
            "at their peak)",)


def _kwargs(c: Choice, planner: Any) -> dict[str, Any]:
    """The :func:`vram_magic.estimate` keyword arguments that give the row's memory."""
    base, target = planner.base, planner.target
    out: dict[str, Any] = {"optimizer": c.optimizer or base.optimizer, "batch": c.per_rank, "device": base.device}
    if base.dtype is not None:
        out["dtype"] = short_dtype(base.dtype)
    if c.amp is not None:
        out["amp"] = short_dtype(c.amp)
    if c.checkpointing:
        out["checkpointing"] = c.checkpointing
    if c.accumulate > 1:
        out["accumulate"] = c.accumulate
    world = planner.gpus // c.replicas
    if c.zero:
        out.update(zero=c.zero, world=world)
    elif planner.gpus > 1:
        out["world"] = world
    if c.offload:
        out["offload"] = True
    if c.param_dtype is not None:
        out.update(param_dtype=short_dtype(c.param_dtype), reduce_dtype="fp32")
    if c.master is not None:
        out.update(dtype=short_dtype(c.master), master_weights="fp32")
    if c.tp > 1:
        out["tp"] = c.tp
    if c.cp > 1:
        out["cp"] = c.cp
    if c.pp > 1:  # the pipeline's micro-batches, not accumulation
        out.pop("accumulate", None)
        out.update(pp=c.pp, micro_batches=c.accumulate)
        if c.schedule != "1f1b":
            out["schedule"] = c.schedule
    if c.lora:
        out["lora"] = c.lora
    if c.quantize:
        out["quantize"] = c.quantize
    out.update(lever_kwargs(c.levers, c.checkpointing))
    if target.gpu is not None:
        out["gpu"] = target.gpu.name
    elif target.budget is not None:
        out["budget"] = target.budget
    return out


def _assumptions(planner: Any) -> tuple[str, ...]:
    out = [planner.rates.assumptions]
    host = getattr(planner, "host", None)
    if host is not None:
        out.append(f"{planner.gpus} GPUs in hosts of {host}: NVLink inside a host ({planner.intra.name}), "
                   f"{planner.net.name} between hosts; ring collectives at 80 % of the link")
        out.append("overlap as the runtime does it: FSDP prefetches each block's all-gather during the block before "
                   "and reduce-scatters during the next block's backward (the first gather and the last "
                   "reduce-scatter exposed); DDP's and ZeRO's gradient buckets overlap the last backward (the last "
                   "bucket exposed); tensor-parallel, context-parallel and pipeline communication exposed, with the "
                   "pipeline's bubble; each row's collectives say what each leaves exposed")
    else:
        if planner.gpus > 1:
            out.append(f"{planner.gpus} GPUs over {planner.net.name}; ring collectives at 80 % of it")
        out.append("no overlap assumed: communication, offload's transfers and the host's update add to the step "
                   "(FSDP and DDP overlap much of their communication with compute: an upper bound)")
    return tuple(out)


def _inputs_batch(request: Request) -> tuple[int, int]:
    """``(batch, tokens per sample)`` of the inputs: dimension 0 of the first tensor, and its dimension 1 when it
    holds token ids (integers, two dimensions), else 0."""
    from ..fake.convert import specs_in
    from ..torch_private import FakeTensorMode

    specs = specs_in(request.input_specs(FakeTensorMode(allow_non_fake_inputs=True)))
    if not specs or not specs[0].shape:
        raise ValueError("the inputs have no batch dimension to plan over")
    first = specs[0]
    tokens = first.shape[1] if len(first.shape) == 2 and not first.dtype.is_floating_point else 0
    return first.shape[0], tokens

