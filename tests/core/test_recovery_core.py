"""Re-sharding to the survivors of a lost rank, in the simulated world: the pure part of
surviving a lost rank."""

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


# ---------------------------------------------------------------- when to restart from
#
# A model of the copies' protocol (shell/recovery/copies.py) around each step ``j`` of every
# rank: ``C`` the step's collectives (forward, backward, reduce-scatter), ``W`` the optimizer's
# pre-hook (wait for the neighbour's copy of step ``j``, snapshot its own state at ``j``),
# ``S`` the optimizer step (``done = j + 1``), ``P`` the post-hook (post its state at
# ``j + 1`` to its copy holder). One rank dies before one of its events; the survivors run on
# until each blocks on it (a collective it never joins, a copy it never sent), then report what
# they can restore. Whatever the moment, a step every survivor can restore must exist.

_EVENTS = ("C", "W", "S", "P")


def _survivor_reports(n: int, victim: int, death: int, partial: Any) -> list[Any]:
    """Each survivor's :class:`Restorable` once the victim died before its event ``death``
    (an index into the per-step events); ``partial(r)``: whether survivor ``r`` completed the
    collective the victim died in."""
    from functional_fsdp.core.recovery import Restorable

    pos = {r: 0 for r in range(n)}  # the next event index of each rank
    posted = {r: {0} for r in range(n)}  # copies each rank posted (step 0 at construction)
    progressed = True
    while progressed:
        progressed = False
        for r in range(n):
            if r == victim:
                pos[r] = death
                continue
            i = pos[r]
            j, ev = divmod(i, len(_EVENTS))
            if j > 50:
                continue
            kind = _EVENTS[ev]
            if kind == "C":
                ok = pos[victim] > i or (pos[victim] == i and partial(r))
                ok = ok and all(pos[q] >= i for q in range(n) if q != victim)
            elif kind == "W":
                ok = j in posted[copy_source(r, n)]
            else:
                ok = True
            if ok:
                if kind == "P":
                    posted[r].add(j + 1)
                pos[r] = i + 1
                progressed = True
    for e in range(death):
        j, ev = divmod(e, len(_EVENTS))
        if _EVENTS[ev] == "P":
            posted[victim].add(j + 1)
    reports = []
    for r in range(n):
        if r == victim:
            continue
        i = pos[r]
        steps_done = sum(1 for e in range(i) if _EVENTS[e % 4] == "S")
        waited = [e // 4 for e in range(i) if _EVENTS[e % 4] == "W"]
        snapshot = waited[-1] if waited else None
        held = waited[-1] if waited else 0
        own = {steps_done} | ({snapshot} if snapshot is not None else set())
        copy = {held}
        source = copy_source(r, n)
        in_flight = held + 1
        if in_flight in posted[source]:  # arrived (a dead sender's too: it had posted it)
            copy.add(in_flight)
        reports.append(Restorable(r, tuple(sorted(own)), tuple(sorted(copy))))
    return reports


@settings(deadline=None, max_examples=200)
@given(
    n=st.integers(2, 5),
    data=st.data(),
    death=st.integers(0, 4 * 6 - 1),
)
def test_a_single_loss_at_any_moment_leaves_a_step_to_restart_from(
    n: int, data: Any, death: int
) -> None:
    from functional_fsdp.core.recovery import restart_step

    victim = data.draw(st.integers(0, n - 1))
    passed = data.draw(st.sets(st.integers(0, n - 1)))
    reports = _survivor_reports(n, victim, death, lambda r: r in passed)
    step = restart_step(reports, n)
    steps_done = min(max(r.own) for r in reports)
    assert step >= steps_done - 1  # at most the step in flight is redone
    for r in reports:
        assert step in r.own
    assert step in next(r for r in reports if r.rank == copy_holder(victim, n)).copy


def test_restart_step_is_the_latest_common_step_and_names_the_impossible() -> None:
    from functional_fsdp.core.errors import UnrecoverableLossError
    from functional_fsdp.core.recovery import Restorable, active_world_size, restart_step

    rep = [Restorable(0, (3, 4), (3,)), Restorable(2, (3, 4), (3, 4))]
    assert restart_step(rep, 3) == 4  # rank 1's copy (held by 2) arrived at 4
    rep = [Restorable(0, (3, 4), (3, 4)), Restorable(2, (3, 4), (3,))]
    assert restart_step(rep, 3) == 3
    with pytest.raises(UnrecoverableLossError, match="no step is restorable"):
        restart_step([Restorable(0, (5, 6), (4,)), Restorable(2, (5, 6), (4,))], 3)
    with pytest.raises(UnrecoverableLossError, match="lost together"):
        restart_step([Restorable(0, (1,), (1,)), Restorable(3, (1,), (1,))], 4)
    assert [active_world_size(a, 4) for a in (1, 2, 3, 4, 5)] == [1, 2, 2, 4, 4]
    assert active_world_size(3, 8) == 2 and active_world_size(3) == 3
    assert active_world_size(7, 2) == 2


def test_regrouping_mixed_dtypes_with_odd_and_empty_buffers() -> None:
    """Found by the property above: a mixed-dtype group's packed bytes (here 0, or an odd
    count) must start at an aligned offset in the all-gathered rows, or the bf16 view fails."""
    for tree in (
        {"w": torch.tensor([]), "b": torch.tensor([], dtype=torch.bfloat16)},
        {"w": torch.ones(3, dtype=torch.bfloat16), "m": torch.ones(1, dtype=torch.uint8)},
    ):
        old = [shard(tree, world_size=3, rank=r) for r in range(3)]
        got = SimulatedWorld(2).run(
            lambda c, old=old: regroup(old[(0, 2)[c.rank]], old[(2, 1)[c.rank]], [1], c)
        )
        for j, new in enumerate(got):
            assert torch.equal(new.flat, shard(tree, world_size=2, rank=j).flat)


def test_pack_locals_into_a_donated_state_equals_a_fresh_pack() -> None:
    """The recovery snapshots repack the optimizer's moments every step into the buffers of
    the previous snapshot (``donate=``): the same bytes as a fresh pack, in the same buffer."""
    from functional_fsdp.core.transitions import pack_locals

    tree = {"w": torch.arange(10.0).reshape(5, 2), "b": torch.arange(3.0)}
    lay = shard(tree, world_size=2, rank=1).layout
    first = pack_locals([torch.ones(1), torch.ones(2, 2)], lay, 1)  # "b", "w" (sorted)
    locals_ = [torch.full((1,), 3.0), torch.full((2, 2), 7.0)]
    again = pack_locals(locals_, lay, 1, donate=first)
    assert again.flat is first.flat
    assert torch.equal(again.flat, pack_locals(locals_, lay, 1).flat)
    with pytest.raises(LayoutMismatchError, match="donated state"):
        pack_locals(locals_, lay, 0, donate=first)
