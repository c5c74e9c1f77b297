"""``measure()`` around real ``model.generate()`` calls (the reference cases of tests/support/generate_zoo.py): the KV
cache the
block keeps against the bytes worked out by hand from the config, the peak's split, the tracker's peak against the
profiler's (Δ B: the tracker's peak minus the profiler's, in bytes), the decode steps it counted, and what measuring
costs (×time: generate() measured over unmeasured, one run each after a warm-up: a rough figure).

    .venv/bin/python benchmarks/kv_cache_measure.py [case name fragment ...]
"""

from __future__ import annotations

import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: tests.support
import vram_magic
from tests.support.generate_zoo import CASES, Case, real_generate
from vram_magic.core.units import format_bytes

F32, I64 = 4, 8


def by_hand(case: Case, model: torch.nn.Module) -> int:
    """The cache generate() returns, from the config alone: keys and values per layer of batch (× beams) × kv heads
    × tokens × head dim × 4 bytes; a sliding layer's storage holds the window (its keys are a view of the last
    window - 1 tokens), plus its window-size tensor; a static layer holds max_length - 1 tokens, plus its length
    counter; T5 keeps its decoder's tokens and the encoder's (cross attention)."""
    cfg = model.config
    batch = case.batch * case.beams
    tokens = case.prompt + case.new - 1
    if cfg.is_encoder_decoder:
        per = 2 * batch * cfg.num_heads * cfg.d_kv * F32
        return cfg.num_decoder_layers * per * (case.new + case.prompt)
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per = 2 * batch * heads * dim * F32
    static = case.kwargs.get("cache_implementation") == "static"
    window = getattr(cfg, "sliding_window", None)
    default = "sliding_attention" if window else "full_attention"  # Mistral: every layer slides
    types = getattr(cfg, "layer_types", None) or [default] * cfg.num_hidden_layers
    total = 0
    for kind in types:
        sliding = kind == "sliding_attention" and window
        if static:
            total += per * (min(window, tokens) if sliding else tokens) + I64
        elif sliding and tokens >= window:
            total += per * window + I64
        else:
            total += per * tokens + (I64 if sliding else 0)
    return total


def run(case: Case) -> dict[str, object]:
    torch.manual_seed(0)
    model = case.build().eval()
    ids = case.ids()
    kwargs = dict(max_new_tokens=case.new, min_new_tokens=case.new, do_sample=False, return_dict_in_generate=True,
                  **case.kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.generate(ids, **kwargs)  # warm-up
        t0 = time.perf_counter()
        out = model.generate(ids, **kwargs)
        plain = time.perf_counter() - t0
        del out
        t0 = time.perf_counter()
        with vram_magic.measure() as m:
            out = model.generate(ids, **kwargs)
        measured = time.perf_counter() - t0
    if m.report is None:  # the report could not be built: say why
        raise RuntimeError("; ".join(str(w.message) for w in caught if "vram_magic" in str(w.message)))
    hand = by_hand(case, model)
    del out
    ref = real_generate(case)
    return {"case": case.name, "hand": hand, "after": m.after["kv_cache"], "peak_kv": m.peak["kv_cache"],
            "peak_act": m.peak["activations"], "peak": m.peak.total, "profiler": ref.peak,
            "steps": sum(1 for _, stage, _ in m.trace.steps if stage == "decode"), "slowdown": measured / plain}


def main(names: list[str]) -> None:
    cases = [c for c in CASES.values() if not names or any(n.lower() in c.name.lower() for n in names)]
    print(f"{'case':<52} {'by hand':>10} {'after kv':>10} {'peak kv':>10} {'peak act':>10} {'peak':>10} "
          f"{'profiler':>10} {'Δ B':>6} {'steps':>5} {'×time':>6}")
    for case in cases:
        r = run(case)
        ok = "=" if r["after"] == r["hand"] else "≠"
        print(f"{r['case']:<52} {format_bytes(r['hand']):>10} {ok}{format_bytes(r['after']):>9} "
              f"{format_bytes(r['peak_kv']):>10} {format_bytes(r['peak_act']):>10} {format_bytes(r['peak']):>10} "
              f"{format_bytes(r['profiler']):>10} {r['peak'] - r['profiler']:>6} {r['steps']:>5} {r['slowdown']:>6.1f}",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
