"""Pipelines of transformers decoders cut into stages by the package's own stage builder
(vram_magic/estimator/layouts/stages.py: a deep copy of the model without the other stages' layers, as torchtitan's
``pipeline_llm`` cuts it), trained on real gloo ranks by ``torch.distributed.pipelining``: the jobs of
tests/support/parallel_runs.py's ``stages-*`` cases (and of ``tp-pp-llama``, tensor parallelism inside each stage).

Every rank builds the whole model from one small config with the same seed, cuts its own stages and lets go of the
model, wraps each stage in a ``PipelineStage`` and runs the schedule with the model's own loss
(``model.loss_function`` on the labels: what an estimate given ``{"input_ids", "labels"}`` trains on) and AdamW over
its own parameters. The first stage's rank holds the token ids, the last stage's the labels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# 8 layers: 4 ranks × 2 stages a rank for the looped and V-shaped schedules
DECODER = {"num_hidden_layers": 8, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128}
BATCH, SEQ, MICRO_BATCHES = 8, 64, 4


def build(arch: str, tp: int = 1) -> torch.nn.Module:
    """The whole model (fp32, every dropout 0), the same on every rank: ``llama``, ``qwen3`` (q/k norms, its own
    head size) or ``gemma`` (the head tied to the embedding, a scaled embedding)."""
    import transformers

    transformers.logging.set_verbosity_error()
    kwargs = dict(DECODER, num_key_value_heads=max(DECODER["num_key_value_heads"], tp))
    cls, config = {
        "llama": (transformers.LlamaForCausalLM, lambda: transformers.LlamaConfig(**kwargs)),
        "qwen3": (transformers.Qwen3ForCausalLM, lambda: transformers.Qwen3Config(**kwargs, head_dim=16)),
        "gemma": (transformers.GemmaForCausalLM, lambda: transformers.GemmaConfig(**kwargs, head_dim=16)),
    }[arch]
    torch.manual_seed(0)
    return cls(config()).float().train()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)``, the same on every rank."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, DECODER["vocab_size"], (BATCH, SEQ), generator=g)
    return ids, torch.randint(0, DECODER["vocab_size"], (BATCH, SEQ), generator=g)


def micro_batches(schedule: str, world: int, given: int = MICRO_BATCHES) -> int:
    """The micro-batches of a case: DualPipeV needs at least as many as stages (2 a rank)."""
    return max(given, 2 * world) if schedule == "dualpipev" else given


def stages_of(schedule: str, world: int, rank: int) -> tuple[int, list[int]]:
    """``(stages in all, the stages of rank)``, laid out as the schedule lays them."""
    from vram_magic.estimator.layouts.pipeline import TWO_A_RANK
    from vram_magic.estimator.layouts.pipeline import stages_of as laid

    n = world * (2 if schedule in TWO_A_RANK else 1)
    return n, laid(rank, world, n, schedule)


def job(arch: str, schedule: str, world: int, rank: int, split_points: tuple[str, ...] = (),
        tp_mesh: Any = None, pp_group: Any = None, tp_plan: Any = None) -> tuple[dict[str, Any], Callable[[], None]]:
    """One rank's pipelined training step: ``(the names a measurement scans, the step)``. ``tp_mesh``: tensor
    parallelism inside each stage with ``tp_plan(stage module)`` (``world`` then counts pipeline ranks, ``rank``
    is the pipeline rank and ``pp_group`` its process group)."""
    import torch.distributed.pipelining as pipelining

    from vram_magic.estimator.layouts.pipeline import SCHEDULE_CLASSES
    from vram_magic.estimator.layouts.stages import build_stage, model_parts, plan_stages

    n, mine = stages_of(schedule, world, rank)
    full = build(arch, tp_mesh.size() if tp_mesh is not None else 1)
    plan = plan_stages(full, model_parts(full), n, split_points)
    loss_function, vocab = full.loss_function, full.config.vocab_size
    modules = [build_stage(full, plan, s) for s in mine]
    del full
    if tp_mesh is not None:
        for module in modules:
            tp_plan(module, tp_mesh)
    cpu = torch.device("cpu")
    group = {"group": pp_group} if pp_group is not None else {}
    stages = [pipelining.PipelineStage(module, s, n, cpu, **group) for module, s in zip(modules, mine)]

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss_function(logits=logits, labels=labels, vocab_size=vocab)

    m = micro_batches(schedule, world)
    cls = getattr(pipelining, SCHEDULE_CLASSES[schedule])
    schedule_ = cls(stages if len(stages) > 1 else stages[0], n_microbatches=m, loss_fn=loss_fn)
    ids, labels = data()
    first, last = 0 in mine, n - 1 in mine
    ids = ids if first else None
    labels = labels if last else None
    opt = torch.optim.AdamW([p for module in modules for p in module.parameters()], lr=1e-3)

    def step() -> None:
        schedule_.step(*((ids,) if first else ()), target=labels)
        opt.step()
        opt.zero_grad(set_to_none=True)

    ns: dict[str, Any] = {"stages": modules, "schedule": schedule_, "opt": opt}
    if first:
        ns["ids"] = ids
    if last:
        ns["labels"] = labels
    return ns, step


def layer_plan() -> dict[str, Any]:
    """Each decoder layer's tensor-parallel plan (torchtitan's for its Llama, without sequence parallelism): q, k, v,
    gate and up colwise, o and down rowwise; the embedding, the norms and the head stay whole."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
    plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
                 "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})
    return plan


