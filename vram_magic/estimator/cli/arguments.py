"""The options of ``%vram_estimate`` and of ``python -m vram_magic estimate``: one list, read the same way by both.

MODEL, ``--input``, ``--loss`` and ``--optimizer`` take either ``module:attribute`` (imported) or a Python
expression evaluated in a namespace: the notebook's in the magic, ``torch`` alone on the command line. An
``--input`` expression is evaluated on fake tensors (so ``torch.randn(4096, 4096, 4096)`` costs nothing) and,
if it names a zero-argument function, that function is called there.
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Callable
from typing import Any

from ..options import OPTIMIZERS

QUOTING = ("an expression with spaces must be quoted as one argument, e.g. --input \"torch.randn(32, 3, 224, 224)\" "
           "or --input \"{'input_ids': ids, 'attention_mask': mask}\"; or name a variable or a zero-argument function: "
           "--input batch")

# (flags, keyword arguments of argparse's add_argument); shared by the magic and the command line
OPTIONS: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (("model",), {"help": "the model: a name (an nn.Module or a zero-argument function that builds one) or "
                          "module:attribute"}),
    (("--input",), {"metavar": "EXPR", "help": "the inputs: an expression such as \"torch.randn(32, 3, 224, 224)\" "
                    "or \"{'input_ids': ids, 'labels': ids}\" (evaluated on fake tensors, so any size is free), the "
                    "name of a tensor, dict, BatchEncoding or zero-argument function, or module:attribute"}),
    (("--shape",), {"metavar": "D1,D2,...", "help": "one input of this shape per sample (use with --batch)"}),
    (("--batch",), {"type": int, "help": "batch size for --shape (or a new batch size for --input)"}),
    (("--vocab",), {"type": int, "metavar": "N", "help": "with --shape: integer token ids below N instead of floats"}),
    (("--loss",), {"metavar": "EXPR", "help": "loss function, e.g. \"lambda out: out.logits.sum()\" (default: the "
                   "output's own loss, e.g. a Hugging Face model given labels, else the output's sum)"}),
    (("--optimizer",), {"default": "adamw", "help": f"{', '.join(OPTIMIZERS)}, or an optimizer object or class "
                        "(a name or module:attribute)"}),
    (("--inference",), {"action": "store_true", "help": "a forward pass under inference_mode only"}),
    (("--dtype",), {"help": "bf16, fp16 or fp32 weights and inputs"}),
    (("--amp",), {"help": "autocast to bf16 or fp16"}),
    (("--master-weights",), {"metavar": "fp32", "help": "with --dtype bf16|fp16: an fp32 master copy of the weights "
                             "in the optimizer (mixed precision as DeepSpeed and Megatron train)"}),
    (("--checkpointing",), {"nargs": "?", "const": True, "default": False, "metavar": "ops|POLICY",
                            "help": "activation checkpointing (the model's own gradient_checkpointing_enable when it "
                            "has one, else of each block); --checkpointing ops: op-level selective checkpointing of "
                            "each block (torchtitan's policy), or the name of a policy function"}),
    (("--accumulate",), {"type": int, "default": 1, "metavar": "K", "help": "split the batch into K micro-batches"}),
    (("--zero",), {"type": int, "metavar": "STAGE", "help": "ZeRO stage 1, 2 or 3 (per-rank memory; needs --world)"}),
    (("--fsdp",), {"action": "store_true", "help": "FSDP full sharding (like ZeRO-3; needs --world)"}),
    (("--world",), {"type": int, "default": 1, "metavar": "N", "help": "number of ranks for --zero/--fsdp"}),
    (("--offload",), {"nargs": "?", "const": True, "default": False, "metavar": "params",
                      "help": "optimizer state and step on the host; --offload params: FSDP2's CPUOffloadPolicy "
                      "(sharded parameters and gradients on the host too; with --zero 3)"}),
    (("--param-dtype",), {"metavar": "bf16|fp16", "help": "with --zero 3 / --fsdp: FSDP2's MixedPrecisionPolicy "
                          "(fp32 shards, bf16 all-gathers and compute)"}),
    (("--reduce-dtype",), {"metavar": "fp32|bf16", "help": "with --param-dtype: the gradients' reduce-scatter "
                           "dtype (default fp32)"}),
    (("--float8",), {"action": "store_true", "help": "torchao's Float8Linear in place of the linear layers "
                     "(convert_to_float8_training; not the output head)"}),
    (("--quantize",), {"metavar": "FORMAT", "help": "the linear layers' weights in int8, int4, nf4 or nf4-dq "
                       "(frozen; the output head kept as it is)"}),
    (("--lora",), {"type": int, "metavar": "R", "help": "rank-R LoRA adapters on the linear layers, the rest of "
                   "the model frozen (with --quantize nf4: QLoRA)"}),
    # the recipes (estimator/step/recipes/)
    (("--step",), {"metavar": "NAME", "help": "your training step, a function fn(model, batch, optimizer) (a name or "
                   "module:attribute), traced as written; --optimizer may then name a function model -> what fn "
                   "receives"}),
    (("--keep-output",), {"metavar": "yes|no", "help": "the built-in step keeps the model's output alive through "
                          "backward (yes, the default: out = model(**batch); out.loss.backward()) or frees it first "
                          "(no: model(**batch).loss.backward(), as Hugging Face's Trainer does)"}),
    (("--optimizer-in-backward",), {"action": "store_true", "help": "one optimizer per parameter, stepping inside "
                                    "backward (register_post_accumulate_grad_hook; torchtune's optimizer_in_bwd)"}),
    (("--offload-activations",), {"action": "store_true", "help": "tensors saved for backward kept on the host "
                                  "(save_on_cpu(pin_memory=True))"}),
    (("--loss-chunks",), {"type": int, "metavar": "N", "help": "a causal LM's head and cross-entropy computed in N "
                          "chunks of the hidden states (torchtune's chunked loss)"}),
    (("--moe-imbalance",), {"type": float, "metavar": "F", "help": "mixture of experts: the busiest expert takes F "
                            "times its balanced share of tokens × top-k / experts (the worst case; default 1: "
                            "balanced)"}),
    (("--gpu",), {"help": "a GPU from the catalogue, e.g. A100-80GB, RTX-4090, T4"}),
    (("--budget",), {"metavar": "SIZE", "help": "device memory to fit into, e.g. 24GiB"}),
    (("--alloc-conf",), {"metavar": "SETTINGS", "help": "the CUDA caching allocator's settings, as "
                         "PYTORCH_CUDA_ALLOC_CONF takes them (e.g. expandable_segments:True, max_split_size_mb:512, "
                         "roundup_power2_divisions:4; default: that variable's value)"}),
    (("--device",), {"default": "cuda", "help": "cuda (model a GPU, the default) or cpu (model a CPU run)"}),
    (("--max-batch",), {"action": "store_true", "help": "search the largest batch that fits --gpu/--budget"}),
    (("--max-seq",), {"action": "store_true", "help": "search the longest sequence (input dimension 1) that fits"}),
    (("--what-if",), {"action": "store_true", "help": "add the what-if table of strategies"}),
    # model parallelism (layouts/tensor.py, layouts/pipeline.py)
    (("--tp",), {"type": int, "default": 1, "metavar": "T", "help": "tensor parallelism over T ranks "
                 "(parallelize_module with --tp-plan, or the default plan of a Llama-like transformers decoder)"}),
    (("--tp-plan",), {"metavar": "EXPR", "help": "with --tp: the parallelize_plan, a dict of ColwiseParallel / "
                   "RowwiseParallel / SequenceParallel styles (a name or an expression)"}),
    (("--pp",), {"metavar": "P", "help": "pipeline parallelism over P stages of an nn.Sequential (split evenly by "
                 "blocks) or of a transformers decoder or torchtitan model (by layers), or the children or layers "
                 "where stages begin: --pp 4,8 or --pp model.layers.8,model.layers.16"}),
    (("--micro-batches",), {"type": int, "metavar": "M", "help": "with --pp: the micro-batches (default P)"}),
    (("--schedule",), {"default": "1f1b", "help": "with --pp: 1f1b, gpipe; two stages a rank: interleaved, "
                       "interleaved-zb, zbv, dualpipev"}),
    (("--cp",), {"type": int, "default": 1, "metavar": "C", "help": "context parallelism: the sequence sharded over C "
                 "ranks, ring attention (a decoder with SDPA attention, --device cuda)"}),
    # text generation (generate/trace.py)
    (("--generate",), {"type": int, "metavar": "N", "help": "the peak of model.generate(input_ids, max_new_tokens=N) "
                       "instead of a step; --max-seq then finds the longest prompt, --max-batch the largest batch"}),
    (("--cache",), {"metavar": "NAME", "help": "with --generate: the cache_implementation (static, offloaded, "
                    "quantized, ... as the installed transformers names them; default: the model's own)"}),
    (("--beams",), {"type": int, "default": 1, "metavar": "K", "help": "with --generate: beam search with K beams"}),
]

_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def parse_error_hint(message: str) -> str:
    """A parse error, with the advice to quote when an expression was split at its spaces."""
    if "unrecognized arguments" in message or "expected one argument" in message or "No closing quotation" in message:
        return f"{message} — {QUOTING}"
    return message


def unquote(text: str) -> str:
    """IPython's argument splitting keeps the quotes around an expression: drop one matching pair."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def is_reference(text: str) -> bool:
    return bool(_REF.match(text))


