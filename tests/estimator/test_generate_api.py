"""estimate(..., generate=N) beyond the real-run comparisons: bad input, the longest prompt and the largest batch,
the what-ifs, the caches modelled (quantized, offloaded), CUDA's attention kernels and the %vram_estimate flags."""

from __future__ import annotations

import math

import pytest
import torch

import vram_magic
from tests.support import run, skip_module_without_transformers_5
from tests.support.generate_zoo import CASES, TupleGPT, llama
from vram_magic.estimator.device.sdpa import sdpa_kernel

skip_module_without_transformers_5()

F32 = 4
LONG = "Llama MHA, long generation (peak at the last step)"


def small_llama():
    torch.manual_seed(0)
    return llama().eval()


def ids(batch: int = 2, prompt: int = 64, vocab: int = 8000) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, prompt), generator=torch.Generator().manual_seed(0))


# --- bad input ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "8"])
def test_generate_must_be_a_positive_whole_number(bad):
    with pytest.raises(ValueError, match="number of new tokens, a whole number ≥ 1"):
        vram_magic.estimate(small_llama(), ids(), generate=bad, device="cpu")


def test_unknown_cache_lists_the_known_ones():
    from transformers.generation.configuration_utils import ALL_CACHE_IMPLEMENTATIONS

    with pytest.raises(ValueError) as err:
        vram_magic.estimate(small_llama(), ids(), generate=4, cache_implementation="paged-ish", device="cpu")
    text = str(err.value)
    assert "unknown cache implementation 'paged-ish'" in text
    for name in ALL_CACHE_IMPLEMENTATIONS:
        assert name in text


def test_encoder_only_model_cannot_generate():
    from tests.support.zoo import hf_bert

    with pytest.raises(ValueError, match="BertForMaskedLM is an encoder-only model"):
        vram_magic.estimate(hf_bert(), ids(vocab=8000), generate=4, device="cpu")


def test_a_model_without_generate_or_cache_says_what_is_needed():
    model = torch.nn.Sequential(torch.nn.Embedding(100, 16), torch.nn.Linear(16, 100))
    with pytest.raises(ValueError, match="has no generate\\(\\) and its forward takes no cache.*past_key_values"):
        vram_magic.estimate(model, ids(vocab=100), generate=4, device="cpu")


def test_search_needs_a_capacity_and_training_options_are_refused():
    with pytest.raises(ValueError, match="need a capacity: give gpu="):
        vram_magic.estimate(small_llama(), ids(), generate=4, max_seq=True, device="cpu")
    with pytest.raises(ValueError, match="checkpointing applies to training"):
        vram_magic.estimate(small_llama(), ids(), generate=4, checkpointing=True)
    with pytest.raises(ValueError, match="apply to generate=N"):
        vram_magic.estimate(small_llama(), ids(), num_beams=2)
    with pytest.raises(ValueError, match="num_beams must be a whole number"):
        vram_magic.estimate(small_llama(), ids(), generate=4, num_beams=0)


def test_random_ids_made_on_fake_tensors_are_an_unpadded_prompt():
    """An inputs expression of random ids has no values on fake tensors; generate() reads them (a pad token in
    the prompt, negative ids): they stand in as one ordinary token, an unpadded prompt."""
    est = vram_magic.estimate(small_llama(), lambda: torch.randint(0, 8000, (2, 64)), generate=4, device="cpu")
    assert not est.partial
    assert est.generation.kv_cache == 2 * 4 * 2 * 2 * (64 + 4 - 1) * 32 * F32


def test_offloading_needs_a_gpu():
    with pytest.raises(ValueError, match="needs device='cuda'"):
        vram_magic.estimate(small_llama(), ids(), generate=4, cache_implementation="offloaded", device="cpu")


def test_magic_flags_and_their_errors(shell):
    run(shell, "import torch\nfrom tests.support import generate_zoo\nmodel = generate_zoo.llama().eval()\n"
               "ids = torch.randint(3, 8000, (2, 64))")
    for line, words in [("--generate 0", "whole number ≥ 1"), ("--generate 4 --cache bogus", "the installed "
                        "transformers knows: static"), ("--generate 4 --max-seq", "need a capacity")]:
        result = run(shell, f"%vram_estimate model --input ids {line} --device cpu")
        assert result.error_in_exec is not None and words in str(result.error_in_exec)
    result = run(shell, "%vram_estimate model --input ids --generate 6 --beams 2 --batch 3 --device cpu -q -o est")
    assert result.error_in_exec is None
    est = shell.user_ns["est"]
    assert (est.generation.batch, est.generation.beams, est.generation.new_tokens) == (3, 2, 6)
    assert est.generation.kv_cache == 3 * 2 * 4 * 2 * 2 * (64 + 6 - 1) * 32 * F32
    assert run(shell, "x = 1 + 1").error_in_exec is None  # the kernel is alive


