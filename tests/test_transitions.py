"""functional_fsdp.transitions over a simulated world: properties, a state machine, conformance.

Oracles never use the library: shards are ``torch.chunk`` slices (``distribute_tensor``'s
semantics), reduced gradients are dense means of every rank's full gradient, sliced the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import optree
import pytest
import torch
from _helpers import assert_bit_equal, assert_unchanged, leaves, oracle_local, random_like, snapshot
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from strategies import float_dtypes, mesh_shapes, param_trees, world_sizes

from functional_fsdp import layout as L
from functional_fsdp._tree import tree_leaves
from functional_fsdp.errors import (
    IndivisibleError,
    LayoutMismatchError,
    MeshError,
    ScalarParameterError,
    StateError,
)
from functional_fsdp.records import PostForwardState, ShardedState, UnshardedState
from functional_fsdp.testing import SimulatedWorld
from functional_fsdp.transitions import (
    begin_unshard,
    finish_unshard,
    post_forward_from_gather,
    reduce_grad,
    reshard,
    shard,
    unshard,
    writeback,
)

FP32 = [torch.float32]
SEEDS = st.integers(0, 2**16)


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def shard_all(tree: Any, ws: int, **kw: Any) -> list[ShardedState]:
    """Every rank's shard (sharding needs no communication)."""
    return [shard(tree, world_size=ws, rank=r, **kw) for r in range(ws)]


def unshard_all(
    world: SimulatedWorld, states: list[Any], comm: Callable[[Any], Any] | None = None
) -> list[UnshardedState]:
    return world.run(lambda c, s: unshard(s, comm(c) if comm else c), states)


def mean_of(per_rank: list[Any], i: int) -> torch.Tensor:
    """Dense mean (in float64) of leaf ``i`` over ranks' full gradients."""
    return torch.stack([leaves(g)[i].double() for g in per_rank]).mean(0)


# Default tolerances by the dtype the gradient comes back in. float32: a mean of a few values
# of magnitude <= 4, rounded at each of a few adds and one divide. bfloat16 reduced in float32:
# one rounding of the float32 mean to bfloat16 (at most one bfloat16 ulp, 2**-7 relative).
_GRAD_TOL = {
    torch.float32: {"atol": 1e-6, "rtol": 1e-5},
    torch.bfloat16: {"atol": 1e-6, "rtol": 2**-7},
}


def assert_grads(
    states: list[ShardedState], full: list[torch.Tensor | None], ws: int, **tol: Any
) -> None:
    """Each rank's sharded grads equal its slice of ``full``; padding rows are zero.

    ``tol`` (``atol``/``rtol``) applies to every leaf; without it each leaf gets its dtype's
    tolerance from ``_GRAD_TOL``.
    """
    for r, s in enumerate(states):
        for i, want in enumerate(full):
            got = s.local_grad(i)
            if want is None:
                assert got is None
                continue
            assert got is not None and got.dtype == s.layout.specs[i].dtype
            expected = oracle_local(want, ws, r).to(got.dtype)
            torch.testing.assert_close(got, expected, **(tol or _GRAD_TOL[got.dtype]))
            padded = s.grads[i]
            assert not padded.narrow(0, got.shape[0], padded.shape[0] - got.shape[0]).any()


# --------------------------------------------------------------------------- shard / unshard


@given(tree=param_trees(), ws=world_sizes())
def test_round_trip_is_bit_exact(tree: Any, ws: int) -> None:
    outs = unshard_all(SimulatedWorld(ws), shard_all(tree, ws))
    for out in outs:
        back = out.tree()
        assert optree.tree_structure(back) == optree.tree_structure(tree)
        for got, want in zip(leaves(back), leaves(tree)):
            assert_bit_equal(got, want)


@given(
    tree=param_trees(dtypes=[torch.float32, torch.bfloat16, torch.float16, torch.int64]),
    ws=world_sizes(),
    param_dtype=float_dtypes(),
)
def test_round_trip_casts_to_param_dtype(tree: Any, ws: int, param_dtype: torch.dtype) -> None:
    outs = unshard_all(SimulatedWorld(ws), shard_all(tree, ws, param_dtype=param_dtype))
    for out in outs:
        for got, want in zip(out.params, leaves(tree)):
            # param_dtype applies to floating-point parameters only
            assert_bit_equal(got, want.to(param_dtype) if want.is_floating_point() else want)


