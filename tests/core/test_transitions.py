"""functional_fsdp.core.transitions over a simulated world: properties, a state machine, conformance.

Oracles never use the library: shards are ``torch.chunk`` slices (``distribute_tensor``'s
semantics), reduced gradients are dense means of every rank's full gradient, sliced the same way.
"""

from __future__ import annotations

from typing import Any

import attrs
import optree
import pytest
import torch
from _helpers import assert_bit_equal, leaves, oracle_local, random_like
from _transition_helpers import (
    assert_grads,
    divisors,
    mean_of,
    shard_all,
    unshard_all,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import float_dtypes, mesh_shapes, param_trees, world_sizes

from functional_fsdp.core import layout as L
from functional_fsdp.core.compression import GradCompression
from functional_fsdp.core.errors import LayoutMismatchError, StateError
from functional_fsdp.core.records import PostForwardState, ShardedState
from functional_fsdp.core.reduction import reduce_row_numel
from functional_fsdp.core.transitions import (
    ReducePolicy,
    ReduceState,
    begin_unshard,
    post_forward_from_gather,
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


def test_shard_dims_tree_must_name_every_leaf_and_nothing_else() -> None:
    """``shard_dims`` as a pytree is matched to the tree by key: a missing or unknown key is
    named (it never shifts the next leaves' dims), and a value that is not an int is refused."""
    tree = {"a": torch.randn(4, 2), "b": torch.randn(4, 2), "c": torch.randn(2, 4)}

    def refused(dims: Any) -> str:
        with pytest.raises(LayoutMismatchError) as e:
            shard(tree, world_size=2, rank=0, shard_dims=dims)
        return str(e.value)

    msg = refused({"a": 0, "b": 0})
    assert "shard_dims has no entry for 'c'" in msg and "['a', 'b', 'c']" in msg, msg
    msg = refused({"a": 0, "b": 0, "c": 1, "d": 0})
    assert "shard_dims has entries the tree lacks: 'd'" in msg, msg
    # a misspelt key: before, "c" silently took "x"'s dim and "b" took "c"'s
    msg = refused({"a": 0, "c": 1, "x": 0})
    assert "no entry for 'b'" in msg and "entries the tree lacks: 'x'" in msg, msg
    assert "not an int" in refused({"a": 0, "b": 0, "c": 1.5})
    s = shard(tree, world_size=2, rank=0, shard_dims={"a": 0, "b": 1, "c": 1})
    assert s.layout.shard_dims == (0, 1, 1)


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
        lambda c, g: reduce_grad(
            g, shard(tree, world_size=ws, rank=c.rank), c, policy=ReducePolicy(divide_factor=f)
        ),
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
        lambda c, g: reduce_grad(
            g, shard(tree, world_size=ws, rank=c.rank), c, policy=ReducePolicy(force_sum=True)
        ),
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
        keep = ReducePolicy(all_reduce=False)
        with pytest.raises(StateError, match="reduce_grad_with_state"):
            reduce_grad(g1, s0, sc, replicate_comm=rc, policy=keep)  # it would drop the sum
        held, kept = reduce_grad_with_state(
            g1, s0, ReduceState(), sc, replicate_comm=rc, policy=keep
        )
        later, after = reduce_grad_with_state(g2, held, kept, sc, replicate_comm=rc)
        return now, held, later, kept, after

    outs = world.run(body, first, second)
    k = len(leaves(tree))
    for row in range(reps):
        ranks = range(row * shards, row * shards + shards)
        assert_grads([outs[r][0] for r in ranks], [mean_of(first, i) for i in range(k)], shards)
        assert_grads([outs[r][1] for r in ranks], [None] * k, shards)  # nothing reduced yet...
        assert all(outs[r][3].partial is not None for r in ranks)  # ...but kept as a partial
        both = [mean_of(first, i) + mean_of(second, i) for i in range(k)]
        assert_grads([outs[r][2] for r in ranks], both, shards)
        assert all(outs[r][4].partial is None for r in ranks)


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
        unused = reduce_grad(g, s, c, policy=ReducePolicy(reduce_unused=True))
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


# -------------------------------------------------------------- fields a transition keeps


def _with_every_field(
    state: ShardedState, seed: int, has: dict[str, bool]
) -> tuple[ShardedState, ReduceState]:
    """``state`` and a reduction state with each optional field set (random values of the
    right shape) or ``None``."""
    gen = torch.Generator().manual_seed(seed + state.rank)
    lay = state.layout
    grads = tuple(
        torch.randn(shape, generator=gen).to(s.dtype) if i % 2 == 0 else None
        for i, (shape, s) in enumerate(zip(lay.shard_shapes, lay.specs))
    )
    carry = ReduceState(
        partial=torch.randn(reduce_row_numel(lay, lay.world_size > 1), generator=gen)
        if has["partial"]
        else None,
        residual=torch.randn(lay.world_size * lay.shard_numel, generator=gen)
        if has["residual"]
        else None,
    )
    return attrs.evolve(state, grads=grads if has["grads"] else None), carry


def _assert_carried(before: Any, after: Any, changed: set[str]) -> None:
    """Every field of ``after``'s record type that ``before`` has too, outside ``changed``, is
    the same object (tensors, tuples, records) or an equal value (static metadata)."""
    for f in attrs.fields(type(after)):
        if f.name in changed or not hasattr(before, f.name):
            continue
        old, new = getattr(before, f.name), getattr(after, f.name)
        if old is new:
            continue
        assert not isinstance(old, (torch.Tensor, tuple)) and old == new, (
            f"{type(after).__name__}.{f.name} was not carried over: {old!r} -> {new!r}"
        )


_HAS = st.fixed_dictionaries({k: st.booleans() for k in ("grads", "partial", "residual")})


@given(tree=param_trees(max_leaves=3), ws=world_sizes(max_size=4), seed=SEEDS, has=_HAS)
@settings(max_examples=30)
def test_transitions_carry_every_field_they_do_not_change(
    tree: Any, ws: int, seed: int, has: dict[str, bool]
) -> None:
    """Each transition changes only the fields its docstring names; the rest (grads, layout,
    rank, sources; in the reduction's state the HSDP partial sum and the compression residual)
    come back as they went in."""
    edited = random_like(tree, seed)
    full_grads = random_like(tree, seed + 1, dtype=torch.float32)

    def body(c):
        s, carry = _with_every_field(shard(tree, world_size=ws, rank=c.rank), seed, has)
        u = unshard(s, c)
        _assert_carried(s, u, {"params", "buffer", "source"})
        assert u.source is s
        assert reshard(u) is s
        for k in divisors(ws):
            pf = reshard(u, group_size=k)
            _assert_carried(u, pf, {"group_size", "rows"})
        wb = writeback(attrs.evolve(u, params=tuple(leaves(edited))))
        _assert_carried(s, wb, {"flat"})
        # Without HSDP or compression a reduction changes only the gradients.
        reduced = reduce_grad(
            full_grads, attrs.evolve(s, grads=None), c, policy=ReducePolicy(reduce_unused=True)
        )
        _assert_carried(attrs.evolve(s, grads=None), reduced, {"grads"})
        if s.layout.grad_reduce_dtype() == torch.float32:
            kept, same = reduce_grad_with_state(full_grads, s, carry, c)
            _assert_carried(s, kept, {"grads"})
            _assert_carried(carry, same, set())  # neither compressed nor HSDP: carried as is
            # Compression changes the residual too (error feedback), and nothing else (a group
            # of only empty shards included: nothing goes on the wire). Its rows carry no
            # presence flags: a partial sum is one padded shard.
            if carry.partial is not None:
                carry = attrs.evolve(carry, partial=carry.partial[: s.layout.shard_numel])
            squeezed, fed = reduce_grad_with_state(
                full_grads, s, carry, c, policy=ReducePolicy(compression=GradCompression())
            )
            _assert_carried(s, squeezed, {"grads"})
            _assert_carried(carry, fed, {"residual"})

    SimulatedWorld(ws).run(body)


@given(tree=param_trees(dtypes=FP32, max_leaves=3), mesh=mesh_shapes(max_size=4), seed=SEEDS)
@settings(max_examples=15)
def test_hsdp_reduction_carries_every_field_but_grads_and_partial(
    tree: Any, mesh: tuple[int, int], seed: int
) -> None:
    replicas, ws = mesh
    full_grads = random_like(tree, seed)
    has = {"grads": True, "partial": False, "residual": True}

    world = SimulatedWorld(replicas * ws, mesh_shape=mesh)

    def body(c):
        shard_comm, rep_comm = world.shard_comm(c.rank), world.replicate_comm(c.rank)
        s, carry = _with_every_field(shard(tree, world_size=ws, rank=shard_comm.rank), seed, has)
        held, kept = reduce_grad_with_state(
            full_grads,
            s,
            carry,
            shard_comm,
            replicate_comm=rep_comm,
            policy=ReducePolicy(all_reduce=False),
        )
        _assert_carried(s, held, set())
        _assert_carried(carry, kept, {"partial"})
        assert kept.partial is not None
        done, after = reduce_grad_with_state(
            full_grads, held, kept, shard_comm, replicate_comm=rep_comm
        )
        _assert_carried(held, done, {"grads"})
        _assert_carried(kept, after, {"partial"})
        assert after.partial is None

    world.run(body)
