"""Mixture-of-experts training steps of transformers' MoE decoders, real (measured with ``vram_magic.measure()``)
beside ``vram_magic.estimate()``, with both experts implementations and three routers:

* ``real``: the model's own router (random weights);
* ``balanced``: the router forced to route as the estimate assumes (a constant added to its logits makes ``topk``
  choose ``tokens × k / experts`` tokens per expert, round-robin), against ``estimate(...)``;
* ``busiest ×2``: forced so that one expert takes twice its balanced share and the others share the rest, against
  ``estimate(..., moe_imbalance=2)``.

    OMP_NUM_THREADS=1 python benchmarks/moe_routing.py [--only mixtral,qwen3_moe] [--dtypes fp32,bf16]

The models, the forced routers and the step come from ``tests/support/moe.py`` (the tests use the same): the step,
twice: ``out = model(**batch)``, ``out.loss.backward()``, AdamW (``foreach=False``), ``zero_grad``, as in
``benchmarks/hf_sweep.py``; the model in fp32 or bf16 (``model.to(torch.bfloat16)``: bf16 weights, gradients and
AdamW state). Sizes are chosen so the peak falls where the experts' tensors are alive (an expert's
intermediate size 512, 8 experts, top-2, a vocabulary of 64, 2 × 64 tokens). Each row runs in its own process. The
forced routers exist for the routers laid out as Mixtral's (logits, then softmax and top-k): Mixtral, Qwen2/3-MoE,
OLMoE; gpt-oss and DeepSeek-V3 run with their own routers only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the checkout: tests.support
from tests.support.moe import FORCEABLE, MODELS  # noqa: E402

ROUTERS = {"real": None, "balanced": 1.0, "busiest ×2": 2.0}  # the router, or the imbalance it is forced to
DTYPES = {"fp32": None, "bf16": "bfloat16"}


def one(name: str, implementation: str, router: str, dtype: str = "fp32") -> dict[str, Any]:
    import time
    import warnings

    import torch

    import vram_magic
    from tests.support import moe

    warnings.simplefilter("ignore")
    model = moe.build(name, implementation, ROUTERS[router], getattr(torch, DTYPES[dtype] or "float32"))
    data = moe.batch()
    report = moe.measured(model, data)
    t0 = time.perf_counter()
    est = vram_magic.estimate(model, data, device="cpu", moe_imbalance=ROUTERS[router] or 1.0)
    return {"real": report.peak.total, "estimate": est.peak.total, "partial": est.partial,
            "seconds": round(time.perf_counter() - t0, 2), "experts": est.experts, "measured_experts": report.experts,
            "note": next((n for n in est.notes if n.startswith("MoE routing")), "")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", help="models, comma-separated")
    p.add_argument("--dtypes", default="fp32,bf16", help="the models' dtypes, comma-separated (fp32, bf16)")
    p.add_argument("--one", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(*args.one)))
        return 0
    names = [n for n in MODELS if not args.only or n in args.only.split(",")]
    print(f"{'model':<12}{'dtype':<6}{'experts':<12}{'router':<12}{'real':>12}{'estimate':>12}{'diff':>9}  "
          "experts' params / grads / state at the peak (estimate = measured)")
    for name in names:
        for dtype in args.dtypes.split(","):
            for implementation in ("grouped_mm", "eager"):
                for router in ROUTERS if name in FORCEABLE else ("real",):
                    command = [sys.executable, os.path.abspath(__file__), "--one", name, implementation, router, dtype]
                    done = subprocess.run(command, capture_output=True, text=True, timeout=900,
                                          env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
                    head = f"{name:<12}{dtype:<6}{implementation:<12}{router:<12}"
                    try:
                        row = json.loads(done.stdout.strip().splitlines()[-1])
                    except (IndexError, json.JSONDecodeError):
                        print(f"{head} failed: {(done.stderr.strip().splitlines() or ['?'])[-1][:120]}")
                        continue
                    diff = 100.0 * (row["estimate"] - row["real"]) / row["real"]
                    e, same = row["experts"], row["experts"] == row["measured_experts"]
                    split = f"{e['parameters']:,} / {e['gradients']:,} / {e['optimizer_state']:,}" + \
                        ("" if same else f" ≠ measured {row['measured_experts']}")
                    print(f"{head}{row['real']:>12,}{row['estimate']:>12,}{diff:>+8.2f}%  {split}"
                          f"{'  PARTIAL' if row['partial'] else ''}", flush=True)
    return 0

if __name__ == "__main__":
    sys.exit(main())