# --- builders ---------------------------------------------------------------------------------------------------
def _tied(kind: str):
    import transformers as t

    t.logging.set_verbosity_error()
    if kind == "GPT-2":
        return t.GPT2LMHeadModel(t.GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=1000, n_positions=64))
    if kind == "Llama":
        return t.LlamaForCausalLM(t.LlamaConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=128,
                                                num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                                max_position_embeddings=64, tie_word_embeddings=True))
    return t.GPTBigCodeForCausalLM(t.GPTBigCodeConfig(n_layer=1, n_embd=64, n_head=4, vocab_size=1000,
                                                      n_positions=64))


#: parameters by hand, the output head tied to the 1,000 × 64 token embedding (64,000 counted once)
TIED = {
    # wte 64,000, wpe 64 × 64; a block: 2 layer norms 256, c_attn 64 × 192 + 192, c_proj 64 × 64 + 64, c_fc
    # 64 × 256 + 256, c_proj 256 × 64 + 64; ln_f 128
    "GPT-2": 64_000 + 4_096 + (256 + 12_480 + 4_160 + 16_640 + 16_448) + 128,
    # embed 64,000; q and o 64 × 64, k and v 64 × 32 (2 kv heads × 16); gate, up, down 64 × 128; 3 RMS norms of 64
    "Llama": 64_000 + 2 * 4_096 + 2 * 2_048 + 3 * 8_192 + 3 * 64,
    # multi-query: c_attn 64 → 64 + 2 × 16; otherwise GPT-2's block
    "GPT-BigCode": 64_000 + 4_096 + (256 + 64 * 96 + 96 + 4_160 + 16_640 + 16_448) + 128,
}


@pytest.mark.parametrize("kind", list(TIED))
def test_a_builder_keeps_tied_embeddings_tied(kind):
    """A builder runs under transformers' no_init_weights, which in transformers 5 skips init_weights and with it
    tie_weights: the output head then counted apart from the embedding it is tied to."""
    x = ids(1, 16, vocab=1000)
    built = vram_magic.estimate(lambda: _tied(kind), x, generate=2, device="cpu")
    module = vram_magic.estimate(_tied(kind), x, generate=2, device="cpu")
    assert built.parameters == module.parameters == TIED[kind]
    assert built.peak["parameters"] == module.peak["parameters"] == F32 * TIED[kind]
    if kind == "GPT-2":  # a builder that unties the head after construction keeps it untied

        def untied():
            m = _tied(kind)
            m.lm_head.weight = torch.nn.Parameter(m.lm_head.weight.detach().clone())
            return m

        assert vram_magic.estimate(untied, x, generate=2, device="cpu").parameters == TIED[kind] + 64_000


# --- the longest prompt, the largest batch ------------------------------------------------------------------
def test_longest_prompt_and_largest_batch_are_self_consistent():
    from vram_magic.estimator.generate.workload import GenerateWorkload

    model = small_llama()  # estimates hold the model weakly: keep it for the re-runs below
    est = vram_magic.estimate(model, ids(), generate=8, device="cpu", budget="40MiB", max_seq=True, max_batch=True)
    request, target = est.rerun.request, est.rerun.target

    def fits(**size: int) -> bool:  # each a workload of its own: traced anew, nothing kept from the search
        return bool(GenerateWorkload(request, target).evaluate(est.options.with_(**size)).fits)

    assert est.max_prompt and est.max_batch
    assert fits(seq=est.max_prompt) and not fits(seq=math.ceil(est.max_prompt * 1.1))
    assert fits(batch=est.max_batch) and not fits(batch=math.ceil(est.max_batch * 1.1))
    assert f"longest prompt that fits with 8 new tokens: {est.max_prompt}" in str(est)


# --- what-ifs --------------------------------------------------------------------------------------------------
def test_what_ifs_for_generation():
    est = vram_magic.estimate(small_llama(), ids(), generate=8, device="cuda", gpu="T4", what_if=True)
    rows = {r.name: r for r in est.strategies}
    base = est.strategies[0]
    assert base.name.startswith("baseline: generate 8 tokens")
    for name in ("bf16 weights", "int8 weights", "nf4 weights", "static cache", "quantized cache (int4)",
                 "quantized cache (int2)", "offloaded cache", "half the prompt", "half the batch"):
        assert name in rows and rows[name].note, name
    weights = est.peak["parameters"]
    assert rows["bf16 weights"].peak <= base.peak - weights // 2 + 512 * 64  # half the fp32 weights (blocks rounded)
    assert rows["half the batch"].steps == 2
    assert rows["half the prompt"].compute < 1.0
    frame = est.what_if()
    assert "saving" in frame.columns and len(frame) == len(est.strategies)


