"""ReduceState: what one gradient reduction hands the next (compression's residual, HSDP's
partial sum, the gradients held while sync is off), threaded beside the sharded state."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _helpers import leaves, random_like
from _transition_helpers import SEEDS
from hypothesis import given, settings
from strategies import param_trees, world_sizes

from functional_fsdp.core.comm import PLAIN_COMM
from functional_fsdp.core.compression import GradCompression
from functional_fsdp.core.errors import LayoutMismatchError, StateError
from functional_fsdp.core.reduction import (
    ReducePolicy,
    ReduceState,
    hold_unsynced,
    hold_use,
    reduce_grad,
    reduce_grad_with_state,
    reduce_row_numel,
    release_unsynced,
    release_uses,
)
from functional_fsdp.core.transitions import shard
from functional_fsdp.testing import SimulatedWorld

FP32 = [torch.float32]


class _Silent:
    """A communicator on which any collective fails the test: the refusal must come first."""

    world_size, rank, supports_pieces = 2, 0, False
    capabilities = PLAIN_COMM  # what it declares, read before the checks: no collective

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"a collective ran: {name}")


@given(tree=param_trees(dtypes=FP32, max_leaves=3), ws=world_sizes(max_size=4), seed=SEEDS)
@settings(max_examples=20)
def test_held_backwards_then_a_synced_one_reduce_as_their_sum(
    tree: Any, ws: int, seed: int
) -> None:
    """Two backwards with sync off, then one with sync on: one reduction of the three
    gradients' sum (added in backward order), bit for bit; nothing is held afterwards."""
    per_rank = [[random_like(tree, seed + 10 * r + k) for k in range(3)] for r in range(ws)]

    def body(c: Any, gs: list[Any]) -> tuple:
        s = shard(tree, world_size=ws, rank=c.rank)
        lay = s.layout
        g1, g2, g3 = (leaves(g) for g in gs)
        state = hold_unsynced(ReduceState(), g1, lay)
        state = hold_unsynced(state, g2, lay)
        merged, state = release_unsynced(state, g3)
        assert state.unsynced is None
        spec = lay.treespec
        got, _ = reduce_grad_with_state(spec.unflatten(merged), s, state, c)
        want = reduce_grad(spec.unflatten([(a + b) + d for a, b, d in zip(g1, g2, g3)]), s, c)
        return got, want

    for got, want in SimulatedWorld(ws).run(body, per_rank):
        for i in range(len(got.layout)):
            assert torch.equal(got.local_grad(i), want.local_grad(i))


def test_holding_donates_the_held_tensors_and_copies_a_first_gradient() -> None:
    s = shard({"a": torch.zeros(4), "b": torch.zeros(2, 3)}, world_size=2, rank=0)
    first = [torch.ones(4), None]
    state = hold_unsynced(ReduceState(), first, s.layout)
    held = state.unsynced
    assert held is not None and held[1] is None
    first[0].add_(100)  # the caller's gradient is not the held one
    assert torch.equal(held[0], torch.ones(4))
    state = hold_unsynced(state, [torch.ones(4), torch.ones(2, 3)], s.layout)
    assert state.unsynced is not None and state.unsynced[0] is held[0]  # added in place
    assert torch.equal(held[0], torch.full((4,), 2.0))
    merged, after = release_unsynced(state, [None, torch.ones(2, 3)])
    assert merged[0] is held[0] and torch.equal(merged[1], torch.full((2, 3), 2.0))
    assert after.unsynced is None
    nothing, same = release_unsynced(after, [None, None])
    assert nothing == [None, None] and same is after


def test_a_reduction_carries_the_held_gradients_and_the_other_reducers_state() -> None:
    """Each reducer changes only its own field: an exact reduction hands the residual, the
    partial sum (no replicas) and the held gradients back as they came."""
    tree = {"w": torch.randn(6, 2)}
    held = (torch.ones(6, 2),)

    def body(c: Any) -> tuple:
        s = shard(tree, world_size=2, rank=c.rank)
        state = ReduceState(
            residual=torch.zeros(2 * s.layout.shard_numel),
            partial=torch.zeros(reduce_row_numel(s.layout, True)),  # the shard, then the flags
            unsynced=held,
        )
        return state, reduce_grad_with_state(tree, s, state, c)[1]

    for before, after in SimulatedWorld(2).run(body):
        assert after.residual is before.residual and after.partial is before.partial
        assert after.unsynced is held


def test_bad_states_and_stateful_policies_are_refused_before_any_collective() -> None:
    s = shard({"w": torch.randn(6, 2)}, world_size=2, rank=0)
    g = {"w": torch.ones(6, 2)}
    for bad, what in (
        (ReduceState(residual=torch.zeros(5)), "residual"),
        (ReduceState(partial=torch.zeros(5)), "partial"),
        (ReduceState(unsynced=(None, None)), "unsynced"),
    ):
        with pytest.raises(LayoutMismatchError, match=what):
            reduce_grad_with_state(g, s, bad, _Silent())
    with pytest.raises(LayoutMismatchError, match="hold_unsynced"):
        hold_unsynced(ReduceState(), [None, None], s.layout)
    hsdp_later = ReducePolicy(all_reduce=False)
    with pytest.raises(StateError, match=r"partial sum.*reduce_grad_with_state"):
        reduce_grad(g, s, _Silent(), replicate_comm=_Silent(), policy=hsdp_later)
    # Without replicas there is no partial sum to keep: all_reduce=False changes nothing.
    assert not hsdp_later.keeps_state(replicated=False)
    assert hsdp_later.keeps_state(replicated=True)
    assert ReducePolicy(compression=GradCompression()).keeps_state(replicated=False)
    without_feedback = ReducePolicy(compression=GradCompression(error_feedback=False))
    assert not without_feedback.keeps_state(replicated=False)


def test_a_reused_groups_uses_are_held_in_their_dtype_and_added_in_autograds_order() -> None:
    """``hold_use`` keeps an earlier use's gradients (a copy, in their own dtype; ``None``
    stays ``None``) and adds the next ones in place; ``release_uses`` adds the last use's:
    ``(g3 + g2) + g1``, the sum autograd makes of the uses' gradients in one ``.grad``."""
    g = [
        torch.randn(5, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(k))
        for k in range(3)
    ]
    held = hold_use(None, [g[2], None])
    assert held[0] is not None and held[0] is not g[2] and held[0].dtype == torch.bfloat16
    assert held[1] is None and torch.equal(g[2], held[0])
    held = hold_use(held, [g[1], None])
    out = release_uses(held, [g[0], None])
    assert out[1] is None and torch.equal(out[0], (g[2] + g[1]) + g[0])
    with pytest.raises(LayoutMismatchError, match="held"):
        release_uses(held, [g[0]])
