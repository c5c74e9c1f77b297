"""Tensor- and pipeline-parallel training steps on real gloo ranks on the CPU, measured inside each rank: the
figures per-rank estimates are checked against (tests/ranks/test_tp_pp.py, benchmarks/ranks_tp_pp.py).

The cases (:data:`CASES`), each two AdamW steps (forward, loss, backward, step, ``zero_grad``) on every rank; a
tensor-parallel step keeps its output and loss until it returns, as a training loop that ends each step with
``del out, loss`` does (and as an estimate's step does):

* ``tp-mlp``: three blocks ``Linear(256, 1024) → GELU → Linear(1024, 256)``, each ``parallelize_module``-d with
  the first linear ``ColwiseParallel`` and the second ``RowwiseParallel``; batch 256, loss ``out.sum()``.
* ``tp-llama`` / ``tp-llama-sp``: a transformers ``LlamaForCausalLM`` built from a config (2 layers, hidden 256,
  intermediate 512, 4 heads, 2 KV heads; 4 KV heads with 4 ranks, which 2 do not divide), sharded as torchtitan
  shards its Llama: attention q/k/v colwise, o rowwise, MLP gate/up colwise, down rowwise; ``-sp`` adds sequence
  parallelism (``SequenceParallel`` on the norms, the embedding rowwise into a sequence shard, the inputs of
  attention and MLP all-gathered by ``PrepareModuleInput``, o and down reduce-scattered, the head colwise back to
  replicated logits); batch 4 × 128 tokens, loss ``logits.float().sum()``.
* ``pp-gpipe`` / ``pp-1f1b``: four of those blocks split evenly into one stage per rank (``PipelineStage``),
  ``ScheduleGPipe`` / ``Schedule1F1B`` with 4 micro-batches of 64 rows, loss ``out.sum()`` per micro-batch.
* ``pp-interleaved`` (2 ranks): the four blocks as four stages of one block, two per rank (rank r holds stages r
  and r + 2), ``ScheduleInterleaved1F1B`` with 4 micro-batches.
* ``stages-<arch>-<schedule>``: a transformers decoder (8 layers; Llama, Gemma) cut into stages by the package's
  stage builder and trained by each of PyTorch's schedules, the zero-bubble ones too, with the model's own loss on
  labels (tests/support/decoder_pipelines.py); ``-split`` at the split point ``model.layers.2``; ``tp-pp-llama`` (4
  ranks): two pipeline stages, each tensor-parallel over two ranks (``-sp``: with sequence parallelism, the
  estimate's default plan). Run only when asked for by name
  (:func:`cases_for` with ``kinds``), and not profiled.
* ``fsdp-llama-bf16`` (``-reduce-bf16``, ``-offload``, ``-float8``): a transformers Llama under FSDP2 with
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32 | bf16)``, with ``CPUOffloadPolicy`` for ``-offload``,
  torchao's float8 linears for ``-float8`` (tests/support/fsdp_jobs.py); asked for by name (``kinds=("fsdp",)``), not
  profiled.

:func:`run` starts the ranks and returns plain numbers per rank (:class:`RankFigures` as dicts): the measured
``before``, ``after`` and ``peak`` by category with their details, the most each detail held at once, and the
profiler's view of the same steps in the same rank (run again on a fresh copy of the job, not measured): its
highest CPU memory above where it started, beside the measurement's peak above its ``before``. A tensor-parallel case
is measured twice in each rank and the lower peak kept (:data:`TP_MEASURED_RUNS`: gloo's worker thread now and then
lets go of a collective's buffers late).

How ranks start: one launcher process is spawned (a new interpreter that imports torch, and transformers when a
case needs it, and never runs backward), then it forks the ranks, which rendezvous through a c10d TCP store on a
free port; every rank runs the cases one after the other and writes one JSON file per case; the launcher waits
for them (killing any that outlive the deadline), and this process waits for the launcher (killing it and any rank
it left). ``armed=True`` runs one case without ``measure()`` in the ranks, inside ``LaunchedRanks`` (what
``%%vram --ranks`` does): each rank is measured from joining the job to ``destroy_process_group``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "other")
WIDTH, HIDDEN = 256, 1024
MLP_BLOCKS = 3
TP_BATCH = 256
PP_BLOCKS = 4
# the pipeline's batch (rows), split into MICRO_BATCHES; VRAM_PP_BATCH sets another (the ranks inherit it)
PP_BATCH = int(os.environ.get("VRAM_PP_BATCH", "256"))
MICRO_BATCHES = 4
LLAMA = {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
         "vocab_size": 1024, "max_position_embeddings": 256}
LLAMA_BATCH, LLAMA_SEQ = 4, 128
STEPS = 2
JOIN_S = int(os.environ.get("VRAM_RANKS_JOIN_S", "240"))  # one launch's ranks, at most (seconds)


@dataclass(frozen=True)
class Case:
    """A training job spread over the ranks: ``kind`` "tp" or "pp"; ``model`` "mlp", "llama" or "blocks"."""

    name: str
    kind: str
    model: str
    sequence_parallel: bool = False
    schedule: str = ""
    micro_batches: int = 0
    split_points: tuple[str, ...] = ()

    def fits(self, world: int) -> bool:
        """Whether the job runs on ``world`` ranks (the stages split the blocks evenly)."""
        if self.kind == "tp-pp":
            return world == 4
        if self.kind == "stages":
            return not self.split_points or world == len(self.split_points) + 1
        if self.kind != "pp":
            return True
        return PP_BLOCKS % (world * (2 if self.schedule == "interleaved" else 1)) == 0

    def describe(self, world: int) -> str:
        if self.kind == "fsdp":
            return f"{self.name}: Llama 4 layers under FSDP2, bf16 parameters, {world} ranks"
        if self.kind in ("stages", "tp-pp"):
            where = f" split at {', '.join(self.split_points)}" if self.split_points else ""
            tp = ", each stage tensor-parallel over 2" if self.kind == "tp-pp" else ""
            return f"{self.model} (8 layers) in stages{where}, {self.schedule}{tp}, {world} ranks"
        if self.schedule == "interleaved":
            return (f"{PP_BLOCKS} blocks as {PP_BLOCKS} stages, {PP_BLOCKS // world} per rank, "
                    f"ScheduleInterleaved1F1B, {self.micro_batches} micro-batches of {PP_BATCH // self.micro_batches}")
        if self.kind == "pp":
            per = PP_BLOCKS // world
            schedule = "ScheduleGPipe" if self.schedule == "gpipe" else "Schedule1F1B"
            return (f"{PP_BLOCKS} blocks, {per} per stage, {schedule}, {self.micro_batches} micro-batches of "
                    f"{PP_BATCH // self.micro_batches}")
        if self.model == "mlp":
            return f"{MLP_BLOCKS}-block MLP, colwise/rowwise, tp={world}, batch {TP_BATCH}"
        kv = llama_config_kwargs(world)["num_key_value_heads"]
        sp = " + sequence parallel" if self.sequence_parallel else ""
        return (f"Llama {LLAMA['num_hidden_layers']} layers, hidden {LLAMA['hidden_size']}, "
                f"{LLAMA['num_attention_heads']} heads / {kv} KV, tp={world}{sp}, batch {LLAMA_BATCH}×{LLAMA_SEQ}")


CASES: dict[str, Case] = {c.name: c for c in (
    *(Case(name, "fsdp", "llama") for name in ("fsdp-llama-bf16", "fsdp-llama-bf16-reduce-bf16",
                                               "fsdp-llama-bf16-offload", "fsdp-llama-bf16-float8")),
    Case("tp-mlp", "tp", "mlp"),
    Case("tp-llama", "tp", "llama"),
    Case("tp-llama-sp", "tp", "llama", sequence_parallel=True),
    Case("pp-gpipe", "pp", "blocks", schedule="gpipe", micro_batches=MICRO_BATCHES),
    Case("pp-1f1b", "pp", "blocks", schedule="1f1b", micro_batches=MICRO_BATCHES),
    Case("pp-interleaved", "pp", "blocks", schedule="interleaved", micro_batches=MICRO_BATCHES),
    *(Case(f"stages-llama-{s}", "stages", "llama", schedule=s)
      for s in ("gpipe", "1f1b", "interleaved", "interleaved-zb", "zbv", "dualpipev")),
    Case("stages-llama-1f1b-split", "stages", "llama", schedule="1f1b", split_points=("model.layers.2",)),
    *(Case(f"stages-gemma-{s}", "stages", "gemma", schedule=s) for s in ("1f1b", "zbv")),
    Case("tp-pp-llama", "tp-pp", "llama", schedule="1f1b"),
    Case("tp-pp-llama-sp", "tp-pp", "llama", sequence_parallel=True, schedule="1f1b"),
)}


def cases_for(world: int, kinds: tuple[str, ...] = ("tp", "pp")) -> tuple[str, ...]:
    """The cases of ``kinds`` that run on ``world`` ranks."""
    return tuple(name for name, case in CASES.items() if case.kind in kinds and case.fits(world))


def static_stages() -> bool:
    """This PyTorch's ``PipelineStage`` needs its input's shape given (2.5): it infers none, and on gloo its
    ``Schedule1F1B`` and ``ScheduleInterleaved1F1B`` never finish their first step (2.5.1: a receive waits
    until the timeout), while GPipe's stages keep the shapes' buffers of their own."""
    from torch.distributed.pipelining import PipelineStage

    return "input_args" in _required(PipelineStage)


# --- the models, their plans and inputs (what an estimate of the same job builds too) ----------------------------
def block() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, WIDTH))


def mlp() -> nn.Module:
    return nn.Sequential(*[block() for _ in range(MLP_BLOCKS)])


def mlp_plan() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for i in range(MLP_BLOCKS):
        plan[f"{i}.0"], plan[f"{i}.2"] = ColwiseParallel(), RowwiseParallel()
    return plan


def llama_config_kwargs(world: int) -> dict[str, Any]:
    """The Llama's config: tensor parallelism splits heads, so tp must divide the KV heads: 2 with 2 ranks, 4
    with 4 (4 heads and 2 KV heads admit tp 1 or 2 only)."""
    return {**LLAMA, "num_key_value_heads": 2 if world <= 2 else world}


def llama(world: int) -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_config_kwargs(world)))


def llama_plan(sequence_parallel: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the plan of the model's top modules, the plan of each decoder layer), torchtitan's for its Llama under
    transformers' names."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    layer: dict[str, Any] = {f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
    layer.update({"self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
                  "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})
    if not sequence_parallel:
        return {}, layer
    layer.update({
        "input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel(),
        # the decoder layer calls its attention with keyword arguments
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    })
    top = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
           "model.norm": SequenceParallel(),
           "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    return top, layer


def stage_range(world: int, rank: int) -> range:
    """The blocks of rank ``rank``'s stage: split evenly."""
    per = PP_BLOCKS // world
    return range(rank * per, (rank + 1) * per)