def load_reference(ref: str, what: str) -> Any:
    """``package.module:attribute`` → the object."""
    mod_name, attr = ref.split(":", 1)
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")
    try:
        obj: Any = importlib.import_module(mod_name)
    except ImportError as err:
        raise ValueError(f"{what}: cannot import {mod_name!r}: {err}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{what}: {mod_name!r} has no attribute {attr!r}") from None
    return obj


def evaluate(text: str, ns: dict[str, Any], what: str) -> Any:
    """``module:attribute`` or an expression in ``ns``; ``ValueError`` saying what was wrong."""
    text = unquote(text)
    if is_reference(text):
        return load_reference(text, what)
    try:
        return eval(text, ns)  # noqa: S307 (the user's own expression, in their own namespace)
    except NameError as err:
        raise ValueError(f"{what}: {err} ({_where(ns)})") from None
    except SyntaxError as err:
        raise ValueError(f"{what}: cannot read {text!r} as Python ({err.msg}); {QUOTING}") from None


def _where(ns: dict[str, Any]) -> str:
    return "in the notebook's namespace" if "__builtins__" in ns and len(ns) > 3 else (
        "on the command line only torch is imported: name it as module:attribute")


def inputs_from(args: Any, ns: dict[str, Any]) -> Callable[[], Any]:
    """A zero-argument function making the inputs (called by the estimator on fake tensors)."""
    import torch

    if args.input and args.shape:
        raise ValueError("give either --input EXPR or --shape D1,D2,... --batch N, not both")
    if args.input:
        expr = unquote(args.input)
        if is_reference(expr):
            value = load_reference(expr, "--input")
            return (lambda: value()) if callable(value) and not isinstance(value, torch.Tensor) else (lambda: value)
        try:
            compile(expr, "<--input>", "eval")
        except SyntaxError as err:
            raise ValueError(f"--input: cannot read {expr!r} as Python ({err.msg}); {QUOTING}") from None

        def inputs() -> Any:
            try:
                value = eval(expr, ns)  # noqa: S307
            except NameError as err:
                raise ValueError(f"--input: {err} ({_where(ns)})") from None
            return value() if callable(value) and not isinstance(value, torch.Tensor) else value

        return inputs
    if args.shape:
        try:
            shape = tuple(int(s) for s in unquote(args.shape).replace("x", ",").split(",") if s.strip())
        except ValueError:
            raise ValueError(f"--shape takes sizes separated by commas, e.g. 3,224,224; got {args.shape!r}") from None
        if args.batch is None:
            raise ValueError("--shape needs --batch N")
        full = (args.batch, *shape)
        vocab = args.vocab

        def made() -> Any:
            return torch.randint(0, vocab, full) if vocab else torch.randn(full)

        return made
    raise ValueError("say what the model takes: --input \"torch.randn(32, 3, 224, 224)\" or --input make_batch, "
                     "or --shape 3,224,224 --batch 32")


