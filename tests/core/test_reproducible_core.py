"""The reproducible reduction in the core, in the simulated world: the same bits for every
world size."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from functional_fsdp.core.errors import ReproducibilityError
from functional_fsdp.core.reduction import pack_grads, reduce_grad
from functional_fsdp.core.reproducible import (
    ReproduciblePolicy,
    TreeSums,
    push_leaf,
    tree_reduce,
    tree_sum,
)
from functional_fsdp.core.transitions import shard
from functional_fsdp.testing import SimulatedWorld


def _leaves(shapes: list[tuple[int, ...]], v: int, seed: int) -> list[list[torch.Tensor]]:
    """``v`` micro-batch gradients per parameter, with magnitudes spread over a few binades so
    that the order of additions shows in the bits."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(v):
        out.append(
            [
                torch.randn(s, generator=g) * torch.exp2(torch.randint(-6, 7, s, generator=g))
                for s in shapes
            ]
        )
    return out


def _run(
    shapes: list[tuple[int, ...]],
    leaves: list[list[torch.Tensor]],
    policy: ReproduciblePolicy,
    n: int,
    *,
    mesh: tuple[int, int] | None = None,
    dtype: torch.dtype = torch.float32,
    tree: bool = True,
) -> list[torch.Tensor]:
    """Every parameter's reduced gradient on ``n`` simulated ranks, reassembled in full."""
    world = SimulatedWorld(n, mesh_shape=mesh)
    rows, shards = mesh if mesh is not None else (1, n)
    params = [torch.zeros(s, dtype=dtype) for s in shapes]
    reduce_dtype = torch.float32 if dtype != torch.float32 else None

    def body(comm: Any) -> list[torch.Tensor]:
        rank = comm.rank
        scomm = world.shard_comm(rank) if mesh is not None else comm
        rcomm = world.replicate_comm(rank) if mesh is not None else None
        state = shard(
            params, world_size=shards, rank=scomm.rank, param_dtype=None, reduce_dtype=reduce_dtype
        )
        micro = policy.micro_batches(rank, n)
        scale = 1.0 / len(micro)  # the user's loss / (V / N)
        if tree:
            acc = TreeSums()
            for k in micro:
                grads = [(g.to(dtype) * scale) for g in leaves[k]]
                acc = push_leaf(acc, pack_grads(grads, state.layout), donate=True)
            new = tree_reduce(
                acc.root(), state, scomm, present=[True] * len(shapes), replicate_comm=rcomm
            )
        else:  # what accumulation does without the policy: left to right, backend's order
            total = [torch.zeros(s, dtype=dtype) for s in shapes]
            for k in micro:
                total = [t + g.to(dtype) * scale for t, g in zip(total, leaves[k])]
            new = reduce_grad(total, state, scomm, replicate_comm=rcomm)
        return [new.local_grad(i) for i in range(len(shapes))]

    per_rank = world.run(body)
    full = []
    for i in range(len(shapes)):
        full.append(torch.cat([per_rank[r][i] for r in range(shards)], dim=0))
        for row in range(1, rows):  # replicas hold the same shards
            for r in range(shards):
                assert torch.equal(per_rank[row * shards + r][i], per_rank[r][i])
    return full


def _world_sizes(v: int) -> list[int]:
    return [n for n in (1, 2, 4, 8) if n <= v]


_shapes = st.lists(
    st.tuples(st.integers(1, 9), st.integers(1, 5)).map(lambda t: t if t[1] > 2 else (t[0],)),
    min_size=1,
    max_size=3,
)


