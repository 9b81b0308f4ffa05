"""All-gather codecs in the pure core (simulated world): FSDP2's tensor-subclass protocol.

The oracle is FSDP2's protocol by hand: every rank's pre hook on its padded shard, the inputs
concatenated rank-major along dim 0, one post hook, ``as_strided`` to the parameter's size.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from functional_fsdp.core import layout as L
from functional_fsdp.core.codec import SubclassCodec, gather_bytes, wire, with_codec_inputs
from functional_fsdp.core.errors import GatherCodecError
from functional_fsdp.core.records import GatherInputSpec, GroupLayout, ParamSpec
from functional_fsdp.core.transitions import begin_unshard, finish_unshard, shard_tensors, unshard
from functional_fsdp.extensions import Int8RowwiseWeight
from functional_fsdp.testing import SimulatedWorld
from functional_fsdp.testing import strategies as fst


class _Mesh:
    """What the hooks read of a DeviceMesh: its size."""

    def __init__(self, n: int) -> None:
        self.n = n

    def size(self) -> int:
        return self.n


def _layout(specs: list[ParamSpec], ws: int, param_dtype: torch.dtype | None) -> GroupLayout:
    return GroupLayout.build(specs, ws, param_dtype=param_dtype)


def _int8_inputs(shape: tuple[int, ...], ws: int) -> GatherInputSpec:
    rows = L.chunk_size(shape[0], ws)
    return GatherInputSpec(((rows, *shape[1:]), (rows, 1)), (torch.int8, torch.float32))


def _oracle(full: torch.Tensor, ws: int, dtype: torch.dtype) -> torch.Tensor:
    """FSDP2's protocol by hand on the full tensor."""
    rows = L.chunk_size(full.shape[0], ws)
    per_rank = []
    for r in range(ws):
        start, n = L.shard_extent(full.shape[0], ws, r)
        padded = full.new_zeros((rows, *full.shape[1:]))
        padded[:n].copy_(full[start : start + n])
        inputs, _ = Int8RowwiseWeight(padded).fsdp_pre_all_gather(
            _Mesh(ws), full.shape, None, None, None
        )
        per_rank.append(inputs)
    outputs = tuple(torch.cat([p[j] for p in per_rank]) for j in range(2))
    out, _ = Int8RowwiseWeight(full).fsdp_post_all_gather(outputs, None, dtype)
    return torch.as_strided(out, full.shape, full.contiguous().stride(), 0)


def _run(fulls: list[torch.Tensor], coded: list[bool], ws: int, pdt: torch.dtype | None) -> list:
    specs = [ParamSpec(f"p{i}", tuple(t.shape), t.dtype) for i, t in enumerate(fulls)]
    lay = _layout(specs, ws, pdt)
    lay = with_codec_inputs(
        lay, [_int8_inputs(s.shape, ws) if c else None for s, c in zip(specs, coded)]
    )

    def body(comm: Any) -> Any:
        state = shard_tensors(fulls, lay, comm.rank)
        codecs = [
            SubclassCodec(s.fqn, _Mesh(ws), s.shape, wrap=Int8RowwiseWeight) if c else None
            for s, c in zip(specs, coded)
        ]
        return unshard(state, comm, codecs=codecs)

    return SimulatedWorld(ws).run(body)


