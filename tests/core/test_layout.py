"""functional_fsdp.core.layout: chunk extents, padding, shard-dim checks, divide factors, packing."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import shapes, world_sizes

from functional_fsdp.core import layout as L
from functional_fsdp.core.errors import IndivisibleError, ScalarParameterError

# ---------------------------------------------------------------------------- chunk extents


@pytest.mark.parametrize(
    ("dim0", "ws", "rows"),
    [
        (5, 4, [2, 2, 1, 0]),
        (6, 4, [2, 2, 2, 0]),
        (2, 4, [1, 1, 0, 0]),
        (8, 4, [2, 2, 2, 2]),
        (0, 3, [0, 0, 0]),
        (1, 1, [1]),
        (9, 8, [2, 2, 2, 2, 1, 0, 0, 0]),
    ],
)
def test_spec_examples(dim0: int, ws: int, rows: list[int]) -> None:
    assert [length for _, length in L.shard_extents(dim0, ws)] == rows


def test_extents_match_torch_chunk_exhaustively() -> None:
    for dim0 in range(0, 41):
        for ws in range(1, 9):
            chunks = torch.arange(dim0).chunk(ws)
            want = [(int(c[0]), len(c)) if len(c) else (dim0, 0) for c in chunks]
            want += [(dim0, 0)] * (ws - len(want))
            got = list(L.shard_extents(dim0, ws))
            # an empty chunk's start is not defined by torch; compare lengths and non-empty starts
            assert [n for _, n in got] == [n for _, n in want], (dim0, ws)
            assert [s for s, n in got if n] == [s for s, n in want if n], (dim0, ws)


@given(dim0=st.integers(0, 200), ws=world_sizes(max_size=16))
def test_extents_tile_the_dimension(dim0: int, ws: int) -> None:
    extents = L.shard_extents(dim0, ws)
    c = L.chunk_size(dim0, ws)
    assert c == math.ceil(dim0 / ws)
    pos = 0
    for start, length in extents:
        assert 0 <= length <= c
        if length:
            assert start == pos
        pos += length
    assert pos == dim0
    lengths = [n for _, n in extents]
    # full chunks first, then at most one partial chunk, then empty shards
    partial = [n for n in lengths if 0 < n < c]
    assert len(partial) <= 1
    assert lengths == sorted(lengths, reverse=True)


@given(dim0=st.integers(0, 200), ws=world_sizes(max_size=16))
def test_padding(dim0: int, ws: int) -> None:
    padded = L.padded_size(dim0, ws)
    assert padded % ws == 0
    assert dim0 <= padded < dim0 + ws
    assert padded == L.chunk_size(dim0, ws) * ws
    assert sum(n for _, n in L.shard_extents(dim0, ws)) + (padded - dim0) == padded


@given(shape=shapes(), ws=world_sizes())
def test_sharded_shape_replaces_only_the_shard_dim(shape: tuple[int, ...], ws: int) -> None:
    for dim in range(len(shape)):
        out = L.sharded_shape(shape, dim, ws)
        assert out[dim] == L.chunk_size(shape[dim], ws)
        assert out[:dim] == shape[:dim] and out[dim + 1 :] == shape[dim + 1 :]


def test_bad_rank_or_world() -> None:
    with pytest.raises(ValueError, match="outside world"):
        L.shard_extent(5, 4, 4)
    with pytest.raises(ValueError, match="outside world"):
        L.shard_extent(5, 4, -1)
    with pytest.raises(ValueError, match="world size"):
        L.chunk_size(5, 0)


# -------------------------------------------------------------------------- check_shard_dim


def test_scalar_raises_scalar_parameter_error() -> None:
    with pytest.raises(ScalarParameterError, match="scalar") as info:
        L.check_shard_dim((), 0, 2, name="model.temperature")
    assert isinstance(info.value, ValueError)  # FSDP2 raises ValueError for scalars
    assert "model.temperature" in str(info.value)


def test_indivisible_shard_dim_names_dim_size_factor() -> None:
    with pytest.raises(IndivisibleError) as info:
        L.check_shard_dim((4, 6), 1, 4, name="proj.weight")
    err = info.value
    assert (err.dim, err.size, err.factor) == (1, 6, 4)
    msg = str(err)
    assert "proj.weight" in msg and "Shard(1)" in msg and "6" in msg and "4" in msg
    assert isinstance(err, ValueError)


def test_shard_dim_normalised_and_validated() -> None:
    assert L.check_shard_dim((5, 8), -1, 4) == 1
    assert L.check_shard_dim((5, 8), 1, 4) == 1
    # Shard(0) never needs even division: uneven chunks are padded
    assert L.check_shard_dim((5, 3), 0, 4) == 0
    assert L.check_shard_dim((0, 3), 0, 8) == 0
    with pytest.raises(IndivisibleError, match="out of range"):
        L.check_shard_dim((5, 8), 2, 4)
    with pytest.raises(IndivisibleError, match="out of range"):
        L.check_shard_dim((5, 8), -3, 4)


@given(shape=shapes(min_dims=2), ws=world_sizes(), data=st.data())
def test_shard_dim_divisibility_rule(shape: tuple[int, ...], ws: int, data: st.DataObject) -> None:
    dim = data.draw(st.integers(1, len(shape) - 1))
    if shape[dim] % ws == 0:
        assert L.check_shard_dim(shape, dim, ws) == dim
    else:
        with pytest.raises(IndivisibleError):
            L.check_shard_dim(shape, dim, ws)


def test_check_sub_group_size() -> None:
    L.check_sub_group_size(2, 8)
    L.check_sub_group_size(8, 8)
    L.check_sub_group_size(1, 8)
    for bad in (3, 0, 16):
        with pytest.raises(IndivisibleError, match="reshard_after_forward"):
            L.check_sub_group_size(bad, 8)


# --------------------------------------------------------------------------- divide factors


def test_default_is_avg() -> None:
    f = L.divide_factors(4, 1, overflow_risk=False)
    assert (f.pre, f.post, f.op, f.all_reduce_op, f.premul) == (None, None, "avg", "avg", None)
    hsdp = L.divide_factors(4, 2, overflow_risk=False)
    assert (hsdp.op, hsdp.all_reduce_op) == ("avg", "avg")


def test_world_size_one_sums() -> None:
    f = L.divide_factors(1, 1, overflow_risk=False)
    assert (f.op, f.all_reduce_op, f.pre, f.post, f.premul) == ("sum", "sum", None, None, None)


def test_custom_factor() -> None:
    same = L.divide_factors(4, 1, overflow_risk=False, factor=4)
    assert (same.op, same.premul, same.pre, same.post) == ("avg", None, None, None)
    other = L.divide_factors(4, 1, overflow_risk=False, factor=3)
    assert (other.op, other.all_reduce_op, other.pre, other.post) == ("sum", "sum", None, None)
    assert other.premul == pytest.approx(1 / 3)


@pytest.mark.parametrize(
    ("factor", "pre", "post"), [(8, 4, 2), (6, 4, 1.5), (4, 2, 2), (2, 2, 1), (1, 1, 1), (16, 4, 4)]
)
def test_fp16_pre_post_split(factor: int, pre: float, post: float) -> None:
    f = L.divide_factors(factor, 1, overflow_risk=True)
    assert (f.pre, f.post, f.op, f.all_reduce_op) == (pre, post, "sum", "sum")
    custom = L.divide_factors(2, 1, overflow_risk=True, factor=factor)
    assert (custom.pre, custom.post) == (pre, post)


def test_force_sum_post_divides() -> None:
    f = L.divide_factors(4, 2, overflow_risk=False, force_sum=True)
    assert (f.pre, f.post, f.op, f.all_reduce_op) == (None, 8.0, "sum", "sum")


@given(
    rs=world_sizes(),
    ar=world_sizes(max_size=4),
    factor=st.one_of(st.none(), st.integers(1, 64).map(float)),
    overflow=st.booleans(),
    force_sum=st.booleans(),
)
def test_divide_factors_match_fsdp2(
    rs: int, ar: int, factor: float | None, overflow: bool, force_sum: bool
) -> None:
    """Oracle: FSDP2's own ``_get_gradient_divide_factors`` (it only calls ``.size()`` on groups)."""
    from torch.distributed import ReduceOp
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

    class _Sized:
        def __init__(self, n: int) -> None:
            self.n = n

        def size(self) -> int:
            return self.n

    dtype = torch.float16 if overflow else torch.float32
    want = _get_gradient_divide_factors(
        _Sized(rs),
        _Sized(ar) if ar > 1 else None,
        dtype,
        factor=factor,
        force_sum_reduction_for_comms=force_sum,
    )
    got = L.divide_factors(rs, ar, overflow_risk=overflow, factor=factor, force_sum=force_sum)
    names = {ReduceOp.SUM: "sum", ReduceOp.AVG: "avg"}
    w_pre, w_post, w_rs, w_ar = want
    assert got.pre == w_pre
    assert got.post == w_post
    if w_rs in names:
        assert got.op == names[w_rs]
        assert got.premul is None
    else:  # torch's PREMUL_SUM(1 / factor)
        assert got.op == "sum"
        assert factor is not None and got.premul == pytest.approx(1 / factor)
    if ar > 1:
        assert got.all_reduce_op == names[w_ar]


