"""What a user may ask of an estimate, checked once, with messages that say what is accepted: the tables of
accepted values and their parsers (a leaf: it imports nothing else of the estimator)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

import torch

from .parallel_options import parse_parallel

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
}
#: the optimizers of fine-tuning recipes, by name: (library, class). bitsandbytes' and torchao's state is modelled from
#: the parameters' shapes (step/low_bit_optimizers.py), Muon runs with AdamW for what is not 2-D (step/muon.py)
RECIPE_OPTIMIZERS: dict[str, tuple[str, str]] = {
    "adamw8bit": ("bitsandbytes", "AdamW8bit"), "adam8bit": ("bitsandbytes", "Adam8bit"),
    "paged_adamw8bit": ("bitsandbytes", "PagedAdamW8bit"), "paged_adamw": ("bitsandbytes", "PagedAdamW"),
    "torchao_adamw8bit": ("torchao", "AdamW8bit"), "torchao_adamw4bit": ("torchao", "AdamW4bit"),
    "torchao_adamw_fp8": ("torchao", "AdamWFp8"), "muon": ("torch", "Muon"),
}
OPTIMIZERS = ("sgd", "sgd-momentum", "adam", "adamw", "adagrad", "rmsprop", "adafactor", *RECIPE_OPTIMIZERS)
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
        return cls(type(optimizer), tuple(optimizer.defaults.items()) + tuple(library_settings(optimizer).items()))

    @property
    def defaults(self) -> dict[str, Any]:
        return dict(self.hyper)


def library_settings(optimizer: Any) -> dict[str, Any]:
    """What bitsandbytes and torchao keep outside ``defaults`` although the state depends on it: bitsandbytes' bits,
    smallest 8-bit tensor and ``max_unorm`` (``optimizer.args``), paging (``is_paged``) and the per-parameter overrides
    of its GlobalOptimManager, by the parameter's index in the optimizer (bitsandbytes 0.50.2:
    bitsandbytes/optim/optimizer.py); torchao's block size (``block_size``, torchao 0.18.0: torchao/optim/adam.py)."""
    library = str(type(optimizer).__module__).split(".")[0]
    out: dict[str, Any] = {}
    if library == "bitsandbytes":
        args = getattr(optimizer, "args", None)
        for key in ("optim_bits", "min_8bit_size", "max_unorm"):
            if hasattr(args, key):
                out[key] = getattr(args, key)
        out["is_paged"] = bool(getattr(optimizer, "is_paged", False))
        overrides = _bnb_overrides(optimizer)
        if overrides:
            out["overrides"] = overrides
    elif library == "torchao" and isinstance(getattr(optimizer, "block_size", None), int):
        out["block_size"] = optimizer.block_size
    return out


