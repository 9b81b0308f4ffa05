"""The transitions as a state machine, one conformance suite over every transition (packed and
pieces collectives), the bad-input catalogue, and pieces-vs-packed equality."""

from __future__ import annotations

from typing import Any

import attrs
import optree
import pytest
import torch
from _helpers import assert_bit_equal, assert_unchanged, leaves, random_like, snapshot
from _transition_helpers import (
    assert_grads,
    divisors,
    mean_of,
    shard_all,
    unshard_all,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from strategies import param_trees, world_sizes

from functional_fsdp.core._tree import tree_leaves
from functional_fsdp.core.errors import (
    IndivisibleError,
    LayoutMismatchError,
    MeshError,
    ScalarParameterError,
    StateError,
)
from functional_fsdp.core.records import PostForwardState, ShardedState, UnshardedState
from functional_fsdp.core.transitions import (
    ReducePolicy,
    ReduceState,
    begin_unshard,
    finish_unshard,
    reduce_grad,
    reduce_grad_with_state,
    reshard,
    shard,
    unshard,
    writeback,
)
from functional_fsdp.testing import SimulatedWorld

FP32 = [torch.float32]
SEEDS = st.integers(0, 2**16)


# ---------------------------------------------------------------------- the state machine


class TransitionMachine(RuleBasedStateMachine):
    """Random sequences of transitions on every rank; the model of truth is the full tensors."""

    @initialize(tree=param_trees(dtypes=FP32, max_leaves=3), ws=world_sizes(max_size=6))
    def start(self, tree: Any, ws: int) -> None:
        self.ws = ws
        self.world = SimulatedWorld(ws)
        self.structure = optree.tree_structure(tree)
        self.truth = [t.clone() for t in leaves(tree)]
        self.truth_grads: list[torch.Tensor | None] = [None] * len(self.truth)
        self.states: list[Any] = shard_all(tree, ws)
        self.layout = self.states[0].layout

    def _kind(self) -> type:
        return type(self.states[0])

    def _is(self, kind: type) -> bool:
        return isinstance(self.states[0], kind)

    def _sharded(self) -> list[ShardedState]:
        """The sharded state under the current one (it owns the gradients)."""
        return [s if isinstance(s, ShardedState) else s.source for s in self.states]

    @precondition(lambda self: self._is(ShardedState) or self._is(PostForwardState))
    @rule()
    def do_unshard(self) -> None:
        self.states = self._unshard(self.states)

    def _unshard(self, states: list[Any]) -> list[UnshardedState]:
        if isinstance(states[0], PostForwardState):
            k = states[0].group_size
            return unshard_all(self.world, states, lambda c: self.world.sub_group_comm(c.rank, k))
        return unshard_all(self.world, states)

    @precondition(lambda self: self._is(UnshardedState))
    @rule()
    def do_reshard(self) -> None:
        self.states = [reshard(u) for u in self.states]

    @precondition(lambda self: self._is(UnshardedState))
    @rule(data=st.data())
    def do_reshard_after_forward(self, data: st.DataObject) -> None:
        k = data.draw(st.sampled_from(divisors(self.ws)), label="group_size")
        self.states = [reshard(u, group_size=k) for u in self.states]

    @precondition(lambda self: self._is(PostForwardState))
    @rule()
    def do_drop_post_forward(self) -> None:
        self.states = [pf.source for pf in self.states]

    @precondition(lambda self: self._is(UnshardedState))
    @rule(seed=SEEDS)
    def do_edit_and_writeback(self, seed: int) -> None:
        edited = random_like(self.truth, seed)
        self.states = [writeback(attrs.evolve(u, params=tuple(edited))) for u in self.states]
        self.truth = edited

    @precondition(lambda self: self._is(ShardedState))
    @rule(seed=SEEDS, accumulate=st.booleans())
    def do_reduce_grad(self, seed: int, accumulate: bool) -> None:
        grads = [random_like(self.truth, seed + r) for r in range(self.ws)]
        spec = self.states[0].layout.treespec
        # In the structure the state was sharded from (a flat list is refused for dict trees).
        trees = [g if spec is None else optree.tree_unflatten(spec, g) for g in grads]
        self.states = self.world.run(
            lambda c, g, s: reduce_grad(g, s, c, accumulate=accumulate), trees, self.states
        )
        for i in range(len(self.truth)):
            mean = mean_of(grads, i).float()
            old = self.truth_grads[i]
            self.truth_grads[i] = mean + old if (accumulate and old is not None) else mean

    @invariant()
    def states_are_consistent(self) -> None:
        kind = self._kind()
        assert kind in (ShardedState, UnshardedState, PostForwardState)
        assert all(type(s) is kind for s in self.states)
        assert [s.rank for s in self.states] == list(range(self.ws))
        assert all(s.layout == self.layout for s in self.states)

    @invariant()
    def unshard_gives_the_truth(self) -> None:
        full = self.states if self._is(UnshardedState) else self._unshard(self.states)
        for u in full:
            for got, want in zip(u.params, self.truth):
                assert_bit_equal(got, want)
        assert optree.tree_structure(full[0].tree()) == self.structure

    @invariant()
    def grads_are_the_truth(self) -> None:
        assert_grads(self._sharded(), self.truth_grads, self.ws, atol=1e-5, rtol=1e-5)


TestTransitionMachine = TransitionMachine.TestCase
TestTransitionMachine.settings = settings(stateful_step_count=8)


# --------------------------------------------------------------------------- conformance


@attrs.frozen
class _Ctx:
    tree: Any
    ws: int
    world: SimulatedWorld
    grads: list[Any]


def _prepared(c: Any, ctx: _Ctx) -> tuple[ShardedState, UnshardedState]:
    s = reduce_grad(ctx.grads[c.rank], shard(ctx.tree, world_size=ctx.ws, rank=c.rank), c)
    return s, unshard(s, c)


def _case_shard(c, ctx):
    return (ctx.tree,), lambda: shard(ctx.tree, world_size=ctx.ws, rank=c.rank)


def _case_unshard(c, ctx):
    s, _ = _prepared(c, ctx)
    return (s,), lambda: unshard(s, c)


def _case_reshard(c, ctx):
    _, u = _prepared(c, ctx)
    return (u,), lambda: reshard(u)


def _case_reshard_after_forward(c, ctx):
    _, u = _prepared(c, ctx)
    k = divisors(ctx.ws)[-2] if ctx.ws > 1 else 1
    return (u,), lambda: reshard(u, group_size=k)


def _case_unshard_post_forward(c, ctx):
    _, u = _prepared(c, ctx)
    k = divisors(ctx.ws)[-2] if ctx.ws > 1 else 1
    pf = reshard(u, group_size=k)
    if k == ctx.ws:
        return (pf,), lambda: unshard(pf, c)
    return (pf,), lambda: unshard(pf, ctx.world.sub_group_comm(c.rank, k))


def _case_writeback(c, ctx):
    s, u = _prepared(c, ctx)
    edited = attrs.evolve(u, params=tuple(p + 1 for p in u.params))
    return (edited, s), lambda: writeback(edited, s)


def _case_unshard_into(c, ctx):
    s, _ = _prepared(c, ctx)
    lay = s.layout
    buf = torch.empty(ctx.ws * lay.gather.total, dtype=lay.gather_buffer_dtype)
    # ``buf`` is donated (written by design); only the sharded state must stay as it was.
    return (s,), lambda: finish_unshard(begin_unshard(s, c, async_op=False, into=buf))


def _case_reduce_grad(c, ctx):
    s, _ = _prepared(c, ctx)
    g = ctx.grads[c.rank]
    return (g, s), lambda: reduce_grad(g, s, c)


def _case_reduce_grad_partial(c, ctx):
    s, _ = _prepared(c, ctx)
    g = ctx.grads[c.rank]
    rc = ctx.world.replicate_comm(c.rank)
    keep = ReducePolicy(all_reduce=False)
    held, kept = reduce_grad_with_state(g, s, ReduceState(), c, replicate_comm=rc, policy=keep)
    return (g, held, kept), lambda: reduce_grad_with_state(g, held, kept, c, replicate_comm=rc)


CONFORMANCE = {
    "shard": _case_shard,
    "unshard": _case_unshard,
    "unshard_into": _case_unshard_into,
    "reshard": _case_reshard,
    "reshard_after_forward": _case_reshard_after_forward,
    "unshard_post_forward": _case_unshard_post_forward,
    "writeback": _case_writeback,
    "reduce_grad": _case_reduce_grad,
    "reduce_grad_partial": _case_reduce_grad_partial,
}


class _Recording:
    """A communicator that delegates to ``comm`` and records the collectives called on it."""

    def __init__(self, comm: Any, calls: list[str]) -> None:
        self._comm, self._calls = comm, calls

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._comm, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kw: Any) -> Any:
            self._calls.append(name)
            return attr(*args, **kw)

        return call