def whole_plan() -> dict[str, Any]:
    """:func:`layer_plan` for every layer, under the whole model's names (what an estimate takes)."""
    return {f"model.layers.{i}.{k}": v for i in range(DECODER["num_hidden_layers"]) for k, v in layer_plan().items()}


def _shard_layers(stage: torch.nn.Module, mesh: Any) -> None:
    from tests.support.parallel_runs import parallelize

    for layer in stage.model.layers.values():
        parallelize(layer, mesh, layer_plan())


def _shard_sequence_parallel(stage: torch.nn.Module, mesh: Any) -> None:
    """torchtitan's plan with sequence parallelism (the estimate's default plan) on the stage's own modules: the
    embedding rowwise into a sequence shard, the norms sequence-parallel, the head colwise back to whole logits; the
    hidden state between stages is then a sequence shard, so the stage counts its positions over ``mesh.size()``
    shards."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    from tests.support.parallel_runs import llama_plan, parallelize

    top: dict[str, Any] = {}
    if stage.is_first:
        top["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if stage.is_last:
        top.update({"model.norm": SequenceParallel(),
                    "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    parallelize(stage, mesh, top)
    for layer in stage.model.layers.values():
        parallelize(layer, mesh, llama_plan(True)[1])
    stage.seq_shards = mesh.size()


def tp_pp_job(arch: str, schedule: str, world: int, rank: int,
              sequence_parallel: bool = False) -> tuple[dict[str, Any], Callable[[], None]]:
    """``world // 2`` pipeline ranks, each stage tensor-parallel over 2 ranks: the mesh ``(pp, tp)``, rank r
    tensor-parallel rank ``r % 2`` of pipeline rank ``r // 2`` (torchtitan's numbering, the estimate's)."""
    from torch.distributed.device_mesh import init_device_mesh

    tp = 2
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("pp", "tp"))
    return job(arch, schedule, world // tp, rank // tp, tp_mesh=mesh["tp"], pp_group=mesh["pp"].get_group(),
               tp_plan=_shard_sequence_parallel if sequence_parallel else _shard_layers)


def estimate(case: Any, world: int) -> Any:
    """The estimate of a ``stages-*`` or ``tp-pp-*`` case of parallel_runs.py as a user writes it: the model's
    builder, its ids and labels, the layout (with tensor parallelism: the plan the ranks apply, or with sequence
    parallelism the estimate's default, torchtitan's)."""
    import vram_magic

    ids, labels = data()
    tp = 2 if case.kind == "tp-pp" else 1
    layout: dict[str, Any] = dict(pp=list(case.split_points) if case.split_points else world // tp,
                                  schedule=case.schedule, micro_batches=micro_batches(case.schedule, world // tp))
    if tp > 1:
        layout.update(tp=tp, parallelize_plan=None if case.sequence_parallel else whole_plan())
    return vram_magic.estimate(lambda: build(case.model, tp), {"input_ids": ids, "labels": labels}, device="cpu",
                               **layout)


__all__ = ["BATCH", "DECODER", "MICRO_BATCHES", "SEQ", "build", "data", "estimate", "job", "layer_plan",
           "micro_batches", "stages_of", "tp_pp_job", "whole_plan"]
