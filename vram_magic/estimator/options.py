"""What a user may ask of an estimate, checked once, with messages that say what is accepted: the tables of
accepted values and their parsers (a leaf: it imports nothing else of the estimator)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
}
OPTIMIZERS = ("sgd", "sgd-momentum", "adam", "adamw", "adagrad", "rmsprop", "adafactor")
SHARDING = (None, 1, 2, 3)
#: weight-only formats of ``quantize=`` (their layouts: ``quantize.FORMATS``)
QUANTIZE_FORMATS = ("int8", "int4", "nf4", "nf4-dq")


def parse_dtype(value: Any, what: str = "dtype") -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    if isinstance(value, str) and value.lower() in DTYPES:
        return DTYPES[value.lower()]
    raise ValueError(f"{what} must be one of bf16, fp16, fp32 (or a torch floating dtype), not {value!r}")


def short_dtype(dtype: torch.dtype | None) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))  # type: ignore[arg-type]


@dataclass(frozen=True)
class OptimizerChoice:
    """An optimizer object given as ``optimizer=``, kept as what an estimate reuses of it: its class and
    hyper-parameters, never its parameters or state (the user's real tensors)."""

    cls: type
    hyper: tuple[tuple[str, Any], ...]

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> OptimizerChoice:
        return cls(type(optimizer), tuple(optimizer.defaults.items()))

    @property
    def defaults(self) -> dict[str, Any]:
        return dict(self.hyper)


@dataclass(frozen=True)
class Options:
    """One configuration of a step. ``optimizer`` is a name, an optimizer class or an :class:`OptimizerChoice`
    (what an optimizer object was)."""

    optimizer: Any = "adamw"
    inference: bool = False
    dtype: torch.dtype | None = None
    amp: torch.dtype | None = None
    master_weights: bool = False  # half-precision weights and gradients, an fp32 master copy in the optimizer
    checkpointing: bool | int = False  # True (every block) or k (every k-th block)
    accumulate: int = 1
    zero: int | None = None  # ZeRO stage 1, 2 or 3 (3 is what FSDP's full sharding does)
    world: int = 1
    offload: bool = False
    device: str = "cuda"
    steps: int = 2
    batch: int | None = None  # resize the inputs' batch dimension (what-ifs and max-batch search)
    seq: int | None = None  # resize dimension 1 of the inputs (sequence length)
    quantize: str | None = None  # weight-only quantization of the linear layers (quantize.FORMATS)
    lora: int | None = None  # rank of LoRA adapters on the linear layers, the rest frozen
    # generate(): the number of new tokens (None: a training or inference step) and how they are produced
    generate: int | None = None
    cache_implementation: str | None = None  # as transformers names it (None: the model's default)
    num_beams: int = 1
    do_sample: bool = False
    cache_bits: int = 4  # a quantized cache's bits (2 or 4)
    last_logits_only: bool = False  # the output head computes the last position only (logits_to_keep=1)
    # model parallelism (layouts/tensor.py, layouts/pipeline.py): ``world`` ranks = tp × pp × dp, ZeRO over dp
    tp: int = 1  # tensor-parallel ranks (parallelize_module)
    pp: int = 1  # pipeline stages (torch.distributed.pipelining)
    split_points: tuple[str, ...] = ()  # the children where the stages after the first begin (default: even)
    micro_batches: int | None = None  # the pipeline's micro-batches (None: pp)
    schedule: str = "1f1b"  # the pipeline schedule: 1f1b, gpipe or interleaved
    parallelize_plan: tuple[tuple[str, Any], ...] | None = None  # (module name, style) pairs; None: the default
    pp_rank: int = 0  # which pipeline rank a trace is of

    @property
    def dp(self) -> int:
        """The data-parallel ranks: ``world / (tp × pp)``."""
        return max(self.world // (self.tp * self.pp), 1)

    @property
    def parallel(self) -> bool:
        """Whether the model is split across ranks (tensor or pipeline parallelism)."""
        return self.tp > 1 or self.pp > 1

    def with_(self, **changes: Any) -> Options:
        return replace(self, **changes)

    def trace_key(self) -> Options:
        """These options with those applied after the trace at their defaults: two configurations with the same key
        run the same fake step (:data:`AFTER_TRACE`)."""
        return replace(self, **AFTER_TRACE)

    def describe(self) -> str:
        parts = [f"{'inference' if self.inference else 'training'}"]
        if not self.inference:
            parts.append(optimizer_name(self.optimizer))
        if self.dtype is not None:
            parts.append(short_dtype(self.dtype) + (" + fp32 master weights" if self.master_weights else ""))
        if self.quantize:
            parts.append(f"{self.quantize} weights")
        if self.lora:
            parts.append(f"LoRA r={self.lora}")
        if self.amp is not None:
            parts.append(f"AMP {short_dtype(self.amp)}")
        if self.checkpointing:
            k = int(self.checkpointing)
            parts.append("checkpointing" + (f" every {k} blocks" if k > 1 else ""))
        if self.accumulate > 1:
            parts.append(f"accumulate {self.accumulate}")
        if self.tp > 1:
            parts.append(f"TP {self.tp}")
        if self.pp > 1:
            parts.append(f"PP {self.pp} ({self.schedule.upper() if self.schedule != 'interleaved' else 'interleaved'}"
                         f", {self.micro_batches or self.pp} micro-batches)")
        if self.zero:
            parts.append(f"ZeRO-{self.zero} × {self.dp if self.parallel else self.world}")
        if self.offload:
            parts.append("optimizer offload")
        return ", ".join(parts)


#: options a trace does not depend on, with their defaults: each rank's share (ZeRO's stage over ``world`` ranks) and
#: the optimizer's state moved to the host are applied to the traced storages afterwards (``layouts/``)
AFTER_TRACE: dict[str, Any] = {"zero": None, "world": 1, "offload": False}


#: training options that mean nothing for generate() (their defaults)
_TRAINING = {"checkpointing": False, "accumulate": 1, "zero": None, "fsdp": False, "world": 1, "offload": False,
             "lora": None, "master_weights": None, "loss_fn": None, "tp": 1, "pp": 1, "micro_batches": None,
             "parallelize_plan": None}


def check_training_options(given: dict[str, Any]) -> None:
    """``ValueError`` for training options given with ``generate=``."""
    wrong = [k for k, default in _TRAINING.items() if k in given and given[k] != default]
    if wrong:
        raise ValueError(f"{', '.join(wrong)} appl{'y' if len(wrong) > 1 else 'ies'} to training; generate= estimates "
                         "inference (drop them, or estimate a training step without generate=)")


def optimizer_name(opt: Any) -> str:
    if isinstance(opt, str):
        return opt
    if isinstance(opt, type):
        return opt.__name__
    if isinstance(opt, OptimizerChoice):
        return opt.cls.__name__
    return type(opt).__name__


def make_options(
    *,
    optimizer: Any = "adamw",
    inference: bool = False,
    dtype: Any = None,
    amp: Any = None,
    master_weights: Any = None,
    checkpointing: bool = False,
    accumulate: int = 1,
    zero: Any = None,
    fsdp: bool = False,
    world: int = 1,
    offload: bool = False,
    device: str = "cuda",
    steps: int = 2,
    quantize: Any = None,
    lora: Any = None,
    tp: int = 1,
    pp: Any = 1,
    micro_batches: int | None = None,
    schedule: str = "1f1b",
    parallelize_plan: Any = None,
) -> Options:
    """Check every option; raise ``ValueError``/``TypeError`` naming what is accepted."""
    if isinstance(optimizer, str):
        if optimizer.lower() not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}, "
                             "or pass a torch.optim.Optimizer class or object")
        optimizer = optimizer.lower()
    elif isinstance(optimizer, type):
        if not issubclass(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer class {optimizer.__name__} is not a torch.optim.Optimizer")
    elif isinstance(optimizer, torch.optim.Optimizer):
        optimizer = OptimizerChoice.of(optimizer)
    elif not isinstance(optimizer, OptimizerChoice):
        raise TypeError(f"optimizer must be a name ({', '.join(OPTIMIZERS)}), a torch.optim.Optimizer class or "
                        f"object, not {type(optimizer).__name__}")
    dt = parse_dtype(dtype)
    am = parse_dtype(amp, "amp")
    if am is torch.float32:
        raise ValueError("amp must be bf16 or fp16 (the lower precision autocast runs in)")
    master = parse_master_weights(master_weights)
    if master and dt not in (torch.bfloat16, torch.float16):
        raise ValueError("master_weights='fp32' keeps an fp32 copy of half-precision weights: give dtype='bf16' or "
                         "dtype='fp16' with it")
    if master and inference:
        raise ValueError("master_weights applies to training (the optimizer holds the fp32 copy); drop it with "
                         "inference=True")
    for name, value in (("accumulate", accumulate), ("world", world), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number ≥ 1, not {value!r}")
    if fsdp:
        if zero not in (None, 3):
            raise ValueError("fsdp shards like ZeRO-3; give either fsdp=True or zero=1|2|3, not both")
        zero = 3
    if zero is not None:
        if isinstance(zero, str) and zero.isdigit():
            zero = int(zero)
        if zero not in (1, 2, 3):
            raise ValueError(f"zero must be 1, 2 or 3 (the ZeRO stage), not {zero!r}")
    parallel = parse_parallel(tp, pp, micro_batches, schedule, parallelize_plan, world, zero, inference, accumulate)
    world = parallel.pop("world")
    if zero is not None and world < 2:
        raise ValueError("sharding needs world ≥ 2 (the number of ranks), e.g. zero=3, world=8")
    if device not in ("cuda", "cpu") and not (isinstance(device, str) and device.startswith("cuda:")):
        raise ValueError(f"device must be 'cuda' (model a GPU) or 'cpu' (model a CPU run), not {device!r}")
    if inference and (accumulate > 1 or zero is not None or offload):
        raise ValueError("accumulate, zero/fsdp and offload apply to training; drop them with inference=True")
    quant, rank = parse_quantize(quantize), parse_lora(lora)
    return Options(
        quantize=quant, lora=rank,
        optimizer=optimizer, inference=bool(inference), dtype=dt, amp=am, master_weights=master,
        checkpointing=parse_checkpointing(checkpointing),
        accumulate=accumulate, zero=zero, world=world, offload=bool(offload),
        device="cuda" if str(device).startswith("cuda") else "cpu", steps=steps, **parallel,
    )


def parse_checkpointing(value: Any) -> bool | int:
    """``False``, ``True`` (every block) or ``k ≥ 2`` (every k-th block); ``ValueError`` otherwise."""
    if value is None or value is False or value == 0:
        return False
    if value is True or value == 1:
        return True
    if isinstance(value, str) and value.strip().isdigit():
        return parse_checkpointing(int(value))
    if isinstance(value, int) and value >= 2:
        return value
    raise ValueError(f"checkpointing must be True (every block), False, or k ≥ 2 (every k-th block), not {value!r}")


def parse_master_weights(value: Any) -> bool:
    """``None``/``False`` (weights are trained in their own dtype) or ``"fp32"`` (an fp32 master copy)."""
    if value is None or value is False:
        return False
    if value is True or (isinstance(value, str) and value.lower() in ("fp32", "float32")) or value is torch.float32:
        return True
    raise ValueError(f"master_weights must be 'fp32' (an fp32 master copy of bf16/fp16 weights) or None, not "
                     f"{value!r}")


def parse_quantize(value: Any) -> str | None:
    """``None`` or a format name from :data:`QUANTIZE_FORMATS` (``ValueError`` naming them otherwise)."""
    if value is None or value is False:
        return None
    if isinstance(value, str) and value.lower() in QUANTIZE_FORMATS:
        return value.lower()
    raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_FORMATS)} (weight-only quantization of the linear "
                     f"layers), not {value!r}")