@given(factor=st.integers(1, 4096))
def test_pre_times_post_is_the_factor(factor: int) -> None:
    f = L.divide_factors(1, 1, overflow_risk=True, factor=factor)
    assert f.pre is not None and f.post is not None
    assert f.pre * f.post == pytest.approx(factor)
    assert math.log2(f.pre).is_integer(), "the pre-divide is a power of two"


# ------------------------------------------------------------------------------ PackLayout


_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int8,
    torch.int64,
    torch.bool,
]


@given(numels=st.lists(st.integers(0, 50), min_size=1, max_size=6), data=st.data())
def test_mixed_pack_alignment(numels: list[int], data: st.DataObject) -> None:
    dtypes = [data.draw(st.sampled_from(_DTYPES)) for _ in numels]
    pack = L.PackLayout.build(numels, [d.itemsize for d in dtypes], uniform=False)
    assert pack.total % 16 == 0
    end = 0
    for off, size, n, d in zip(pack.offsets, pack.sizes, numels, dtypes):
        assert off % 16 == 0, "each region must start 16-byte aligned"
        assert off >= end, "regions must not overlap"
        assert size == n * d.itemsize
        end = off + size
    assert pack.total >= end
    assert pack.total - end < 16


@given(numels=st.lists(st.integers(0, 50), min_size=1, max_size=6))
def test_uniform_pack_is_back_to_back(numels: list[int]) -> None:
    pack = L.PackLayout.build(numels, [4] * len(numels), uniform=True)
    offsets = [sum(numels[:i]) for i in range(len(numels))]
    assert list(pack.offsets) == offsets
    assert list(pack.sizes) == numels
    assert pack.total == sum(numels)


@given(numels=st.lists(st.integers(0, 20), min_size=1, max_size=6), data=st.data())
def test_mixed_pack_round_trips_through_bytes(numels: list[int], data: st.DataObject) -> None:
    """Each region of a byte buffer can be viewed back as its own dtype without corruption."""
    from functional_fsdp.core.records import region

    dtypes = [data.draw(st.sampled_from(_DTYPES)) for _ in numels]
    pack = L.PackLayout.build(numels, [d.itemsize for d in dtypes], uniform=False)
    buf = torch.zeros(pack.total, dtype=torch.uint8)
    values = [torch.arange(n).to(d) for n, d in zip(numels, dtypes)]
    for i, v in enumerate(values):
        region(buf, pack, i, v.dtype).copy_(v)
    for i, v in enumerate(values):
        assert torch.equal(region(buf, pack, i, v.dtype), v)


def test_layout_records_are_hashable_and_cached() -> None:
    a = L.PackLayout.build([3, 5], [4, 2], uniform=False)
    b = L.PackLayout.build([3, 5], [4, 2], uniform=False)
    assert a == b and hash(a) == hash(b)
    assert L.divide_factors(4, 1, overflow_risk=True) is L.divide_factors(4, 1, overflow_risk=True)
