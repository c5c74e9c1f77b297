"""Small models written by hand that tests and benchmarks share: a GPT-2-shaped decoder with its loss inside
(:class:`GPT`), a small convnet, and a chain of pointwise ops between matmuls (:class:`PointwiseMLP`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, 2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """GPT-2's shape: token and position embeddings, pre-norm blocks, a tied head, the loss inside the model
    (``benchmarks/estimate_hf.py`` measures a larger one: "GPT-2 shape, by hand")."""

    def __init__(self, vocab: int = 1000, d: int = 128, layers: int = 2, heads: int = 4, positions: int = 512) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(positions, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def gpt_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 1000, (8, 256), generator=g)
    return idx, idx.roll(-1, 1)


def small_convnet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.Conv2d(32, 64, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def images() -> torch.Tensor:
    return torch.randn(16, 3, 64, 64, generator=torch.Generator().manual_seed(0))


# a pointwise chain per layer: `x + gelu(h) * sigmoid(h) + tanh(h) * 0.5 - h.pow(2) * 0.01` on `h = lin(x)`
D, LAYERS, BATCH = 512, 4, 4096


class PointwiseMLP(nn.Module):
    def __init__(self, d: int = D, layers: int = LAYERS) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.lins:
            h = lin(x)
            x = x + F.gelu(h) * torch.sigmoid(h) + torch.tanh(h) * 0.5 - h.pow(2) * 0.01
        return x


def pointwise_batch() -> torch.Tensor:
    return torch.randn(BATCH, D, generator=torch.Generator().manual_seed(0))
