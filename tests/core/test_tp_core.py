"""The pure 2-D core (functional_fsdp.core.tensor_parallel) in the simulated world, with hypothesis.

For drawn TP placements, TP mesh shapes and dp sizes (uneven chunks included): sharding a
TP-local tensor over dp and gathering it back is bit-exact; the TP-local blocks gathered over
the TP ranks give the original global tensor; ``reduce_grad`` over dp equals the dense mean of
the dp ranks' TP-local gradients. The 2 x 2 x 2 HSDP x TP arithmetic (replicate, shard, tp) runs
here too: 8 simulated ranks, which a 2-core machine cannot run as processes.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from functional_fsdp.core import tensor_parallel as TP
from functional_fsdp.core.errors import LayoutMismatchError, UnsupportedPlacementError
from functional_fsdp.core.layout import shard_extent
from functional_fsdp.core.records import GroupLayout
from functional_fsdp.core.reduction import reduce_grad
from functional_fsdp.core.transitions import shard_tensors, unshard
from functional_fsdp.testing import SimulatedWorld


@st.composite
def tp_cases(draw: st.DrawFn) -> tuple:
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
    tp_ndim = draw(st.integers(1, 2))
    sizes = tuple(draw(st.lists(st.integers(1, 3), min_size=tp_ndim, max_size=tp_ndim)))
    placements = tuple(
        draw(st.sampled_from(["Replicate()", *(f"Shard({d})" for d in range(ndim))])) for _ in sizes
    )
    dp = draw(st.integers(1, 4))
    return shape, placements, sizes, dp


def _coords(sizes: tuple[int, ...]) -> list[tuple[int, ...]]:
    n = 1
    for s in sizes:
        n *= s
    return [TP.tp_coords_of(r, sizes) for r in range(n)]


def _spec(shape, placements, sizes, coords):
    return TP.tp_param_spec(
        "w", shape, torch.float32, tp_placements=placements, tp_sizes=sizes, tp_coords=coords
    )


@given(tp_cases())
def test_dp_round_trip_of_tp_local_is_exact(case) -> None:
    shape, placements, sizes, dp = case
    full = torch.randn(shape)
    world = SimulatedWorld(dp)
    for coords in _coords(sizes):
        spec = _spec(shape, placements, sizes, coords)
        local = TP.local_from_global(full, spec, sizes, coords)
        assert tuple(local.shape) == spec.shape
        layout = GroupLayout.build([spec], dp)
        states = [shard_tensors([local], layout, r) for r in range(dp)]
        outs = world.run(lambda comm, s: unshard(s, comm).params[0], states)
        for out in outs:
            assert torch.equal(out, local)


@given(tp_cases())
def test_gathered_global_equals_original(case) -> None:
    shape, placements, sizes, _ = case
    full = torch.randn(shape)
    coords = _coords(sizes)
    specs = [_spec(shape, placements, sizes, c) for c in coords]
    locals_ = [TP.local_from_global(full, s, sizes, c).clone() for s, c in zip(specs, coords)]
    assert torch.equal(TP.global_from_locals(locals_, specs[0], sizes), full)
    world = SimulatedWorld(len(coords))
    outs = world.run(
        lambda comm, loc, spec: TP.gather_global(loc, spec, comm, sizes), locals_, specs
    )
    for out in outs:
        assert torch.equal(out, full)


@given(tp_cases())
def test_reduce_grad_is_the_dense_mean_over_dp(case) -> None:
    shape, placements, sizes, dp = case
    world = SimulatedWorld(dp)
    for coords in _coords(sizes)[:2]:
        spec = _spec(shape, placements, sizes, coords)
        layout = GroupLayout.build([spec], dp)
        # Integer-valued gradients: the mean is exact whatever the summation order.
        grads = [torch.randint(-8, 8, spec.shape).float() * dp for _ in range(dp)]
        states = [shard_tensors([torch.zeros(spec.shape)], layout, r) for r in range(dp)]
        outs = world.run(lambda comm, s, g: reduce_grad([g], s, comm).local_grad(0), states, grads)
        mean = torch.stack(grads).mean(0)
        for r, out in enumerate(outs):
            start, length = layout.extent(0, r)
            assert torch.equal(out, mean.narrow(0, start, length))


def test_hsdp_x_tp_2x2x2_arithmetic() -> None:
    """(replicate=2, shard=2, tp=2): each TP coordinate's 4 dp ranks reduce-scatter over the
    shard pair and all-reduce over the replicate pair; gather over shard restores the TP-local
    tensor; the global tensor is the TP gather of the TP-local ones."""
    full = torch.randn(6, 5)
    placements, sizes = ("Shard(0)",), (2,)
    world = SimulatedWorld(8)
    grads = [torch.randint(-8, 8, (3, 5)).float() * 4 for _ in range(8)]

    def rank_fn(comm, rank: int):
        rep, sh, tp = rank // 4, rank // 2 % 2, rank % 2
        spec = _spec((6, 5), placements, sizes, (tp,))
        layout = GroupLayout.build([spec], 2)
        local = TP.local_from_global(full, spec, sizes, (tp,))
        state = shard_tensors([local], layout, sh)
        shard_comm = world.group([rep * 4 + s * 2 + tp for s in range(2)]).comm(rank)
        rep_comm = world.group([r * 4 + sh * 2 + tp for r in range(2)]).comm(rank)
        tp_comm = world.group([rep * 4 + sh * 2 + t for t in range(2)]).comm(rank)
        gathered = unshard(state, shard_comm).params[0]
        reduced = reduce_grad([grads[rank]], state, shard_comm, replicate_comm=rep_comm)
        glob = TP.gather_global(gathered, spec, tp_comm, sizes)
        return gathered, local, reduced.local_grad(0), glob

    outs = world.run(rank_fn, list(range(8)))
    for rank, (gathered, local, grad, glob) in enumerate(outs):
        assert torch.equal(gathered, local)
        assert torch.equal(glob, full)
        tp, sh = rank % 2, rank // 2 % 2
        dp_ranks = [r * 4 + s * 2 + tp for r in range(2) for s in range(2)]
        mean = torch.stack([grads[r] for r in dp_ranks]).mean(0)
        assert torch.equal(grad, mean.narrow(0, *shard_extent(3, 2, sh)))


def test_strided_split_factor_counts_tp_shards_of_the_dp_dim() -> None:
    assert TP.dp_split_factor(0, ("Shard(0)",), (2,)) == 2
    assert TP.dp_split_factor(0, ("Shard(1)",), (2,)) == 1
    assert TP.dp_split_factor(0, ("Replicate()",), (4,)) == 1
    assert TP.dp_split_factor(0, ("Shard(0)", "Shard(0)"), (2, 3)) == 6


@pytest.mark.parametrize("bad", ["Partial(sum)", "_StridedShard(dim=0, sf=2)", "Shard(-1)"])
def test_unsupported_placements_are_named(bad: str) -> None:
    with pytest.raises(UnsupportedPlacementError, match="supported are Shard"):
        TP.parse_placement(bad)


def test_placement_out_of_range_and_mismatched_sizes() -> None:
    with pytest.raises(UnsupportedPlacementError, match="out of range"):
        TP.tp_local_shape((4,), ("Shard(1)",), (2,), (0,))
    with pytest.raises(LayoutMismatchError, match="one entry per TP mesh dim"):
        TP.tp_local_shape((4,), ("Shard(0)",), (2, 2), (0,))
    with pytest.raises(LayoutMismatchError, match="outside"):
        TP.tp_local_shape((4,), ("Shard(0)",), (2,), (2,))
