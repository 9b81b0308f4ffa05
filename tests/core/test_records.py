"""functional_fsdp.core.records: invariants at construction, hashable layouts, policies, pytrees."""

from __future__ import annotations

import attrs
import optree
import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from hypothesis import given
from hypothesis import strategies as st
from strategies import param_trees, world_sizes

from functional_fsdp.core import layout as L
from functional_fsdp.core._tree import (
    NAMESPACE,
    tree_flatten,
    tree_leaves,
    tree_map,
    tree_unflatten,
)
from functional_fsdp.core.errors import (
    IndivisibleError,
    LayoutMismatchError,
    PolicyError,
    ScalarParameterError,
)
from functional_fsdp.core.records import (
    CPUOffloadPolicy,
    GroupLayout,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ParamSpec,
    PostForwardState,
    ShardedState,
    UnshardedState,
)
from functional_fsdp.core.reduction import ReduceState
from functional_fsdp.core.transitions import reshard, shard, unshard
from functional_fsdp.testing import SimulatedWorld


def _specs() -> list[ParamSpec]:
    return [ParamSpec("w", (5, 3), torch.float32), ParamSpec("b", (3,), torch.float32)]


def _layout(ws: int = 4, **kw) -> GroupLayout:
    return GroupLayout.build(_specs(), ws, **kw)


def _sharded(ws: int = 4, rank: int = 1) -> ShardedState:
    return shard({"w": torch.randn(5, 3), "b": torch.randn(3)}, world_size=ws, rank=rank)


def _unsharded(ws: int = 2) -> list[UnshardedState]:
    full = {"w": torch.randn(5, 3), "b": torch.randn(3)}
    return SimulatedWorld(ws).run(lambda c: unshard(shard(full, world_size=ws, rank=c.rank), c))


# ------------------------------------------------------------------------------ invariants


def test_sharded_state_checks_its_buffer() -> None:
    lay = _layout()
    total = lay.storage.total
    ShardedState(lay, 0, torch.zeros(total))  # consistent: fine
    with pytest.raises(LayoutMismatchError, match="1-D"):
        ShardedState(lay, 0, torch.zeros(total + 1))
    with pytest.raises(LayoutMismatchError, match="float64"):
        ShardedState(lay, 0, torch.zeros(total, dtype=torch.float64))
    with pytest.raises(LayoutMismatchError):
        ShardedState(lay, 0, torch.zeros(1, total))
    with pytest.raises(LayoutMismatchError, match="rank 4"):
        ShardedState(lay, 4, torch.zeros(total))
    with pytest.raises(LayoutMismatchError, match="rank -1"):
        ShardedState(lay, -1, torch.zeros(total))


def test_sharded_state_checks_its_grads() -> None:
    lay = _layout()
    flat = torch.zeros(lay.storage.total)
    ok = ShardedState(lay, 0, flat, grads=(torch.zeros(lay.shard_shapes[0]), None))
    assert ok.local_grad(1) is None
    with pytest.raises(LayoutMismatchError, match="entries"):
        ShardedState(lay, 0, flat, grads=(None,))
    with pytest.raises(LayoutMismatchError, match="'w'"):
        ShardedState(lay, 0, flat, grads=(torch.zeros(5, 3), None))  # full, not padded shard shape


def test_unsharded_state_checks_its_params() -> None:
    lay = _layout(2)
    UnshardedState(lay, 0, (torch.zeros(5, 3), torch.zeros(3)))
    with pytest.raises(LayoutMismatchError, match="got 1 tensors"):
        UnshardedState(lay, 0, (torch.zeros(5, 3),))
    with pytest.raises(LayoutMismatchError, match="shape"):
        UnshardedState(lay, 0, (torch.zeros(5, 4), torch.zeros(3)))
    with pytest.raises(LayoutMismatchError, match="dtype"):
        UnshardedState(lay, 0, (torch.zeros(5, 3, dtype=torch.float16), torch.zeros(3)))
    other = ShardedState(_layout(4), 0, torch.zeros(_layout(4).storage.total))
    with pytest.raises(LayoutMismatchError, match="different layout"):
        UnshardedState(lay, 0, (torch.zeros(5, 3), torch.zeros(3)), source=other)