# The transitions whose collectives (on the shard communicator) have a pieces form there.
_PIECES = {
    "unshard_into": "all_gather_pieces",
    "reduce_grad": "reduce_scatter_pieces",
    "reduce_grad_partial": "reduce_scatter_pieces",
}


@pytest.mark.parametrize("pieces", [False, True], ids=["packed", "pieces"])
@pytest.mark.parametrize("name", sorted(CONFORMANCE))
@given(tree=param_trees(dtypes=FP32, max_leaves=3), ws=world_sizes(max_size=4), seed=SEEDS)
@settings(max_examples=10)
def test_transition_conformance(name: str, pieces: bool, tree: Any, ws: int, seed: int) -> None:
    """Every transition leaves its inputs unchanged and returns a frozen record, on the packed
    collectives and on the pieces ones (gather straight into ``into=``, unpacked reductions)."""
    ctx = _Ctx(
        tree,
        ws,
        SimulatedWorld(ws, mesh_shape=(1, ws), pieces=pieces),
        [random_like(tree, seed + r) for r in range(ws)],
    )

    def body(c):
        calls: list[str] = []
        inputs, call = CONFORMANCE[name](_Recording(c, calls), ctx)
        before = snapshot(*inputs)
        del calls[:]  # only the transition under test
        return inputs, before, call(), calls

    for inputs, before, out, calls in ctx.world.run(body):
        if name in _PIECES and ws > 1:  # the path under test is the one taken
            assert (_PIECES[name] in calls) == pieces, calls
        assert_unchanged(before, *inputs)
        # A stateful reduction returns its new reduction state beside the sharded state.
        for rec in out if isinstance(out, tuple) else (out,):
            assert isinstance(rec, (ShardedState, UnshardedState, PostForwardState, ReduceState))
            assert attrs.has(type(rec))
            with pytest.raises(attrs.exceptions.FrozenInstanceError):
                rec.rank = 0
            assert all(isinstance(t, torch.Tensor) for t in tree_leaves(rec))


