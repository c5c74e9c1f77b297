"""estimate(..., generate=N) against real generate() runs on the CPU: tiny transformers models built from configs
(no downloads) and a hand-written decoder, the profiler's peak of the real run beside the estimate's, the cache
the real run ends with beside the estimate's, both worked out by hand from the shapes."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.support import skip_module_without_transformers_5
from tests.support.generate_zoo import CASES, Case, TupleGPT, estimate_case, real_generate, real_tuple_generate

skip_module_without_transformers_5()

F32 = 4


@functools.cache
def real(name: str):
    """One real run per case for the whole module (each is seconds under the profiler)."""
    return real_generate(CASES[name])


@functools.cache
def estimated(name: str):
    return estimate_case(CASES[name])


def kv_by_hand(name: str) -> int:
    """The cache generate() ends with: ``2 × layers × rows × kv heads × tokens × head dim × bytes`` per layer type,
    tokens = prompt + new − 1 (sliding layers keep a window's worth: the last torch.cat's output, a view of
    window − 1 of it, and an 8-byte window tensor; a static layer's 8-byte length tensor)."""
    c = CASES[name]
    rows, tokens = c.batch * c.beams, c.prompt + c.new - 1
    per_token = {  # one layer, keys and values: rows × kv heads × head dim × 4 bytes × 2
        "Llama (GQA)": 2 * rows * 2 * 32 * F32, "Llama, static cache": 2 * rows * 2 * 32 * F32,
        "Llama, beam search × 3": 2 * rows * 2 * 32 * F32, "GPT-2 (MHA)": 2 * rows * 4 * 64 * F32,
        "Mistral (sliding window 64)": 2 * rows * 2 * 32 * F32, "Gemma-2 (hybrid, window 64)": 2 * rows * 2 * 32 * F32,
        "T5 (encoder-decoder)": 2 * rows * 4 * 64 * F32,
        "Llama MHA, long prompt (cache dominates)": 2 * rows * 8 * 32 * F32,
        "Llama MHA, long generation (peak at the last step)": 2 * rows * 8 * 64 * F32,
    }[name]
    if name.startswith("Mistral"):  # 4 sliding layers: a 64-token storage each, and the window tensor
        return 4 * 64 * per_token + 4 * 8
    if name.startswith("Gemma-2"):  # 2 sliding (64 tokens) + 2 full layers
        return 2 * 64 * per_token + 2 * tokens * per_token + 2 * 8
    if name.startswith("T5"):  # self-attention: the decoder's start token + new − 1; cross-attention: the prompt
        return 4 * (1 + c.new - 1) * per_token + 4 * c.prompt * per_token
    return 4 * tokens * per_token + (4 * 8 if "static" in name else 0)


@pytest.mark.parametrize("name", list(CASES))
def test_generate_estimate_matches_the_real_run(name):
    case = CASES[name]
    est, ref = estimated(name), real(name)
    gen = est.generation
    assert ref.kv_cache == kv_by_hand(name)
    assert abs(est.peak.total - ref.peak) <= 0.01 * ref.peak, (est.peak.total, ref.peak)
    above, real_above = est.peak.total - ref.base, ref.peak - ref.base
    assert abs(above - real_above) <= 0.05 * real_above, (above, real_above)
    assert abs(gen.kv_cache - ref.kv_cache) <= 0.02 * ref.kv_cache, (gen.kv_cache, ref.kv_cache)
    # at a prefill peak the cache holds what the layers run so far wrote (a sliding layer the whole prompt; T5's peak
    # is in its encoder, before any cache): its final size is the last step's (test below)
    assert est.peak["kv_cache"] <= est.peak.total
    assert gen.new_tokens == case.new and gen.prompt == case.prompt and gen.batch == case.batch
    assert gen.beams == case.beams
    assert "generate() cannot run on fake tensors" in est.notes[0]


def test_peak_at_the_last_step_holds_the_whole_cache():
    """Where the last decoding step is the peak, the cache at the peak is the cache the real run ends with (one
    layer's value tensor is still the one-token-shorter copy torch.cat replaces)."""
    name = "Llama MHA, long generation (peak at the last step)"
    est, ref = estimated(name), real(name)
    assert est.generation.peak_step == CASES[name].new - 1
    assert abs(est.peak["kv_cache"] - ref.kv_cache) <= 0.02 * ref.kv_cache
    one_token_of_one_tensor = CASES[name].batch * 8 * 64 * F32
    assert est.peak["kv_cache"] == ref.kv_cache - one_token_of_one_tensor
    growth = est.peak.details("other")
    assert any("KV-cache growth" in label for label in growth)


def t5_three_layers():
    import transformers as t

    return t.T5ForConditionalGeneration(t.T5Config(num_layers=3, num_decoder_layers=3, d_model=256, d_ff=512,
                                                   num_heads=4, d_kv=64, vocab_size=8000, decoder_start_token_id=0,
                                                   pad_token_id=0, eos_token_id=1))


def test_encoder_decoder_whose_peak_is_in_its_encoder():
    """T5's peak is in its encoder, whose embeddings stay alive through every block (T5Stack keeps inputs_embeds while
    hidden_states is its eval-mode dropout: the same tensor). PyTorch's Python decomposition of dropout, which a
    dispatch mode runs under inference_mode, returns a clone instead: 2 × 256 × 256 × 4 = 524,288 B too many over
    the whole encoder, +8.6 % of the peak above weights and inputs."""
    case = Case("T5, 3 layers, 256-token prompt", t5_three_layers, 2, 256, 32)
    est, ref = estimate_case(case), real_generate(case)
    per_token = 2 * 2 * 4 * 64 * F32  # one layer's keys and values, 2 rows × 4 heads × 64 dims
    assert ref.kv_cache == 3 * (1 + 31) * per_token + 3 * 256 * per_token  # self-attention + cross-attention
    assert est.generation.kv_cache == ref.kv_cache
    assert est.generation.peak_step == 0 and est.generation.encoder_length == 256
    above, real_above = est.peak.total - ref.base, ref.peak - ref.base
    # what is left: the CPU flash-attention kernel's own buffer (threads × 82,432 B here), not modelled, as for the
    # decoders
    flash_buffer = torch.get_num_threads() * (64 * 256 + 64 + 64 + 64 * 64) * F32
    assert 0 <= real_above - above <= flash_buffer + 0.001 * real_above, (above, real_above)


def test_cache_bytes_per_token():
    case = CASES["Llama (GQA)"]
    gen = estimated("Llama (GQA)").generation
    per_layer = 2 * 2 * 32 * F32  # keys and values, 2 kv heads × 32 dims × fp32, per sequence
    assert gen.kv_per_token_per_sequence == 4 * per_layer
    assert gen.kv_per_token == case.batch * 4 * per_layer
    assert gen.kv_cache == gen.kv_per_token * (case.prompt + case.new - 1)
    assert gen.layers == "4 × DynamicLayer" and gen.cache == "DynamicCache"
    assert gen.logits_to_keep is True


def test_sliding_layers_stop_growing():
    gen = estimated("Gemma-2 (hybrid, window 64)").generation
    per_layer = 2 * 2 * 2 * 32 * F32
    assert gen.kv_per_token == 2 * per_layer  # the two full-attention layers
    assert gen.kv_fixed == 2 * 64 * per_layer  # the two sliding layers: their window (keys and values)
    assert "DynamicSlidingWindowLayer" in gen.layers


def test_hand_written_decoder_with_a_tuple_cache():
    torch.manual_seed(0)
    model = TupleGPT().eval()
    ids = torch.randint(0, 2000, (2, 64), generator=torch.Generator().manual_seed(0))
    import vram_magic

    est = vram_magic.estimate(model, ids, generate=16, device="cpu")
    real = real_tuple_generate(2, 64, 16)
    assert abs(est.peak.total - real.peak) <= 0.01 * real.peak, (est.peak.total, real.peak)
    kv = 4 * 2 * 2 * 4 * (64 + 16 - 1) * 64 * F32  # layers × (k, v) × batch × heads × tokens × head dim × fp32
    assert real.kv_cache == kv
    assert est.generation.kv_cache == kv
    assert est.generation.kind == "hand-written"
    assert est.generation.kv_per_token == kv // (64 + 16 - 1)
    assert "hand-written decoder" in est.notes[0]


def test_one_new_token_is_the_prefill_alone():
    case = CASES["Llama (GQA)"]
    import vram_magic

    est = vram_magic.estimate(case.build().eval(), case.ids(), generate=1, device="cpu")
    assert est.generation.steps_run == (0,)
    assert est.generation.kv_cache == case.batch * 4 * 2 * 2 * 32 * F32 * case.prompt


@pytest.mark.cuda
def test_generate_estimate_on_a_gpu():
    """On a GPU: the real generate()'s max_memory_allocated above what was allocated before it, beside the
    estimate's peak (device='cuda', the GPU named)."""
    import vram_magic

    case = CASES["Llama MHA, long generation (peak at the last step)"]
    major, minor = torch.cuda.get_device_capability()
    from vram_magic.estimator.device.gpus import GPU

    gpu = GPU("this GPU", torch.cuda.get_device_properties(0).total_memory, "", capability=(major, minor))
    est = vram_magic.estimate(case.build().eval(), case.ids(), generate=case.new, device="cuda", gpu=gpu)
    model = case.build().eval().cuda()
    ids = case.ids().cuda()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model.generate(ids, max_new_tokens=case.new, min_new_tokens=case.new, do_sample=False)
    peak = torch.cuda.max_memory_allocated()
    assert before > 0
    assert abs(est.peak.total - peak) <= 0.05 * peak, (est.peak.total, peak)


@pytest.mark.cuda
def test_what_a_gpu_needs_is_enough_for_the_real_call():
    """The real generate() with PyTorch's allocator limited (a memory fraction; the CUDA context is outside it) to
    what the estimate says the allocator needs, + 5 % and a 20 MiB segment, runs through; limited to the live
    blocks the estimate saw at that peak, less 5 %, it runs out."""
    import vram_magic
    from vram_magic.estimator.device.gpus import GPU

    case = CASES["Llama MHA, long generation (peak at the last step)"]
    props = torch.cuda.get_device_properties(0)
    gpu = GPU("this GPU", props.total_memory, "", 0.0, capability=torch.cuda.get_device_capability())
    est = vram_magic.estimate(case.build().eval(), case.ids(), generate=case.new, device="cuda", gpu=gpu)
    needs = est.needed - est.context
    model, ids = case.build().eval().cuda(), case.ids().cuda()

    def runs(limit: int) -> bool:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(limit / props.total_memory)
        try:
            model.generate(ids, max_new_tokens=case.new, min_new_tokens=case.new, do_sample=False)
            return True
        except torch.OutOfMemoryError:
            return False
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)

    assert runs(int(needs * 1.05) + (20 << 20)), (est.needed, est.generation.in_use, est.generation.stranded)
    assert not runs(int(est.generation.in_use * 0.95))