def test_unsharded_params_use_gather_dtypes() -> None:
    lay = _layout(2, param_dtype=torch.bfloat16)
    UnshardedState(
        lay, 0, (torch.zeros(5, 3, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.bfloat16))
    )
    with pytest.raises(LayoutMismatchError, match="dtype"):
        UnshardedState(lay, 0, (torch.zeros(5, 3), torch.zeros(3)))


def test_post_forward_state_checks_group_and_rows() -> None:
    src = _sharded(4, 1)
    lay = src.layout
    n = lay.gather.total
    pf = PostForwardState(lay, 1, 2, torch.zeros(2 * n), src)
    assert pf.sub_rank == 1
    with pytest.raises(IndivisibleError):
        PostForwardState(lay, 1, 3, torch.zeros(n), src)
    with pytest.raises(LayoutMismatchError):
        PostForwardState(lay, 1, 2, torch.zeros(n), src)


def test_group_layout_build_validates_specs() -> None:
    with pytest.raises(ScalarParameterError, match="temp"):
        GroupLayout.build([ParamSpec("temp", (), torch.float32)], 2)
    with pytest.raises(IndivisibleError, match="proj"):
        GroupLayout.build([ParamSpec("proj", (4, 6), torch.float32, shard_dim=1)], 4)


def test_mixed_gather_dtypes_need_a_reduce_dtype() -> None:
    specs = [ParamSpec("a", (4,), torch.float32), ParamSpec("b", (4,), torch.bfloat16)]
    with pytest.raises(LayoutMismatchError, match="reduce_dtype"):
        GroupLayout.build(specs, 2).grad_reduce_dtype()
    assert (
        GroupLayout.build(specs, 2, reduce_dtype=torch.float32).grad_reduce_dtype() == torch.float32
    )
    # a common param_dtype makes the gather dtypes uniform again
    assert (
        GroupLayout.build(specs, 2, param_dtype=torch.bfloat16).grad_reduce_dtype()
        == torch.bfloat16
    )


def test_param_dtype_applies_to_floating_point_only() -> None:
    specs = [
        ParamSpec("w", (4,), torch.float32),
        ParamSpec("idx", (4,), torch.int64, requires_grad=False),
    ]
    lay = GroupLayout.build(specs, 2, param_dtype=torch.bfloat16)
    assert lay.gather_dtypes == (torch.bfloat16, torch.int64)
    assert not lay.gather.uniform and lay.gather_buffer_dtype == torch.uint8


@given(tree=param_trees(), ws=world_sizes())
def test_layout_fields_are_derived_consistently(tree, ws: int) -> None:
    leaves = optree.tree_leaves(tree)
    lay = GroupLayout.build([ParamSpec.for_tensor(str(i), t) for i, t in enumerate(leaves)], ws)
    assert len(lay) == len(leaves)
    for i, t in enumerate(leaves):
        assert lay.shard_shapes[i] == L.sharded_shape(t.shape, 0, ws)
        assert lay.padded_full_shape(i)[0] == L.padded_size(t.shape[0], ws)
        assert sum(lay.local_shape(i, r)[0] for r in range(ws)) == t.shape[0]
        assert lay.storage.sizes[i] == L.prod(lay.shard_shapes[i]) * (
            1 if lay.storage.uniform else t.dtype.itemsize
        )
    dtypes = {t.dtype for t in leaves}
    assert lay.storage.uniform == (len(dtypes) == 1)
    assert lay.storage_dtype == (leaves[0].dtype if len(dtypes) == 1 else torch.uint8)


# ------------------------------------------------------------------------------- hashing


