"""A sweep of transformers' architectures, each built from a tiny config: the real CPU training step measured with
``vram_magic.measure()`` beside ``vram_magic.estimate()`` through a builder (the model constructed on fake tensors),
with the same step on both sides.

    OMP_NUM_THREADS=1 python benchmarks/hf_sweep.py [--only llama,t5] [--drop-output]

The step, twice (the first makes the optimizer's state): ``out = model(**batch)``, ``out.loss.backward()``,
``opt.step()``, ``opt.zero_grad(set_to_none=True)``, ``del out`` — the output alive through backward, the
estimate's default convention; ``--drop-output`` runs ``model(**batch).loss.backward()`` (Hugging Face's Trainer)
against ``estimate(..., keep_output=False)``. The optimizer is AdamW with ``foreach=False`` (the CPU's default). Each
model runs in its own process (``--one NAME``), so that one model's leftovers never count in the next. A row reads
the real peak (the model, the batch and the step), the estimate's, and the difference; PARTIAL where the estimate
stopped early, and the error where either side failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a shrunken config's fields, by the names transformers' configs use
DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=128, pad_token_id=0)
ENCODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=512,
               max_position_embeddings=128, pad_token_id=0)
MOE = dict(DECODER, num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
           shared_expert_intermediate_size=64)
GPT = dict(n_embd=64, n_layer=2, n_head=4, n_positions=128, vocab_size=512)
SEQ2SEQ = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
               encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=512, max_position_embeddings=128,
               decoder_start_token_id=2, pad_token_id=1)
T5 = dict(d_model=64, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4, d_kv=16, vocab_size=512,
          decoder_start_token_id=0, pad_token_id=0)
VIT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=32,
           patch_size=8, num_labels=10, encoder_stride=8)

# (name, model type, head, config fields)
CASES: list[tuple[str, str, str, dict[str, Any]]] = [
    *[(t, t, "causal", DECODER) for t in (
        "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo", "olmo2", "cohere", "granite",
        "stablelm", "starcoder2", "glm", "helium", "smollm3")],
    ("gemma3_text", "gemma3_text", "causal", dict(DECODER, sliding_window=32)),
    ("phi", "phi", "causal", DECODER),
    ("gpt_neox", "gpt_neox", "causal", DECODER),
    ("falcon", "falcon", "causal", {**{k: v for k, v in DECODER.items() if k != "head_dim"},
                                    "new_decoder_architecture": True, "num_kv_heads": 2}),
    ("mixtral", "mixtral", "causal", MOE),
    ("qwen3_moe", "qwen3_moe", "causal", MOE),
    ("qwen2_moe", "qwen2_moe", "causal", MOE),
    ("olmoe", "olmoe", "causal", MOE),
    *[(t, t, "causal", GPT) for t in ("gpt2", "gpt_bigcode")],
    ("gptj", "gptj", "causal", dict(GPT, rotary_dim=8)),
    ("codegen", "codegen", "causal", dict(GPT, rotary_dim=8, n_ctx=128)),
    ("bloom", "bloom", "causal", dict(hidden_size=64, n_layer=2, n_head=4, vocab_size=512)),
    ("opt", "opt", "causal", dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                                  vocab_size=512, max_position_embeddings=128, word_embed_proj_dim=64)),
    ("mpt", "mpt", "causal", dict(d_model=64, n_heads=4, n_layers=2, vocab_size=512, max_seq_len=128)),
    *[(t, t, "masked", ENCODER) for t in ("bert", "roberta", "electra", "deberta-v2", "xlm-roberta", "camembert")],
    ("albert", "albert", "masked", dict(ENCODER, embedding_size=32)),
    ("distilbert", "distilbert", "masked", dict(dim=64, hidden_dim=128, n_layers=2, n_heads=4, vocab_size=512)),
    ("modernbert", "modernbert", "masked", dict(ENCODER, global_attn_every_n_layers=2, local_attention=32,
                                                pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                                                sep_token_id=2)),
    ("t5", "t5", "seq2seq", T5),
    ("mt5", "mt5", "seq2seq", T5),
    *[(t, t, "seq2seq", SEQ2SEQ) for t in ("bart", "mbart", "pegasus", "marian", "blenderbot")],
    *[(t, t, "image", VIT) for t in ("vit", "deit")],
    ("convnext", "convnext", "image", dict(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1], num_labels=10,
                                           image_size=32)),
    ("swin", "swin", "image", dict(embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4, image_size=32,
                                   patch_size=4, num_labels=10)),
    ("resnet", "resnet", "image", dict(hidden_sizes=[16, 32], depths=[1, 1], embedding_size=16, num_labels=10)),
    ("wav2vec2", "wav2vec2", "ctc", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, conv_dim=[32, 32], conv_stride=[5, 2],
                                         conv_kernel=[10, 3], vocab_size=32, num_conv_pos_embeddings=16,
                                         num_conv_pos_embedding_groups=4, layerdrop=0.1)),
]
BATCH, SEQ = 2, 64


def build(model_type: str, head: str, fields: dict[str, Any]) -> Any:
    import transformers

    config = transformers.AutoConfig.for_model(model_type, **fields)
    if model_type == "deit":  # (transformers 5.24's auto class needs config.architectures for DeiT)
        return transformers.DeiTForImageClassification(config)
    auto = {"causal": transformers.AutoModelForCausalLM, "masked": transformers.AutoModelForMaskedLM,
            "seq2seq": transformers.AutoModelForSeq2SeqLM, "image": transformers.AutoModelForImageClassification,
            "ctc": transformers.AutoModelForCTC}[head]
    return auto.from_config(config)


def batch(head: str, seed: int = 0) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    if head == "image":
        return {"pixel_values": torch.randn(BATCH, 3, 32, 32, generator=g), "labels": torch.randint(0, 10, (BATCH,),
                                                                                                       generator=g)}
    if head == "ctc":
        return {"input_values": torch.randn(BATCH, 4000, generator=g),
                "labels": torch.randint(1, 32, (BATCH, 12), generator=g)}
    ids = torch.randint(3, 512, (BATCH, SEQ), generator=g)
    if head == "seq2seq":
        return {"input_ids": ids, "labels": torch.randint(3, 512, (BATCH, SEQ // 2), generator=g)}
    return {"input_ids": ids, "labels": ids.clone()}


def one(name: str, keep_output: bool) -> dict[str, Any]:
    import torch

    import vram_magic

    _, model_type, head, fields = next(c for c in CASES if c[0] == name)
    row: dict[str, Any] = {"name": name}
    torch.manual_seed(0)
    try:
        model = build(model_type, head, fields)
    except Exception as err:
        return {**row, "error": f"config: {type(err).__name__}: {str(err)[:120]}"}
    data = batch(head)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)

    def step() -> None:
        for _ in range(2):
            if keep_output:
                out = model(**data)
                out.loss.backward()
            else:
                model(**data).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if keep_output:
                del out

    torch.manual_seed(0)  # LayerDrop and dropout draw the same on both sides of the comparison
    try:
        with vram_magic.measure(device="cpu", namespace={"model": model, "opt": opt, "data": data}) as m:
            step()
        row["real"] = m.report.peak.total  # the model, the batch, and the step's peak above them
    except Exception as err:
        return {**row, "error": f"real step: {type(err).__name__}: {str(err)[:120]}"}
    extra = {} if keep_output else {"keep_output": False}
    t0 = time.perf_counter()
    try:
        est = vram_magic.estimate(lambda: build(model_type, head, fields), lambda: batch(head), device="cpu",
                                  optimizer="adamw", **extra)
    except Exception as err:
        return {**row, "error": f"estimate: {type(err).__name__}: {str(err)[:160]}"}
    row["estimate_s"] = round(time.perf_counter() - t0, 2)
    row["estimate"] = est.peak.total
    row["partial"] = bool(getattr(est, "partial", False))
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", help="names, comma-separated")
    p.add_argument("--drop-output", action="store_true", help="the step drops the output before backward")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    keep = not args.drop_output
    if args.one:
        print(json.dumps(one(args.one, keep)))
        return 0
    names = [c[0] for c in CASES if not args.only or c[0] in args.only.split(",")]
    print(f"{'model':<14}{'real':>13}{'estimate':>13}{'diff':>9}  note")
    worst = 0.0
    for name in names:
        cmd = [sys.executable, os.path.abspath(__file__), "--one", name] + (["--drop-output"] if not keep else [])
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                              env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
        try:
            row = json.loads(done.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            print(f"{name:<14} failed: {(done.stderr.strip().splitlines() or ['?'])[-1][:140]}")
            continue
        if "error" in row:
            print(f"{name:<14} {row['error']}")
            continue
        diff = 100.0 * (row["estimate"] - row["real"]) / max(row["real"], 1)
        worst = max(worst, abs(diff)) if not row["partial"] else worst
        note = "PARTIAL" if row["partial"] else ""
        print(f"{name:<14}{row['real']:>13,}{row['estimate']:>13,}{diff:>+8.2f}%  {note} ({row['estimate_s']} s)")
    print(f"worst difference of the whole estimates: {worst:.2f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
