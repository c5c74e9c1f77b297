"""The planner's time model on this CPU against real steps: six models × six plans (baseline, checkpointing, half
micro-batch × 2 accumulation, bf16 autocast, SGD with momentum, half the batch) and the recipes' levers (an optimizer
in backward, op-level checkpointing, activations saved on the host, and for the causal LMs the loss in 4 chunks:
``--levers`` alone measures those beside the baseline), each plan's real training step on
one thread beside the time the model predicts from the estimator's own trace of that configuration
(``timing/step_time.step_time(micro_ops(trace, rates), options, trace, network)``, the numbers a plan's rows carry).
Run::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/plan_cpu.py [--rounds 7] [--models mlp,gpt2] [--markdown]
        [--save rows.jsonl] [--load rows.jsonl] [--levers]

``--save`` appends each model's rows to a file as it finishes (a run on a busy machine takes a while); ``--load``
reports on rows saved before (by runs of one model each, say) without measuring anything.

Targets, as ratios to each model's baseline: median error ≤ 15 %, worst ≤ 35 %, Spearman's rank correlation ≥ 0.8
across each model's plans; after calibrating on the baseline, each plan's absolute time within 25 %.

A shared machine's wall time says more about its neighbours than about the step, so each step's CPU time
(``time.process_time``: one thread, so it is that thread's time) is the measure the errors are computed on; wall time
is printed beside it. The plans' steps are interleaved, one step of each plan per round (after two warm-up rounds),
so a drift in the machine's load hits every plan alike; each plan's figure is its median over the rounds.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import vram_magic
from vram_magic.estimator.fake.frameworks import enable_checkpointing
from vram_magic.estimator.step.optimizers import make_optimizer
from vram_magic.estimator.step.recipes.chunked_loss import ChunkedLoss
from vram_magic.estimator.step.recipes.op_checkpointing import context_fn
from vram_magic.estimator.step.trace import checkpoint_units
from vram_magic.estimator.timing.cpu_profile import cpu_profile
from vram_magic.estimator.timing.rates import cpu_rates
from vram_magic.estimator.timing.step_time import micro_ops, network_for, step_time

TARGET_MEDIAN, TARGET_WORST, TARGET_RHO, TARGET_CALIBRATED = 0.15, 0.35, 0.8, 0.25


# --- the models -------------------------------------------------------------------------------------------------------
class ConvBlock(nn.Module):
    """A residual block of two 3×3 convolutions with BatchNorm."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
                                  nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


def conv_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.Sequential(*[ConvBlock(32) for _ in range(4)]),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


def mlp() -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)) for _ in range(4)])


def _tokens(batch: int, seq: int, vocab: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (batch, seq))
    return {"input_ids": ids, "labels": ids.clone()}


def gpt2() -> tuple[nn.Module, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=2048, n_positions=256)
    return GPT2LMHeadModel(cfg), _tokens(4, 128, 2048)


def llama() -> tuple[nn.Module, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=2048, max_position_embeddings=256)
    return LlamaForCausalLM(cfg), _tokens(4, 128, 2048)


def bert() -> tuple[nn.Module, Any]:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
                     vocab_size=2048, max_position_embeddings=256)
    return BertForMaskedLM(cfg), _tokens(4, 128, 2048)


def vit() -> tuple[nn.Module, Any]:
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=64, patch_size=8, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                    intermediate_size=1024, num_labels=10)
    return ViTForImageClassification(cfg), {"pixel_values": torch.randn(16, 3, 64, 64),
                                            "labels": torch.randint(0, 10, (16,))}


MODELS: dict[str, Callable[[], tuple[nn.Module, Any]]] = {
    "mlp": lambda: (mlp(), torch.randn(64, 512)),
    "conv-bn": lambda: (conv_net(), torch.randn(16, 3, 32, 32)),
    "gpt2": gpt2,
    "llama": llama,
    "bert": bert,
    "vit": vit,
}


def batch_of(inputs: Any) -> int:
    return inputs.shape[0] if isinstance(inputs, torch.Tensor) else next(iter(inputs.values())).shape[0]


CAUSAL_LMS = ("gpt2", "llama")