def interleaved_stages(world: int, rank: int) -> list[int]:
    """The stages (one block each) of rank ``rank`` under the interleaved schedule: ``rank``, ``rank + world``, …"""
    return list(range(rank, PP_BLOCKS, world))


# --- a job in one rank ------------------------------------------------------------------------------------------
def parallelize(module: nn.Module, mesh: Any, plan: dict[str, Any]) -> nn.Module:
    """``parallelize_module(module, mesh, plan)``, one module at a time from its parent: PyTorch 2.5's
    ``parallelize_module`` applies a dotted key's style to the top module's child of the key's last name too."""
    from torch.distributed.tensor.parallel import parallelize_module

    for path, style in plan.items():
        parent, _, leaf = path.rpartition(".")
        parallelize_module(module.get_submodule(parent) if parent else module, mesh, {leaf: style})
    return module


def _tp_job(case: Case, world: int, mesh: Any) -> tuple[dict[str, Any], Callable[[], None]]:
    torch.manual_seed(0)
    if case.model == "mlp":
        model = parallelize(mlp(), mesh, mlp_plan())
        x = torch.randn(TP_BATCH, WIDTH)

        def forward() -> Any:
            return model(x)

        def loss_of(out: Any) -> torch.Tensor:
            return out.sum()

        ns: dict[str, Any] = {"model": model, "x": x}
    else:
        model = llama(world)
        top, layer = llama_plan(case.sequence_parallel)
        if top:
            parallelize(model, mesh, top)
        for decoder in model.model.layers:
            parallelize(decoder, mesh, layer)
        ids = torch.randint(0, LLAMA["vocab_size"], (LLAMA_BATCH, LLAMA_SEQ))
        # explicit positions: under sequence parallelism the embeddings hold a shard of the sequence, from which
        # the model would otherwise count them
        positions = torch.arange(LLAMA_SEQ).unsqueeze(0)

        def forward() -> Any:
            return model(input_ids=ids, position_ids=positions, use_cache=False)

        def loss_of(out: Any) -> torch.Tensor:
            return out.logits.float().sum()

        ns = {"model": model, "ids": ids, "positions": positions}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ns["opt"] = opt

    def step() -> None:
        # the output and the loss live until the step returns, as in a loop that ends each step with `del out,
        # loss` (and as an estimate's step keeps them)
        out = forward()
        loss = loss_of(out)
        # gloo's worker thread lets go of a finished collective's buffers a moment after its wait returns: without
        # this barrier the logits' all-gather staging buffer (sequence parallelism) was now and then still held when
        # backward began, and the rank then peaked there, 786 KB higher (1 run of 12)
        torch.distributed.barrier()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return ns, step