def build(args: Any, ns: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """``(model, inputs, keyword arguments of vram_magic.estimate)`` from parsed options; ``ValueError`` for
    bad input."""
    for option in ("batch", "vocab"):
        value = getattr(args, option, None)
        if value is not None and value < 1:
            raise ValueError(f"--{option} must be a whole number of at least 1, not {value}")
    model = evaluate(args.model, ns, "model")
    inputs = inputs_from(args, ns)
    optimizer: Any = args.optimizer
    if optimizer.lower() not in OPTIMIZERS:
        name = unquote(optimizer)
        if not is_reference(name) and name.split("(")[0].split(".")[0] not in ns:
            raise ValueError(f"--optimizer: unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}, "
                             "or the name of an optimizer object or class (module:attribute on the command line)")
        optimizer = evaluate(optimizer, ns, "--optimizer")
    kwargs: dict[str, Any] = dict(
        optimizer=optimizer, inference=args.inference, dtype=args.dtype, amp=args.amp,
        master_weights=args.master_weights, checkpointing=args.checkpointing, accumulate=args.accumulate,
        zero=args.zero, fsdp=args.fsdp, world=args.world, offload=args.offload, gpu=args.gpu, budget=args.budget,
        param_dtype=getattr(args, "param_dtype", None), reduce_dtype=getattr(args, "reduce_dtype", None),
        float8=bool(getattr(args, "float8", False)),
        alloc_conf=getattr(args, "alloc_conf", None),
        quantize=args.quantize, lora=args.lora,
        device=args.device, what_if=args.what_if, max_batch=args.max_batch, max_seq=args.max_seq,
    )
    kwargs.update(parallel_options(args, ns))
    kwargs.update(recipe_options(args, ns))
    if args.batch is not None and args.input:  # --input resized to --batch (with --shape it is the shape's batch)
        kwargs["batch"] = args.batch
    if args.loss:
        kwargs["loss_fn"] = evaluate(args.loss, ns, "--loss")
    if getattr(args, "generate", None) is not None or getattr(args, "cache", None) or getattr(args, "beams", 1) != 1:
        kwargs.update(generate=args.generate, cache_implementation=args.cache, num_beams=args.beams)
        for option in ("optimizer", "inference"):  # a training step's options: generate= is inference
            kwargs.pop(option)
    return model, inputs, kwargs


def recipe_options(args: Any, ns: dict[str, Any]) -> dict[str, Any]:
    """The recipes' options from parsed ones (only those given): ``step``, ``keep_output``, ``optimizer_in_backward``,
    ``offload_activations``, ``loss_chunks``, ``moe_imbalance``, and ``checkpointing`` as a policy's name."""
    out: dict[str, Any] = {}
    if getattr(args, "step", None):
        out["step"] = evaluate(args.step, ns, "--step")
    keep = getattr(args, "keep_output", None)
    if keep is not None:
        word = unquote(str(keep)).lower()
        if word not in ("yes", "no", "true", "false", "1", "0"):
            raise ValueError(f"--keep-output takes yes or no, not {keep!r}")
        out["keep_output"] = word in ("yes", "true", "1")
    for flag in ("optimizer_in_backward", "offload_activations"):
        if getattr(args, flag, False):
            out[flag] = True
    if getattr(args, "loss_chunks", None) is not None:
        out["loss_chunks"] = args.loss_chunks
    if getattr(args, "moe_imbalance", None) is not None:
        out["moe_imbalance"] = args.moe_imbalance
    checkpointing = getattr(args, "checkpointing", False)
    if isinstance(checkpointing, str):
        text = unquote(checkpointing)
        named = text.lower() == "ops" or text.isdigit()
        out["checkpointing"] = text if named else evaluate(text, ns, "--checkpointing")
    return out


def parallel_options(args: Any, ns: dict[str, Any]) -> dict[str, Any]:
    """``tp``, ``pp``, ``cp``, ``micro_batches``, ``schedule`` and ``parallelize_plan`` from parsed options (only
    those given)."""
    out: dict[str, Any] = {}
    if getattr(args, "cp", 1) != 1:
        out["cp"] = args.cp
    if getattr(args, "tp", 1) != 1:
        out["tp"] = args.tp
    pp = getattr(args, "pp", None)
    if pp:
        text = unquote(pp)
        out["pp"] = int(text) if text.strip().isdigit() else [p.strip() for p in text.split(",") if p.strip()]
    if getattr(args, "micro_batches", None) is not None:
        out["micro_batches"] = args.micro_batches
    if getattr(args, "schedule", "1f1b") != "1f1b":
        out["schedule"] = args.schedule
    if getattr(args, "tp_plan", None):
        out["parallelize_plan"] = evaluate(args.tp_plan, ns, "--tp-plan")
    return out


# the options of %vram_plan and python -m vram_magic plan: the model, its inputs and loss as for an estimate, then
# what the plan is for
_SHARED = ("model", "--input", "--shape", "--batch", "--vocab", "--loss", "--optimizer", "--dtype", "--device",
           "--budget", "--step")
PLAN_OPTIONS: list[tuple[tuple[str, ...], dict[str, Any]]] = [o for o in OPTIONS if o[0][0] in _SHARED] + [
    (("--gpu",), {"help": "the GPU to train on, from the catalogue (A100-80GB, L4, T4, ...)"}),
    (("--gpus",), {"type": int, "default": 1, "metavar": "N", "help": "how many of them (data parallel)"}),
    (("--global-batch",), {"type": int, "metavar": "B", "help": "samples per optimizer step across the GPUs "
                           "(default: the inputs' batch)"}),
    (("--allow",), {"metavar": "WHAT", "help": "also try lora, quantize (QLoRA, with lora), optimizer, batch, "
                    "parallel (tensor and pipeline parallelism; comma-separated): they change what or how the model "
                    "trains; recipes: the recipes' levers even when a classic combination fits"}),
    (("--interconnect",), {"metavar": "LINK", "help": "how the GPUs talk: nvlink, pcie, infiniband-400g, "
                           "infiniband-200g, ethernet-100g, ethernet-25g (default: the GPU's own link in one host)"}),
    (("--generate",), {"type": int, "metavar": "N", "help": "plan model.generate(input_ids, max_new_tokens=N): "
                       "weights, cache and the largest batch, by tokens/s"}),
    (("--top",), {"type": int, "default": 10, "metavar": "N", "help": "rows to show"}),
]


def build_plan(args: Any, ns: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """``(model, inputs, keyword arguments of vram_magic.plan)`` from parsed plan options; ``ValueError`` for bad
    input."""
    for option in ("batch", "vocab", "gpus", "global_batch", "top"):
        value = getattr(args, option, None)
        if value is not None and value < 1:
            raise ValueError(f"--{option.replace('_', '-')} must be a whole number of at least 1, not {value}")
    model = evaluate(args.model, ns, "model")
    inputs = inputs_from(args, ns)
    optimizer: Any = args.optimizer
    if optimizer.lower() not in OPTIMIZERS:
        optimizer = evaluate(optimizer, ns, "--optimizer")
    if args.batch is not None and args.input:
        raise ValueError("--batch resizes the inputs of an estimate; a plan takes --global-batch")
    kwargs: dict[str, Any] = dict(gpu=args.gpu, gpus=args.gpus, global_batch=args.global_batch, device=args.device,
                                  allow=args.allow or (), interconnect=args.interconnect, generate=args.generate,
                                  top=args.top,
                                  optimizer=optimizer, dtype=args.dtype, budget=args.budget)
    if args.loss:
        kwargs["loss_fn"] = evaluate(args.loss, ns, "--loss")
    if args.step:  # your own step, planned as written
        kwargs["step"] = evaluate(args.step, ns, "--step")
    return model, inputs, kwargs
