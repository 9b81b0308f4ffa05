"""Oracles and small helpers shared by the core tests (no library code is used to compute them)."""

from __future__ import annotations

from collections.abc import Callable
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


class MLPGPT(torch.nn.Module):
    """The GPT's structure (token embeddings, ``layers`` residual blocks made by ``block``, a
    vocabulary head without bias, ``loss``) with cheap blocks: what FSDP does around a compiled
    region does not depend on the ops inside it, and a compile's time grows with them."""

    def __init__(
        self, block: Callable[[], torch.nn.Module], vocab: int, dim: int = 32, layers: int = 2
    ) -> None:
        super().__init__()
        self.vocab = vocab
        self.tok = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(block() for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(
            self(idx).reshape(-1, self.vocab), targets.reshape(-1)
        )


def full_named(named: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Each tensor's full value, detached, in its own storage: ``t.full_tensor()`` for a
    ``DTensor``, a copy of ``t`` for a plain tensor; torch's own collectives, none of this
    package's code.

    In few collectives: the DTensors sharded on dim 0 over one dim of a mesh (and replicated on
    its others) are gathered together, one all-gather per mesh dim and dtype; any other DTensor
    gets its own ``full_tensor()``. A case snapshotting a model's parameters and gradients
    after every step made 50 all-gathers per step, each 6 ms on 4 ranks of 2 cores: most of
    its time. Call it on every rank of the meshes (a collective)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, Shard

    out: dict[str, torch.Tensor] = {}
    together: dict[tuple[Any, ...], list[tuple[str, DTensor]]] = {}
    for name, t in named.items():
        t = t.detach()
        if not isinstance(t, DTensor):
            out[name] = t.clone()
            continue
        dims = [d for d, p in enumerate(t.placements) if not isinstance(p, Replicate)]
        if len(dims) == 1 and t.placements[dims[0]] == Shard(0) and t.dim() > 0:
            together.setdefault((id(t.device_mesh), dims[0], t.dtype), []).append((name, t))
        else:
            out[name] = t.full_tensor()
    for (_, mesh_dim, _), members in together.items():
        mesh = members[0][1].device_mesh
        n = mesh.size(mesh_dim)
        rows_of = [-(-t.shape[0] // n) for _, t in members]  # torch.chunk's rows per rank
        pieces = []
        for (_, t), per in zip(members, rows_of):
            local = t.to_local()
            padded = local.new_zeros((per, *t.shape[1:]))
            padded[: local.shape[0]] = local
            pieces.append(padded.reshape(-1))
        send = torch.cat(pieces)
        recv = send.new_empty(n * send.numel())
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(recv, send, group=mesh.get_group(mesh_dim))
        rows = recv.view(n, -1)
        offset = 0
        for (name, t), per, piece in zip(members, rows_of, pieces):
            full = rows[:, offset : offset + piece.numel()].reshape(n * per, *t.shape[1:])
            out[name] = full[: t.shape[0]].clone()
            offset += piece.numel()
    return {name: out[name] for name in named}