def _pp_job(case: Case, world: int, rank: int) -> tuple[dict[str, Any], Callable[[], None]]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    torch.manual_seed(0)
    blocks = [block() for _ in range(PP_BLOCKS)]  # every rank builds them all, with the same values; keeps its own
    cpu = torch.device("cpu")
    # PyTorch 2.5's stages take their input's shape (2.6 on infer it in the first step)
    shapes = {"input_args": torch.empty(PP_BATCH // case.micro_batches, WIDTH)} if static_stages() else {}
    stages: Any
    if case.schedule == "interleaved":
        model: nn.Module = nn.ModuleList(blocks[i] for i in interleaved_stages(world, rank))
        stages = [PipelineStage(blocks[i], i, PP_BLOCKS, cpu, **shapes) for i in interleaved_stages(world, rank)]
        schedule: Any = ScheduleInterleaved1F1B(stages, n_microbatches=case.micro_batches, loss_fn=_sum_loss)
    else:
        model = nn.Sequential(*[blocks[i] for i in stage_range(world, rank)])
        stages = PipelineStage(model, rank, world, cpu, **shapes)
        kind = ScheduleGPipe if case.schedule == "gpipe" else Schedule1F1B
        schedule = kind(stages, n_microbatches=case.micro_batches, loss_fn=_sum_loss)
    del blocks
    x = torch.randn(PP_BATCH, WIDTH)
    target = torch.zeros(PP_BATCH, WIDTH)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=target)
        else:
            schedule.step()
        opt.step()
        opt.zero_grad(set_to_none=True)

    ns = {"model": model, "stage" if isinstance(stages, PipelineStage) else "stages": stages, "schedule": schedule,
          "opt": opt}
    if rank == 0:
        ns["x"] = x
    if rank == world - 1:
        ns["target"] = target
    return ns, step


def _required(cls: type) -> set[str]:
    """The arguments ``cls(...)`` cannot do without."""
    import inspect

    return {n for n, p in inspect.signature(cls).parameters.items() if p.default is inspect.Parameter.empty}


def _sum_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return output.sum()


def _job(case: Case, world: int, rank: int, mesh: Any) -> tuple[dict[str, Any], Callable[[], None]]:
    if case.kind == "fsdp":  # FSDP2 with its mixed-precision (and offload) policy (tests/support/fsdp_jobs.py)
        from tests.support import fsdp_jobs

        return fsdp_jobs.job(case.name, world, rank)
    if case.kind in ("stages", "tp-pp"):
        from tests.support import decoder_pipelines

        if case.kind == "stages":
            return decoder_pipelines.job(case.model, case.schedule, world, rank, case.split_points)
        return decoder_pipelines.tp_pp_job(case.model, case.schedule, world, rank, case.sequence_parallel)
    return _tp_job(case, world, mesh) if case.kind == "tp" else _pp_job(case, world, rank)


# --- figures ------------------------------------------------------------------------------------------------------
def _breakdown(b: Any) -> dict[str, int]:
    return {c: int(b[c]) for c in CATEGORIES}


def _details(b: Any) -> dict[str, dict[str, int]]:
    return {c: {k: int(v) for k, v in b.details(c).items()} for c in CATEGORIES}


def _highest(trace: Any) -> dict[str, dict[str, int]]:
    """The most bytes each (category, label) held at once during the block."""
    if trace is None:
        return {}
    now: dict[tuple[str, str], int] = {}
    for cat, label, n in trace.base:
        now[(cat, label)] = now.get((cat, label), 0) + n
    for s in trace.initial:
        b = trace.blocks[s]
        now[(b.category, b.label)] = now.get((b.category, b.label), 0) + b.size
    high = dict(now)
    for ev in trace.events:
        b = trace.blocks[abs(ev)]
        key = (b.category, b.label)
        now[key] = now.get(key, 0) + (b.size if ev > 0 else -b.size)
        if now[key] > high.get(key, 0):
            high[key] = now[key]
    out: dict[str, dict[str, int]] = {c: {} for c in CATEGORIES}
    for (cat, label), n in high.items():
        if n and cat in out:
            out[cat][label] = n
    return out


def figures_of(report: Any, **extra: Any) -> dict[str, Any]:
    """A rank's report as plain numbers."""
    return {**extra, "before": _breakdown(report.before), "after": _breakdown(report.after),
            "peak": _breakdown(report.peak), "peak_details": _details(report.peak),
            "after_details": _details(report.after), "highest": _highest(getattr(report, "trace", None)),
            "measured_rise": int(report.peak.total - report.before.total), "wall_s": float(report.wall_time)}


def _profiled_rise(case: Case, world: int, rank: int, mesh: Any) -> int:
    """The same steps on a fresh copy of the job under PyTorch's profiler: its highest CPU memory above where it
    started (every allocation of this rank's thread, kernel scratch included)."""
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tests.support.zoo import profiled_cpu_peak
    from vram_magic.engine.profiler.recorder import quiet_stderr

    ns, step = _job(case, world, rank, mesh)
    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(STEPS):
            step()
    del ns, step
    return int(profiled_cpu_peak(prof))


#: measured runs of a tensor-parallel case in each rank, the lowest peak kept: gloo's worker thread lets go of a
#: finished collective's buffers a moment after the rank's wait returns, and now and then after the rank has made its
#: next tensors, so a run's peak holds a buffer that the program itself had released. Such a delay only ever adds (a
#: hidden state, 524,288 B, in the backward of the sequence-parallel Llama on 2 ranks moved that rank's peak from the
#: forward's end into the backward, 1 suite run of 4 here); of two identical runs the lower is the one without it.
TP_MEASURED_RUNS = 2


def _measure_case(case: Case, world: int, rank: int, mesh: Any) -> dict[str, Any]:
    import vram_magic

    stages = (interleaved_stages(world, rank) if case.schedule == "interleaved" else [rank]) if case.kind == "pp" \
        else []
    if case.kind in ("stages", "tp-pp"):
        from tests.support.decoder_pipelines import stages_of

        tp = 2 if case.kind == "tp-pp" else 1
        stages = stages_of(case.schedule, world // tp, rank // tp)[1]
    best: dict[str, Any] | None = None
    for run in range(TP_MEASURED_RUNS if case.kind == "tp" else 1):
        if run:
            gc.collect()  # the first run's job, gone before the second is measured
        ns, step = _job(case, world, rank, mesh)
        with vram_magic.measure(namespace=ns) as m:
            for _ in range(STEPS):
                step()
        del ns, step
        figures = figures_of(m.report, case=case.name, world=world, rank=rank, stages=stages)
        if best is None or figures["measured_rise"] < best["measured_rise"]:
            best = figures
        best["measured_runs"] = run + 1
    assert best is not None
    return best


# --- the ranks ----------------------------------------------------------------------------------------------------
def _rank_main(rank: int, world: int, port: int, names: Sequence[str], folder: str, armed: bool) -> None:
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        mesh = None
        if any(CASES[n].kind == "tp" for n in names):
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (world,))
        for name in names:
            case = CASES[name]
            if armed:  # measured from joining the job to leaving it, by what %%vram --ranks arms
                ns, step = _job(case, world, rank, mesh)
                for _ in range(STEPS):
                    step()
                continue
            figures = _measure_case(case, world, rank, mesh)
            dist.barrier()
            if case.kind in ("tp", "pp"):
                figures["profiler_rise"] = _profiled_rise(case, world, rank, mesh)
            with open(os.path.join(folder, f"{name}-{rank}.json"), "w") as f:
                json.dump(figures, f)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launcher(world: int, names: Sequence[str], folder: str, armed: bool, pids: Any) -> None:
    """In a new interpreter: import what the ranks need once, then fork them and wait."""
    import torch.distributed  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401

    import vram_magic  # noqa: F401

    if any(CASES[n].model in ("llama", "gemma") for n in names):
        import transformers  # noqa: F401
        from transformers import LlamaForCausalLM  # noqa: F401
    ctx = mp.get_context("fork")
    port = _free_port()
    launched = None
    if armed:
        from vram_magic.ranks.launch import LaunchedRanks

        launched = LaunchedRanks(folder, title=f"{names[0]} × {world}", fork_advice=False)
        launched.__enter__()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, list(names), folder, armed), daemon=True)
             for r in range(world)]
    try:
        for p in procs:
            p.start()
        pids.send([p.pid for p in procs])
        deadline = time.monotonic() + JOIN_S
        for p in procs:
            p.join(max(deadline - time.monotonic(), 0.1))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        if launched is not None:
            launched.__exit__(None, None, None)
    bad = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
    if bad:
        raise SystemExit(f"ranks failed (exit codes {bad})")


