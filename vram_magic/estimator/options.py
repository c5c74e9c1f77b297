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
        if self.zero:
            parts.append(f"ZeRO-{self.zero} × {self.world}")
        if self.offload:
            parts.append("optimizer offload")
        return ", ".join(parts)


#: options a trace does not depend on, with their defaults: each rank's share (ZeRO's stage over ``world`` ranks) and
#: the optimizer's state moved to the host are applied to the traced storages afterwards (``layouts/``)
AFTER_TRACE: dict[str, Any] = {"zero": None, "world": 1, "offload": False}


#: training options that mean nothing for generate() (their defaults)
_TRAINING = {"checkpointing": False, "accumulate": 1, "zero": None, "fsdp": False, "world": 1, "offload": False,
             "lora": None, "master_weights": None, "loss_fn": None}


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
        device="cuda" if str(device).startswith("cuda") else "cpu", steps=steps,
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
