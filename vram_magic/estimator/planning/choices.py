"""One combination of strategies (:class:`Choice`) and what it means for the user: its name, what changes, what
changes the training's math, the code that applies it, and what it costs besides time (after the guide's chapter 5:
no saving is free)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ..options import Options, optimizer_name, short_dtype
from .recipes import lever_facts, lever_options

_BATCH_NORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm)


@dataclass(frozen=True)
class Choice:
    """Micro-batch × accumulation (``micro × accumulate`` samples a rank, ``global_batch`` over every rank),
    checkpointing, the ZeRO stage, offload, mixed precision, adapters, the optimizer (``None``: the user's)."""

    micro: int
    accumulate: int
    checkpointing: bool | int | str  # False, True, every k-th block, or "ops" (op-level: recipes.py)
    zero: int | None
    offload: bool
    amp: torch.dtype | None
    lora: int | None
    quantize: str | None
    optimizer: Any
    global_batch: int
    tp: int = 1  # tensor-parallel ranks
    pp: int = 1  # pipeline stages (``accumulate`` is then the pipeline's micro-batches)
    # FSDP2's MixedPrecisionPolicy (with zero=3): fp32 shards, the all-gathers and the compute in this dtype, the
    # reduce-scatters in fp32; the class is traced as one FSDP2 rank (layouts/fsdp.py)
    param_dtype: torch.dtype | None = None
    levers: tuple[str, ...] = ()  # the recipes' levers (recipes.py); ``checkpointing="ops"`` is op-level checkpointing
    cp: int = 1  # context-parallel ranks (the sequence sharded over them)
    schedule: str = "1f1b"  # the pipeline's schedule (pp ≥ 2)
    replicas: int = 1  # HSDP: the data-parallel ranks shard inside a host and replicate over this many hosts
    # half-precision weights and gradients with an fp32 master copy in the optimizer (the ZeRO paper's mixed
    # precision, DeepSpeed's bf16): the layouts' precision beside autocast where FSDP2's MixedPrecisionPolicy is not
    # traced (with tp or pp)
    master: torch.dtype | None = None

    @property
    def per_rank(self) -> int:
        return self.micro * self.accumulate

    @property
    def half_compute(self) -> bool:
        """Whether the activations are in half precision (autocast, FSDP2's ``param_dtype`` or half weights)."""
        return self.amp is not None or self.param_dtype is not None or self.master is not None

    def trace_class(self) -> tuple[Any, ...]:
        """What changes the fake run besides the micro-batch and accumulation."""
        return (self.checkpointing, self.amp, self.lora, self.quantize, self.optimizer, self.tp, self.pp) + \
            ((self.param_dtype,) if self.param_dtype is not None else ()) + ((self.levers,) if self.levers else ()) + \
            ((self.cp, self.schedule) if self.cp > 1 or self.pp > 1 else ()) + \
            (("master", self.master) if self.master is not None else ())

    def shards(self, gpus: int) -> int:
        """The ranks a ZeRO stage shards over: the data-parallel and context-parallel ranks (a host's under HSDP)."""
        return max(gpus // (self.tp * self.pp) // self.replicas, 1)

    def data_parallel(self, gpus: int) -> int:
        """The data-parallel ranks (replicas of one model, each a batch of its own)."""
        return max(gpus // (self.tp * self.pp * self.cp), 1)

    def options(self, base: Options, gpus: int) -> Options:
        if self.levers or self.checkpointing == "ops":
            plain = replace(self, levers=(), checkpointing=True if self.checkpointing == "ops" else self.checkpointing)
            return plain.options(base, gpus).with_(**lever_options(self.levers, self.checkpointing))
        precision = {"param_dtype": self.param_dtype, "reduce_dtype": torch.float32} if self.param_dtype else \
            {"dtype": self.master, "master_weights": True} if self.master is not None else {}
        # the micro-batches are the pipeline's; ZeRO, if any, over the dp × cp ranks (an HSDP replica's)
        return base.with_(batch=self.per_rank, accumulate=self.accumulate if self.pp == 1 else 1,
                          checkpointing=self.checkpointing, zero=self.zero,
                          world=gpus // self.replicas if gpus > 1 else 1, offload=self.offload, amp=self.amp,
                          lora=self.lora, quantize=self.quantize,
                          optimizer=self.optimizer if self.optimizer is not None else base.optimizer,
                          tp=self.tp, pp=self.pp, cp=self.cp, micro_batches=self.accumulate if self.pp > 1 else None,
                          schedule=self.schedule if self.pp > 1 else "1f1b", **precision)


def searched_batches(global_batch: int, gpus: int, allow: frozenset[str]) -> list[int]:
    """The global batches searched: the one asked for, and half of it where ``allow`` has ``"batch"``."""
    half = global_batch // 2
    return [global_batch] + ([half] if "batch" in allow and half >= gpus and half % gpus == 0 else [])


def searched_layouts(base: Options, gpus: int) -> list[tuple[int | None, bool]]:
    """``(ZeRO stage, optimizer state on the host)`` searched: no sharding, and ZeRO-1/2/3 over more than one GPU,
    each with the state on the host on CUDA (a CPU's optimizer state is on the host already)."""
    offloads = (False, True) if base.device == "cuda" else (False,)
    return [(None, o) for o in offloads] + ([(z, o) for z in (1, 2, 3) for o in offloads] if gpus > 1 else [])


@dataclass(frozen=True)
class Facts:
    name: str
    changes: tuple[str, ...] = ()
    numerics: tuple[str, ...] = ()
    code: tuple[str, ...] = ()
    tradeoffs: tuple[str, ...] = ()


def _device(base: Options) -> str:
    return "cuda" if base.device == "cuda" else "cpu"


def _autocast(c: Choice, base: Options) -> str:
    device = _device(base)
    return f"with torch.autocast({device!r}, dtype=torch.{'bfloat16' if c.amp == torch.bfloat16 else 'float16'}):"


def _accumulation_code(c: Choice, base: Options, keyed: bool = False) -> str:
    """The accumulation loop, each micro-batch's forward under autocast where the row has it (fp16: scaled);
    ``keyed``: the batch is a dict of tensors (a transformers model's ``input_ids``, ``labels``, ...)."""
    if keyed:
        head = (f"for i in range({c.accumulate}):  # {c.accumulate} micro-batches of {c.micro} a step\n"
                f"    micro = {{k: v[i * {c.micro}:(i + 1) * {c.micro}] for k, v in batch.items()}}\n")
        call = "model(**micro)"
    else:
        head = f"for micro in batch.split({c.micro}):  # {c.accumulate} micro-batches a step\n"
        call = "model(micro)"
    if c.amp is None:
        return head + f"    ({call}.loss / {c.accumulate}).backward()\noptimizer.step(); optimizer.zero_grad()"
    fp16 = c.amp == torch.float16
    return ((f"scaler = torch.amp.GradScaler({_device(base)!r})\n" if fp16 else "") + head
            + f"    {_autocast(c, base)}\n        loss = {call}.loss / {c.accumulate}\n"
            + ("    scaler.scale(loss).backward()\nscaler.step(optimizer); scaler.update(); optimizer.zero_grad()"
               if fp16 else "    loss.backward()\noptimizer.step(); optimizer.zero_grad()"))


def describe(c: Choice, base: Options, *, model: Any = None, gpu: Any = None, gpus: int = 1,
             keyed: bool = False) -> Facts:
    """What ``c`` changes from a plain step of ``base`` (one micro-batch a step, nothing sharded or offloaded), with
    code and trade-offs when ``model`` (its source) is given; ``keyed``: the inputs are a dict of tensors."""
    changes, numerics, code, trade = model_parallel_facts(c, gpus)
    built = _model(model)
    hf = built is not None and callable(getattr(built, "gradient_checkpointing_enable", None))
    accumulated = c.accumulate > 1 and c.pp == 1
    if accumulated:
        changes.append(f"micro-batch {c.micro} × {c.accumulate} accumulated")
        code.append(_accumulation_code(c, base, keyed))
        if built is not None and any(isinstance(m, _BATCH_NORMS) for m in built.modules()):
            trade.append(f"BatchNorm's statistics come from micro-batches of {c.micro} samples, not "
                         f"{c.per_rank}: noisier, and different from a step of the whole batch")
    if c.checkpointing and c.checkpointing != "ops":
        every = int(c.checkpointing)
        changes.append("checkpointing" + (f" every {every} blocks" if every > 1 else ""))
        if hf and (every == 1 or callable(getattr(built, "activation_checkpointing_enable", None))):
            # transformers 5.x names it activation_checkpointing_enable (gradient_checkpointing_enable deprecated)
            switch, kwargs = ("activation_checkpointing_enable", "activation_checkpointing_kwargs") \
                if callable(getattr(built, "activation_checkpointing_enable", None)) else \
                ("gradient_checkpointing_enable", "gradient_checkpointing_kwargs")
            every_n = f", every_n_layers={every}" if every > 1 else ""
            code.append(f"model.{switch}({kwargs}={{'use_reentrant': False}}{every_n})")
        else:
            code.append("from torch.utils.checkpoint import checkpoint\n"
                        f"# in the forward, around {'every block' if every == 1 else f'one block in {every}'}:\n"
                        "x = checkpoint(block, x, use_reentrant=False)")
        trade.append("the checkpointed blocks' forward runs again in the backward")
    if c.param_dtype is not None:
        changes.append(f"FSDP2 {short_dtype(c.param_dtype)} params / fp32 reduce (MixedPrecisionPolicy)")
        numerics.append(f"{short_dtype(c.param_dtype)} compute (FSDP2 casts the gathered weights, the activations "
                        "follow), fp32 weights, gradient reduction and update")
    if c.master is not None:
        name = short_dtype(c.master)
        changes.append(f"{name} weights + fp32 master weights")
        numerics.append(f"{name} weights, gradients and compute; the optimizer updates an fp32 master copy (the ZeRO "
                        "paper's mixed precision: 2 + 2 + 12 bytes a parameter with AdamW)")
        code.append(f"deepspeed config: {{'{'bf16' if c.master == torch.bfloat16 else 'fp16'}': {{'enabled': True}}, "
                    f"'zero_optimization': {{'stage': {c.zero or 0}}}}}  # half-precision weights, fp32 master")
        trade.append("gradients are reduced in half precision; Megatron-LM's bf16 keeps an fp32 gradient buffer "
                     "instead (2 more bytes a parameter)")
    if c.amp is not None:
        name = short_dtype(c.amp)
        changes.append(f"{name} autocast")
        numerics.append(f"{name} mixed precision")
        if not accumulated:  # (with accumulation, the loop above runs each micro-batch under autocast)
            code.append(f"{_autocast(c, base)}\n    loss = model({'**batch' if keyed else 'batch'}).loss")
            if c.amp == torch.float16:
                code.append(f"scaler = torch.amp.GradScaler({_device(base)!r}); scaler.scale(loss).backward(); "
                            "scaler.step(optimizer); scaler.update()")
        if c.amp == torch.float16:
            trade.append(f"fp16's range is narrow: loss scaling is needed ({gpu.name if gpu else 'this GPU'} has no "
                         "bf16), and some models overflow")
    if c.lora:
        changes.append(f"{'QLoRA: nf4 base + ' if c.quantize else ''}LoRA r={c.lora}")
        numerics.append(f"LoRA trains rank-{c.lora} adapters, not the model's weights")
        code.append("from peft import LoraConfig, get_peft_model\n"
                    f"model = get_peft_model(model, LoraConfig(r={c.lora}, target_modules='all-linear'))")
        if c.quantize:
            code.insert(len(code) - 1, "from transformers import BitsAndBytesConfig  # load the base in 4 bits\n"
                        "quantization_config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4')")
            trade.append("a 4-bit base: each matmul dequantizes its weight (slower), a small quality loss")
        trade.append("another fine-tuning method: only the adapters learn")
    if c.optimizer is not None:
        _optimizer_facts(c.optimizer, base, changes, numerics, code, trade)
    lever_facts(c, changes, code, trade)
    if c.zero:
        what = {1: "ZeRO-1 (optimizer state sharded)", 2: "ZeRO-2 (optimizer state and gradients sharded)",
                3: "FSDP / ZeRO-3 (everything sharded)"}[c.zero]
        changes.append(f"{what} × {c.shards(gpus)}" + (f" in each host, {c.replicas} replicas (HSDP)"
                                                        if c.replicas > 1 else ""))
        code.append({1: "torch.distributed.optim.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW)",
                     2: "deepspeed.initialize(model=model, config={'zero_optimization': {'stage': 2}, ...})",
                     3: "from torch.distributed.fsdp import fully_shard\nfor block in blocks: fully_shard(block)\n"
                        "fully_shard(model)"}[c.zero] if c.param_dtype is None else _fsdp2_code(c))
        if c.replicas > 1:
            code.append(f"mesh = init_device_mesh('cuda', ({c.replicas}, {c.shards(gpus)}), "
                        "mesh_dim_names=('replicate', 'shard'))  # HSDP: fully_shard(..., mesh=mesh)")
    elif c.data_parallel(gpus) * c.cp > 1:
        changes.append(f"DDP × {c.data_parallel(gpus) * c.cp}")
        code.append("model = torch.nn.parallel.DistributedDataParallel(model)")
    if c.offload:
        changes.append("optimizer state on the host")
        if "in_backward" not in c.levers:  # with an optimizer in backward: torchao's CPUOffloadOptimizer (recipes.py)
            code.append(f"deepspeed config: {{'zero_optimization': {{'stage': {c.zero or 1}, "
                        "'offload_optimizer': {'device': 'cpu'}}}")
        trade.append("the update runs on the CPU and gradients and weights cross PCIe every step")
    if c.global_batch and c.per_rank * c.data_parallel(gpus) != c.global_batch:
        changes.append(f"global batch {c.per_rank * c.data_parallel(gpus)}")
    name = ", ".join(changes) if changes else "as it is"
    return Facts(name, tuple(changes), tuple(numerics), tuple(code), tuple(trade))


#: the code that makes each optimizer a plan may offer
_OPTIMIZER_CODE = {
    "sgd-momentum": "torch.optim.SGD(model.parameters(), lr=..., momentum=0.9)",
    "adafactor": "torch.optim.Adafactor(model.parameters(), lr=...)",
    "adamw8bit": "import bitsandbytes as bnb\noptimizer = bnb.optim.AdamW8bit(model.parameters(), lr=...)",
}


def _optimizer_facts(optimizer: Any, base: Options, changes: list[str], numerics: list[str], code: list[str],
                     trade: list[str]) -> None:
    """What another optimizer changes: 8-bit AdamW keeps AdamW's update and hyper-parameters and stores its moments in
    8 bits; the others change the update."""
    name = optimizer_name(optimizer)
    code.append(_OPTIMIZER_CODE.get(str(optimizer), str(optimizer)))
    if name == "adamw8bit":
        changes.append("8-bit AdamW (bitsandbytes)")
        numerics.append("AdamW's moments quantized to 8 bits, block-wise (an fp32 scale per 256 values; tensors under "
                        "4,096 elements keep 32-bit moments): about 2 instead of 8 bytes a parameter, close to 32-bit "
                        "AdamW in quality for most fine-tuning")
        trade.append("needs bitsandbytes and a CUDA GPU; its fused update reads and writes the moments in 8 bits "
                     "(timed as one pass over the parameter, its gradient and the 8-bit moments)")
        return
    changes.append(name)
    numerics.append(f"{name} instead of {optimizer_name(base.optimizer)}")
    trade.append("another optimizer: its learning rate and schedule need tuning again")


def _fsdp2_code(c: Choice) -> str:
    """``fully_shard`` with FSDP2's mixed-precision policy."""
    dtype = "torch.bfloat16" if c.param_dtype == torch.bfloat16 else "torch.float16"
    return ("from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard\n"
            f"mp = MixedPrecisionPolicy(param_dtype={dtype}, reduce_dtype=torch.float32)\n"
            "for block in blocks: fully_shard(block, mp_policy=mp)\nfully_shard(model, mp_policy=mp)")


#: the pipeline schedules' names and PyTorch classes
SCHEDULE_NAMES = {"1f1b": ("1F1B", "Schedule1F1B"), "interleaved": ("interleaved 1F1B", "ScheduleInterleaved1F1B"),
                  "zbv": ("ZB-V", "ScheduleZBVZeroBubble"), "gpipe": ("GPipe", "ScheduleGPipe"),
                  "interleaved-zb": ("interleaved zero bubble", "ScheduleInterleavedZeroBubble"),
                  "dualpipev": ("DualPipeV", "ScheduleDualPipeV")}


def model_parallel_facts(c: Choice, gpus: int) -> tuple[list[str], list[str], list[str], list[str]]:
    """``(changes, numerics, code, trade-offs)`` of ``c``'s tensor, context and pipeline parallelism."""
    changes: list[str] = []
    code: list[str] = []
    trade: list[str] = []
    if c.tp > 1:
        changes.append(f"tensor parallel × {c.tp}")
        code.append("from torch.distributed.tensor.parallel import parallelize_module\n"
                    f"mesh = init_device_mesh('cuda', ({gpus // c.tp}, {c.tp}), mesh_dim_names=('rest', 'tp'))\n"
                    "parallelize_module(model, mesh['tp'], plan)  # plan: ColwiseParallel / RowwiseParallel styles")
        trade.append(f"two all-reduces of each block's activations in the forward and two in the backward across "
                     f"{c.tp} GPUs: worth it over NVLink, slow across hosts")
    if c.cp > 1:
        changes.append(f"context parallel × {c.cp}")
        code.append("from torch.distributed.tensor.experimental import context_parallel\n"
                    "with context_parallel(mesh['cp'], buffers=[ids, labels], buffer_seq_dims=[1, 1]):\n"
                    "    loss = model(input_ids=ids, labels=labels).loss  # SDPA becomes ring attention")
        trade.append(f"each attention's keys and values gathered from the {c.cp} context-parallel ranks (and their "
                     "gradients sent back) in every forward and backward")
    if c.pp > 1:
        name, cls = SCHEDULE_NAMES.get(c.schedule, (c.schedule, "Schedule1F1B"))
        changes.append(f"pipeline × {c.pp} ({c.accumulate} micro-batches of {c.micro}, {name})")
        code.append(f"from torch.distributed.pipelining import PipelineStage, {cls}\n"
                    "stage = PipelineStage(my_blocks, rank, num_stages, device)  # torchtitan: pipeline_llm\n"
                    f"{cls}(stage, n_microbatches={c.accumulate}, loss_fn=loss_fn).step(batch)")
        if c.schedule in ("zbv", "dualpipev"):
            left = "" if c.accumulate >= 2 * c.pp else \
                f"; with fewer than 2p = {2 * c.pp} micro-batches a bubble of (p − 1)/(2m) = " \
                f"{100 * (c.pp - 1) / (2 * c.accumulate):.0f} % of its work is left"
            trade.append("ZB-V: two stages a rank in a V, the backward split into input and weight gradients to fill "
                         f"the pipeline's bubble{left}; twice the pipeline's sends")
        else:
            v = 2 if c.schedule == "interleaved" else 1
            bubble = (c.pp - 1) / (v * c.accumulate)
            trade.append(f"the pipeline's bubble: each stage idles (p − 1)/({'v·' if v > 1 else ''}m) = "
                         f"{100 * bubble:.0f} % of its work; the first stage holds p micro-batches' activations")
    return changes, [], code, trade


def _model(source: Any) -> Any:
    """The model a source holds, when it is a module (a builder is not built again for words)."""
    if source is None:
        return None
    get = getattr(source, "module", None)
    try:
        return get() if callable(get) else None
    except Exception:
        return None
