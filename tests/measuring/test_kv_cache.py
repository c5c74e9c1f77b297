"""The KV cache measured: real ``model.generate()`` of transformers models built from configs (no downloads), under
``vram_magic.measure()`` and ``%%vram`` in a real shell, the cache's bytes worked out by hand."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
import torch

import vram_magic
from tests.support import run_ok, skip_module_without_transformers_5
from vram_magic.engine.hooks import generation
from vram_magic.engine.hooks.kv_cache import is_kv_cache, kv_cache_bytes, kv_cache_tensors
from vram_magic.measuring.render.html import live_html
from vram_magic.measuring.render.text import live_text

skip_module_without_transformers_5()
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

F32, I64 = 4, 8


def _llama(layers: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int = 16, **extra):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=heads * head_dim, intermediate_size=64,
                                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   head_dim=head_dim, **extra)
    return transformers.LlamaForCausalLM(cfg).eval()


def _generate(model, ids, n: int, **kwargs):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          return_dict_in_generate=True, do_sample=False, pad_token_id=0, **kwargs)


def _kv(layers: int, batch: int, heads: int, tokens: int, head_dim: int, itemsize: int = F32) -> int:
    """Keys and values of every layer, by hand."""
    return 2 * layers * batch * heads * tokens * head_dim * itemsize


# (name, model factory, prompt length, new tokens, the cache the cell keeps by hand, options)
B, P, N = 2, 6, 24
CASES = [
    # Llama with grouped-query attention: 2 key/value heads of 16 for 4 query heads; the last token is never fed back
    ("llama-gqa", lambda: _llama(), _kv(2, B, 2, P + N - 1, 16), {}),
    # GPT-2, multi-head attention: as many key/value heads as query heads (4 of 8 dimensions)
    ("gpt2-mha", lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=96, n_positions=64)).eval(), _kv(2, B, 4, P + N - 1, 8), {}),
    # Mistral with a sliding window of 8: each layer's keys are a view of its last 7 tokens into a storage of 8 (the
    # window's last step's torch.cat), and a window-size tensor (int64) per layer
    ("mistral-sliding", lambda: transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8)).eval(), _kv(2, B, 2, 8, 16) + 2 * I64, {}),
    # a static cache: both layers preallocated at max_length - 1 tokens, and a length counter (int64) per layer
    ("llama-static", lambda: _llama(), _kv(2, B, 2, P + N - 1, 16) + 2 * I64, {"cache_implementation": "static"}),
    # a quantized cache (transformers' fp8 backend): one byte per element, and one float32 scale per tensor
    ("llama-fp8", lambda: _llama(), _kv(2, B, 2, P + N - 1, 16, itemsize=1) + 2 * 2 * F32,
     {"cache_implementation": "quantized", "cache_config": {"backend": "fp8"}}),
]


@pytest.mark.parametrize("name,make,expected,options", CASES, ids=[c[0] for c in CASES])
def test_generate_keeps_its_cache_as_kv_cache(name, make, expected, options):
    model = make()
    ids = torch.randint(1, 96, (B, P))
    with vram_magic.measure() as m:
        out = _generate(model, ids, N, **options)
    assert out.sequences.shape == (B, P + N)
    assert m.after["kv_cache"] == expected
    assert kv_cache_bytes(out) == expected  # what the detection function finds in the output, the same
    assert m.after.details("kv_cache") == {"out['cache']": expected}
    assert m.after["activations"] == 0  # no longer filed under activations
    for b in (m.before, m.after, m.peak, m.delta):
        assert sum(b[c] for c in vram_magic.CATEGORIES) == b.total
    assert m.before["kv_cache"] == 0 and m.delta["kv_cache"] == expected
    if name != "mistral-sliding":  # a window stops growing: its prefill may be the cell's peak
        assert m.peak["kv_cache"] >= expected
    phases = m.trace.phases()
    assert phases["prefill"] and phases["decode"]
    decode_steps = [step for _, stage, step in m.trace.steps if stage == "decode"]
    assert decode_steps == list(range(1, N))  # the prompt's forward, then one forward per token but the last
    for cls, method in ((transformers.cache_utils.Cache, "update"), (transformers.GenerationMixin, "generate")):
        assert not generation.is_wrapped(cls, method)  # put back when the block ended


def test_growth_step_by_step_is_kv_cache_at_the_peak():
    """At a decode step's peak, the cache at its full length and the copy torch.cat is replacing: the old keys or
    values of one layer, one token shorter."""
    layers, n = 2, 40
    model = _llama(layers=layers)
    ids = torch.randint(1, 96, (B, 4))
    with vram_magic.measure() as m:
        out = _generate(model, ids, n)
    final = _kv(layers, B, 2, 4 + n - 1, 16)
    one_layer_old = B * 2 * (4 + n - 2) * 16 * F32
    assert m.after["kv_cache"] == final and kv_cache_bytes(out) == final
    assert final <= m.peak["kv_cache"] <= final + one_layer_old
    assert m.peak.details("kv_cache").get("made by cache updates", 0) == m.peak["kv_cache"] - final
    assert m.peak["kv_cache"] > m.peak["activations"]  # the old layout put all of it under activations


def test_encoder_decoder_keeps_self_and_cross_attention_caches():
    layers, heads, d_kv = 2, 4, 8
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=96, d_model=32, d_kv=d_kv, d_ff=64, num_layers=layers, num_heads=heads,
        decoder_start_token_id=0)).eval()
    ids = torch.randint(1, 96, (B, P))
    with vram_magic.measure() as m:
        out = _generate(model, ids, N)
    # the decoder's own cache: its start token and every new token but the last; the cross-attention cache: the
    # encoder's output projected once per layer, prompt long
    assert m.after["kv_cache"] == _kv(layers, B, heads, N, d_kv) + _kv(layers, B, heads, P, d_kv)
    assert kv_cache_bytes(out) == m.after["kv_cache"]
    assert m.after["activations"] == 0
    # the encoder's run is part of the prefill
    assert [stage for _, stage, _ in m.trace.steps][:1] == ["prefill"]
    assert sum(1 for _, stage, _ in m.trace.steps if stage == "decode") == N - 1


class _Attention(torch.nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.out = torch.nn.Linear(d, d)

    def forward(self, x, layer_past=None):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).split(d, dim=2))
        if layer_past is not None:
            k = torch.cat([layer_past[0], k], dim=2)
            v = torch.cat([layer_past[1], v], dim=2)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=layer_past is None)
        return self.out(y.transpose(1, 2).reshape(b, t, d)), (k, v)


class _Decoder(torch.nn.Module):
    """A hand-written decoder whose cache is a tuple of (key, value) per layer, passed back in as past_key_values."""

    def __init__(self, vocab: int = 96, d: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(_Attention(d, heads) for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, ids, past_key_values=None):
        x = self.emb(ids)
        presents = []
        for i, block in enumerate(self.blocks):
            x, present = block(x, None if past_key_values is None else past_key_values[i])
            presents.append(present)
        return self.head(x[:, -1]), tuple(presents)


def test_hand_written_decoder_with_a_tuple_cache():
    model = _Decoder().eval()
    ids = torch.randint(0, 96, (B, P))
    with torch.no_grad(), vram_magic.measure() as m:
        logits, past_key_values = model(ids)
        tok = logits.argmax(-1, keepdim=True)
        for _ in range(N - 1):
            logits, past_key_values = model(tok, past_key_values=past_key_values)
            tok = logits.argmax(-1, keepdim=True)
    assert is_kv_cache(past_key_values)  # a legacy tuple cache, name or not
    expected = _kv(2, B, 4, P + N - 1, 8)
    assert m.after["kv_cache"] == expected == kv_cache_bytes(past_key_values)
    assert m.after.details("kv_cache") == {"past_key_values": expected}
    assert m.after["activations"] == 0
    # the copies each torch.cat replaced were the cache too, at the line that grows it
    assert m.peak["kv_cache"] >= expected
    copies = sum(b.size for b in m.trace.blocks.values() if b.label == "earlier copies (the cache's line)")
    # every decode step but the last made a new key and value per layer that the next step replaced
    assert copies == sum(_kv(2, B, 4, P + k, 8) for k in range(1, N - 1))


def test_detection_of_caches_by_structure_and_by_name():
    k = torch.zeros(2, 4, 5, 8)
    legacy = ((k, k.clone()), (k.clone(), k.clone()))
    assert is_kv_cache(legacy) and kv_cache_bytes(legacy) == 4 * k.nbytes
    assert not is_kv_cache([(k, k)])  # a list of pairs needs a cache's name to be believed
    assert is_kv_cache([(k, k)], "cache") and is_kv_cache([(k, k)], "model.past") and is_kv_cache(k, "kv_cache")
    assert is_kv_cache({"k": k, "v": k}, "state['kv_cache']")
    assert not is_kv_cache({"img": k}, "cache")  # a memo named `cache` is not a KV cache
    assert not is_kv_cache([1, 2, 3], "past") and not is_kv_cache(torch.zeros(3), "cache")
    assert not is_kv_cache(((torch.zeros(2, 3), torch.zeros(2, 3)),))  # pairs of 2-D tensors: not a legacy cache
    dynamic = transformers.DynamicCache()
    dynamic.update(k, k.clone(), 0)
    assert is_kv_cache(dynamic) and kv_cache_bytes(dynamic) == 2 * k.nbytes
    both = transformers.EncoderDecoderCache(dynamic, transformers.DynamicCache())
    assert is_kv_cache(both) and [p for p, _ in kv_cache_tensors(both)] == [
        "self_attention_cache.layers[0].keys", "self_attention_cache.layers[0].values"]
    assert kv_cache_tensors({"cache": dynamic}) and kv_cache_tensors({"past_key_values": legacy})
    assert kv_cache_tensors(k) == [] and kv_cache_tensors(None) == []


def test_detection_does_not_import_transformers():
    code = ("import sys, torch\nfrom vram_magic.engine.hooks.kv_cache import is_kv_cache, kv_cache_tensors\n"
            "import vram_magic\nwith vram_magic.measure():\n    x = torch.zeros(4, 2, 3, 5)\n"
            "assert not is_kv_cache(x) and is_kv_cache(x, 'cache')\nassert 'transformers' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_training_with_use_cache_keeps_five_columns():
    """A training forward of a Hugging Face decoder builds a cache too (use_cache=True): what it makes is what
    attention saves for backward, activations, and the report stays as it was."""
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96,
                                                                 n_positions=64))
    assert model.config.use_cache
    ids = torch.randint(0, 96, (B, 16))
    with vram_magic.measure() as m:
        model(ids, labels=ids).loss.backward()
    assert m.peak["kv_cache"] == m.after["kv_cache"] == 0
    assert m.peak["activations"] > 0
    text = str(m.report)
    assert "kv cache" not in text and "KV cache" not in text


MODEL = """import torch, transformers
transformers.logging.set_verbosity_error()
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=64)).eval()
ids = torch.randint(1, 96, (16, 8))
"""
GENERATE = ("out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32, "
            "return_dict_in_generate=True, do_sample=False, pad_token_id=0)")
# 2 layers x keys and values x batch 16 x 2 heads x (8 + 32 - 1) tokens x 64 dimensions x 4 bytes: 1.22 MiB
KV = 2 * 2 * 16 * 2 * 39 * 64 * F32


def test_generate_under_the_cell_magic(shell, tmp_path):
    run_ok(shell, MODEL)
    run_ok(shell, f"%%vram -q -o r\n{GENERATE}")
    r = shell.user_ns["r"]
    assert r.after["kv_cache"] == KV and r.after["activations"] == 0
    assert r.delta["kv_cache"] == KV and r.peak["kv_cache"] >= KV
    # shown: a column in the tables, a segment of its own colour in the bars, a row of the history
    text = str(r)
    assert "kv cache" in text.splitlines()[1] and "K KV cache" in text
    html = r._repr_mimebundle_()["text/html"]
    assert 'class="vram-seg vram-kv_cache"' in html and "#117722" in html
    assert f'data-bytes="{KV}"' in html
    # advice names the variable and what to do
    kept = [a for a in r.advice if a.kind == "kv-cache"]
    assert kept and kept[0].saving == KV and "`del out`" in kept[0].detail
    assert "return_dict_in_generate" in kept[0].detail
    # the next cell frees it: the diff, the history and its export know the category
    run_ok(shell, "%%vram -q -o r2\ndel out")
    r2 = shell.user_ns["r2"]
    assert r2.delta["kv_cache"] == -KV and r2.after["kv_cache"] == 0
    diff = shell.run_line_magic("vram", "diff")
    assert list(diff["kv_cache"]) == [KV, 0, -KV]
    history = shell.run_line_magic("vram", "history")
    assert list(history["kv_cache"])[-2:] == [KV, 0] and list(history["peak_kv_cache"])[-2] >= KV
    path = tmp_path / "history.csv"
    run_ok(shell, f"%vram export {path}")
    head, *rows = path.read_text().splitlines()
    columns = head.split(",")
    assert "kv_cache" in columns and "peak_kv_cache" in columns
    assert [int(row.split(",")[columns.index("kv_cache")]) for row in rows[-2:]] == [KV, 0]
    # PyTorch's memory viewer opens its snapshot, the KV cache among its categories
    memory_viz = pytest.importorskip("torch.cuda._memory_viz")
    path = tmp_path / "generate.pickle"
    r.save_snapshot(str(path))
    snap = pickle.loads(path.read_bytes())
    categories = {e.get("category") for e in snap["device_traces"][0]}
    assert {"kv_cache", "unknown"} <= categories
    lines = memory_viz.memory(snap, format_flamegraph=lambda t: t).splitlines()
    assert sum(int(line.rsplit(" ", 1)[1]) for line in lines) == r.after.total
    assert memory_viz.trace_plot(snap).lstrip().startswith("<!DOCTYPE html>")


def test_timeline_shows_prefill_and_decode_steps(shell):
    from vram_magic.measuring.render.timeline import decode_steps, phase_runs, text_boxes

    run_ok(shell, MODEL)
    run_ok(shell, f"%%vram -q -o r\n{GENERATE}")
    r = shell.user_ns["r"]
    runs = [run for run in phase_runs(r) if run[0] != "cell"]  # the cell's own line makes the attention mask first
    assert [p for p, _, _ in runs] == ["prefill", "decode"]
    _, a, _ = runs[1]
    assert decode_steps(r, 0, len(r.trace.events) + 1) == decode_steps(r, a, len(r.trace.events) + 1) == 31
    fig = r.timeline()
    texts = [t for t, _ in text_boxes(fig)]
    assert "KV cache" in texts and "prefill" in texts and "decode" in texts
    assert "forward" not in texts  # a generating cell names only the phases it had


def test_live_status_during_generate():
    """What the live view reads while generate() runs: the phase, the decode step and the cache so far."""
    model = _llama()
    ids = torch.randint(1, 96, (B, P))
    seen = []

    texts = []

    class Watch(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            status = m.status()
            seen.append((status.phase, status.step, status.breakdown["kv_cache"], input_ids.shape[1]))
            texts.append((live_text(status, cell=3), live_html(status, cell=3)))
            return scores

    with vram_magic.measure() as m:
        out = _generate(model, ids, 5, logits_processor=transformers.LogitsProcessorList([Watch()]))
    del out
    # after the prompt's forward, then after each decode step: the cache holds the tokens fed so far
    assert [(p, s) for p, s, _, _ in seen] == [("prefill", 0), ("decode", 1), ("decode", 2), ("decode", 3),
                                              ("decode", 4)]
    assert [kv for _, _, kv, _ in seen] == [_kv(2, B, 2, t, 16) for _, _, _, t in seen]
    # what the live view draws of it: the step in its first line, the cache among the categories
    first, last = texts[0], texts[-1]
    assert " · prefill · " in first[0].splitlines()[0] and " · decode step 4 · " in last[0].splitlines()[0]
    assert "KV cache" in last[0].splitlines()[1] and "vram-kv_cache" in last[1]


def test_nested_blocks_keep_the_wrappers_until_the_outer_one_ends():
    model = _llama()
    ids = torch.randint(1, 96, (B, P))
    with vram_magic.measure() as outer:
        with vram_magic.measure() as inner:
            out = _generate(model, ids, 3)
        assert generation.is_wrapped(transformers.cache_utils.Cache, "update")
    assert not generation.is_wrapped(transformers.cache_utils.Cache, "update")
    expected = _kv(2, B, 2, P + 2, 16)
    assert inner.after["kv_cache"] == outer.after["kv_cache"] == expected == kv_cache_bytes(out)


def test_advice_when_the_cache_fills_the_budget():
    """A budget the cache fills: what to do about the cache; one byte short of the peak: the failing request is
    the cache's growth in a decode step."""
    model = _llama(heads=2, kv_heads=2, head_dim=64)
    ids = torch.randint(1, 96, (32, 4))  # a cache of 2.7 MiB: each suggestion saves more than 1 MiB
    with vram_magic.measure() as m:
        out = _generate(model, ids, 40)
    peak = m.peak.total
    assert m.peak["kv_cache"] >= 0.25 * peak
    del out
    with vram_magic.measure(budget=int(peak * 1.1)) as fits:
        out = _generate(model, ids, 40)
    del out
    kinds = {a.kind for a in fits.advice}
    assert {"kv-quantized", "kv-offloaded", "kv-context"} <= kinds
    quantized = next(a for a in fits.advice if a.kind == "kv-quantized")
    assert quantized.saving == fits.peak["kv_cache"] * 3 // 4
    assert 'cache_implementation="quantized"' in quantized.detail
    with pytest.raises(torch.OutOfMemoryError), vram_magic.measure(budget=peak - 1) as short:
        _generate(model, ids, 40)
    assert short.oom is not None and short.oom.phase in ("decode", "cache update")
    failing = next(a for a in short.advice if a.kind == "oom")
    assert "KV cache" in failing.detail


@pytest.mark.cuda
def test_generate_on_cuda_counts_the_cache_in_the_allocators_blocks():
    """On a GPU the same cache, each of its tensors in a caching-allocator block (sizes rounded up to 512 B)."""
    model = _llama().cuda()
    ids = torch.randint(1, 96, (B, P), device="cuda")
    with vram_magic.measure(device="cuda") as m:
        out = _generate(model, ids, N)
    per_tensor = B * 2 * (P + N - 1) * 16 * F32  # one layer's keys (or values): 7,424 B in a 7,680 B block
    assert m.after["kv_cache"] == 2 * 2 * (-(-per_tensor // 512) * 512)
    assert kv_cache_bytes(out) == 2 * 2 * per_tensor
    assert m.after["activations"] == 0 and m.peak["kv_cache"] >= m.after["kv_cache"]