def plans(batch: int, model: str = "", classic: bool = True) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {"baseline": {}}
    if classic:
        out.update({"checkpointing": {"checkpointing": True}, "micro/2 × 2": {"accumulate": 2},
                    "bf16 autocast": {"amp": "bf16"}, "sgd-momentum": {"optimizer": "sgd-momentum"},
                    "batch/2": {"batch": batch // 2}})
    out.update({"optimizer in backward": {"optimizer_in_backward": True}, "op-level checkpointing":
                {"checkpointing": "ops"}, "activations on the host": {"offload_activations": True}})
    if model in CAUSAL_LMS:
        out["loss in 4 chunks"] = {"loss_chunks": 4}
    return out


# --- a real step ---------------------------------------------------------------------------------------------------
def rows(inputs: Any, start: int, stop: int) -> Any:
    if isinstance(inputs, torch.Tensor):
        return inputs[start:stop]
    return {k: v[start:stop] for k, v in inputs.items()}


@dataclass
class RealStep:
    """One plan's model, optimizer and inputs, trained for real."""

    model: nn.Module
    optimizer: Any
    parts: list[Any]
    amp: torch.dtype | None
    in_backward: bool = False
    offload: bool = False
    chunked: Any = None

    @classmethod
    def of(cls, model: nn.Module, inputs: Any, opts: dict[str, Any]) -> RealStep:
        model = copy.deepcopy(model).train()
        if opts.get("checkpointing") == "ops":  # torchtitan's op policy around each block, as the estimate applies it
            enable_checkpointing(model, checkpoint_units(model), 1, modes=False, context_fn=context_fn("ops", False))
        elif opts.get("checkpointing"):
            enable_checkpointing(model, checkpoint_units(model), int(opts["checkpointing"]))
        batch = opts.get("batch") or batch_of(inputs)
        k = opts.get("accumulate", 1)
        size = -(-batch // k)
        parts = [rows(inputs, i * size, min((i + 1) * size, batch)) for i in range(k)]
        amp = torch.bfloat16 if opts.get("amp") == "bf16" else None
        chunked = ChunkedLoss.of(model, opts["loss_chunks"], inputs) if opts.get("loss_chunks") else None
        if opts.get("optimizer_in_backward"):  # PyTorch's recipe: one optimizer per parameter, stepped by its hook
            per = {p: make_optimizer(opts.get("optimizer", "adamw"), [p], "cpu") for p in model.parameters()}

            def step(p: torch.Tensor) -> None:
                per[p].step()
                per[p].zero_grad(set_to_none=True)

            for p in model.parameters():
                p.register_post_accumulate_grad_hook(step)
            return cls(model, per, parts, amp, in_backward=True, chunked=chunked)
        optimizer = make_optimizer(opts.get("optimizer", "adamw"), list(model.parameters()), "cpu")
        return cls(model, optimizer, parts, amp, offload=bool(opts.get("offload_activations")), chunked=chunked)

    def __call__(self) -> None:
        import contextlib

        for part in self.parts:
            saving = torch.autograd.graph.save_on_cpu(pin_memory=True) if self.offload else contextlib.nullcontext()
            with torch.autocast("cpu", dtype=self.amp, enabled=self.amp is not None), saving:
                if self.chunked is not None:
                    out, loss = self.chunked.forward_loss(part, lambda: None)
                else:
                    out = self.model(**part) if isinstance(part, dict) else self.model(part)
                    loss = out.loss if hasattr(out, "loss") else out.sum()
            loss.backward()
            del out, loss
        if not self.in_backward:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


def predicted(model: nn.Module, inputs: Any, opts: dict[str, Any]) -> float:
    """The time model's step time for ``opts``, from the estimator's trace of that configuration."""
    est = vram_magic.estimate(model, inputs, device="cpu", **opts)
    trace = est.rerun.trace(est.options)
    return step_time(micro_ops(trace, cpu_rates(cpu_profile())), est.options, trace, network_for(None, 1)).total


def measure(steps: dict[str, RealStep], rounds: int, warmup: int = 2) -> dict[str, tuple[float, float]]:
    """``{plan: (median CPU seconds, median wall seconds)}`` of one step, the plans interleaved round by round."""
    cpu: dict[str, list[float]] = {k: [] for k in steps}
    wall: dict[str, list[float]] = {k: [] for k in steps}
    for r in range(warmup + rounds):
        for name, step in steps.items():
            c, w = time.process_time(), time.perf_counter()
            step()
            c, w = time.process_time() - c, time.perf_counter() - w
            if r >= warmup:
                cpu[name].append(c)
                wall[name].append(w)
    return {k: (statistics.median(cpu[k]), statistics.median(wall[k])) for k in steps}


# --- statistics -------------------------------------------------------------------------------------------------------
def ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 1.0


# --- the run ----------------------------------------------------------------------------------------------------------
@dataclass
class Row:
    model: str
    plan: str
    cpu: float
    wall: float
    pred: float


def run_model(name: str, rounds: int, classic: bool = True) -> list[Row]:
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    chosen = plans(batch_of(inputs), name, classic)
    preds = {p: predicted(model, inputs, o) for p, o in chosen.items()}
    steps = {p: RealStep.of(model, inputs, o) for p, o in chosen.items()}
    real = measure(steps, rounds)
    return [Row(name, p, real[p][0], real[p][1], preds[p]) for p in chosen]


def report(rows_: list[Row], markdown: bool) -> bool:
    by_model: dict[str, list[Row]] = {}
    for r in rows_:
        by_model.setdefault(r.model, []).append(r)
    errors, walls, calibrated, raw, rhos = [], [], [], [], {}
    bases = {m: rs[0] for m, rs in by_model.items()}
    factor = statistics.median(b.cpu / b.pred for b in bases.values())  # one factor for the machine
    head = ("| model | plan | real CPU ms | real wall ms | predicted ms | real ×base | predicted ×base | error | "
            "uncalibrated | one-factor calibrated |")
    print(head if markdown else head.replace("|", " ").strip())
    if markdown:
        print("|" + "---|" * 10)
    for m, rs in by_model.items():
        b = bases[m]
        for r in rs:
            real_x, pred_x, wall_x = r.cpu / b.cpu, r.pred / b.pred, r.wall / b.wall
            err = pred_x / real_x - 1
            if r is not b:
                errors.append(abs(err))
                walls.append(abs(pred_x / wall_x - 1))
            calibrated.append(abs(r.pred * factor / r.cpu - 1))
            raw.append(abs(r.pred / r.cpu - 1))
            cells = [m, r.plan, f"{r.cpu * 1e3:.1f}", f"{r.wall * 1e3:.1f}", f"{r.pred * 1e3:.1f}",
                     f"{real_x:.2f}", f"{pred_x:.2f}", f"{err:+.1%}", f"{r.pred / r.cpu - 1:+.1%}",
                     f"{r.pred * factor / r.cpu - 1:+.1%}"]
            print("| " + " | ".join(cells) + " |" if markdown else "  ".join(f"{c:>13}" for c in cells))
        rhos[m] = spearman([r.cpu for r in rs], [r.pred for r in rs])
    med, worst = statistics.median(errors), max(errors)
    print()
    print(f"ratios to the baseline (CPU time): median error {med:.1%} (target ≤ {TARGET_MEDIAN:.0%}), worst "
          f"{worst:.1%} (≤ {TARGET_WORST:.0%}); against wall time: median {statistics.median(walls):.1%}, worst "
          f"{max(walls):.1%}")
    print("Spearman per model: " + ", ".join(f"{m} {v:.2f}" for m, v in rhos.items()) +
          f" (target ≥ {TARGET_RHO})")
    print(f"calibrated on each model's baseline: worst absolute error {worst:.1%} (target ≤ {TARGET_CALIBRATED:.0%}; "
          "the same figures as the ratios' errors)")
    print(f"uncalibrated: median absolute error {statistics.median(raw):.1%}, worst {max(raw):.1%}; one factor for "
          f"the machine ({factor:.2f}, the median of the baselines' real/predicted): median "
          f"{statistics.median(calibrated):.1%}, worst {max(calibrated):.1%}")
    missed = [what for what, hit in (("median", med <= TARGET_MEDIAN), ("worst", worst <= TARGET_WORST),
                                      ("Spearman", min(rhos.values()) >= TARGET_RHO),
                                      ("calibrated", worst <= TARGET_CALIBRATED)) if not hit]
    ok = not missed
    print("targets met" if ok else f"targets NOT met: {', '.join(missed)}")
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7, help="measured steps per plan (after two warm-up rounds)")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--save", help="append each model's rows to this file (JSON lines) as it finishes")
    ap.add_argument("--load", help="report on the rows in this file, measuring nothing")
    ap.add_argument("--levers", action="store_true", help="the recipes' levers beside the baseline only")
    args = ap.parse_args()
    if args.load:
        with open(args.load) as f:
            saved = [Row(**json.loads(line)) for line in f if line.strip()]
        sys.exit(0 if report(saved, args.markdown) else 1)
    torch.set_num_threads(1)
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    print(cpu_profile().describe())
    out: list[Row] = []
    for name in args.models.split(","):
        rs = run_model(name, args.rounds, classic=not args.levers)
        out.extend(rs)
        if args.save:
            with open(args.save, "a") as f:
                f.writelines(json.dumps(vars(r)) + "\n" for r in rs)
        print(f"  {name}: " + ", ".join(f"{r.plan} {r.cpu * 1e3:.0f}/{r.pred * 1e3:.0f} ms" for r in rs),
              file=sys.stderr, flush=True)
    print(f"load average {load0[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} "
          f"CPUs; {time.perf_counter() - t0:.0f} s; torch {torch.__version__}, {args.rounds} rounds")
    ok = report(out, args.markdown)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
