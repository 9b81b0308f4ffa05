"""Re-sharding to the survivors of a lost rank, in the simulated world (issue "Lose a rank,
lose no step"): the pure part."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from functional_fsdp.core.errors import LayoutMismatchError, StateError
from functional_fsdp.core.recovery import (
    copy_holder,
    copy_source,
    recoverable,
    regroup,
    relayout,
    survivors,
)
from functional_fsdp.core.transitions import shard
from functional_fsdp.testing import SimulatedWorld
from functional_fsdp.testing import strategies as fst


def _lost_sets(n: int) -> st.SearchStrategy[tuple[int, ...]]:
    return st.sets(st.integers(0, n - 1), min_size=1, max_size=max(1, n // 2)).map(
        lambda s: tuple(sorted(s))
    )


@settings(deadline=None, max_examples=40)
@given(data=st.data(), tree=fst.param_trees(), n=st.integers(2, 6))
def test_regrouping_equals_sharding_for_the_survivors(data: Any, tree: Any, n: int) -> None:
    lost = data.draw(_lost_sets(n).filter(lambda s: recoverable(n, s)))
    alive = survivors(n, lost)
    active = data.draw(st.integers(1, len(alive)))
    old = [shard(tree, world_size=n, rank=r) for r in range(n)]
    world = SimulatedWorld(len(alive))

    def body(comm: Any) -> Any:
        r = alive[comm.rank]
        return regroup(old[r], old[copy_source(r, n)], lost, comm, active=active)

    got = world.run(body)
    for j, new in enumerate(got):
        if j >= active:
            assert new is None
            continue
        want = shard(tree, world_size=active, rank=j)
        assert new.layout == want.layout == relayout(old[0].layout, active)
        assert torch.equal(new.flat, want.flat)


def test_neighbours_hold_each_others_copies() -> None:
    assert [copy_source(r, 4) for r in range(4)] == [3, 0, 1, 2]
    assert all(copy_holder(copy_source(r, 5), 5) == r for r in range(5))
    assert recoverable(4, [1]) and recoverable(4, [0, 2])
    assert not recoverable(4, [1, 2]) and not recoverable(2, [0, 1]) and not recoverable(1, [0])


def test_losing_a_rank_with_its_copy_is_refused_on_every_survivor() -> None:
    tree = {"w": torch.arange(12.0).reshape(6, 2)}
    old = [shard(tree, world_size=4, rank=r) for r in range(4)]
    world = SimulatedWorld(2)
    with pytest.raises(StateError, match="last checkpoint"):
        world.run(lambda c: regroup(old[(0, 3)[c.rank]], old[(3, 2)[c.rank]], [1, 2], c))


def test_a_wrong_copy_or_rank_order_is_named() -> None:
    tree = {"w": torch.arange(12.0).reshape(6, 2)}
    old = [shard(tree, world_size=3, rank=r) for r in range(3)]
    world = SimulatedWorld(2)
    with pytest.raises(LayoutMismatchError, match="holds a copy"):
        world.run(lambda c: regroup(old[(0, 2)[c.rank]], old[0], [1], c))
    with pytest.raises(LayoutMismatchError, match="old-rank order"):
        world.run(lambda c: regroup(old[(2, 0)[c.rank]], old[(1, 2)[c.rank]], [1], c))