# ---------------------------------------------------------------------------- bad input


def test_scalar_leaf_raises() -> None:
    with pytest.raises(ScalarParameterError, match="temperature"):
        shard({"temperature": torch.tensor(1.0)}, world_size=2, rank=0)


def test_non_tensor_leaf_raises() -> None:
    with pytest.raises(TypeError, match="'lr'"):
        shard({"lr": 0.1}, world_size=2, rank=0)


def test_non_divisible_shard_dim_raises() -> None:
    with pytest.raises(IndivisibleError) as info:
        shard({"w": torch.randn(4, 6)}, world_size=4, rank=0, shard_dims=1)
    assert (info.value.dim, info.value.size, info.value.factor) == (1, 6, 4)
    assert "'w'" in str(info.value) or "w:" in str(info.value)


def test_wrong_communicator_size_raises_before_any_collective() -> None:
    s = shard({"w": torch.randn(5, 3)}, world_size=4, rank=0)
    before = snapshot(s)
    comm = SimulatedWorld(2).comm(0)  # a 2-rank group: a collective here would hang rank 0
    with pytest.raises(MeshError, match="4"):
        unshard(s, comm)
    with pytest.raises(MeshError):
        reduce_grad([torch.ones(5, 3)], s, comm)
    assert_unchanged(before, s)


def test_post_forward_needs_its_sub_group() -> None:
    world = SimulatedWorld(4)
    tree = {"w": torch.randn(5, 3)}
    outs = world.run(
        lambda c: reshard(unshard(shard(tree, world_size=4, rank=c.rank), c), group_size=2)
    )
    with pytest.raises(MeshError):
        unshard(outs[1], world.comm(1))  # the full group, not the 2-rank sub-group
    with pytest.raises(MeshError, match="sub-rank"):
        unshard(outs[1], SimulatedWorld(2).comm(0))  # a sub-group, but the wrong position in it


def test_wrong_state_raises_state_error() -> None:
    s = shard({"w": torch.randn(5, 3)}, world_size=1, rank=0)
    u = unshard(s, SimulatedWorld(1).comm(0))
    with pytest.raises(StateError, match="already sharded"):
        reshard(s)
    with pytest.raises(StateError, match="already unsharded"):
        unshard(u, SimulatedWorld(1).comm(0))
    with pytest.raises(StateError):
        writeback(s)
    with pytest.raises(StateError):
        writeback(u, u)
    with pytest.raises(StateError):
        reduce_grad([torch.ones(5, 3)], u, SimulatedWorld(1).comm(0))
    orphan = UnshardedState(u.layout, 0, u.params)  # no sharded source
    with pytest.raises(StateError):
        reshard(orphan)
    with pytest.raises(StateError):
        writeback(orphan)


