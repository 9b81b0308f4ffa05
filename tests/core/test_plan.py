"""The communication plan (``core/plan.py``): the sharing rules and the buckets, in one process."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from functional_fsdp.core.comm import coalesces
from functional_fsdp.core.plan import (
    GroupPlanFacts,
    ReduceFacts,
    SharingFacts,
    derive_plan,
    gathers_together,
    prefetch_targets,
    reduces_together,
)

PLAIN = SharingFacts(world_size=2, coalesces=True)


@pytest.mark.parametrize(
    "change",
    [
        {"world_size": 1},
        {"coalesces": False},
        {"offload": True},
        {"codecs": True},
        {"keeps_rows": True},
        {"tied": True},
        {"lends": True},
        {"forward_users": 2},
    ],
)
def test_each_fact_alone_keeps_an_all_gather_out_of_a_bucket(change: dict) -> None:
    assert gathers_together(PLAIN)
    assert not gathers_together(attrs.evolve(PLAIN, **change))


@pytest.mark.parametrize(
    "change", [{"world_size": 1}, {"coalesces": False}, {"sync": False}, {"plain": False}]
)
def test_each_fact_alone_keeps_a_reduce_scatter_out_of_a_bucket(change: dict) -> None:
    plain = ReduceFacts(world_size=4, coalesces=True)
    assert reduces_together(plain)
    assert not reduces_together(attrs.evolve(plain, **change))


def test_a_communicator_declares_whether_it_coalesces() -> None:
    class Declares:
        coalesces = True

    assert coalesces(Declares())
    assert not coalesces(object())  # undeclared: it cannot


groups = st.lists(
    st.tuples(st.integers(1, 12), st.sampled_from(["pg0", "pg1"]), st.booleans()),
    min_size=1,
    max_size=12,
)


@given(groups=groups, bucket_bytes=st.integers(-1, 30), data=st.data())
def test_buckets_cover_every_group_once_in_order_within_a_route(
    groups: list, bucket_bytes: int, data: st.DataObject
) -> None:
    names = [f"g{i}" for i in range(len(groups))]
    facts = {n: GroupPlanFacts(b, r, s) for n, (b, r, s) in zip(names, groups)}
    backward = data.draw(st.permutations(names))
    plan = derive_plan(names, backward, names[::-1], facts, bucket_bytes)
    for order, buckets, members in (
        (names, plan.schedule.forward, plan.forward),
        (list(backward), plan.schedule.backward, plan.backward),
    ):
        flat = [n for b in buckets for n in b.groups]
        assert flat == order  # every group once, in the order they run
        for b in buckets:
            assert all(members[n] == b.groups for n in b.groups)
            if b.coalesced:
                assert len({facts[n].route for n in b.groups}) == 1
                assert all(facts[n].shares for n in b.groups)
                assert b.unsharded_bytes <= bucket_bytes
            assert b.unsharded_bytes == sum(facts[n].unsharded_bytes for n in b.groups)
    assert all(len(r) > 1 for r in plan.reduce)
    last = plan.forward[names[-1]]
    assert plan.kept <= set(last)
    assert all(facts[n].shares for n in plan.kept)
    if plan.kept:
        assert sum(facts[n].unsharded_bytes for n in last) <= bucket_bytes


def test_off_means_one_collective_per_group_and_nothing_kept() -> None:
    facts = {n: GroupPlanFacts(1, "pg", True) for n in "abc"}
    plan = derive_plan("abc", "cba", "cba", facts, 0)
    assert plan.schedule.collectives() == (3, 3, 3)
    assert plan.reduce == () and plan.kept == frozenset()
    assert derive_plan("abc", "cba", "cba", facts, 8, keep_last=False).kept == frozenset()


@given(
    order=st.lists(st.sampled_from("abcdef"), max_size=12),
    gathering=st.sets(st.sampled_from("abcdef")),
)
def test_prefetch_targets_are_the_next_gathering_module_after_the_first_place(
    order: list[str], gathering: set[str]
) -> None:
    """What the hooks searched the order for at every call, answered once for every module."""
    got = prefetch_targets(order, gathering)
    for k in set(order):
        i = order.index(k)
        nxt = [m for m in order[i + 1 :] if m in gathering][:1]
        assert got.get(k) == (nxt[0] if nxt else None)
    assert set(got) <= set(order)


def test_the_plan_holds_each_phases_prefetch_targets() -> None:
    facts = {n: GroupPlanFacts(1, "pg", True) for n in "abc"}
    plan = derive_plan(
        "abc", "cba", "cba", facts, 0, forward_uses="xabc", backward_uses="cbax", gathering="abc"
    )
    assert plan.forward_prefetch == {"x": "a", "a": "b", "b": "c"}
    assert plan.backward_prefetch == {"c": "b", "b": "a"}