def test_layouts_are_hashable_and_equal_by_value() -> None:
    a, b = _layout(4), _layout(4)
    assert a == b and hash(a) == hash(b)
    assert {a: 1}[b] == 1
    assert a != _layout(2)
    assert a != _layout(4, param_dtype=torch.bfloat16)
    assert a != GroupLayout.build(_specs()[::-1], 4)
    spec = ParamSpec("w", (5, 3), torch.float32)
    assert hash(spec) == hash(ParamSpec("w", (5, 3), torch.float32))
    assert (
        len({spec, ParamSpec("w", (5, 3), torch.float32), ParamSpec("w", (5, 3), torch.float16)})
        == 2
    )


def test_layout_equality_ignores_the_treespec() -> None:
    a = shard({"w": torch.randn(5, 3), "b": torch.randn(3)}, world_size=2, rank=0).layout
    specs = a.specs
    b = GroupLayout.build(specs, 2)
    assert a.treespec is not None and b.treespec is None
    assert a == b and hash(a) == hash(b)


def test_policies_are_hashable() -> None:
    assert hash(MixedPrecisionPolicy(torch.bfloat16)) == hash(MixedPrecisionPolicy(torch.bfloat16))
    assert CPUOffloadPolicy() == CPUOffloadPolicy(pin_memory=True)
    assert CPUOffloadPolicy(pin_memory=False) != CPUOffloadPolicy()


# ------------------------------------------------------------------------------ policies


@pytest.mark.parametrize("bad", [torch.int32, torch.bool, "bfloat16", 16, torch.complex64])
@pytest.mark.parametrize("field", ["param_dtype", "reduce_dtype", "output_dtype"])
def test_mixed_precision_rejects_bad_dtypes(field: str, bad: object) -> None:
    with pytest.raises(PolicyError, match=field):
        MixedPrecisionPolicy(**{field: bad})


def test_mixed_precision_coerces_torch_policy() -> None:
    theirs = torch_fsdp.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        output_dtype=torch.float16,
        cast_forward_inputs=False,
    )
    ours = MixedPrecisionPolicy.coerce(theirs)
    assert isinstance(ours, MixedPrecisionPolicy)
    assert ours == MixedPrecisionPolicy(torch.bfloat16, torch.float32, torch.float16, False)
    assert MixedPrecisionPolicy.coerce(torch_fsdp.MixedPrecisionPolicy()) == MixedPrecisionPolicy()
    assert MixedPrecisionPolicy.coerce(None) == MixedPrecisionPolicy()
    mine = MixedPrecisionPolicy(torch.float16)
    assert MixedPrecisionPolicy.coerce(mine) is mine
    with pytest.raises(PolicyError, match="mp_policy"):
        MixedPrecisionPolicy.coerce(object())


def test_offload_coerces_torch_policies() -> None:
    cpu = OffloadPolicy.coerce(torch_fsdp.CPUOffloadPolicy(pin_memory=False))
    assert type(cpu) is CPUOffloadPolicy and cpu.pin_memory is False
    assert OffloadPolicy.coerce(torch_fsdp.CPUOffloadPolicy()) == CPUOffloadPolicy(pin_memory=True)
    base = OffloadPolicy.coerce(torch_fsdp.OffloadPolicy())
    assert type(base) is OffloadPolicy
    assert type(OffloadPolicy.coerce(None)) is OffloadPolicy
    mine = CPUOffloadPolicy()
    assert OffloadPolicy.coerce(mine) is mine
    assert isinstance(mine, OffloadPolicy)
    with pytest.raises(PolicyError, match="offload_policy"):
        OffloadPolicy.coerce("cpu")


# -------------------------------------------------------------------------------- frozen