def _bnb_overrides(optimizer: Any) -> tuple[tuple[int, tuple[tuple[str, Any], ...]], ...]:
    """``((index, ((key, value), ...)), ...)``: the settings GlobalOptimManager gives single parameters (by id, by
    position, or by module and attribute as Hugging Face's Trainer keeps embeddings in 32 bits), that change the
    state's size."""
    manager = getattr(optimizer, "mng", None)
    if manager is None:
        return ()
    by_id = dict(getattr(manager, "pid2config", {}) or {})
    for module, attr, config in getattr(manager, "module_weight_config_triple", ()) or ():
        weight = getattr(module, attr, None)
        if weight is not None:
            by_id[id(weight)] = config
    by_index = dict(getattr(manager, "index2config", {}) or {})
    out = []
    flat = 0
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            config = {**by_index.get((g, i), {}), **by_id.get(id(p), {})}
            kept = tuple(sorted((k, v) for k, v in config.items() if k in ("optim_bits", "min_8bit_size", "max_unorm")))
            if kept:
                out.append((flat, kept))
            flat += 1
    return tuple(out)


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
    # FSDP2 as large runs configure it (layouts/fsdp.py traces one rank of it for real): MixedPrecisionPolicy's dtypes,
    # CPUOffloadPolicy (sharded parameters and gradients on the host too, with the optimizer state) and torchao's
    # Float8Linear in place of the linear layers
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    offload_params: bool = False
    float8: bool = False
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
    cp: int = 1  # context-parallel ranks: the sequence sharded over them, ring attention (layouts/context.py)
    split_points: tuple[str, ...] = ()  # the children where the stages after the first begin (default: even)
    micro_batches: int | None = None  # the pipeline's micro-batches (None: pp)
    schedule: str = "1f1b"  # the pipeline schedule (SCHEDULES)
    parallelize_plan: tuple[tuple[str, Any], ...] | None = None  # (module name, style) pairs; None: the default
    pp_rank: int = 0  # which pipeline rank a trace is of
    # the recipes' levers (step/recipes/): the user's own step, the built-in step's convention, and what a step holds
    step: Any = None  # fn(model, batch, optimizer): one training step as the user writes it
    keep_output: bool = True  # the built-in step keeps the model's output alive through backward
    optimizer_in_backward: bool = False  # one optimizer per parameter, each stepping inside backward
    offload_activations: bool = False  # tensors saved for backward kept on the host (save_on_cpu, pinned)
    loss_chunks: int = 1  # the head and cross-entropy of a causal LM computed in N chunks of the hidden states
    checkpoint_ops: Any = None  # op-level selective checkpointing of each block: "ops" (torchtitan's) or a policy
    moe_imbalance: float = 1.0  # the busiest MoE expert's tokens over its balanced share (tracing/routing.py)

    @property
    def dp(self) -> int:
        """The data-parallel ranks: ``world / (tp × pp × cp)``."""
        return max(self.world // (self.tp * self.pp * self.cp), 1)

    @property
    def parallel(self) -> bool:
        """Whether the model is split across ranks (tensor or pipeline parallelism)."""
        return self.tp > 1 or self.pp > 1

    def with_(self, **changes: Any) -> Options:
        return replace(self, **changes)

    def trace_key(self) -> Options:
        """These options with those applied after the trace at their defaults: two configurations with the same key
        run the same fake step (:data:`AFTER_TRACE`)."""
        if self.fsdp_traced:  # one FSDP2 rank traced for real: its world and shards (and CPUOffloadPolicy) are in it
            return self if self.offload_params else replace(self, offload=False)
        return replace(self, **AFTER_TRACE)

    @property
    def fsdp_traced(self) -> bool:
        """Whether the step is traced as one rank of FSDP2 (``fully_shard`` with its mixed-precision or offload
        policy, ``layouts/fsdp.py``) rather than sharded after an unsharded trace (``layouts/zero.py``)."""
        return self.zero == 3 and (self.param_dtype is not None or self.reduce_dtype is not None or self.offload_params)

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
        if self.checkpoint_ops is not None:
            parts.append("op-level checkpointing" + (" (torchtitan's op SAC)" if self.checkpoint_ops == "ops" else ""))
        elif self.checkpointing:
            k = int(self.checkpointing)
            parts.append("checkpointing" + (f" every {k} blocks" if k > 1 else ""))
        if self.accumulate > 1:
            parts.append(f"accumulate {self.accumulate}")
        if self.tp > 1:
            parts.append(f"TP {self.tp}")
        if self.cp > 1:
            parts.append(f"CP {self.cp}")
        if self.pp > 1:
            parts.append(f"PP {self.pp} ({self.schedule.upper() if self.schedule != 'interleaved' else 'interleaved'}"
                         f", {self.micro_batches or self.pp} micro-batches)")
        if self.zero:
            parts.append(f"ZeRO-{self.zero} × {self.dp if self.parallel else self.world}")
        if self.param_dtype is not None or self.reduce_dtype is not None:
            parts.append(f"FSDP2 mixed precision ({short_dtype(self.param_dtype) if self.param_dtype else 'fp32'} "
                         f"params, {short_dtype(self.reduce_dtype or self.param_dtype)} reduce)")
        if self.offload_params:
            parts.append("parameters, gradients and optimizer state on the host (CPUOffloadPolicy)")
        elif self.offload:
            parts.append("optimizer offload")
        if self.float8:
            parts.append("float8 linears")
        parts += [words for on, words in ((self.step is not None, "your step"),
                                          (self.optimizer_in_backward, "optimizer in backward"),
                                          (self.offload_activations, "activations on the host"),
                                          (self.loss_chunks > 1, f"loss in {self.loss_chunks} chunks")) if on]
        return ", ".join(parts)


#: options a trace does not depend on, with their defaults: each rank's share (ZeRO's stage over ``world`` ranks) and
#: the optimizer's state moved to the host are applied to the traced storages afterwards (``layouts/``)
AFTER_TRACE: dict[str, Any] = {"zero": None, "world": 1, "offload": False}


#: training options that mean nothing for generate() (their defaults)
_TRAINING = {"checkpointing": False, "accumulate": 1, "zero": None, "fsdp": False, "world": 1, "offload": False,
             "lora": None, "master_weights": None, "loss_fn": None, "tp": 1, "pp": 1, "micro_batches": None,
             "parallelize_plan": None, "step": None, "keep_output": None, "optimizer_in_backward": False,
             "offload_activations": False, "loss_chunks": None}


_TRAINING.update(param_dtype=None, reduce_dtype=None, float8=False)  # FSDP2's mixed precision, float8 (parse_fsdp2)
_TRAINING.update(cp=1)  # context parallelism (parse_parallel)


def check_training_options(given: dict[str, Any]) -> None:
    """``ValueError`` for training options given with ``generate=``."""
    wrong = [k for k, default in _TRAINING.items() if k in given and given[k] != default]
    if wrong:
        raise ValueError(f"{', '.join(wrong)} appl{'y' if len(wrong) > 1 else 'ies'} to training; generate= estimates "
                         "inference (drop them, or estimate a training step without generate=)")


def optimizer_name(opt: Any) -> str:
    """The optimizer's name as the user gave it: a name, or a class's (with its library's, bitsandbytes' or torchao's,
    in front: ``bitsandbytes.AdamW``)."""
    if isinstance(opt, str):
        return opt
    if callable(opt) and not isinstance(opt, (type, OptimizerChoice, torch.optim.Optimizer)):
        return f"{getattr(opt, '__name__', type(opt).__name__)}(model)"  # what the user's callable makes for step=
    cls = opt if isinstance(opt, type) else opt.cls if isinstance(opt, OptimizerChoice) else type(opt)
    library = str(getattr(cls, "__module__", "")).split(".")[0]
    return f"{library}.{cls.__name__}" if library in ("bitsandbytes", "torchao") else cls.__name__


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
    offload: Any = False,
    device: str = "cuda",
    steps: int = 2,
    param_dtype: Any = None,
    reduce_dtype: Any = None,
    float8: bool = False,
    quantize: Any = None,
    lora: Any = None,
    tp: int = 1,
    pp: Any = 1,
    micro_batches: int | None = None,
    schedule: str = "1f1b",
    parallelize_plan: Any = None,
    step: Any = None,
    keep_output: Any = None,
    optimizer_in_backward: bool = False,
    offload_activations: bool = False,
    loss_chunks: Any = None,
    cp: int = 1,
    moe_imbalance: Any = 1.0,
) -> Options:
    """Check every option; raise ``ValueError``/``TypeError`` naming what is accepted."""
    recipe = parse_recipe(step, keep_output, optimizer_in_backward, offload_activations, loss_chunks, checkpointing,
                          optimizer, inference, dict(accumulate=accumulate, amp=amp, tp=tp, pp=pp,
                                                     master_weights=master_weights))
    checkpointing = recipe.pop("checkpointing")
    if step is not None and callable(optimizer) and not isinstance(optimizer, (type, torch.optim.Optimizer)):
        pass  # a callable that makes the step's optimizer argument (step/recipes/user_step.py)
    elif isinstance(optimizer, str):
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
                        f"object (or, with step=, a callable model -> the step's optimizer), not "
                        f"{type(optimizer).__name__}")
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
    parallel = parse_parallel(tp, pp, micro_batches, schedule, parallelize_plan, world, zero, inference, accumulate,
                              cp)
    world = parallel.pop("world")
    if zero is not None and world < 2:
        raise ValueError("sharding needs world ≥ 2 (the number of ranks), e.g. zero=3, world=8")
    if device not in ("cuda", "cpu") and not (isinstance(device, str) and device.startswith("cuda:")):
        raise ValueError(f"device must be 'cuda' (model a GPU) or 'cpu' (model a CPU run), not {device!r}")
    fsdp2 = parse_fsdp2(param_dtype, reduce_dtype, offload, float8, zero=zero, amp=am, master=master, tp=tp, pp=pp,
                        inference=inference)
    offload = fsdp2.pop("offload")
    if step is not None and (fsdp2["param_dtype"] is not None or fsdp2["reduce_dtype"] is not None
                             or fsdp2["offload_params"]):
        raise ValueError("step= is not traced under FSDP2's own MixedPrecisionPolicy or CPUOffloadPolicy yet: drop "
                         "param_dtype, reduce_dtype and offload='params' (zero=3 alone shards as FSDP does), or drop "
                         "step= to have the built-in step use them")
    if inference and (accumulate > 1 or zero is not None or offload):
        raise ValueError("accumulate, zero/fsdp and offload apply to training; drop them with inference=True")
    quant, rank = parse_quantize(quantize), parse_lora(lora)
    return Options(
        quantize=quant, lora=rank,
        optimizer=optimizer, inference=bool(inference), dtype=dt, amp=am, master_weights=master,
        checkpointing=parse_checkpointing(checkpointing),
        accumulate=accumulate, zero=zero, world=world, offload=bool(offload), **fsdp2,
        device="cuda" if str(device).startswith("cuda") else "cpu", steps=steps, **parallel, **recipe,
        moe_imbalance=parse_moe_imbalance(moe_imbalance),
    )