@settings(max_examples=40, deadline=None)
@given(
    ws=fst.world_sizes(min_size=1, max_size=8),
    rows_per_rank=st.integers(1, 3),
    cols=st.integers(1, 5),
    plain=fst.shapes(min_dims=1, max_dims=2, max_side=7),
    bf16=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_decode_gather_encode_equals_fsdp2_protocol(
    ws: int, rows_per_rank: int, cols: int, plain: tuple, bf16: bool, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(ws * rows_per_rank, cols, generator=g)
    p = torch.randn(plain, generator=g)
    pdt = torch.bfloat16 if bf16 else None
    outs = _run([w, p], [True, False], ws, pdt)
    want_w = _oracle(w, ws, pdt or torch.float32)
    for out in outs:
        assert out.params[0].dtype == want_w.dtype
        assert torch.equal(out.params[0], want_w)
        assert torch.equal(out.params[1], p.to(pdt or p.dtype))


def test_int8_sends_fewer_bytes_than_fp32() -> None:
    spec = ParamSpec("w", (64, 32), torch.float32)
    lay = _layout([spec], 2, None)
    coded = with_codec_inputs(lay, [_int8_inputs(spec.shape, 2)])
    assert gather_bytes(lay) == 32 * 32 * 4
    assert gather_bytes(coded) == 32 * 32 + 32 * 4


def test_uneven_shard_with_unpadded_inputs_is_refused() -> None:
    spec = ParamSpec("w", (5, 3), torch.float32)
    with pytest.raises(GatherCodecError, match="padded shard shape"):
        with_codec_inputs(_layout([spec], 2, None), [_int8_inputs((6, 3), 2)])


class _Bad(Int8RowwiseWeight):
    mode = ""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):  # type: ignore[override]
        (q, s), meta = super().fsdp_pre_all_gather(
            mesh, outer_size, outer_stride, module, mp_policy
        )
        if self.mode == "not_tuple":
            return q
        if self.mode == "numel":
            return (q.reshape(-1)[:-1], s), meta
        if self.mode == "dtype":
            return (q.float(), s), meta
        if self.mode == "raise":
            raise RuntimeError("boom")
        return (q, s), meta

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):  # type: ignore[override]
        if self.mode == "post_raise":
            raise RuntimeError("post boom")
        if self.mode == "post_wrong":
            return outputs[0]
        return super().fsdp_post_all_gather(outputs, metadata, param_dtype, out=out)


@pytest.mark.parametrize(
    "mode,match",
    [
        ("not_tuple", "must return \\(all_gather_inputs, metadata\\)"),
        ("numel", "returned inputs"),
        ("dtype", "returned inputs"),
        ("raise", "fsdp_pre_all_gather raised RuntimeError"),
    ],
)
def test_bad_pre_hook_raises_before_the_collective(mode: str, match: str) -> None:
    w = torch.randn(4, 3)
    spec = ParamSpec("w", (4, 3), torch.float32)
    lay = with_codec_inputs(_layout([spec], 2, None), [_int8_inputs(spec.shape, 2)])
    world = SimulatedWorld(2)

    def body(comm: Any) -> Any:
        state = shard_tensors([w], lay, comm.rank)
        flat = state.flat.clone()

        def wrap(t: torch.Tensor) -> torch.Tensor:
            sub = _Bad(t)
            sub.mode = mode
            return sub

        codec = SubclassCodec("w", _Mesh(2), spec.shape, wrap=wrap)
        with pytest.raises(GatherCodecError, match=match):
            begin_unshard(state, comm, codecs=[codec], async_op=False)
        assert torch.equal(state.flat, flat)  # state unchanged
        return True

    assert world.run(body) == [True, True]


@pytest.mark.parametrize("mode", ["post_raise", "post_wrong"])
def test_bad_post_hook_is_named(mode: str) -> None:
    w = torch.randn(4, 3)
    spec = ParamSpec("w", (4, 3), torch.float32)
    lay = with_codec_inputs(_layout([spec], 1, None), [_int8_inputs(spec.shape, 1)])
    state = shard_tensors([w], lay, 0)

    def wrap(t: torch.Tensor) -> torch.Tensor:
        sub = _Bad(t)
        sub.mode = mode
        return sub

    world = SimulatedWorld(1)
    codec = SubclassCodec("w", _Mesh(1), spec.shape, wrap=wrap)
    with pytest.raises(GatherCodecError, match="fsdp_post_all_gather"):
        world.run(lambda c: unshard(state, c, codecs=[codec]))


class _ViewCodec:
    """A codec whose decode returns its gathered output itself (as torchao's float8 wraps it):
    the full tensor is a view of the decode buffer, at that input's offset there."""

    def __init__(self, rows: int) -> None:
        self.rows = rows

    def encode(self, shard: torch.Tensor) -> Any:
        padded = shard.new_zeros((self.rows, *shard.shape[1:]))
        padded[: shard.shape[0]].copy_(shard)
        return (padded,), None

    def decode(self, outputs: tuple, metadata: Any, param_dtype: torch.dtype, *, out: Any) -> Any:
        del metadata, param_dtype
        return None if out is not None else (outputs[0], (outputs[0],))