@given(tree=param_trees(), ws=world_sizes())
def test_shards_match_the_chunk_oracle(tree: Any, ws: int) -> None:
    from torch.distributed.tensor import Shard  # only its splitter, no process group

    states = shard_all(tree, ws)
    for i, full in enumerate(leaves(tree)):
        padded_rows = 0
        dtensor_padded, _ = Shard(0)._split_tensor(full, ws, with_padding=True)
        for r, s in enumerate(states):
            local = s.local(i)
            assert_bit_equal(local, oracle_local(full, ws, r))
            assert local.shape[1:] == full.shape[1:]  # empty shards keep the other dims
            padded = s.shard(i)
            assert padded.shape[0] == L.chunk_size(full.shape[0], ws)
            assert_bit_equal(padded, dtensor_padded[r])  # zero padding, as distribute_tensor pads
            padded_rows += padded.shape[0]
        assert padded_rows == L.padded_size(full.shape[0], ws)
        assert sum(s.local(i).shape[0] for s in states) == full.shape[0]


@given(ws=world_sizes(min_size=2), rows=st.integers(0, 9), data=st.data())
def test_shard_dim_one(ws: int, rows: int, data: st.DataObject) -> None:
    cols = ws * data.draw(st.integers(0, 3))
    tree = {"w": torch.randn(rows, cols), "b": torch.randn(5)}
    dims = lambda fqn, t: 1 if fqn == "w" else 0  # noqa: E731
    states = shard_all(tree, ws, shard_dims=dims)
    for r, s in enumerate(states):
        assert_bit_equal(s.local(1), torch.chunk(tree["w"], ws, dim=1)[r] if cols else tree["w"])
    for out in unshard_all(SimulatedWorld(ws), states):
        assert_bit_equal(out.tree()["w"], tree["w"])
        assert_bit_equal(out.tree()["b"], tree["b"])


def test_spec_example_shards() -> None:
    full = torch.arange(15.0).view(5, 3)
    states = shard_all({"w": full}, 4)
    assert [tuple(s.local(0).shape) for s in states] == [(2, 3), (2, 3), (1, 3), (0, 3)]
    assert torch.equal(states[3].shard(0), torch.zeros(2, 3))


# ------------------------------------------------------------------------------ reduce_grad


@given(tree=param_trees(dtypes=FP32), ws=world_sizes(), seed=SEEDS)
def test_reduce_grad_is_the_dense_mean(tree: Any, ws: int, seed: int) -> None:
    grads = [random_like(tree, seed + r) for r in range(ws)]
    outs = SimulatedWorld(ws).run(
        lambda c, g: reduce_grad(g, shard(tree, world_size=ws, rank=c.rank), c), grads
    )
    assert_grads(outs, [mean_of(grads, i) for i in range(len(leaves(tree)))], ws)


@given(tree=param_trees(dtypes=[torch.float16], max_leaves=3), ws=world_sizes(), seed=SEEDS)
def test_reduce_grad_fp16_pre_post_divide(tree: Any, ws: int, seed: int) -> None:
    grads = [random_like(tree, seed + r) for r in range(ws)]
    outs = SimulatedWorld(ws).run(
        lambda c, g: reduce_grad(g, shard(tree, world_size=ws, rank=c.rank), c), grads
    )
    assert_grads(
        outs, [mean_of(grads, i) for i in range(len(leaves(tree)))], ws, atol=1e-2, rtol=1e-2
    )


def test_reduce_grad_fp16_does_not_overflow() -> None:
    """8 ranks x 16384 overflows float16 (max 65504) unless divided before the sum (4 then 2)."""
    ws = 8
    tree = {"w": torch.zeros(8, dtype=torch.float16)}
    grads = [{"w": torch.full((8,), 16384.0, dtype=torch.float16)} for _ in range(ws)]
    outs = SimulatedWorld(ws).run(
        lambda c, g: reduce_grad(g, shard(tree, world_size=ws, rank=c.rank), c), grads
    )
    for s in outs:
        assert torch.equal(s.local_grad(0), torch.full((1,), 16384.0, dtype=torch.float16))