def parse_moe_imbalance(value: Any) -> float:
    """The busiest MoE expert's tokens over its balanced share: a number ≥ 1 (``ValueError`` otherwise)."""
    try:
        factor = float(value)
    except (TypeError, ValueError):
        factor = float("nan")
    if isinstance(value, bool) or not factor >= 1 or factor == float("inf"):
        raise ValueError(f"moe_imbalance must be a number ≥ 1 (the busiest expert's tokens over its balanced share of "
                         f"tokens × top-k / experts; 1 is balanced routing), not {value!r}")
    return factor


def parse_recipe(step: Any, keep_output: Any, in_backward: Any, offload_activations: Any, loss_chunks: Any,
                 checkpointing: Any, optimizer: Any, inference: bool, others: dict[str, Any]) -> dict[str, Any]:
    """The recipes' options checked (``ValueError``/``TypeError`` saying what to give instead): the user's ``step``, the
    built-in step's ``keep_output``, ``optimizer_in_backward``, ``offload_activations``, ``loss_chunks`` and
    ``checkpointing="ops"`` (or a policy: ``checkpoint_ops``). ``others``: the options they exclude."""
    for name, value in (("optimizer_in_backward", in_backward), ("offload_activations", offload_activations)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, not {value!r}")
    if keep_output is not None and not isinstance(keep_output, bool):
        raise TypeError(f"keep_output must be True (out = model(**batch); ...; loss.backward()) or False "
                        f"(model(**batch).loss.backward()), not {keep_output!r}")
    if isinstance(loss_chunks, str) and loss_chunks.strip().isdigit():
        loss_chunks = int(loss_chunks)
    if loss_chunks is None:
        loss_chunks = 1
    if isinstance(loss_chunks, bool) or not isinstance(loss_chunks, int) or loss_chunks < 1:
        raise ValueError(f"loss_chunks must be a whole number ≥ 2 (the chunks of the hidden states the head and the "
                         f"loss are computed in; torchtune uses 8), not {loss_chunks!r}")
    ops = None
    if isinstance(checkpointing, str) and checkpointing.strip().lower() == "ops":
        ops = "ops"
    elif callable(checkpointing) and not isinstance(checkpointing, bool):
        ops = checkpointing
    elif isinstance(checkpointing, (list, tuple, set, frozenset)):
        ops = tuple(checkpointing)  # the ops whose outputs are saved (create_selective_checkpoint_contexts' list)
    levers = {"optimizer_in_backward": in_backward, "offload_activations": offload_activations,
              "loss_chunks": loss_chunks > 1}
    if inference and (step is not None or any(levers.values()) or keep_output is not None):
        raise ValueError("step, keep_output, optimizer_in_backward, offload_activations and loss_chunks apply to "
                         "training; drop them with inference=True")
    if step is not None:
        if not callable(step):
            raise TypeError(f"step must be a function fn(model, batch, optimizer) that runs one training step, not "
                            f"{type(step).__name__}")
        given = [k for k, on in (("keep_output", keep_output is not None), ("optimizer_in_backward", in_backward),
                                 ("loss_chunks", loss_chunks > 1), ("accumulate", others["accumulate"] != 1),
                                 ("amp", others["amp"] is not None), ("master_weights", bool(others["master_weights"])),
                                 ("tp", others["tp"] != 1), ("pp", others["pp"] != 1)) if on]
        if given:
            raise ValueError(f"step= runs your step as you wrote it, which settles {', '.join(given)}: write "
                             f"{'them' if len(given) > 1 else 'it'} into the step (its autocast, its accumulation "
                             "loop, its loss), or drop step= to have the built-in step do it")
    elif callable(optimizer) and not isinstance(optimizer, (str, type, torch.optim.Optimizer)):
        raise TypeError("a callable optimizer= (model -> what the step receives) is for step=fn; without it give a "
                        "name, an optimizer class or an optimizer object")
    if in_backward:
        wrong = [k for k, on in (("accumulate", others["accumulate"] != 1), ("tp", others["tp"] != 1),
                                 ("pp", others["pp"] != 1), ("master_weights", bool(others["master_weights"]))) if on]
        if wrong:
            raise ValueError(f"optimizer_in_backward steps each parameter as soon as its gradient is accumulated: it "
                             f"cannot take {', '.join(wrong)} (gradients are never kept across micro-batches; "
                             "torchtune refuses the same)")
    if loss_chunks > 1 and (others["tp"] != 1 or others["pp"] != 1):
        raise ValueError("loss_chunks applies to a whole causal LM on one rank; drop tp/pp or loss_chunks")
    return {"step": step, "keep_output": True if keep_output is None else keep_output,
            "optimizer_in_backward": in_backward, "offload_activations": offload_activations,
            "loss_chunks": loss_chunks, "checkpoint_ops": ops,
            "checkpointing": True if ops is not None else parse_checkpointing(checkpointing)}


@functools.cache
def fsdp2_available() -> bool:
    """Whether this PyTorch has FSDP2's public API (``torch.distributed.fsdp.fully_shard`` and its policies: 2.6 on),
    which the estimates of FSDP2's own mixed precision and offload run."""
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


def parse_fsdp2(param_dtype: Any, reduce_dtype: Any, offload: Any, float8: Any, *, zero: Any, amp: Any, master: bool,
                tp: Any, pp: Any, inference: bool) -> dict[str, Any]:
    """FSDP2's mixed precision (``param_dtype``, ``reduce_dtype``), the offload asked for (``False``, ``True`` or
    ``"optimizer"``: the optimizer's state; ``"params"``: FSDP2's ``CPUOffloadPolicy``, parameters and gradients too)
    and ``float8``, checked (``ValueError`` naming what is accepted): ``{"offload", "offload_params", "param_dtype",
    "reduce_dtype", "float8"}``."""
    if offload is None or offload is False or offload is True:
        params = False
    elif isinstance(offload, str) and offload.lower() in ("optimizer", "params"):
        params = offload.lower() == "params"
    else:
        raise ValueError(f"offload must be True (or 'optimizer': the optimizer's state on the host) or 'params' "
                         f"(FSDP2's CPUOffloadPolicy: parameters, gradients and optimizer state on the host), not "
                         f"{offload!r}")
    pd, rd = parse_dtype(param_dtype, "param_dtype"), parse_dtype(reduce_dtype, "reduce_dtype")
    if pd is torch.float32:
        raise ValueError("param_dtype is the dtype FSDP2 all-gathers and computes in: bf16 or fp16 (fp32 parameters "
                         "compute in fp32 without it)")
    if (pd is not None or rd is not None or params) and not fsdp2_available():
        raise ValueError(f"param_dtype, reduce_dtype and offload='params' are traced with FSDP2's own fully_shard "
                         f"(torch.distributed.fsdp, PyTorch 2.6 or later; this is {torch.__version__}): upgrade "
                         f"PyTorch, or estimate zero=3 without them")
    if (pd is not None or rd is not None or params) and zero != 3:
        what = "offload='params' is FSDP2's CPUOffloadPolicy" if params else \
            "param_dtype and reduce_dtype are FSDP2's MixedPrecisionPolicy"
        raise ValueError(f"{what}: give zero=3 (or fsdp=True) and world=N with it")
    if pd is not None and rd is None:  # the recipes' reduction (torchtitan's default), not FSDP2's own (param_dtype)
        rd = torch.float32
    if pd is not None and amp is not None:
        raise ValueError("param_dtype replaces autocast (FSDP2 casts the parameters it gathers, the activations "
                         "follow): drop amp, or drop param_dtype to estimate fp32 weights under autocast")
    if (pd is not None or rd is not None or params) and master:
        raise ValueError("master_weights and FSDP2's mixed precision are two ways to keep fp32 weights: FSDP2 keeps "
                         "the fp32 shards itself; drop master_weights")
    if (pd is not None or rd is not None or params) and (tp != 1 or pp != 1):
        raise ValueError("FSDP2's mixed precision and offload policies are estimated with data parallelism alone; "
                         "with tp or pp, drop param_dtype, reduce_dtype and offload='params'")
    if not isinstance(float8, bool):
        raise ValueError(f"float8 must be True (torchao's Float8Linear in place of the linear layers) or False, not "
                         f"{float8!r}")
    if float8 and inference:
        raise ValueError("float8 converts the linear layers for training (torchao's convert_to_float8_training); drop "
                         "inference=True")
    return {"offload": bool(offload), "offload_params": params, "param_dtype": pd, "reduce_dtype": rd,
            "float8": float8}


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
    raise ValueError(f"checkpointing must be True (every block), False, k ≥ 2 (every k-th block), \"ops\" (op-level "
                     f"selective checkpointing of each block) or a selective-checkpointing policy, not {value!r}")


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
