"""The five pure transitions: ``shard``, ``unshard``, ``reshard``, ``writeback``, ``reduce_grad``.

Each takes records (and, for collectives, an injected :class:`~functional_fsdp.core.comm.Communicator`)
and returns new records; inputs are never mutated. The lower-level steps (``pack_for_gather``,
``begin_unshard``/``finish_unshard``, ``pack_grads``/``finish_reduce``) are public too, so a
custom trainer (or the shell) can overlap communication with compute.

There is one unshard path: every parameter has an all-gather codec (:mod:`.codec`), the
identity for a plain one, and ``begin_unshard`` encodes, issues the one all-gather (or copies,
at world size 1: :func:`~.comm.collective_or_copy`), ``finish_unshard`` copies out and decodes.

State diagram (per group)::

    ShardedState --unshard--> UnshardedState --reshard()--> ShardedState
         ^                        |      \\--reshard(group_size=k)--> PostForwardState
         |                        |                                        |
         +--writeback(edited)-----+           PostForwardState --unshard(sub-group)--> Unsharded
    ShardedState --reduce_grad(full grads)--> ShardedState (with sharded grads)
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, cast

import attrs
import optree
import torch

from . import codec as C
from . import layout as L
from .comm import (
    Communicator,
    DoneWork,
    PiecesCommunicator,
    Work,
    check_comm,
    collective_or_copy,
    uses_pieces,
)
from .errors import GatherCodecError, LayoutMismatchError, MeshError, StateError
from .records import (
    GroupLayout,
    ParamSpec,
    PostForwardState,
    ShardedState,
    UnshardedState,
    region,
)
from .reduction import (
    PendingReduce,
    ReduceInput,
    ReducePolicy,
    ReduceState,
    accumulate_local_grads,
    begin_reduce,
    carries_presence,
    empty_buffer,
    finish_reduce,
    issue_reduce,
    pack_grads,
    reduce_grad,
    reduce_grad_with_state,
    reduce_input,
    reduce_row_numel,
    refit_partial,
)

__all__ = [
    "GatherInput",
    "PendingReduce",
    "Landed",
    "PendingUnshard",
    "RowShare",
    "ReduceInput",
    "ReducePolicy",
    "ReduceState",
    "accumulate_local_grads",
    "begin_reduce",
    "begin_unshard",
    "carries_presence",
    "copy_out",
    "encode_unshard",
    "finish_reduce",
    "finish_unshard",
    "full_views",
    "issue_reduce",
    "land_unshard",
    "pack_for_gather",
    "pack_grads",
    "pack_locals",
    "post_forward_from_gather",
    "reduce_grad",
    "reduce_grad_with_state",
    "reduce_input",
    "reduce_row_numel",
    "refit_partial",
    "reshard",
    "shard",
    "shard_tensors",
    "unshard",
    "writeback",
]

ShardDims = int | Callable[[str, torch.Tensor], int] | Any


# --------------------------------------------------------------------------------------- shard


def shard(
    tree: Any,
    *,
    world_size: int,
    rank: int,
    shard_dims: ShardDims = 0,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> ShardedState:
    """Shard a pytree of full tensors for one rank (no communication).

    Args:
        tree: a pytree of tensors (a dict of parameters, a list, nested containers).
        world_size: ranks in the shard group.
        rank: which rank's shard to build.
        shard_dims: ``int`` for every leaf, a function ``(fqn, tensor) -> int``, or a pytree of
            ints matching ``tree`` (one per leaf, under the same keys; a missing or unknown key
            raises :class:`~.errors.LayoutMismatchError` naming it).
        param_dtype: all-gather / compute dtype for floating-point leaves (mixed precision).
        reduce_dtype: gradient reduction dtype.

    Returns:
        A :class:`ShardedState` whose :attr:`~ShardedState.flat` holds this rank's padded shards.

    Example:
        >>> import torch
        >>> s = shard({"w": torch.arange(5.0)}, world_size=4, rank=2)
        >>> s.local(0)
        tensor([4.])
    """
    paths, leaves, spec = optree.tree_flatten_with_path(tree)
    fqns = [".".join(str(p) for p in path) for path in paths]
    if callable(shard_dims):
        dims = [int(shard_dims(f, t)) for f, t in zip(fqns, leaves)]
    elif isinstance(shard_dims, int):
        dims = [shard_dims] * len(leaves)
    else:
        dims = _dims_by_path(shard_dims, fqns)
    for f, t in zip(fqns, leaves):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"shard: leaf {f!r} is a {type(t).__name__}, not a torch.Tensor")
    specs = [
        ParamSpec(f, tuple(t.shape), t.dtype, bool(t.requires_grad), d)
        for f, t, d in zip(fqns, leaves, dims)
    ]
    lay = GroupLayout.build(
        specs, world_size, param_dtype=param_dtype, reduce_dtype=reduce_dtype, treespec=spec
    )
    return shard_tensors(leaves, lay, rank)


def _dims_by_path(shard_dims: Any, fqns: Sequence[str]) -> list[int]:
    """``shard`` 's ``shard_dims`` given as a pytree: each leaf's dim, matched by its path (so a
    missing or extra key is named, never silently shifts the dims of the leaves after it)."""
    paths, values, _ = optree.tree_flatten_with_path(shard_dims)
    given = {".".join(str(p) for p in path): d for path, d in zip(paths, values)}
    missing = [f for f in fqns if f not in given]
    unknown = [k for k in given if k not in set(fqns)]
    if missing or unknown:
        problems = []
        if missing:
            problems.append(f"has no entry for {', '.join(map(repr, missing))}")
        if unknown:
            problems.append(f"has entries the tree lacks: {', '.join(map(repr, unknown))}")
        raise LayoutMismatchError(
            f"shard: shard_dims {' and '.join(problems)}; the tree's leaves are "
            f"{list(fqns)}. Give shard_dims the tree's structure (one int per leaf, under the "
            "same keys), or one int for every leaf, or a function (fqn, tensor) -> int"
        )
    dims = []
    for f in fqns:
        try:
            dims.append(operator.index(given[f]))
        except TypeError:
            raise LayoutMismatchError(
                f"shard: shard_dims[{f!r}] is {given[f]!r}, not an int (the dim to shard)"
            ) from None
    return dims


def shard_tensors(tensors: Sequence[torch.Tensor], layout: GroupLayout, rank: int) -> ShardedState:
    """Shard full tensors given in ``layout`` order for ``rank`` (no communication)."""
    layout.check_full(tensors, what="shard", dtypes=[s.dtype for s in layout.specs])
    locals_ = []
    for i, t in enumerate(tensors):
        start, length = layout.extent(i, rank)
        locals_.append(t.narrow(layout.shard_dims[i], start, length))
    return pack_locals(locals_, layout, rank)


def pack_locals(
    locals_: Sequence[torch.Tensor | None],
    layout: GroupLayout,
    rank: int,
    *,
    device: torch.device | None = None,
    donate: ShardedState | None = None,
) -> ShardedState:
    """A sharded state from this rank's unpadded shards (``None``: zeros); padding is zero.

    The one place a :class:`ShardedState` is packed from local tensors (sharding, re-adopting
    parameters after ``_apply``, ``functional_call`` substitutes, gradient cotangents, the
    recovery snapshots): one zeroed buffer and one ``foreach`` copy, cast to each parameter's
    dtype. No communication.

    Args:
        donate: an earlier result of this function for the same layout and rank, whose buffer
            is overwritten and returned instead of a new one (its padding is still zero; the
            caller gives it up). Shards passed as ``None`` keep their old values there.

    Raises:
        LayoutMismatchError: a shard's shape is not this rank's local shape in ``layout``, or
            ``donate`` has another layout or rank.
    """
    if len(locals_) != len(layout):
        raise LayoutMismatchError(
            f"pack_locals: {len(locals_)} shards for a layout of {len(layout)} parameters"
        )
    if donate is not None:
        if donate.layout != layout or donate.rank != rank:
            raise LayoutMismatchError(
                "pack_locals: the donated state has another layout or rank than the one packed"
            )
        state = donate
    else:
        given = [t for t in locals_ if t is not None]
        dev = device or (given[0].device if given else torch.device("cpu"))
        flat = torch.zeros(layout.storage.total, dtype=layout.storage_dtype, device=dev)
        state = ShardedState(layout, rank, flat)
    dst, src = [], []
    for i, t in enumerate(locals_):
        if t is None:
            continue
        want = layout.local_shape(i, rank)
        if tuple(t.shape) != want:
            raise LayoutMismatchError(
                f"pack_locals: the shard of {layout.specs[i].fqn!r} on rank {rank} has shape "
                f"{tuple(t.shape)}, expected {want}"
            )
        if t.numel():
            dst.append(state.local(i))
            src.append(t.detach())
    if dst:
        with torch.no_grad():
            torch._foreach_copy_(dst, src)
    return state


# ------------------------------------------------------------------------------------- unshard


def pack_for_gather(state: ShardedState) -> torch.Tensor:
    """This rank's all-gather input: the padded shards packed in the gather dtypes.

    Zero-copy when no dtype changes (the sharded buffer itself is sent; collectives only read
    their input); one cast-copy when the group is uniform; a per-parameter copy otherwise.
    """
    lay = state.layout
    if lay.gathers_storage:
        return state.flat
    # A byte buffer has alignment gaps between regions: zero them so every rank sends (and the
    # post-forward rows keep) deterministic bytes, as the zero-initialised sharded buffer does.
    alloc = torch.empty if lay.gather.uniform else torch.zeros
    out = alloc(lay.gather.total, dtype=lay.gather_buffer_dtype, device=state.flat.device)
    if lay.storage.uniform and lay.gather.uniform:
        out.copy_(state.flat)
        return out
    for i in range(len(lay)):
        region(out, lay.gather, i, lay.gather_dtypes[i]).copy_(state.shard(i).reshape(-1))
    return out


@attrs.frozen(eq=False)
class PendingUnshard:
    """A *handle* (not a record: no pytree, never compared) for an all-gather in flight;
    :func:`finish_unshard` turns it into an :class:`UnshardedState`. Its buffers are owned by
    the collective until ``work.wait()``.

    ``output`` is the padded rank-major all-gather output, or ``None`` when the pieces were
    gathered straight into ``into`` (no copy-out needed). ``into`` is where the gathered
    inputs will be laid out per parameter either way (on the packed path :func:`finish_unshard`
    copies out into it). ``codecs`` and ``metadata`` are what the encode step used and
    returned (``None``: every codec is the identity). ``input`` is the all-gather input when
    the encode made a new buffer (``None``: the state's own tensor was sent); like ``output``
    it belongs to the collective until ``work.wait()``, then to the caller, who may free it.
    ``share`` is set for a member of a bucket whose rows are handed out one member at a time
    (:func:`~.coalesce.begin_unshard_coalesced` without buffers): landing fills the caller's
    buffer from it, and a handle dropped unlanded must :meth:`RowShare.drop` it.
    """

    layout: GroupLayout
    rank: int
    output: torch.Tensor | None
    work: Work
    source: ShardedState | None
    into: torch.Tensor | None = None
    codecs: tuple[C.GatherCodec | None, ...] | None = None
    metadata: tuple[Any, ...] | None = None
    input: torch.Tensor | None = None
    share: RowShare | None = None


class RowShare(Protocol):
    """A *handle*: one group's part of a bucket's gathered rows, not yet laid out."""

    def fill(self, into: torch.Tensor) -> None:
        """Lay the group's gathered rows out in ``into`` (after the collective completed)."""

    def drop(self) -> None:
        """Give the part up unlanded (the bucket frees its rows once every part is done)."""

    @property
    def rows(self) -> torch.Tensor:
        """The bucket's received rows this part is read from (for stream annotations)."""


@attrs.frozen(eq=False)
class GatherInput:
    """A *handle*: this rank's encoded all-gather input (the copy-in), made by
    :func:`encode_unshard` before the collective is issued (a caller may run the two on
    different streams). ``tensor`` is what is sent; ``metadata`` the codecs' (``None``: every
    codec is the identity); ``fresh``: ``tensor`` is a new buffer, not the state's own sharded
    buffer or kept rows (zero-copy)."""

    tensor: torch.Tensor
    metadata: tuple[Any, ...] | None
    fresh: bool


class Landed(NamedTuple):
    """What :func:`land_unshard` returns: the full parameters, the buffer they were decoded
    from (identity parameters view it), and the inner tensors the codecs' decodes returned
    (FSDP2's ``inner_tensors``: where their storage lives; one may be a view of ``buffer``)."""

    params: tuple[torch.Tensor, ...]
    buffer: torch.Tensor
    inner: tuple[torch.Tensor, ...]


def _uniform_dim0(layout: GroupLayout) -> bool:
    return layout.gather.uniform and layout.dim0


def gathers_in_place(layout: GroupLayout) -> bool:
    """Whether ``layout``'s gathered rows can be laid out in its unsharded buffer row by row
    (:func:`copy_out_rows`, or pieces received there): one dtype, every parameter sharded on
    dim 0."""
    return _uniform_dim0(layout)


def _gather_input(
    state: ShardedState | PostForwardState,
    comm: Communicator,
    codecs: Sequence[C.GatherCodec | None] | None,
) -> tuple[torch.Tensor, tuple[Any, ...] | None]:
    """Check ``state`` against ``comm`` and encode this rank's all-gather input (before any
    collective): the packed shards (identity codecs), the packed encoded inputs (codecs), or
    the rows a :class:`PostForwardState` kept."""
    lay = state.layout
    if isinstance(state, ShardedState):
        check_comm(comm, lay.world_size, "unshard")
        if lay.codec_inputs is not None:
            return C.encode_group(state, codecs if codecs is not None else [None] * len(lay))
        if codecs is not None and any(c is not None for c in codecs):
            raise GatherCodecError(
                "unshard: codecs given for a layout without codec inputs; teach the layout "
                "with codec.with_codec_inputs first"
            )
        return pack_for_gather(state), None
    if isinstance(state, PostForwardState):
        if lay.codec_inputs is not None:
            raise GatherCodecError(
                "unshard: a PostForwardState of a layout with all-gather codecs (the rows hold "
                "no encoded inputs); reshard such groups fully"
            )
        check_comm(comm, state.group_size, "unshard of a PostForwardState (its sub-group)")
        if comm.rank != state.sub_rank:
            raise MeshError(
                f"unshard: sub-group communicator rank {comm.rank} != state sub-rank {state.sub_rank}"
            )
        return state.rows, None
    raise StateError(
        f"unshard expects a ShardedState or PostForwardState, got {type(state).__name__}; "
        "an UnshardedState is already unsharded"
    )


def encode_unshard(
    state: ShardedState | PostForwardState,
    comm: Communicator,
    *,
    codecs: Sequence[C.GatherCodec | None] | None = None,
) -> GatherInput:
    """Check ``state`` against ``comm`` and encode this rank's all-gather input: the first
    half of :func:`begin_unshard` (pack and cast the shards, or run each parameter's codec).

    Raises:
        GatherCodecError: a codec's encode failed or disagrees with the layout.
    """
    inp, metadata = _gather_input(state, comm, codecs)
    own = state.flat if isinstance(state, ShardedState) else state.rows
    return GatherInput(inp, metadata, inp is not own)


def begin_unshard(
    state: ShardedState | PostForwardState,
    comm: Communicator,
    *,
    codecs: Sequence[C.GatherCodec | None] | None = None,
    async_op: bool = True,
    into: torch.Tensor | None = None,
    encoded: GatherInput | None = None,
    alloc: Callable[[int, torch.dtype, torch.device], torch.Tensor] | None = None,
) -> PendingUnshard:
    """Encode and issue the group's one all-gather (over the sub-group for a
    :class:`PostForwardState`).

    Args:
        state: what to gather.
        comm: the shard group (or the sub-group of a :class:`PostForwardState`).
        codecs: per parameter, its all-gather codec (:mod:`~functional_fsdp.core.codec`);
            ``None`` (for a parameter, or all of them) is the identity. A layout with codec
            inputs (``codec.with_codec_inputs``) needs its codecs here.
        async_op: return before the collective completes.
        into: the buffer the gathered inputs will be laid out in (``world_size`` times the
            :func:`~functional_fsdp.core.codec.wire` packing). With a communicator that
            ``supports_pieces``, a sharded state of a uniform dim-0 group of identity codecs
            is gathered straight into it, parameter by parameter (no copy-out).
        encoded: this rank's input, already made by :func:`encode_unshard` with the same
            ``state``, ``comm`` and ``codecs`` (``None``: encode here).
        alloc: makes the all-gather output, ``alloc(numel, dtype, device)`` (default
            ``torch.empty``; the shell's reuses freed host memory).

    Raises:
        GatherCodecError: a codec's encode failed or disagrees with the layout (no collective
            was issued).
    """
    lay = state.layout
    enc = encode_unshard(state, comm, codecs=codecs) if encoded is None else encoded
    inp, metadata = enc.tensor, enc.metadata
    fresh = inp if enc.fresh else None
    source = state if isinstance(state, ShardedState) else state.source
    kept = None if codecs is None else tuple(codecs)
    if (
        into is not None
        and metadata is None
        and isinstance(state, ShardedState)
        and _uniform_dim0(lay)
    ):
        # Straight into the buffer (no all-gather output, no copy-out) where it can be laid out
        # as it arrives.
        work: Work | None = None
        if lay.world_size == 1:
            # One rank: its packed row already is the per-parameter layout of the buffer.
            into.copy_(inp)
            work = DoneWork()
        elif uses_pieces(comm, lay.unsharded_bytes):
            ws, pack = lay.world_size, lay.gather
            sends = list(inp.narrow(0, 0, pack.total).split(pack.sizes))  # back to back
            dsts = _rank_pieces(into, pack, ws)
            recvs = [list(dsts[r::ws]) for r in range(ws)]
            pcomm = cast(PiecesCommunicator, comm)
            work = pcomm.all_gather_pieces(recvs, sends, async_op=async_op)
        if work is not None:
            return PendingUnshard(lay, state.rank, None, work, source, into, kept, input=fresh)
    # world_size rows of the wire packing (a PostForwardState's sub-group sends several rows).
    ranks = comm.world_size
    out = (alloc or empty_buffer)(ranks * inp.numel(), inp.dtype, inp.device)
    work = collective_or_copy(ranks, out, inp, lambda: comm.all_gather(out, inp, async_op=async_op))
    return PendingUnshard(lay, state.rank, out, work, source, into, kept, metadata, fresh)


def land_unshard(
    pending: PendingUnshard,
    *,
    into: torch.Tensor | None = None,
    out: tuple[torch.Tensor, ...] | None = None,
) -> Landed:
    """:func:`finish_unshard` without the record: wait, copy out, decode.

    For a caller that keeps its own unsharded copy across gathers (the shell's persistent
    buffer): with ``out``, the full parameters an earlier landing into the same ``into``
    returned, nothing is rebuilt: identity parameters already view ``into``, codecs decode
    into ``out`` (FSDP2's ``out=``), and ``out`` is returned.
    """
    pending.work.wait()
    lay = pending.layout
    buf = _landing_buffer(pending, into)
    if pending.metadata is None:  # every codec is the identity: views of the buffer
        return Landed(out if out is not None else full_views(lay, buf), buf, ())
    codecs = pending.codecs if pending.codecs is not None else (None,) * len(lay)
    params, inner = C.decode_group(lay, buf, codecs, pending.metadata, out=out)
    return Landed(params, buf, inner)


def _landing_buffer(pending: PendingUnshard, into: torch.Tensor | None) -> torch.Tensor:
    """The buffer the gathered inputs lie in per parameter (copied out of the rank-major
    output unless the pieces landed there, or at world size 1 with no buffer asked for)."""
    lay = pending.layout
    if pending.share is not None:  # a bucket member's rows, laid out now
        buf = into if into is not None else pending.into
        assert buf is not None, "a bucket member lands into a buffer the caller passes"
        pending.share.fill(buf)
        return buf
    if pending.output is None:  # the pieces landed in pending.into
        buf = pending.into
        assert buf is not None
        if into is not None and into is not buf:
            into.copy_(buf)
            return into
        return buf
    target = into if into is not None else pending.into
    if target is None and lay.world_size == 1 and lay.dim0:
        return pending.output  # one rank's row is already laid out per parameter
    buf = target if target is not None else torch.empty_like(pending.output)
    copy_out(lay, pending.output, buf)
    return buf


def finish_unshard(
    pending: PendingUnshard,
    *,
    into: torch.Tensor | None = None,
    out: tuple[torch.Tensor, ...] | None = None,
) -> UnshardedState:
    """Wait for the all-gather, copy out and decode the full parameters (padding stripped).

    Args:
        pending: from :func:`begin_unshard`.
        into: optional buffer (see :func:`begin_unshard`) to copy into; the shell passes its
            persistent unsharded buffer so views saved by autograd stay valid.
        out: the full parameters of an earlier gather into the same ``into``, refreshed in
            place (see :func:`land_unshard`).

    Raises:
        GatherCodecError: a codec's decode failed or returned the wrong thing.
    """
    landed = land_unshard(pending, into=into, out=out)
    buffer = landed.buffer if pending.metadata is None else None
    return UnshardedState(pending.layout, pending.rank, landed.params, pending.source, buffer)


def copy_out(layout: GroupLayout, output: torch.Tensor, buf: torch.Tensor) -> None:
    """Copy a padded all-gather output into ``buf`` so each input is contiguous there (every
    rank's shard of a parameter, for identity codecs).

    One ``split_with_sizes_copy`` per rank for uniform dim-0 groups (:func:`copy_out_rows`); a
    copy per region otherwise (per parameter for groups sharded on other dims; codec groups
    shard on dim 0).
    """
    ws = layout.world_size
    pack, _ = C.wire(layout)
    rows = output.view(ws, pack.total)
    if not layout.dim0:
        for i in range(len(layout)):
            _copy_out_one(layout, rows, buf, i)
        return
    if pack.uniform:
        copy_out_rows(layout, rows.unbind(0), buf)
        return
    for o, n in zip(pack.offsets, pack.sizes):
        dst = buf.narrow(0, ws * o, ws * n).view(ws, n)
        dst.copy_(rows.narrow(1, o, n))  # bytes: every region's dtype is copied exactly


def copy_out_rows(layout: GroupLayout, rows: Sequence[torch.Tensor], buf: torch.Tensor) -> None:
    """:func:`copy_out` from one packed row per rank (``rows[r]``: rank ``r``'s, e.g. this
    rank's own shards as they are beside its peers' received rows) instead of one rank-major
    output. Uniform dim-0 layouts only (:func:`gathers_in_place`)."""
    ws = layout.world_size
    pack, _ = C.wire(layout)
    pieces = _rank_pieces(buf, pack, ws)
    sizes = list(pack.sizes)
    for r, row in enumerate(rows):
        torch.split_with_sizes_copy(row, sizes, dim=0, out=list(pieces[r::ws]))


def _rank_pieces(buf: torch.Tensor, pack: L.PackLayout, ws: int) -> tuple[torch.Tensor, ...]:
    """Where each rank's piece of each parameter lies in an unsharded buffer of a uniform
    packing (the layout :func:`copy_out` makes: parameter by parameter, rank by rank within
    one): entry ``i * ws + r`` is rank ``r``'s piece of parameter ``i``, so ``[r::ws]`` are rank
    ``r``'s. One ``split`` (a few microseconds) instead of a view per region and rank."""
    sizes = [n for n in pack.sizes for _ in range(ws)]
    return buf.narrow(0, 0, ws * pack.total).split(sizes)


def full_views(layout: GroupLayout, buf: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The full (unpadded) parameters as views into a copied-out buffer (see :func:`copy_out`)."""
    return tuple(_full_view(layout, buf, i) for i in range(len(layout)))


def _full_region(layout: GroupLayout, buf: torch.Tensor, i: int) -> torch.Tensor:
    ws, pack = layout.world_size, layout.gather
    r = buf.narrow(0, ws * pack.offsets[i], ws * pack.sizes[i])
    return r if pack.uniform else r.view(layout.gather_dtypes[i])


def _full_view(layout: GroupLayout, buf: torch.Tensor, i: int) -> torch.Tensor:
    spec, dim = layout.specs[i], layout.shard_dims[i]
    if dim == 0:
        return (
            _full_region(layout, buf, i)
            .view(layout.padded_full_shape(i))
            .narrow(0, 0, spec.shape[0])
        )
    return _full_region(layout, buf, i).view(spec.shape)


def _copy_out_one(layout: GroupLayout, rows: torch.Tensor, buf: torch.Tensor, i: int) -> None:
    ws, pack, dim = layout.world_size, layout.gather, layout.shard_dims[i]
    if pack.sizes[i] == 0:
        # Nothing to copy; a (ws, 0) byte slice cannot be viewed as a wider dtype either.
        return
    src = rows.narrow(1, pack.offsets[i], pack.sizes[i])
    dst = _full_region(layout, buf, i)
    if not pack.uniform:
        src = src.contiguous().view(layout.gather_dtypes[i])
    if dim == 0:
        dst.view(ws, -1).copy_(src)
        return
    full = dst.view(layout.specs[i].shape)
    chunk = layout.shard_shapes[i][dim]
    for r in range(ws):
        full.narrow(dim, r * chunk, chunk).copy_(src[r].view(layout.shard_shapes[i]))


def unshard(
    state: ShardedState | PostForwardState,
    comm: Communicator,
    *,
    codecs: Sequence[C.GatherCodec | None] | None = None,
) -> UnshardedState:
    """All-gather a group's full parameters: encode (pack, cast to ``param_dtype``; or each
    parameter's codec), one all-gather, copy out, decode (strip padding). A
    :class:`PostForwardState` gathers over its sub-group ``comm``.
    """
    return finish_unshard(begin_unshard(state, comm, codecs=codecs, async_op=False))


# ------------------------------------------------------------------------------------- reshard


def reshard(
    unsharded: UnshardedState, *, group_size: int | None = None
) -> ShardedState | PostForwardState:
    """Drop the full tensors.

    Args:
        unsharded: the state to reshard.
        group_size: ``None`` (or the world size) returns the sharded source state; ``k`` returns
            a :class:`PostForwardState` keeping this rank's rows for a ``k``-rank sub-group
            (``reshard_after_forward=k``).
    """
    if not isinstance(unsharded, UnshardedState):
        raise StateError(
            f"reshard expects an UnshardedState, got {type(unsharded).__name__}; the state is "
            "already sharded (call unshard first)"
        )
    lay = unsharded.layout
    if unsharded.source is None:
        raise StateError(
            "reshard: this UnshardedState has no sharded source; use writeback(unsharded, sharded)"
        )
    if group_size is None or group_size == lay.world_size:
        return unsharded.source
    L.check_sub_group_size(group_size, lay.world_size)
    per = lay.world_size // group_size
    first = (unsharded.rank % group_size) * per
    rows = torch.empty(
        per * lay.gather.total, dtype=lay.gather_buffer_dtype, device=_device(unsharded.params)
    )
    rows.zero_()
    for j in range(per):
        row = rows.narrow(0, j * lay.gather.total, lay.gather.total)
        for i, full in enumerate(unsharded.params):
            start, length = lay.extent(i, first + j)
            dst = region(row, lay.gather, i, lay.gather_dtypes[i]).view(lay.shard_shapes[i])
            dim = lay.shard_dims[i]
            dst.narrow(dim, 0, length).copy_(full.narrow(dim, start, length))
    return PostForwardState(lay, unsharded.rank, group_size, rows, unsharded.source)


def post_forward_from_gather(
    layout: GroupLayout, rank: int, group_size: int, output: torch.Tensor, source: ShardedState
) -> PostForwardState:
    """Build a :class:`PostForwardState` by slicing the padded all-gather output (a copy)."""
    L.check_sub_group_size(group_size, layout.world_size)
    per = layout.world_size // group_size
    n = layout.gather.total
    rows = output.narrow(0, (rank % group_size) * per * n, per * n).clone()
    return PostForwardState(layout, rank, group_size, rows, source)


# ----------------------------------------------------------------------------------- writeback


def writeback(unsharded: UnshardedState, sharded: ShardedState | None = None) -> ShardedState:
    """A new sharded state holding this rank's slice of the (possibly edited) full tensors.

    Args:
        unsharded: full tensors, e.g. edited in place inside ``summon_full_params``.
        sharded: the sharded state to write into (default: ``unsharded.source``). Not mutated.

    Returns:
        ``sharded`` with only :attr:`~ShardedState.flat` replaced: grads and the static fields
        are carried over as they are.
    """
    if not isinstance(unsharded, UnshardedState):
        raise StateError(f"writeback expects an UnshardedState, got {type(unsharded).__name__}")
    sharded = sharded if sharded is not None else unsharded.source
    if sharded is None:
        raise StateError(
            "writeback: pass the ShardedState to write into (the unsharded state has no source)"
        )
    if not isinstance(sharded, ShardedState):
        raise StateError(f"writeback writes into a ShardedState, got {type(sharded).__name__}")
    if sharded.layout != unsharded.layout:
        raise LayoutMismatchError(
            "writeback: the sharded and unsharded states have different layouts"
        )
    fresh = shard_tensors(
        [p.to(s.dtype) for p, s in zip(unsharded.params, sharded.layout.specs)],
        sharded.layout,
        sharded.rank,
    )
    # Evolve the given state, not the fresh one, so a field added to ShardedState later is kept
    # too (listing the fields to copy once dropped one).
    return attrs.evolve(sharded, flat=fresh.flat)


# ------------------------------------------------------------------------------------- helpers


def _device(tensors: Sequence[torch.Tensor]) -> torch.device:
    return tensors[0].device if tensors else torch.device("cpu")