def parse_lora(value: Any) -> int | None:
    """``None`` or a LoRA rank ≥ 1 (``ValueError`` otherwise)."""
    if value is None or value is False:
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"lora must be the adapters' rank, a whole number ≥ 1 (e.g. lora=16), not {value!r}")
    return value


#: the pipeline schedules (``torch.distributed.pipelining``'s ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B)
SCHEDULES = ("1f1b", "gpipe", "interleaved")


def parse_parallel(tp: Any, pp: Any, micro_batches: Any, schedule: Any, plan: Any, world: int, zero: Any,
                   inference: bool, accumulate: int) -> dict[str, Any]:
    """The model-parallel options checked (``ValueError``/``TypeError`` naming what is accepted), with ``world``
    (``tp × pp`` when it was left at 1)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a whole number ≥ 1 (the tensor-parallel ranks), not {tp!r}")
    split_points: tuple[str, ...] = ()
    if isinstance(pp, (list, tuple)):
        if not pp or not all(isinstance(p, str) for p in pp):
            raise TypeError("pp takes the number of stages, or a list of the modules where the stages after the "
                            "first begin (e.g. pp=['4', '8'] for three stages)")
        split_points, pp = tuple(pp), len(pp) + 1
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pp must be a whole number ≥ 1 (the pipeline stages) or a list of split points, not {pp!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, not {schedule!r}")
    if micro_batches is not None and (isinstance(micro_batches, bool) or not isinstance(micro_batches, int)
                                      or micro_batches < 1):
        raise ValueError(f"micro_batches must be a whole number ≥ 1, not {micro_batches!r}")
    if micro_batches is not None and pp == 1:
        raise ValueError("micro_batches is the pipeline's (pp ≥ 2); for gradient accumulation give accumulate=K")
    if plan is not None and tp == 1:
        raise ValueError("parallelize_plan applies with tp ≥ 2 (the tensor-parallel ranks)")
    if plan is not None:
        plan = parse_plan(plan)
    if pp > 1 and inference:
        raise ValueError("pp estimates a training step (a pipeline's forwards and backwards); drop inference=True")
    if pp > 1 and accumulate > 1:
        raise ValueError("with pp the batch is split into micro_batches; give micro_batches=K instead of accumulate")
    ranks = tp * pp
    if ranks > 1:
        if world == 1:
            world = ranks
        if world % ranks:
            raise ValueError(f"tp × pp × dp must equal world: tp={tp} × pp={pp} = {ranks} does not divide "
                             f"world={world}; give world as a multiple of {ranks} (dp = world / {ranks})")
        if zero is not None and world // ranks < 2:
            raise ValueError(f"zero shards over the data-parallel ranks, dp = world / (tp × pp) = {world // ranks}: "
                             f"give world={2 * ranks} or more with zero")
    return {"tp": tp, "pp": pp, "split_points": split_points, "micro_batches": micro_batches if pp > 1 else None,
            "schedule": schedule, "parallelize_plan": plan, "world": world}


def parse_plan(plan: Any) -> tuple[tuple[str, Any], ...]:
    """The user's ``parallelize_plan`` as ``((module name or pattern, style), ...)``; ``TypeError`` for anything
    but a dict of PyTorch's parallel styles."""
    if not isinstance(plan, dict) or not plan:
        raise TypeError("parallelize_plan must be a dict from module names to parallel styles, as "
                        "parallelize_module takes it, e.g. {'0': ColwiseParallel(), '2': RowwiseParallel()}, not "
                        f"{type(plan).__name__}")
    from torch.distributed.tensor.parallel import ParallelStyle

    for name, style in plan.items():
        if not isinstance(name, str) or not isinstance(style, ParallelStyle):
            raise TypeError(f"parallelize_plan: {name!r} → {type(style).__name__}: each entry must be a module name "
                            "(or a pattern such as 'layers.*.mlp') and a style (ColwiseParallel, RowwiseParallel, "
                            "SequenceParallel, PrepareModuleInput, ...)")
    return tuple(plan.items())