@contextlib.contextmanager
def _main_spec() -> Any:
    """``__main__`` with a ``__spec__`` while a process is spawned: under IPython (an ``InteractiveShell`` in the same
    process, as the tests make) ``sys.modules["__main__"]`` is the shell's namespace object, which has none, and
    ``multiprocessing.spawn`` reads it (``AttributeError``). ``None`` says "nothing to import again in the child"."""
    main = sys.modules.get("__main__")
    missing = main is not None and not hasattr(main, "__spec__")
    if missing:
        main.__spec__ = None
    try:
        yield
    finally:
        if missing:
            del main.__spec__


def _start(world: int, names: Sequence[str], folder: str, armed: bool) -> None:
    ctx = mp.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    launcher = ctx.Process(target=_launcher, args=(world, list(names), folder, armed, send))
    with _main_spec():
        launcher.start()
    send.close()
    pids: list[int] = []
    try:
        if receive.poll(JOIN_S):
            pids = receive.recv()
        launcher.join(JOIN_S + 30)
    finally:
        if launcher.is_alive():
            launcher.kill()
            launcher.join(5)
        for pid in pids:  # a rank the launcher could not stop
            try:
                os.kill(pid, 9)
            except OSError:
                pass
    if launcher.exitcode != 0:
        raise RuntimeError(f"the ranks of {', '.join(names)} × {world} failed (launcher exit code {launcher.exitcode})")


