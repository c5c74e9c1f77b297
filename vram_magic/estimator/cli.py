"""``python -m vram_magic estimate package.module:build_model --shape 3,224,224 --batch 32 --gpu T4``.

The same options as ``%vram_estimate``; MODEL is ``module:attribute`` (an ``nn.Module`` or a zero-argument
builder) and ``--input`` is ``module:attribute`` of a zero-argument callable, or an expression using
``torch``. Exit status: 0 when the step fits (or no capacity was given), 1 when it does not, 2 on bad input.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any

from .options import OPTIMIZERS


def _load(ref: str, what: str) -> Any:
    if ":" not in ref:
        raise ValueError(f"{what} must be written module:attribute (e.g. mypkg.models:build_model), got {ref!r}")
    mod_name, attr = ref.split(":", 1)
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")
    try:
        obj: Any = importlib.import_module(mod_name)
    except ImportError as err:
        raise ValueError(f"cannot import {mod_name!r} for {what}: {err}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{mod_name!r} has no attribute {attr!r} ({what})") from None
    return obj


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vram_magic estimate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="module:attribute of an nn.Module or a zero-argument builder")
    p.add_argument("--input", help="module:attribute of a zero-argument callable, or an expression using torch")
    p.add_argument("--shape", help="per-sample input shape, e.g. 3,224,224 (with --batch)")
    p.add_argument("--batch", type=int)
    p.add_argument("--vocab", type=int, help="with --shape: integer token ids below N")
    p.add_argument("--optimizer", default="adamw", help=", ".join(OPTIMIZERS))
    p.add_argument("--inference", action="store_true")
    p.add_argument("--dtype")
    p.add_argument("--amp")
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--zero", type=int)
    p.add_argument("--fsdp", action="store_true")
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--offload", action="store_true")
    p.add_argument("--gpu")
    p.add_argument("--budget")
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-batch", action="store_true")
    p.add_argument("--max-seq", action="store_true")
    p.add_argument("--what-if", action="store_true")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON instead of the report")
    return p


def main(argv: list[str]) -> int:
    import torch

    from . import EstimateError, estimate

    args = parser().parse_args(argv)
    try:
        model = _load(args.model, "MODEL")
        if args.input and args.shape:
            raise ValueError("give either --input or --shape with --batch, not both")
        if args.input:
            ref = args.input
            if ":" in ref and "(" not in ref:
                inputs = _load(ref, "--input")
            else:
                def inputs() -> Any:
                    return eval(ref, {"torch": torch})  # noqa: S307 (the user's own command line)
        elif args.shape:
            if args.batch is None:
                raise ValueError("--shape needs --batch")
            full = (args.batch, *(int(s) for s in args.shape.split(",") if s.strip()))
            vocab = args.vocab

            def inputs() -> Any:
                return torch.randint(0, vocab, full) if vocab else torch.randn(full)
        else:
            raise ValueError("say what the model takes: --input module:make_batch or --shape 3,224,224 --batch 32")
        optimizer: Any = args.optimizer if args.optimizer.lower() in OPTIMIZERS else _load(args.optimizer,
                                                                                          "--optimizer")
        progress = None if args.json else (lambda msg: print(f"max-batch: trying {msg}", file=sys.stderr))
        est = estimate(model, inputs, optimizer=optimizer, inference=args.inference, dtype=args.dtype,
                       amp=args.amp, checkpointing=args.checkpointing, accumulate=args.accumulate, zero=args.zero,
                       fsdp=args.fsdp, world=args.world, offload=args.offload, gpu=args.gpu, budget=args.budget,
                       device=args.device, what_if=args.what_if, max_batch=args.max_batch, max_seq=args.max_seq,
                       progress=progress)
    except (ValueError, TypeError, EstimateError) as err:
        print(f"vram_magic estimate: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({
            "peak": est.peak.as_dict(), "peak_total": est.peak.total, "needed": est.needed,
            "after_forward": est.after_forward.as_dict(), "capacity": est.capacity, "fits": est.fits,
            "max_batch": est.max_batch, "max_seq": est.max_seq,
            "flops": dict(est.flops), "partial": est.partial, "problem": est.problem,
            "what_if": [{"strategy": s.name, "peak": s.peak, "needed": s.needed, "compute": s.compute}
                        for s in est.strategies],
        }, indent=2))
    else:
        print(est)
    return 1 if est.fits is False else 0
