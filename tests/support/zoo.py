"""The model zoo the estimate benchmarks run: small enough for a 2-core CPU, varied enough to matter."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 1000))


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = nn.Sequential() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.skip(x))


def convnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
        Block(32, 32), Block(32, 64, 2), Block(64, 128, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 100),
    )


class UNet(nn.Module):
    def __init__(self, c: int = 32) -> None:
        super().__init__()

        def double(cin: int, cout: int) -> nn.Module:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                                 nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())

        self.d1, self.d2, self.d3 = double(3, c), double(c, 2 * c), double(2 * c, 4 * c)
        self.up2 = nn.ConvTranspose2d(4 * c, 2 * c, 2, stride=2)
        self.u2 = double(4 * c, 2 * c)
        self.up1 = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.u1 = double(2 * c, c)
        self.out = nn.Conv2d(c, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.d1(x)
        b = self.d2(F.max_pool2d(a, 2))
        c = self.d3(F.max_pool2d(b, 2))
        y = self.u2(torch.cat([self.up2(c), b], 1))
        y = self.u1(torch.cat([self.up1(y), a], 1))
        return self.out(y)


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 8000, d: int = 256, layers: int = 4, heads: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(1, 512, d))
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens) + self.pos[:, : tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class LSTMTagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(128, 256, num_layers=2, batch_first=True)
        self.gru = nn.GRU(256, 128, batch_first=True)
        self.out = nn.Linear(128, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.rnn(x)
        y, _ = self.gru(y)
        return self.out(y)


class ViT(nn.Module):
    def __init__(self, d: int = 192, layers: int = 4, heads: int = 3, patch: int = 16, image: int = 224) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, d, patch, patch)
        n = (image // patch) ** 2
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(torch.zeros(1, n + 1, d))
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, activation="gelu", batch_first=True,
                                       norm_first=True) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 100)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x[:, 0]))


# name -> (builder, inputs maker)
ZOO: dict[str, tuple[Callable[[], nn.Module], Callable[[], object]]] = {
    "MLP": (mlp, lambda: torch.randn(64, 1024)),
    "ConvNet+BN": (convnet, lambda: torch.randn(16, 3, 64, 64)),
    "U-Net": (UNet, lambda: torch.randn(4, 3, 64, 64)),
    "Transformer (tied)": (TiedLM, lambda: torch.randint(0, 8000, (8, 128))),
    "LSTM+GRU": (LSTMTagger, lambda: torch.randn(16, 64, 128)),
    "ViT": (ViT, lambda: torch.randn(4, 3, 224, 224)),
}


def train_steps(model: nn.Module, x: object, steps: int, opt: torch.optim.Optimizer | None = None) -> None:
    """The training steps every benchmark compares: forward, sum, backward, AdamW step, zero_grad."""
    opt = opt if opt is not None else torch.optim.AdamW(model.parameters())
    for _ in range(steps):
        out = model(x)
        loss = out.sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del out, loss


def profiled_cpu_peak(prof: torch.profiler.profile) -> int:
    """The highest CPU memory in a profile (``profile_memory=True``) above what was allocated before it."""
    from torch._C._profiler import _EventType

    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.typed[0] == _EventType.Allocation and node.typed[1].device.type == "cpu":
            events.append((node.start_time_ns, node.typed[1].alloc_size, node.typed[1].total_allocated))
        stack.extend(node.children)
    events.sort()
    return max(total for _, _, total in events) - (events[0][2] - events[0][1])


# --- Hugging Face models, built from configs (no download) ----------------------------------------------------
def _hf():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def hf_gpt2(layers: int = 4, width: int = 256, use_cache: bool = True) -> nn.Module:
    t = _hf()
    return t.GPT2LMHeadModel(t.GPT2Config(n_layer=layers, n_embd=width, n_head=4, vocab_size=8000, n_positions=1024,
                                          use_cache=use_cache))


def hf_llama() -> nn.Module:
    t = _hf()
    return t.LlamaForCausalLM(t.LlamaConfig(num_hidden_layers=4, hidden_size=256, intermediate_size=688,
                                            num_attention_heads=8, num_key_value_heads=2, vocab_size=8000,
                                            max_position_embeddings=1024))


def hf_bert() -> nn.Module:
    t = _hf()
    return t.BertForMaskedLM(t.BertConfig(num_hidden_layers=4, hidden_size=256, intermediate_size=1024,
                                          num_attention_heads=4, vocab_size=8000, max_position_embeddings=512))


def hf_t5() -> nn.Module:
    t = _hf()
    return t.T5ForConditionalGeneration(t.T5Config(num_layers=4, num_decoder_layers=4, d_model=256, d_ff=1024,
                                                   num_heads=4, d_kv=64, vocab_size=8000, decoder_start_token_id=0,
                                                   pad_token_id=0))


def hf_lora() -> nn.Module:
    import peft

    return peft.get_peft_model(hf_llama(), peft.LoraConfig(r=16, target_modules=["q_proj", "v_proj"],
                                                             lora_dropout=0.0))


def hf_unet() -> nn.Module:
    import diffusers

    return diffusers.UNet2DConditionModel(
        sample_size=32, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(64, 128),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=64, attention_head_dim=8, norm_num_groups=16)


def text_batch(batch: int = 8, seq: int = 256, t5: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8000, (batch, seq), generator=g)
    labels = torch.randint(0, 8000, (batch, seq // 2), generator=g) if t5 else ids.clone()
    return {"input_ids": ids, "attention_mask": torch.ones(batch, seq, dtype=torch.long), "labels": labels}


def unet_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"sample": torch.randn(4, 4, 32, 32, generator=g), "timestep": torch.tensor([10, 20, 30, 40]),
            "encoder_hidden_states": torch.randn(4, 16, 64, generator=g)}


def unet_loss(out: object) -> torch.Tensor:
    return out.sample.float().pow(2).mean()  # type: ignore[attr-defined]


# name -> (builder, inputs maker, loss_fn or None)
HF_ZOO: dict[str, tuple[Callable[[], nn.Module], Callable[[], dict[str, torch.Tensor]], object]] = {
    "GPT-2": (hf_gpt2, text_batch, None),
    "Llama (GQA)": (hf_llama, text_batch, None),
    "BERT": (hf_bert, text_batch, None),
    "T5": (hf_t5, lambda: text_batch(t5=True), None),
    "Llama + LoRA": (hf_lora, text_batch, None),
    "UNet2DCondition": (hf_unet, unet_batch, unet_loss),
}


def real_peak(build: Callable[[], nn.Module], make_inputs: Callable[[], object], loss_fn: Callable | None = None, *,
              inference: bool = False, amp: torch.dtype | None = None, checkpointing: bool = False,
              compiled: bool = False, steps: int = 2) -> int:
    """The real CPU steps' peak: the model and inputs are built first (their bytes counted by hand), then ``steps``
    AdamW steps (or inference forwards) run under the profiler, whose memory timeline sees every allocation
    (kernel scratch included). Inputs: a dict (keyword arguments), a tuple (positional ones) or one value;
    ``loss_fn`` defaults to the estimate's own stand-in; ``compiled``: ``torch.compile`` the model and compile
    its forward and backward by a first step outside the profiler (Inductor, CPU)."""
    import contextlib
    import warnings

    from torch.profiler import ProfilerActivity, profile

    from vram_magic.estimator.step.loss import default_loss

    torch.manual_seed(0)
    model, inputs = build(), make_inputs()
    loss_fn = loss_fn or default_loss
    run = torch.compile(model) if compiled else model
    values = list(inputs.values()) if isinstance(inputs, dict) else list(inputs) if isinstance(inputs, tuple) \
        else [inputs]

    def forward():
        return run(**inputs) if isinstance(inputs, dict) else run(*inputs) if isinstance(inputs, tuple) \
            else run(inputs)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if checkpointing:
            (getattr(model, "enable_gradient_checkpointing", None) or model.gradient_checkpointing_enable)()
        if compiled:
            loss_fn(forward()).backward()
            for p in model.parameters():
                p.grad = None
        base = storage_bytes(*model.parameters(), *model.buffers(), *(v for v in values if isinstance(v, torch.Tensor)))
        cast = torch.autocast("cpu", dtype=amp) if amp is not None else contextlib.nullcontext()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            if inference:
                model.eval()
                for _ in range(steps):
                    with torch.inference_mode(), cast:
                        out = forward()
                    del out
            else:
                model.train()
                opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], foreach=False)
                for _ in range(steps):
                    with cast:
                        out = forward()
                        loss = loss_fn(out)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    del out, loss
    return base + profiled_cpu_peak(prof)


def storage_bytes(*tensors: torch.Tensor) -> int:
    """Bytes of the distinct storages of ``tensors`` (tied weights once)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