def _records() -> dict[str, tuple[object, str]]:
    s = _sharded(4, 1)
    u = _unsharded(2)[0]
    pf = PostForwardState(s.layout, 1, 2, torch.zeros(2 * s.layout.gather.total), s)
    return {
        "ShardedState": (s, "flat"),
        "ShardedState.rank": (s, "rank"),
        "UnshardedState": (u, "params"),
        "PostForwardState": (pf, "rows"),
        "GroupLayout": (s.layout, "world_size"),
        "ParamSpec": (s.layout.specs[0], "shape"),
        "PackLayout": (s.layout.storage, "total"),
        "DivideFactors": (L.divide_factors(4, 1, overflow_risk=True), "pre"),
        "MixedPrecisionPolicy": (MixedPrecisionPolicy(), "param_dtype"),
        "CPUOffloadPolicy": (CPUOffloadPolicy(), "pin_memory"),
    }


@pytest.mark.parametrize(
    "which",
    [
        "ShardedState",
        "ShardedState.rank",
        "UnshardedState",
        "PostForwardState",
        "GroupLayout",
        "ParamSpec",
        "PackLayout",
        "DivideFactors",
        "MixedPrecisionPolicy",
        "CPUOffloadPolicy",
    ],
)
def test_records_are_frozen(which: str) -> None:
    record, name = _records()[which]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        setattr(record, name, None)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        delattr(record, name)


def test_evolve_returns_a_new_record_and_revalidates() -> None:
    s = _sharded(4, 1)
    t = attrs.evolve(s, flat=s.flat.clone())
    assert t is not s and t.layout is s.layout
    with pytest.raises(LayoutMismatchError):
        attrs.evolve(s, flat=torch.zeros(1))


# ------------------------------------------------------------------------------- pytrees


def test_sharded_state_flattens_in_the_namespace() -> None:
    s = _sharded(4, 1)
    assert len(tree_leaves(s)) == 1 and tree_leaves(s)[0] is s.flat
    # outside the namespace a record is an opaque leaf
    assert optree.tree_leaves(s) == [s]
    g0 = torch.ones(s.layout.shard_shapes[0])
    with_grads = attrs.evolve(s, grads=(g0, None))
    leaves = tree_leaves(with_grads)
    assert len(leaves) == 2 and leaves[0] is s.flat and leaves[1] is g0  # None is not a leaf
    assert optree.tree_leaves(with_grads, namespace=NAMESPACE) == leaves


def test_tree_map_keeps_static_metadata() -> None:
    s = _sharded(4, 3)
    doubled = tree_map(lambda t: t * 2, s)
    assert isinstance(doubled, ShardedState)
    assert doubled.layout == s.layout and doubled.rank == 3
    assert torch.equal(doubled.flat, s.flat * 2)


def test_flatten_unflatten_round_trip_of_nested_records() -> None:
    u = _unsharded(2)[1]
    tree = {"state": u, "other": [torch.ones(2)]}
    leaves, spec = tree_flatten(tree)
    # params of the unsharded state, the flat of its source, the extra tensor, its buffer
    assert sum(1 for x in leaves if x is u.source.flat) == 1
    assert all(any(x is p for x in leaves) for p in u.params)
    back = tree_unflatten(spec, leaves)
    assert isinstance(back["state"], UnshardedState)
    assert back["state"].rank == 1 and back["state"].layout == u.layout
    assert isinstance(back["state"].source, ShardedState)
    assert all(a is b for a, b in zip(back["state"].params, u.params))


def test_post_forward_state_flattens_rows_and_source() -> None:
    u = _unsharded(2)[0]
    pf = reshard(u, group_size=1)
    assert isinstance(pf, PostForwardState)
    leaves = tree_leaves(pf)
    assert leaves[0] is pf.rows and leaves[1] is pf.source.flat


