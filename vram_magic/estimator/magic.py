"""``%vram_estimate``: the shell over :func:`vram_magic.estimate`."""

from __future__ import annotations

import sys
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from .options import OPTIMIZERS
from .result import Estimate


@magic_arguments()
@argument("model", help="a model in the namespace (nn.Module) or a zero-argument function that builds one")
@argument("--input", metavar="EXPR", help="inputs: an expression such as \"torch.randn(32, 3, 224, 224)\" "
          "(evaluated on fake tensors, so any size is free) or the name of a zero-argument function")
@argument("--shape", metavar="D1,D2,...", help="one input of this shape per sample (use with --batch)")
@argument("--batch", type=int, help="batch size for --shape (or a new batch size for --input)")
@argument("--vocab", type=int, metavar="N", help="with --shape: integer token ids below N instead of floats")
@argument("--loss", metavar="EXPR", help="loss function, e.g. \"lambda out: out.logits.sum()\"")
@argument("--optimizer", default="adamw", help=f"{', '.join(OPTIMIZERS)}, or an optimizer object/class name")
@argument("--inference", action="store_true", help="a forward pass under inference_mode only")
@argument("--dtype", help="bf16, fp16 or fp32 weights and inputs")
@argument("--amp", help="autocast to bf16 or fp16")
@argument("--checkpointing", action="store_true", help="activation checkpointing of each block")
@argument("--accumulate", type=int, default=1, metavar="K", help="split the batch into K micro-batches")
@argument("--zero", type=int, metavar="STAGE", help="ZeRO stage 1, 2 or 3 (per-rank memory; needs --world)")
@argument("--fsdp", action="store_true", help="FSDP full sharding (like ZeRO-3; needs --world)")
@argument("--world", type=int, default=1, metavar="N", help="number of ranks for --zero/--fsdp")
@argument("--offload", action="store_true", help="optimizer state and step on the host")
@argument("--gpu", help="a GPU from the catalogue, e.g. A100-80GB, RTX-4090, T4")
@argument("--budget", metavar="SIZE", help="device memory to fit into, e.g. 24GiB")
@argument("--device", default="cuda", help="cuda (model a GPU, the default) or cpu (model a CPU run)")
@argument("--max-batch", action="store_true", help="search the largest batch that fits --gpu/--budget")
@argument("--max-seq", action="store_true", help="search the longest sequence (input dimension 1) that fits")
@argument("--what-if", action="store_true", help="add the what-if table of strategies")
@argument("-o", "--output", metavar="NAME", help="store the estimate in the variable NAME")
@argument("-q", "--quiet", action="store_true", help="do not display the estimate")
def _parser(line: str) -> None:
    """Predict a training or inference step's memory without a GPU."""


def parse(line: str) -> Any:
    try:
        return parse_argstring(_parser, line)
    except UsageError:
        raise
    except SystemExit as err:  # argparse's own exit on bad input
        raise UsageError(f"cannot read the options of %vram_estimate: {line!r}") from err