def _mixed_group(ws: int, seed: int) -> tuple[list[torch.Tensor], GroupLayout, list[str]]:
    """int8 weight, view-decoded param, plain param, view-decoded param (uneven on dim 0)."""
    g = torch.Generator().manual_seed(seed)
    fulls = [
        torch.randn(2 * ws, 3, generator=g),
        torch.randn(ws + 1, 2, generator=g),
        torch.randn(5, generator=g),
        torch.randn(3, 4, generator=g),
    ]
    kinds = ["int8", "view", "plain", "view"]
    specs = [ParamSpec(f"p{i}", tuple(t.shape), t.dtype) for i, t in enumerate(fulls)]
    lay = _layout(specs, ws, None)
    inputs: list[GatherInputSpec | None] = []
    for i, k in enumerate(kinds):
        shard = lay.shard_shapes[i]
        if k == "int8":
            inputs.append(_int8_inputs(specs[i].shape, ws))
        elif k == "view":
            inputs.append(GatherInputSpec((shard,), (torch.float32,)))
        else:
            inputs.append(None)
    return fulls, with_codec_inputs(lay, inputs), kinds


def _codecs(lay: GroupLayout, kinds: list[str], ws: int) -> list[Any]:
    return [
        SubclassCodec(s.fqn, _Mesh(ws), s.shape, wrap=Int8RowwiseWeight)
        if k == "int8"
        else (_ViewCodec(lay.shard_shapes[i][0]) if k == "view" else None)
        for i, (s, k) in enumerate(zip(lay.specs, kinds))
    ]


@pytest.mark.parametrize("ws", [1, 2, 3])
def test_decoded_views_start_at_their_inputs_and_refresh_in_place(ws: int) -> None:
    """Several codec parameters in one group: a decode that returns (a view of) its gathered
    output is read at that output's place in the buffer, not at the buffer's start; a second
    gather into the same buffer with ``out=`` refreshes the same tensors (the shell's reuse)."""
    fulls, lay, kinds = _mixed_group(ws, 0)
    edited = [t * 2 + 1 for t in fulls]
    pack, dtype = wire(lay)

    def body(comm: Any) -> Any:
        codecs = _codecs(lay, kinds, ws)
        buf = torch.empty(ws * pack.total, dtype=dtype)
        once = begin_unshard(shard_tensors(fulls, lay, comm.rank), comm, codecs=codecs, into=buf)
        first = finish_unshard(once, into=buf)
        got_first = [t.clone() for t in first.params]
        again = begin_unshard(shard_tensors(edited, lay, comm.rank), comm, codecs=codecs, into=buf)
        second = finish_unshard(again, into=buf, out=first.params)
        return got_first, first.params, second.params

    for got_first, first, second in SimulatedWorld(ws).run(body):
        assert all(a is b for a, b in zip(first, second))
        for got, want in ((got_first, fulls), (second, edited)):
            assert torch.equal(got[0], _oracle(want[0], ws, torch.float32))
            for i in (1, 2, 3):
                assert torch.equal(got[i], want[i]), i


def test_codecs_need_a_layout_that_knows_them() -> None:
    spec = ParamSpec("w", (4, 3), torch.float32)
    plain = _layout([spec], 1, None)
    state = shard_tensors([torch.randn(4, 3)], plain, 0)
    codec = SubclassCodec("w", _Mesh(1), spec.shape, wrap=Int8RowwiseWeight)
    with pytest.raises(GatherCodecError, match="with_codec_inputs"):
        SimulatedWorld(1).run(lambda c: unshard(state, c, codecs=[codec]))
    # Identity codecs spelled out are the plain path.
    spelled = SimulatedWorld(1).run(lambda c: unshard(state, c, codecs=[None]))[0]
    assert torch.equal(
        spelled.params[0], SimulatedWorld(1).run(lambda c: unshard(state, c))[0].params[0]
    )
