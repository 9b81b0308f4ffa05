"""A small GPT-style model for tests, examples and benchmarks (pre-norm blocks, causal SDPA)."""

from __future__ import annotations

import attrs
import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPT", "GPTConfig", "GPTLoss", "pattern_batch", "synthetic_batch"]


@attrs.frozen
class GPTConfig:
    """Model sizes. The defaults are the benchmark model (~13M parameters)."""

    vocab: int = 8192
    dim: int = 384
    n_layers: int = 4
    n_heads: int = 6
    seq: int = 128
    tie_weights: bool = False


class Block(nn.Module):
    """Pre-norm transformer block: attention then MLP, each with a residual."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.dim)
        # No qkv bias: the key bias has an exactly-zero gradient (softmax is shift-invariant),
        # pure float noise that Adam would amplify into +-lr updates.
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.fc = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.out = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``(batch, seq, dim)`` activations."""
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token + position embedding, ``n_layers`` blocks, final norm, vocabulary head."""

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or GPTConfig()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, seq, vocab)`` for token ids ``(batch, seq)``."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy."""
        logits = self(idx)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


class GPTLoss(nn.Module):
    """``gpt.loss`` as a module's forward: what DDP wraps (DDP all-reduces gradients only for
    what runs through its own forward; calling the wrapped GPT's ``loss`` would skip them)."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.gpt.loss(idx, targets)


def synthetic_batch(cfg: GPTConfig, batch: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic token ids and next-token targets for ``seed``."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def pattern_batch(cfg: GPTConfig, batch: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable synthetic task: each sequence counts up by one from a random start.

    Starts are drawn from the first ``min(vocab, 512)`` ids, so a model learns the successor map
    quickly and the loss falls visibly from about ``ln(vocab)`` within tens of steps.
    """
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, min(cfg.vocab, 512), (batch, 1), generator=g)
    data = (start + torch.arange(cfg.seq + 1)) % cfg.vocab
    return data[:, :-1], data[:, 1:]
