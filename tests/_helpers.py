"""Oracles and small helpers shared by the core tests (no library code is used to compute them)."""

from __future__ import annotations

from typing import Any

import optree
import torch

from functional_fsdp.core._tree import tree_leaves


def oracle_local(full: torch.Tensor, world_size: int, rank: int, dim: int = 0) -> torch.Tensor:
    """Rank ``rank``'s shard as ``distribute_tensor(full, mesh, [Shard(dim)]).to_local()`` gives it.

    ``torch.chunk`` returns fewer than ``world_size`` chunks when the dimension is short; the
    remaining ranks hold empty shards that keep the other dimensions.
    """
    chunks = torch.chunk(full, world_size, dim=dim)
    if rank < len(chunks):
        return chunks[rank]
    return full.narrow(dim, full.shape[dim], 0)


def random_like(
    tree: Any, seed: int, *, dtype: torch.dtype | None = None, scale: float = 1.0
) -> Any:
    """A pytree shaped like ``tree`` with deterministic values from ``seed`` (finite, small)."""
    gen = torch.Generator().manual_seed(seed)

    def one(t: torch.Tensor) -> torch.Tensor:
        values = torch.randn(t.shape, generator=gen).clamp_(-4.0, 4.0) * scale
        return values.to(dtype or t.dtype)

    return optree.tree_map(one, tree)


def leaves(tree: Any) -> list[torch.Tensor]:
    """Tensor leaves of a user pytree, in the order :func:`functional_fsdp.shard` lays them out."""
    return optree.tree_leaves(tree)


def snapshot(*objs: Any) -> list[torch.Tensor]:
    """Clones of every tensor leaf (records included) of ``objs``."""
    return [t.detach().clone() for t in tree_leaves(list(objs)) if isinstance(t, torch.Tensor)]


def assert_unchanged(before: list[torch.Tensor], *objs: Any) -> None:
    """Every tensor leaf of ``objs`` is bit-identical (dtype and shape too) to ``before``."""
    after = [t for t in tree_leaves(list(objs)) if isinstance(t, torch.Tensor)]
    assert len(after) == len(before)
    for a, b in zip(after, before):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b), "an input tensor was mutated"


def assert_bit_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Same dtype, shape and bits."""
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape, (tuple(got.shape), tuple(want.shape))
    assert torch.equal(got, want)


class Routed(torch.nn.Module):
    """Two blocks; ``extra`` (sharded with the root's group in the tests) runs only where
    ``use_extra`` says: a parameter some micro-batches or ranks never use (an expert a router
    sends only some micro-batches to, a branch taken on some ranks' data)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(2))
        self.extra = torch.nn.Linear(d, d)
        self.use_extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.blocks[0](x))
        if self.use_extra:
            x = x + torch.tanh(self.extra(x))
        return self.blocks[1](x)