def run(world: int, names: Sequence[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Run the cases ``names`` (default: every case that fits) on ``world`` gloo ranks: ``{case: [figures of rank
    0, rank 1, …]}``."""
    names = cases_for(world) if names is None else tuple(names)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise ValueError(f"unknown cases {unknown}: choose from {list(CASES)}")
    misfit = [n for n in names if not CASES[n].fits(world)]
    if misfit:
        raise ValueError(f"{misfit}: {PP_BLOCKS} blocks do not split evenly into the stages of {world} ranks")
    with tempfile.TemporaryDirectory(prefix="vram_tp_pp_") as folder:
        _start(world, names, folder, armed=False)
        out: dict[str, list[dict[str, Any]]] = {}
        for name in names:
            out[name] = []
            for rank in range(world):
                with open(os.path.join(folder, f"{name}-{rank}.json")) as f:
                    out[name].append(json.load(f))
    return out


_RUNS: dict[tuple[int, tuple[str, ...]], dict[str, list[dict[str, Any]]]] = {}


def run_once(world: int, names: Sequence[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    """:func:`run`, once per process for the same ranks and cases (the tests of the measurement and of the estimate
    share one launch)."""
    key = (world, tuple(cases_for(world) if names is None else names))
    if key not in _RUNS:
        _RUNS[key] = run(world, key[1])
    return _RUNS[key]


def run_armed(world: int, name: str) -> Any:
    """Run one case with the ranks measured as ``%%vram --ranks`` measures them; the ``RankReports``."""
    from vram_magic.ranks import RankReports

    with tempfile.TemporaryDirectory(prefix="vram_tp_pp_armed_") as folder:
        _start(world, [name], folder, armed=True)
        return RankReports.load(folder)


def errors(measured: dict[str, Any], estimated: Any) -> dict[str, float]:
    """An estimate of one rank's peak against its measured figures: per category (and ``"total"``), the error as a
    fraction of the measured bytes (``+0.01``: 1 % over); a category measured at 0 B has the error of its bytes
    against the measured total. ``estimated``: a mapping of the five categories to bytes (an estimate's ``.peak``)."""
    peak = measured["peak"]
    total = sum(peak[c] for c in CATEGORIES)
    out: dict[str, float] = {}
    for c in CATEGORIES:
        est = int(estimated[c])
        out[c] = (est - peak[c]) / (peak[c] or total or 1)
    out["total"] = (sum(int(estimated[c]) for c in CATEGORIES) - total) / (total or 1)
    return out


def off(measured: dict[str, Any], estimated: Any, tolerance: float = 0.01) -> dict[str, float]:
    """The categories where an estimate of this rank is further than ``tolerance`` from the measured peak (empty
    when every category is within it): ``assert not off(figures, est.ranks[r].peak)``."""
    return {c: e for c, e in errors(measured, estimated).items() if abs(e) > tolerance}


__all__ = ["CASES", "CATEGORIES", "Case", "block", "cases_for", "errors", "figures_of", "interleaved_stages", "llama",
           "llama_config_kwargs", "llama_plan", "mlp", "mlp_plan", "off", "parallelize", "run", "run_armed", "run_once",
           "stage_range", "static_stages"]