@given(tree=param_trees(dtypes=[torch.bfloat16], max_leaves=3), ws=world_sizes(), seed=SEEDS)
def test_reduce_grad_bf16(tree: Any, ws: int, seed: int) -> None:
    grads = [random_like(tree, seed + r) for r in range(ws)]
    outs = SimulatedWorld(ws).run(
        lambda c, g: reduce_grad(g, shard(tree, world_size=ws, rank=c.rank), c), grads
    )
    assert_grads(
        outs, [mean_of(grads, i) for i in range(len(leaves(tree)))], ws, atol=2e-2, rtol=2e-2
    )


@given(
    tree=param_trees(dtypes=FP32, max_leaves=3),
    ws=world_sizes(),
    seed=SEEDS,
    factor=st.sampled_from([None, 1.0, 3.0, 0.5, "ws", "2ws"]),
)
def test_reduce_grad_custom_divide_factor(tree: Any, ws: int, seed: int, factor: Any) -> None:
    f = {"ws": float(ws), "2ws": 2.0 * ws}.get(factor, factor)
    grads = [random_like(tree, seed + r) for r in range(ws)]
    outs = SimulatedWorld(ws).run(
        lambda c, g: reduce_grad(g, shard(tree, world_size=ws, rank=c.rank), c, divide_factor=f),
        grads,
    )
    scale = ws / (f if f is not None else ws)  # sum / f == mean * ws / f
    assert_grads(
        outs,
        [mean_of(grads, i) * scale for i in range(len(leaves(tree)))],
        ws,
        atol=1e-5,
        rtol=1e-5,
    )


@given(tree=param_trees(dtypes=FP32, max_leaves=3), ws=world_sizes(), seed=SEEDS)
def test_reduce_grad_force_sum_matches_avg(tree: Any, ws: int, seed: int) -> None:
    grads = [random_like(tree, seed + r) for r in range(ws)]
    outs = SimulatedWorld(ws).run(
        lambda c, g: reduce_grad(g, shard(tree, world_size=ws, rank=c.rank), c, force_sum=True),
        grads,
    )
    assert_grads(outs, [mean_of(grads, i) for i in range(len(leaves(tree)))], ws)


def test_reduce_grad_mixed_dtypes_uses_reduce_dtype() -> None:
    ws = 4
    tree = {
        "a": torch.randn(5, 2, requires_grad=True),
        "b": torch.randn(3, dtype=torch.bfloat16, requires_grad=True),
    }
    grads = [random_like(tree, r) for r in range(ws)]
    with pytest.raises(LayoutMismatchError, match="reduce_dtype"):
        SimulatedWorld(ws).run(
            lambda c, g: reduce_grad(g, shard(tree, world_size=ws, rank=c.rank), c), grads
        )
    outs = SimulatedWorld(ws).run(
        lambda c, g: reduce_grad(
            g, shard(tree, world_size=ws, rank=c.rank, reduce_dtype=torch.float32), c
        ),
        grads,
    )
    # grads come back in each parameter's own dtype, each checked at its dtype's tolerance
    # (the float32 leaf is not held to bfloat16's)
    assert_grads(outs, [mean_of(grads, i) for i in range(2)], ws)


@given(tree=param_trees(dtypes=FP32, max_leaves=3), mesh=mesh_shapes(), seed=SEEDS)
@settings(max_examples=20)
def test_hsdp_reduce_is_the_mean_over_all_ranks(
    tree: Any, mesh: tuple[int, int], seed: int
) -> None:
    reps, shards = mesh
    n = reps * shards
    world = SimulatedWorld(n, mesh_shape=mesh)
    first = [random_like(tree, seed + r) for r in range(n)]
    second = [random_like(tree, seed + n + r) for r in range(n)]

    def body(c, g1, g2):
        sc, rc = world.shard_comm(c.rank), world.replicate_comm(c.rank)
        s0 = shard(tree, world_size=shards, rank=sc.rank)
        now = reduce_grad(g1, s0, sc, replicate_comm=rc)
        held = reduce_grad(g1, s0, sc, replicate_comm=rc, all_reduce=False)
        later = reduce_grad(g2, held, sc, replicate_comm=rc)
        return now, held, later

    outs = world.run(body, first, second)
    k = len(leaves(tree))
    for row in range(reps):
        ranks = range(row * shards, row * shards + shards)
        assert_grads([outs[r][0] for r in ranks], [mean_of(first, i) for i in range(k)], shards)
        assert_grads([outs[r][1] for r in ranks], [None] * k, shards)  # nothing reduced yet...
        assert all(outs[r][1].partial is not None for r in ranks)  # ...but kept as a partial
        both = [mean_of(first, i) + mean_of(second, i) for i in range(k)]
        assert_grads([outs[r][2] for r in ranks], both, shards)
        assert all(outs[r][2].partial is None for r in ranks)