def test_mismatched_shapes_raise_layout_mismatch() -> None:
    s = shard({"w": torch.randn(5, 3), "b": torch.randn(3)}, world_size=2, rank=0)
    with pytest.raises(LayoutMismatchError, match="'w'"):
        reduce_grad({"b": torch.ones(3), "w": torch.ones(5, 4)}, s, SimulatedWorld(2).comm(0))
    # A flat list for a dict tree is ambiguous (layout order is sorted keys): refused, naming
    # the keys, even when its shapes would happen to fit.
    with pytest.raises(LayoutMismatchError, match=r"dict with keys \['b', 'w'\]"):
        reduce_grad([torch.ones(3), torch.ones(5, 3)], s, SimulatedWorld(2).comm(0))
    with pytest.raises(LayoutMismatchError, match="dict with keys"):
        reduce_grad([torch.ones(3)], s, SimulatedWorld(2).comm(0))
    flat = shard([torch.randn(5, 3), torch.randn(3)], world_size=2, rank=0)
    with pytest.raises(LayoutMismatchError, match="got 1"):
        reduce_grad([torch.ones(5, 3)], flat, SimulatedWorld(2).comm(0))
    with pytest.raises(LayoutMismatchError, match="missing key"):
        reduce_grad({"w": torch.ones(5, 3)}, s, SimulatedWorld(2).comm(0))
    other = shard({"w": torch.randn(6, 3), "b": torch.randn(3)}, world_size=2, rank=0)
    u = UnshardedState(s.layout, 0, (torch.zeros(3), torch.zeros(5, 3)), source=s)
    with pytest.raises(LayoutMismatchError, match="different layouts"):
        writeback(u, other)
    with pytest.raises(IndivisibleError):
        reshard(u, group_size=3)


# --------------------------------------------------------------------- pieces vs packed paths


@given(tree=param_trees(), ws=world_sizes(), seed=st.integers(0, 2**16))
def test_pieces_paths_equal_packed_paths(tree: Any, ws: int, seed: int) -> None:
    """A communicator with pieces collectives gathers into the buffer and reduces unpacked
    gradient rows; results are bit-identical to the packed paths (padding and empty shards too).

    Trees mix dtypes. A mixed-dtype group cannot take the pieces gather: its gather buffer is
    raw bytes (``uint8``, each parameter's region viewed as its dtype), while the pieces
    collectives exchange one typed tensor per parameter, so ``begin_unshard`` keeps the packed
    gather for it (checked below). Its reduction can take the pieces path (the gradients are
    cast to the one reduce dtype first), except in float16, which pre-divides the packed buffer
    against overflow.
    """
    grads = [random_like(tree, seed + r) for r in range(ws)]
    uniform = len({t.dtype for t in leaves(tree)}) == 1

    def body(comm: Any, g: Any) -> tuple[tuple[torch.Tensor, ...], tuple[Any, ...] | None, Any]:
        calls: list[str] = []
        rec = _Recording(comm, calls)
        s = shard(tree, world_size=ws, rank=comm.rank)
        lay = s.layout
        buf = torch.empty(ws * lay.gather.total, dtype=lay.gather_buffer_dtype)
        full = finish_unshard(begin_unshard(s, rec, async_op=False, into=buf))
        return full.params, reduce_grad(g, s, rec).grads, (calls, lay.grad_reduce_dtype())

    packed = SimulatedWorld(ws).run(body, grads)
    pieces = SimulatedWorld(ws, pieces=True).run(body, grads)
    for (p_full, p_grads, (p_calls, _)), (q_full, q_grads, (q_calls, rdtype)) in zip(
        packed, pieces
    ):
        assert not any(c.endswith("_pieces") for c in p_calls), p_calls
        if ws > 1:
            assert ("all_gather_pieces" in q_calls) == uniform, q_calls
            assert ("reduce_scatter_pieces" in q_calls) == (rdtype != torch.float16), q_calls
        for a, b in zip(p_full, q_full):
            assert_bit_equal(a, b)
        assert (p_grads is None) == (q_grads is None)
        for a, b in zip(p_grads or (), q_grads or ()):
            assert (a is None) == (b is None)
            if a is not None:
                assert_bit_equal(a, b)