@settings(deadline=None, max_examples=25)
@given(
    v=st.sampled_from([1, 2, 4, 8]),
    shapes=_shapes,
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_the_reduction_is_bit_identical_for_every_world_size(
    v: int, shapes: list[tuple[int, ...]], seed: int, dtype: torch.dtype
) -> None:
    policy = ReproduciblePolicy(virtual_world_size=v)
    leaves = _leaves(shapes, v, seed)
    reference = _run(shapes, leaves, policy, 1, dtype=dtype)
    for n in _world_sizes(v)[1:]:
        got = _run(shapes, leaves, policy, n, dtype=dtype)
        for a, b in zip(got, reference):
            assert torch.equal(a, b), f"V={v} N={n} differs from N=1 by {(a - b).abs().max()}"


@pytest.mark.parametrize("v", [4, 8])
def test_hsdp_gives_the_bits_of_one_dimension_and_of_one_rank(v: int) -> None:
    shapes = [(7, 3), (5,)]
    policy = ReproduciblePolicy(virtual_world_size=v)
    leaves = _leaves(shapes, v, seed=3)
    reference = _run(shapes, leaves, policy, 1)
    for got in (
        _run(shapes, leaves, policy, 4, mesh=(2, 2)),
        _run(shapes, leaves, policy, 4, mesh=(4, 1)),
        _run(shapes, leaves, policy, 4),
    ):
        assert all(torch.equal(a, b) for a, b in zip(got, reference))


def test_without_the_tree_the_bits_depend_on_the_world_size() -> None:
    """The property above is not vacuous: accumulating left to right and letting the
    reduce-scatter add the ranks gives other bits on 1, 2 and 4 ranks for the same data."""
    shapes = [(64, 16)]
    policy = ReproduciblePolicy(virtual_world_size=8)
    leaves = _leaves(shapes, 8, seed=0)
    plain = {n: _run(shapes, leaves, policy, n, tree=False)[0] for n in (1, 2, 4)}
    assert not torch.equal(plain[1], plain[2]) or not torch.equal(plain[1], plain[4])
    tree = {n: _run(shapes, leaves, policy, n)[0] for n in (1, 2, 4)}
    assert torch.equal(tree[1], tree[2]) and torch.equal(tree[1], tree[4])


def test_tree_sums_add_adjacent_pairs_first() -> None:
    xs = [torch.tensor([float(i)]) for i in range(8)]
    acc = TreeSums()
    for i, x in enumerate(xs):
        acc = push_leaf(acc, x)
        assert acc.count == i + 1
        assert len(acc.sums) == bin(i + 1).count("1")  # a binary counter
    assert torch.equal(acc.root(), tree_sum(xs))
    # ((a + b) + (c + d)), not ((a + b) + c) + d: visible with values that round differently.
    a, b, c, d = (torch.tensor([v], dtype=torch.float32) for v in (1.0, 2**-24, 2**-24, 2**-24))
    assert torch.equal(tree_sum([a, b, c, d]), (a + b) + (c + d))
    assert not torch.equal(tree_sum([a, b, c, d]), ((a + b) + c) + d)


def test_an_incomplete_subtree_is_refused() -> None:
    acc = push_leaf(push_leaf(push_leaf(TreeSums(), torch.ones(2)), torch.ones(2)), torch.ones(2))
    with pytest.raises(ReproducibilityError, match="3 micro-batch gradients"):
        acc.root()
    with pytest.raises(ReproducibilityError, match="power-of-two"):
        tree_sum([torch.ones(1)] * 3)


@pytest.mark.parametrize("bad", [0, 3, 6, -2, 2.0, True])
def test_the_virtual_world_size_must_be_a_power_of_two(bad: Any) -> None:
    with pytest.raises(ReproducibilityError, match="power of two"):
        ReproduciblePolicy(virtual_world_size=bad)


def test_micro_batches_and_generators() -> None:
    policy = ReproduciblePolicy(virtual_world_size=8, seed=5)
    assert [list(policy.micro_batches(r, 2)) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert list(policy.micro_batches(3, 4)) == [6, 7]
    with pytest.raises(ReproducibilityError, match="divides 8"):
        policy.micro_batches(0, 3)
    with pytest.raises(ReproducibilityError, match="divides 8"):
        policy.micro_batches(0, 16)
    a = torch.rand(4, generator=policy.generator(2, 6))
    assert torch.equal(a, torch.rand(4, generator=policy.generator(2, 6)))
    assert not torch.equal(a, torch.rand(4, generator=policy.generator(2, 7)))
    assert not torch.equal(a, torch.rand(4, generator=policy.generator(3, 6)))


@settings(deadline=None, max_examples=25)
@given(shapes=_shapes, seed=st.integers(0, 2**31 - 1))
def test_the_norm_is_bit_identical_however_the_rows_are_sharded(
    shapes: list[tuple[int, ...]], seed: int
) -> None:
    from functional_fsdp.core import layout as L
    from functional_fsdp.core.reproducible import canonical_norm, gather_row_sums, row_square_sums

    tensors = _leaves(shapes, 1, seed)[0]
    reference = canonical_norm([row_square_sums(t) for t in tensors])
    assert torch.allclose(
        reference, torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in tensors]))
    )
    for n in (2, 4, 8):
        world = SimulatedWorld(n)

        def body(comm: Any, n: int = n) -> torch.Tensor:
            local = [
                row_square_sums(t.narrow(0, *L.shard_extent(t.shape[0], n, comm.rank)))
                for t in tensors
            ]
            rows = gather_row_sums(local, [t.shape[0] for t in tensors], comm)
            return canonical_norm(rows)

        assert all(torch.equal(got, reference) for got in world.run(body))