def _unquote(text: str) -> str:
    """IPython's argument splitting keeps the quotes around an expression: drop one matching pair."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def _eval(expr: str, ns: dict[str, Any], what: str) -> Any:
    expr = _unquote(expr)
    try:
        return eval(expr, ns)  # noqa: S307 (the user's own expression in their own namespace)
    except NameError as err:
        raise UsageError(f"{what}: {err} in the notebook's namespace") from None
    except SyntaxError as err:
        raise UsageError(f"{what}: cannot read {expr!r} as Python ({err.msg})") from None


def build_kwargs(args: Any, ns: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """``(model, inputs, keyword arguments)`` for :func:`vram_magic.estimate` from parsed magic options."""
    import torch

    model = _eval(args.model, ns, "model")
    if args.input and args.shape:
        raise UsageError("give either --input EXPR or --shape D1,D2,... --batch N, not both")
    if args.input:
        expr = _unquote(args.input)

        def inputs() -> Any:
            value = eval(expr, ns)  # noqa: S307
            return value() if callable(value) and not isinstance(value, torch.Tensor) else value

        try:
            compile(expr, "<--input>", "eval")
        except SyntaxError as err:
            raise UsageError(f"--input: cannot read {expr!r} as Python ({err.msg})") from None
    elif args.shape:
        try:
            shape = tuple(int(s) for s in _unquote(args.shape).replace("x", ",").split(",") if s.strip())
        except ValueError:
            raise UsageError(f"--shape takes sizes separated by commas, e.g. 3,224,224; got {args.shape!r}") from None
        if args.batch is None:
            raise UsageError("--shape needs --batch N")
        full = (args.batch, *shape)
        vocab = args.vocab

        def inputs() -> Any:
            return torch.randint(0, vocab, full) if vocab else torch.randn(full)
    else:
        raise UsageError("say what the model takes: --input \"torch.randn(32, 3, 224, 224)\" or --input make_batch, "
                         "or --shape 3,224,224 --batch 32")
    optimizer: Any = args.optimizer
    if optimizer.lower() not in OPTIMIZERS:
        if _unquote(optimizer).split("(")[0].split(".")[0] not in ns:
            raise UsageError(f"--optimizer: unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}, "
                             "or the name of an optimizer object or class in the notebook")
        optimizer = _eval(optimizer, ns, "--optimizer")
    kwargs: dict[str, Any] = dict(
        optimizer=optimizer, inference=args.inference, dtype=args.dtype, amp=args.amp,
        checkpointing=args.checkpointing, accumulate=args.accumulate, zero=args.zero, fsdp=args.fsdp,
        world=args.world, offload=args.offload, gpu=args.gpu, budget=args.budget, device=args.device,
        what_if=args.what_if, max_batch=args.max_batch, max_seq=args.max_seq,
    )
    if args.loss:
        kwargs["loss_fn"] = _eval(args.loss, ns, "--loss")
    return model, inputs, kwargs


def run_estimate_magic(magics: Any, line: str) -> Estimate | None:
    from . import EstimateError, estimate

    args = parse(line)
    if args.output and not args.output.isidentifier():
        raise UsageError(f"-o needs a variable name, got {args.output!r}")
    ns = magics.shell.user_ns
    model, inputs, kwargs = build_kwargs(args, ns)
    if args.batch is not None and args.input:
        kwargs["batch"] = args.batch
    batch = kwargs.pop("batch", None)
    if not args.quiet and (args.max_batch or args.max_seq):
        kwargs["progress"] = lambda msg: print(f"max-batch: trying {msg}", file=sys.stdout, flush=True)
    try:
        est = estimate(model, inputs, **kwargs) if batch is None else _estimate_batch(model, inputs, batch, kwargs)
    except (ValueError, TypeError, EstimateError) as err:
        raise UsageError(str(err)) from None
    if args.output:
        ns[args.output] = est
    if args.quiet:
        return None
    if getattr(magics, "widget", False) and getattr(magics.shell, "kernel", None) is not None:
        try:
            from IPython.display import display

            display(_bundle(est), raw=True)
            return None
        except Exception:  # no ipywidgets: the estimate renders itself as HTML and text
            pass
    return est


def _estimate_batch(model: Any, inputs: Any, batch: int, kwargs: dict[str, Any]) -> Estimate:
    """--input with --batch: the inputs' batch dimension resized before the run."""
    from dataclasses import replace

    from . import estimate
    from .core import evaluate

    first = estimate(model, inputs, **{**kwargs, "what_if": False, "max_batch": False, "max_seq": False})
    request, target = first.rerun
    opts = first.options.with_(batch=batch)
    est = replace(evaluate(request, opts, target), rerun=(request, target))
    if kwargs.get("max_batch"):
        from . import find_max_batch

        est = replace(est, max_batch=find_max_batch(est, progress=kwargs.get("progress")))
    if kwargs.get("max_seq"):
        from . import find_max_batch

        est = replace(est, max_seq=find_max_batch(est, dim=1, progress=kwargs.get("progress")))
    if kwargs.get("what_if"):
        from .strategies import what_if

        est = replace(est, strategies=tuple(what_if(est)))
    return est


def _bundle(est: Estimate) -> dict[str, Any]:
    import ipywidgets as widgets

    from ..render.widget import widget_bundle
    from .render import estimate_html

    html = estimate_html(est)
    box = widgets.VBox([widgets.HTML(value=html)], layout=widgets.Layout(max_width="56em"))
    box.add_class("vram-estimate-widget")
    return widget_bundle(box, str(est), html)