def test_logits_to_keep_what_if_for_a_model_that_computes_all_logits():
    model = TupleGPT().eval()
    x = ids(2, 64, vocab=2000)
    est = vram_magic.estimate(model, x, generate=8, device="cpu", what_if=True)
    rows = {r.name: r for r in est.strategies}
    assert est.generation.logits_to_keep is None  # not a transformers model
    keep = rows["logits_to_keep=1"]
    all_logits = 2 * 64 * 2000 * F32  # the prefill's logits, alive into the first step
    assert base_saving(est, keep) >= 0.75 * all_logits  # the peak moves elsewhere once they are gone
    assert keep.compute < 1.0


def test_reruns_keep_the_quantized_cache_bits_and_logits_to_keep():
    """A re-run with an estimate's options is the estimate's own: a quantized cache's bits and the logits_to_keep
    what-if are options like any other, and its what-ifs do not offer them again."""
    from vram_magic.estimator import follow_ups
    from vram_magic.estimator.generate.workload import GenerateWorkload

    def offered(est) -> set[str]:  # the what-if rows the estimate's table would re-run
        return {c.name for c in est.rerunnable().candidates(est)}

    model, x = small_llama(), ids(2, 64)
    est4 = vram_magic.estimate(model, x, generate=8, device="cpu", cache_implementation="quantized", budget="40MiB")
    assert "quantized cache (int2)" in offered(est4) and "quantized cache (int4)" not in offered(est4)
    est2 = est4.rerunnable().evaluate(est4.options.with_(cache_bits=2))  # the int2 row, as an estimate
    assert est2.options.cache_bits == 2 and est2.generation.cache_bits == 2
    assert "(int2)" in est2.description and "(int4)" in est4.description
    # by hand, per layer and tensor: 2 rows × 2 kv heads × 64 prompt tokens × 32 dims quantized at the prefill,
    # packed with an fp32 scale and shift per 64 values; the 7 decoding steps' tokens in the full-precision residual
    values = 2 * 2 * 64 * 32
    residual = 2 * 2 * 7 * 32 * F32
    assert est4.generation.kv_cache == 4 * 2 * (values // 2 + 2 * (values // 64) * F32 + residual)
    assert est2.generation.kv_cache == 4 * 2 * (values // 4 + 2 * (values // 64) * F32 + residual)
    request, target = est2.rerun.request, est2.rerun.target
    again = GenerateWorkload(request, target).evaluate(est2.options)
    assert again.generation.kv_cache == est2.generation.kv_cache and again.peak.total == est2.peak.total
    assert not any(name.startswith("quantized cache") for name in offered(est2))
    # the longest prompt of the int2 estimate, checked by estimates traced anew with its options
    found = follow_ups(est2, max_seq=True)

    def fits(seq: int) -> bool:
        return bool(GenerateWorkload(request, target).evaluate(est2.options.with_(seq=seq)).fits)

    assert found.max_prompt and fits(found.max_prompt) and not fits(math.ceil(found.max_prompt * 1.1))
    # the logits_to_keep what-if of a decoder that computes every position's logits
    tuple_model = TupleGPT().eval()
    full = vram_magic.estimate(tuple_model, ids(2, 64, vocab=2000), generate=8, device="cpu")
    keep = full.rerunnable().evaluate(full.options.with_(last_logits_only=True))
    assert keep.options.last_logits_only and keep.generation.last_logits_only
    assert "logits_to_keep=1" in keep.description
    assert "logits_to_keep=1" in offered(full) and "logits_to_keep=1" not in offered(keep)


def base_saving(est, row) -> int:
    return est.strategies[0].needed - row.needed


# --- caches modelled ----------------------------------------------------------------------------------------------
def test_quantized_cache_keeps_packed_bits_and_a_full_precision_residual():
    case = CASES[LONG]
    model = case.build().eval()
    est = vram_magic.estimate(model, case.ids(), generate=case.new, device="cpu", cache_implementation="quantized")
    rows, heads, dim, layers = case.batch, 8, 64, 4
    quantized = rows * heads * case.prompt * dim  # the prompt, quantized at the prefill
    packed = quantized // 2 + 2 * (quantized // 64) * F32  # int4 data, a scale and a shift per 64 values
    residual = rows * heads * (case.new - 1) * dim * F32  # decoding steps < 128: all in the residual
    assert est.generation.kv_cache == layers * 2 * (packed + residual)
    dynamic = vram_magic.estimate(model, case.ids(), generate=case.new, device="cpu")
    assert est.generation.kv_cache < dynamic.generation.kv_cache
    assert "QuantizedLayer" in est.generation.layers or "Modelled" in est.generation.layers


def test_offloaded_cache_on_a_gpu_keeps_two_layers_on_it():
    case = CASES[LONG]
    model = case.build().eval()
    off = vram_magic.estimate(model, case.ids(), generate=case.new, device="cuda", cache_implementation="offloaded")
    dyn = vram_magic.estimate(model, case.ids(), generate=case.new, device="cuda")
    assert off.generation.kv_cache == dyn.generation.kv_cache  # host and device together
    assert off.peak["kv_cache"] <= 0.6 * dyn.peak["kv_cache"]  # the layer in use and the one prefetched, of 4
    assert "offloaded" in off.generation.cache
    # transformers' prefetch stream was a stand-in: no CUDA context started (a CUDA build without a driver refused
    # the real one), and torch.Stream is torch's own again
    assert not torch.cuda.is_initialized()
    assert torch.Stream.__module__.startswith("torch") and torch.cuda.Stream.__module__.startswith("torch")


# --- CUDA: attention kernels, the allocator ------------------------------------------------------------------
def _qkv(dtype, heads=8, kv_heads=8, q=64, kv=64, dim=64):
    q_ = torch.empty(2, heads, q, dim, dtype=dtype, device="meta")
    k = torch.empty(2, kv_heads, kv, dim, dtype=dtype, device="meta")
    return q_, k, k


def test_sdpa_kernel_choice_follows_pytorch():
    mask = torch.empty(2, 1, 64, 64, dtype=torch.bool, device="meta")
    assert sdpa_kernel(*_qkv(torch.bfloat16), None, False, (8, 0)) == "flash"
    assert sdpa_kernel(*_qkv(torch.bfloat16), mask, False, (8, 0)) == "efficient"  # a padding mask
    assert sdpa_kernel(*_qkv(torch.float32), None, False, (8, 0)) == "efficient"  # flash is half precision only
    assert sdpa_kernel(*_qkv(torch.float16), None, False, (7, 5)) == "efficient"  # T4: no flash
    assert sdpa_kernel(*_qkv(torch.float16, kv_heads=2), None, True, (8, 0)) == "flash"  # GQA with flash
    assert sdpa_kernel(*_qkv(torch.float16, kv_heads=2), None, True, (7, 5)) == "math"  # T4 + GQA
    assert sdpa_kernel(*_qkv(torch.bfloat16), None, False, (7, 5)) == "math"  # bf16 before 8.0
    assert sdpa_kernel(*_qkv(torch.float16, dim=320), None, False, (8, 0)) == "efficient"  # head dim > 256


def test_t4_runs_grouped_query_prefill_on_the_math_kernel():
    model, x = small_llama(), ids(2, 256)
    t4 = vram_magic.estimate(model, x, generate=4, device="cuda", gpu="T4", dtype="fp16")
    a100 = vram_magic.estimate(model, x, generate=4, device="cuda", gpu="A100-80GB", dtype="fp16")
    assert dict(t4.generation.sdpa).get("math", 0) > 0 and "math" not in dict(a100.generation.sdpa)
    assert dict(a100.generation.sdpa).get("flash", 0) > 0
    scores = 2 * 8 * 256 * 256 * 2  # batch × heads × prompt × prompt, fp16
    assert t4.peak.total - a100.peak.total >= scores
    assert any("math kernel materializes" in n for n in t4.notes)


def test_cuda_estimate_replays_the_growing_cache_through_the_allocator():
    case = CASES[LONG]
    est = vram_magic.estimate(case.build().eval(), case.ids(), generate=case.new, device="cuda", gpu="A100-80GB")
    gen = est.generation
    assert gen.reserved_growth is not None and gen.reserved_growth >= 0
    assert est.reserved >= est.peak.total
    assert est.needed == est.reserved + est.context
    assert any("replayed over all" in n for n in est.notes)
    assert "reserved above allocated" in str(est)


GIB, MIB = 1 << 30, 1 << 20


def _prefill_like(medium_block_first: bool):
    """Two layers of a prefill on the math kernel, as the allocator sees them: the scores (2 GiB) and their softmax
    (2 GiB), the scores freed, a 256 MiB tensor made while the softmax is alive, then the next layer's scores and
    softmax. ``medium_block_first``: a freed 300 MiB block (an MLP intermediate) lies in the cache beforehand."""
    from vram_magic.estimator.generate.cuda import PinnedAllocator

    a = PinnedAllocator()
    if medium_block_first:
        a.free(a.malloc(300 * MIB, "mlp"))
    scores, softmax = a.malloc(2 * GIB, "scores 0"), a.malloc(2 * GIB, "softmax 0")
    a.free(scores)
    mask = a.malloc(256 * MIB, "mask 1")  # best fit: the smallest free block of at least 256 MiB, split
    a.free(softmax)
    a.malloc(2 * GIB, "scores 1")
    a.malloc(2 * GIB, "softmax 1")
    return a, mask


def test_a_freed_block_split_for_a_smaller_tensor_is_needed_whole():
    """PyTorch's allocator serves a request from the smallest free block large enough, splitting it (remainder
    > 1 MiB), and gives a segment back to the device only when nothing in it is in use. With no smaller free
    block, the 256 MiB tensor splits the freed scores' 2 GiB segment; the next layer's softmax then needs a third
    2 GiB segment, and 1.75 GiB stay free inside the first: what a GPU needs is 6 GiB, not the 4.25 GiB in use."""
    a, _mask = _prefill_like(medium_block_first=False)
    assert (a.peak_reserved, a.peak_pinned, a.in_use) == (6 * GIB, 6 * GIB, 4 * GIB + 256 * MIB)
    (top,) = a.stranded
    assert (top.segment, top.free, top.made_for, top.holders) == (2 * GIB, 2 * GIB - 256 * MIB, "scores 0",
                                                                  (("mask 1", 256 * MIB),))
    # a 300 MiB block freed beforehand takes the tensor instead (44 MiB left free in it): two 2 GiB segments do
    b, _ = _prefill_like(medium_block_first=True)
    assert (b.peak_pinned, b.in_use) == (4 * GIB + 300 * MIB, 4 * GIB + 256 * MIB)
    assert b.stranded[0].made_for == "mlp" and b.stranded[0].free == 44 * MIB


def test_what_a_gpu_needs_for_generation_says_what_is_stranded():
    """A grouped-query Llama on a T4 (the math kernel: 8 heads × 8,192² fp32 scores, 2 GiB a layer) with an
    8,192-token prompt: with the dynamic cache, layer 3's 256 MiB causal mask (8,192² fp32) lands in a freed
    scores block, whose segment stays, and the next scores get a segment of their own; the quantized cache's
    smaller tensors leave a free block for it. Needs differ by more than a GiB for that, and the estimate says so."""
    import transformers as t

    config = t.LlamaConfig(num_hidden_layers=4, hidden_size=1024, intermediate_size=3584, num_attention_heads=8,
                           num_key_value_heads=2, vocab_size=32000, max_position_embeddings=16384)
    x = torch.randint(0, 32000, (1, 8192), generator=torch.Generator().manual_seed(0))
    est = vram_magic.estimate(lambda: t.LlamaForCausalLM(config), x, generate=8, dtype="fp16", gpu="T4")
    quantized = est.rerunnable().evaluate(est.options.with_(cache_implementation="quantized"))
    for e in (est, quantized):
        g = e.generation
        assert e.needed == g.in_use + g.stranded + e.context  # segments holding live blocks at their peak
    assert est.needed - quantized.needed > GIB
    gen = est.generation
    assert gen.stranded > GIB
    assert gen.stranded_by.startswith(f"{vram_magic.format_bytes(2 * GIB - 256 * MIB)} of it in a 2.00 GiB segment "
                                      "made for model.layers.0.self_attn's prefill activations, which "
                                      "model.layers.3.self_attn's prefill activations (256 MiB) keeps")
    assert any(gen.stranded_by in n for n in est.notes)
    from vram_magic.estimator.generate.candidates import stranded_note

    assert stranded_note(gen).startswith(f"; needs {vram_magic.format_bytes(gen.stranded)} free inside segments")
    # blocks of 512 MiB or more kept whole (max_split_size_mb, which the note suggests): nothing strands a GiB
    replay = next(n for n in est.notes if "caching allocator replayed" in n)
    assert "max_split_size_mb:512 keeps blocks of 512 MiB or more from being split" in replay
    kept = vram_magic.estimate(lambda: t.LlamaForCausalLM(config), x, generate=8, dtype="fp16", gpu="T4",
                               alloc_conf="max_split_size_mb:512")
    assert kept.generation.stranded < 100 * MIB and not kept.generation.stranded_by
    assert abs(kept.needed - quantized.needed) < GIB // 10
    assert not any("not modelled for generate()" in n for n in kept.notes)