@given(tree=param_trees(dtypes=FP32, max_leaves=3), ws=world_sizes(), seed=SEEDS)
def test_reduce_grad_accumulates(tree: Any, ws: int, seed: int) -> None:
    g1 = [random_like(tree, seed + r) for r in range(ws)]
    g2 = [random_like(tree, seed + ws + r) for r in range(ws)]

    def body(c, a, b):
        s1 = reduce_grad(a, shard(tree, world_size=ws, rank=c.rank), c)
        return s1, reduce_grad(b, s1, c), reduce_grad(b, s1, c, accumulate=False)

    outs = SimulatedWorld(ws).run(body, g1, g2)
    k = len(leaves(tree))
    assert_grads([o[0] for o in outs], [mean_of(g1, i) for i in range(k)], ws)
    assert_grads([o[1] for o in outs], [mean_of(g1, i) + mean_of(g2, i) for i in range(k)], ws)
    assert_grads([o[2] for o in outs], [mean_of(g2, i) for i in range(k)], ws)


def test_reduce_grad_skips_missing_grads_unless_reduce_unused() -> None:
    ws = 4
    tree = [torch.randn(5, 2, requires_grad=True), torch.randn(3, requires_grad=True)]
    grads = [[torch.randn(5, 2), None] for _ in range(ws)]

    def body(c, g):
        s = shard(tree, world_size=ws, rank=c.rank)
        kept = reduce_grad(g, s, c)
        unused = reduce_grad(g, s, c, reduce_unused=True)
        again = reduce_grad([None, None], kept, c)  # no grads at all: existing ones are kept
        return kept, unused, again

    outs = SimulatedWorld(ws).run(body, grads)
    mean = torch.stack([g[0] for g in grads]).mean(0)
    assert_grads([o[0] for o in outs], [mean, None], ws)
    assert_grads([o[1] for o in outs], [mean, torch.zeros(3)], ws)
    assert_grads([o[2] for o in outs], [mean, None], ws)


# ----------------------------------------------------------------- writeback and reshard


@given(tree=param_trees(), ws=world_sizes(), seed=SEEDS, in_place=st.booleans())
def test_writeback_then_unshard_returns_the_edits(
    tree: Any, ws: int, seed: int, in_place: bool
) -> None:
    edited = random_like(tree, seed)

    def body(c):
        s = shard(tree, world_size=ws, rank=c.rank)
        u = unshard(s, c)
        if in_place:  # as inside summon_full_params(writeback=True)
            for p, e in zip(u.params, leaves(edited)):
                p.copy_(e)
            s2 = writeback(u)
        else:
            s2 = writeback(attrs.evolve(u, params=tuple(leaves(edited))))
        return s, s2, unshard(s2, c)

    outs = SimulatedWorld(ws).run(body)
    for s, _, u2 in outs:
        for got, want in zip(u2.params, leaves(edited)):
            assert_bit_equal(got, want)
        if not in_place:  # the original sharded state still holds the original values
            for i, want in enumerate(leaves(tree)):
                assert_bit_equal(s.local(i), oracle_local(want, ws, s.rank))


def test_writeback_keeps_grads_and_casts_back_from_param_dtype() -> None:
    ws = 2
    tree = {"w": torch.randn(3, 4)}
    edited = torch.randn(3, 4).to(torch.bfloat16)

    def body(c):
        s = reduce_grad(
            {"w": torch.ones(3, 4)},
            shard(tree, world_size=ws, rank=c.rank, param_dtype=torch.bfloat16),
            c,
        )
        u = unshard(s, c)
        s2 = writeback(attrs.evolve(u, params=(edited,)))
        return s, s2, unshard(s2, c)

    for s, s2, u2 in SimulatedWorld(ws).run(body):
        assert s2.grads is s.grads
        assert s2.flat.dtype == torch.float32
        assert_bit_equal(u2.params[0], edited)


@given(tree=param_trees(), ws=world_sizes())
def test_reshard_returns_the_original_sharded_state(tree: Any, ws: int) -> None:
    states = shard_all(tree, ws)
    outs = unshard_all(SimulatedWorld(ws), states)
    for s, u in zip(states, outs):
        assert reshard(u) is s
        assert reshard(u, group_size=ws) is s


