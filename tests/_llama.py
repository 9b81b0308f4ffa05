"""A small Llama-style model as torchtitan builds it: RMSNorm, rotary embeddings (RoPE), SDPA
attention, a SwiGLU feed-forward, blocks in an ``nn.ModuleDict``, ``norm`` and ``output`` at
the top, and an ``init_weights()`` that fills every parameter and the RoPE buffer in place
(for models built on the meta device, then ``to_empty``). Used by the recipe and pipelining
tests; nothing here depends on torchtitan."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes of the model (tiny by default: the tests run on 2 CPU cores)."""

    vocab: int = 64
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    hidden: int = 48
    seq: int = 8
    rope_theta: float = 10000.0


def rope_tables(cfg: LlamaConfig) -> torch.Tensor:
    """``(seq, head_dim)`` cos and sin tables, concatenated on the last dim."""
    head = cfg.dim // cfg.n_heads
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, head, 2, dtype=torch.float32) / head))
    angles = torch.outer(torch.arange(cfg.seq, dtype=torch.float32), inv)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs of ``x`` (``(b, h, s, d)``) by the positions' angles."""
    cos, sin = tables[: x.shape[-2]].chunk(2, dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.flatten(-2)


class RMSNorm(nn.Module):
    """Root-mean-square normalisation with a learned scale."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    """Causal multi-head attention through ``scaled_dot_product_attention`` with RoPE."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.n_heads, d // self.n_heads).transpose(1, 2)

        q, k, v = heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x))
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, d))

    def init_weights(self, std: float) -> None:
        for lin in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=std)


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for lin in (self.w2, self.w3):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=std)


class TransformerBlock(nn.Module):
    """Pre-norm attention and feed-forward with residuals."""

    def __init__(self, cfg: LlamaConfig, layer_id: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim)
        self.feed_forward = FeedForward(cfg)
        self.std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.std)
        self.feed_forward.init_weights(self.std)


class Llama(nn.Module):
    """Embedding, blocks (an ``nn.ModuleDict`` keyed ``"0"``, ``"1"``, ... as in torchtitan),
    final norm and output projection. A pipeline stage keeps a slice of it: the embedding
    and the output may be ``None`` and the stage's blocks any subset."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Module | None = nn.Embedding(cfg.vocab, cfg.dim)
        self.register_buffer("rope", rope_tables(cfg), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = RMSNorm(cfg.dim)
        self.output: nn.Module | None = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def init_weights(self) -> None:
        """Fill every parameter and the RoPE buffer in place (after ``to_empty``)."""
        with torch.no_grad():
            self.rope.copy_(rope_tables(self.cfg))
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()  # type: ignore[operator]
        if self.norm is not None:
            self.norm.reset_parameters()  # type: ignore[operator]
        if self.output is not None:
            bound = 3 * self.cfg.dim**-0.5
            nn.init.trunc_normal_(self.output.weight, std=self.cfg.dim**-0.5, a=-bound, b=bound)


def tokens(cfg: LlamaConfig, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic ``(inputs, targets)`` batch of token ids."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
