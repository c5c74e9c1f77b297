"""Reference runs of ``model.generate()`` on the CPU for the generation estimates: tiny models built from
configs (no downloads), each case a prompt and a number of new tokens, and the real run's peak under the
profiler (every allocation, kernel scratch included), the bytes it starts from, and the cache it ends with."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tests.support.zoo import profiled_cpu_peak, storage_bytes


def _t():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def llama(layers: int = 4, hidden: int = 256, heads: int = 8, kv_heads: int = 2, inter: int = 688,
          vocab: int = 8000) -> nn.Module:
    t = _t()
    return t.LlamaForCausalLM(t.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=inter,
                                            num_attention_heads=heads, num_key_value_heads=kv_heads,
                                            vocab_size=vocab, max_position_embeddings=4096))


def mistral(window: int = 64) -> nn.Module:
    t = _t()
    return t.MistralForCausalLM(t.MistralConfig(num_hidden_layers=4, hidden_size=256, intermediate_size=688,
                                                num_attention_heads=8, num_key_value_heads=2, vocab_size=8000,
                                                max_position_embeddings=4096, sliding_window=window))


def gemma2(window: int = 64) -> nn.Module:
    t = _t()
    return t.Gemma2ForCausalLM(t.Gemma2Config(num_hidden_layers=4, hidden_size=256, intermediate_size=688,
                                              num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                                              vocab_size=8000, max_position_embeddings=4096, sliding_window=window))


def gpt2() -> nn.Module:
    t = _t()
    return t.GPT2LMHeadModel(t.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8000, n_positions=1024))


def t5() -> nn.Module:
    t = _t()
    return t.T5ForConditionalGeneration(t.T5Config(num_layers=4, num_decoder_layers=4, d_model=256, d_ff=1024,
                                                   num_heads=4, d_kv=64, vocab_size=8000, decoder_start_token_id=0,
                                                   pad_token_id=0, eos_token_id=1))


class TupleAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None) -> Any:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=past is None)
        return self.out(y.transpose(1, 2).reshape(b, t, d)), (k, v)


class TupleGPT(nn.Module):
    """A hand-written decoder: ``forward(input_ids, past_key_values=None) -> (logits, past_key_values)``, the cache
    a tuple of ``(key, value)`` per layer, grown by ``torch.cat``."""

    def __init__(self, vocab: int = 2000, d: int = 256, layers: int = 4, heads: int = 4, context: int = 1024) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.attn = nn.ModuleList(TupleAttention(d, heads) for _ in range(layers))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                                 for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, past_key_values: Any = None) -> Any:
        start = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        positions = torch.arange(start, start + input_ids.shape[1])
        x = self.emb(input_ids) + self.pos(positions)
        presents = []
        for i, (attn, mlp) in enumerate(zip(self.attn, self.mlp)):
            a, kv = attn(x, past_key_values[i] if past_key_values is not None else None)
            x = x + a
            x = x + mlp(x)
            presents.append(kv)
        return self.head(self.norm(x)), tuple(presents)


def tuple_generate(model: nn.Module, ids: torch.Tensor, new: int) -> tuple[torch.Tensor, Any]:
    """The greedy loop the estimate models for a hand-written decoder (see vram_magic/estimator/generate/manual.py)."""
    logits, past = model(ids, past_key_values=None)
    for step in range(new):
        token = logits[:, -1, :].argmax(dim=-1, keepdim=True)
        ids = torch.cat([ids, token], dim=-1)
        if step == new - 1:
            break
        logits, past = model(token, past_key_values=past)
    return ids, past


def real_tuple_generate(batch: int = 2, prompt: int = 64, new: int = 16) -> Reference:
    from torch.profiler import ProfilerActivity, profile

    from vram_magic.engine.hooks.kv_cache import kv_cache_bytes

    torch.manual_seed(0)
    model = TupleGPT().eval()
    ids = torch.randint(0, 2000, (batch, prompt), generator=torch.Generator().manual_seed(0))
    base = storage_bytes(*model.parameters(), *model.buffers(), ids)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _, past = tuple_generate(model, ids, new)
    return Reference(base + profiled_cpu_peak(prof), base, kv_cache_bytes(past, "past_key_values"))


@dataclass(frozen=True)
class Case:
    """One generate() call: the model, batch × prompt, new tokens and generate()'s own options."""

    name: str
    build: Callable[[], nn.Module]
    batch: int
    prompt: int
    new: int
    kwargs: dict[str, Any] = field(default_factory=dict)
    vocab: int = 8000

    def ids(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(0)
        return torch.randint(3, self.vocab, (self.batch, self.prompt), generator=g)

    @property
    def beams(self) -> int:
        return int(self.kwargs.get("num_beams", 1))


CASES: dict[str, Case] = {c.name: c for c in (
    Case("Llama (GQA)", llama, 2, 128, 16),
    Case("Mistral (sliding window 64)", mistral, 2, 128, 16),
    Case("Gemma-2 (hybrid, window 64)", gemma2, 2, 128, 16),
    Case("GPT-2 (MHA)", gpt2, 2, 128, 16),
    Case("T5 (encoder-decoder)", t5, 2, 128, 16),
    Case("Llama, static cache", llama, 2, 128, 16, {"cache_implementation": "static"}),
    Case("Llama, beam search × 3", llama, 2, 128, 16, {"num_beams": 3}),
    Case("Llama MHA, long prompt (cache dominates)", lambda: llama(layers=4, hidden=256, heads=8, kv_heads=8,
                                                                 inter=256, vocab=512), 4, 1024, 8, vocab=512),
    Case("Llama MHA, long generation (peak at the last step)", lambda: llama(layers=4, hidden=512, heads=8,
                                                                           kv_heads=8, inter=256, vocab=512),
         8, 32, 32, vocab=512),
)}


@dataclass(frozen=True)
class Reference:
    """A real generate() run: ``peak`` (bytes: what was alive before it plus the profiler's highest rise),
    ``base`` (weights, buffers and inputs), ``kv_cache`` (the cache it returned: distinct storages)."""

    peak: int
    base: int
    kv_cache: int


def real_generate(case: Case) -> Reference:
    from torch.profiler import ProfilerActivity, profile

    from vram_magic.engine.hooks.kv_cache import kv_cache_bytes

    torch.manual_seed(0)
    model = case.build().eval()
    ids = case.ids()
    base = storage_bytes(*model.parameters(), *model.buffers(), ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = model.generate(ids, max_new_tokens=case.new, min_new_tokens=case.new, do_sample=False,
                                 return_dict_in_generate=True, **case.kwargs)
    kv = kv_cache_bytes(out)
    return Reference(base + profiled_cpu_peak(prof), base, kv)


def estimate_case(case: Case, **kwargs: Any) -> Any:
    import vram_magic

    torch.manual_seed(0)
    model = case.build().eval()
    return vram_magic.estimate(model, case.ids(), generate=case.new, device=kwargs.pop("device", "cpu"),
                               cache_implementation=case.kwargs.get("cache_implementation"),
                               num_beams=case.beams, **kwargs)


__all__ = ["CASES", "Case", "Reference", "TupleGPT", "estimate_case", "real_generate", "real_tuple_generate",
           "tuple_generate"]