def test_left_padded_prompts():
    """A padding mask (the first prompt left-padded by 32 tokens): generate() keeps it, the model builds a 4-D
    mask, SDPA takes it (on CUDA memory-efficient attention instead of flash)."""
    import warnings

    from torch.profiler import ProfilerActivity, profile

    import vram_magic
    from tests.support.generate_zoo import llama
    from tests.support.zoo import profiled_cpu_peak, storage_bytes

    torch.manual_seed(0)
    model = llama().eval()
    ids = torch.randint(3, 8000, (2, 128), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 128, dtype=torch.long)
    ids[0, :32], mask[0, :32] = 0, 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    est = vram_magic.estimate(model, inputs, generate=16, device="cpu")
    base = storage_bytes(*model.parameters(), *model.buffers(), ids, mask)
    with warnings.catch_warnings(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        warnings.simplefilter("ignore")
        model.generate(**inputs, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    real = base + profiled_cpu_peak(prof)
    assert abs(est.peak.total - real) <= 0.01 * real, (est.peak.total, real)
    padded = vram_magic.estimate(model, inputs, generate=16, device="cuda", gpu="A100-80GB", dtype="bf16")
    plain = vram_magic.estimate(model, ids, generate=16, device="cuda", gpu="A100-80GB", dtype="bf16")
    assert dict(padded.generation.sdpa) == {"efficient": 8}  # 4 layers, prefill and last step
    assert dict(plain.generation.sdpa) == {"flash": 8}