@given(seed=st.integers(0, 1000))
def test_unsharded_tree_restores_the_user_structure(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    full = {
        "layers": [{"w": torch.randn(3, 2, generator=gen)}, {"w": torch.randn(1, generator=gen)}],
        "b": (torch.randn(4, generator=gen),),
    }
    u = SimulatedWorld(2).run(lambda c: unshard(shard(full, world_size=2, rank=c.rank), c))[0]
    back = u.tree()
    assert optree.tree_structure(back) == optree.tree_structure(full)
    for a, b in zip(optree.tree_leaves(back), optree.tree_leaves(full)):
        assert torch.equal(a, b)


# ------------------------------------------------- pytrees map to any leaf type (equinox)


def _every_record() -> dict[str, object]:
    """One instance of each pytree record, every optional tensor field set."""
    u = _unsharded(2)[1]
    s = u.source
    assert s is not None
    lay = s.layout
    full = attrs.evolve(
        s,
        grads=(torch.randn(lay.shard_shapes[0]), None),
    )
    return {
        "ReduceState": ReduceState(
            residual=torch.randn(lay.world_size * lay.shard_numel),
            partial=torch.randn(lay.shard_numel),
        ),
        "ShardedState": full,
        "UnshardedState": attrs.evolve(u, source=full),
        "PostForwardState": PostForwardState(lay, 1, 1, torch.zeros(2 * lay.gather.total), full),
    }


def _assert_same_record(got: object, want: object) -> None:
    """Same type and, field by field, the same objects (nested records compared the same way)."""
    assert type(got) is type(want)
    for f in attrs.fields(type(want)):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if attrs.has(type(b)) and not isinstance(b, GroupLayout):
            _assert_same_record(a, b)
        elif isinstance(b, tuple):
            assert len(a) == len(b) and all(x is y for x, y in zip(a, b)), f.name
        else:
            assert a is b or a == b, f.name


@pytest.mark.parametrize("which", ["ShardedState", "UnshardedState", "PostForwardState"])
@pytest.mark.parametrize(
    "fn",
    [lambda t: t.shape, lambda t: t.dtype, lambda t: None, lambda t: f"<{t.numel()}>"],
    ids=["shape", "dtype", "none", "str"],
)
def test_tree_map_to_any_leaf_type(which: str, fn) -> None:
    """Unflattening builds the record without its validators, so a tree of shapes, dtypes or
    placeholders is a record of the same type with those leaves in place of the tensors."""
    record = _every_record()[which]
    want = [fn(t) for t in tree_leaves(record)]
    for mapped in (tree_map(fn, record), optree.tree_map(fn, record, namespace=NAMESPACE)):
        assert type(mapped) is type(record)
        # None is not a leaf (the namespace's policy): mapped-to-None fields drop out
        assert tree_leaves(mapped) == [w for w in want if w is not None]
        assert mapped.layout is record.layout and mapped.rank == record.rank


def test_tree_map_to_shapes_keeps_every_field() -> None:
    s = _every_record()["ShardedState"]
    shapes = optree.tree_map(lambda t: t.shape, s, namespace=NAMESPACE)
    assert shapes.flat == s.flat.shape
    assert shapes.grads == (s.grads[0].shape, None)
    assert shapes.layout is s.layout and shapes.rank == s.rank
    r = _every_record()["ReduceState"]
    shapes = optree.tree_map(lambda t: t.shape, r, namespace=NAMESPACE)
    assert type(shapes) is ReduceState
    assert shapes.partial == r.partial.shape and shapes.residual == r.residual.shape


@pytest.mark.parametrize(
    "which", ["ReduceState", "ShardedState", "UnshardedState", "PostForwardState"]
)
def test_flatten_unflatten_round_trip_is_the_original(which: str) -> None:
    record = _every_record()[which]
    leaves, spec = tree_flatten(record)
    _assert_same_record(tree_unflatten(spec, leaves), record)
    paths = optree.tree_paths(record, namespace=NAMESPACE)
    assert paths and all(isinstance(p[0], str) for p in paths)


def test_constructors_still_validate() -> None:
    """Only unflattening skips the checks: building a record, or evolving one, still runs them."""
    s = _sharded(4, 1)
    with pytest.raises(LayoutMismatchError):
        ShardedState(s.layout, s.rank, torch.zeros(1))
    with pytest.raises(LayoutMismatchError):
        UnshardedState(s.layout, 1, (torch.zeros(1),))