@given(tree=param_trees(), ws=world_sizes(), param_dtype=st.none() | float_dtypes(), data=st.data())
def test_reshard_to_sub_group_then_unshard(
    tree: Any, ws: int, param_dtype: Any, data: st.DataObject
) -> None:
    k = data.draw(st.sampled_from(divisors(ws)), label="group_size")
    world = SimulatedWorld(ws)

    def body(c):
        s = shard(tree, world_size=ws, rank=c.rank, param_dtype=param_dtype)
        u = unshard(s, c)
        pf = reshard(u, group_size=k)
        if k == ws:
            return u, pf, None, None
        sub = world.sub_group_comm(c.rank, k)
        # the shell's path: slice the padded all-gather output instead of the full tensors
        sliced = post_forward_from_gather(
            s.layout, c.rank, k, begin_unshard(s, c, async_op=False).output, s
        )
        return u, pf, sliced, unshard(pf, sub)

    for r, (u, pf, sliced, u2) in enumerate(world.run(body)):
        if k == ws:
            assert isinstance(pf, ShardedState)
            continue
        assert isinstance(pf, PostForwardState) and pf.group_size == k and pf.sub_rank == r % k
        assert_bit_equal(pf.rows, sliced.rows)
        for got, want in zip(u2.params, u.params):
            assert_bit_equal(got, want)
        assert reshard(u2) is pf.source


# ------------------------------------------------------------------ world-size invariance


def _sgd_step(state: ShardedState, lr: float) -> ShardedState:
    """Plain SGD on the padded shards (padding grads are zero, so padding stays zero)."""
    new = attrs.evolve(state, flat=state.flat.clone(), grads=None)
    for i, g in enumerate(state.grads):
        new.shard(i).sub_(lr * g)
    return new


def _train_linear_regression(ws: int, steps: int = 4, lr: float = 0.1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 5, generator=gen), torch.randn(8, 3, generator=gen)
    params = {"w": torch.randn(3, 5, generator=gen), "b": torch.randn(3, generator=gen)}

    def body(c):
        xs, ys = x.chunk(ws)[c.rank], y.chunk(ws)[c.rank]
        state = shard(params, world_size=ws, rank=c.rank)
        for _ in range(steps):
            full = unshard(state, c)
            p = {k: v.detach().requires_grad_() for k, v in full.tree().items()}
            loss = ((xs @ p["w"].T + p["b"] - ys) ** 2).mean()
            gw, gb = torch.autograd.grad(loss, [p["w"], p["b"]])
            state = reduce_grad({"w": gw, "b": gb}, reshard(full), c, accumulate=False)
            state = _sgd_step(state, lr)
        return unshard(state, c).tree()

    outs = SimulatedWorld(ws).run(body)
    for o in outs[1:]:
        for k in o:
            assert_bit_equal(o[k], outs[0][k])  # every rank ends with the same parameters
    return outs[0]


def test_training_does_not_depend_on_world_size() -> None:
    results = {ws: _train_linear_regression(ws) for ws in (1, 2, 4)}
    # dense reference without any sharding
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 5, generator=gen), torch.randn(8, 3, generator=gen)
    w, b = torch.randn(3, 5, generator=gen), torch.randn(3, generator=gen)
    for _ in range(4):
        w.requires_grad_(), b.requires_grad_()
        gw, gb = torch.autograd.grad(((x @ w.T + b - y) ** 2).mean(), [w, b])
        w, b = (w - 0.1 * gw).detach(), (b - 0.1 * gb).detach()
    for ws, got in results.items():
        torch.testing.assert_close(got["w"], w, atol=1e-5, rtol=1e-5, msg=f"ws={ws}")
        torch.testing.assert_close(got["b"], b, atol=1e-5, rtol=1e-5, msg=f"ws={ws}")
    assert not torch.equal(results[1]["w"], _train_linear_regression(1, steps=0)["w"])  # it trained


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
    held = reduce_grad(g, s, c, replicate_comm=rc, all_reduce=False)
    return (g, held), lambda: reduce_grad(g, held, c, replicate_comm=rc)


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
        assert isinstance(out, (ShardedState, UnshardedState, PostForwardState))
        assert attrs.has(type(out))
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            out.rank = 0
        assert all(isinstance(t, torch.Tensor) for t in tree_leaves(out))


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
