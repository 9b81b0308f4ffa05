"""Coalesced collectives: several small groups' all-gathers (or reduce-scatters) as one (pure).

Every collective is a synchronisation point between ranks: with many small groups (a deep model
of small blocks) a step pays dozens of latency-bound all-gathers and reduce-scatters, each
waiting for the slowest rank to arrive. Adjacent groups whose data is small travel together in a
*bucket*: one all-gather whose input is the groups' packed shards side by side, and one
reduce-scatter of their packed gradients side by side. Coalescing changes who travels together,
never what is summed: each element of a reduce-scatter is still the sum of the same ``N``
values in the same rank order, so the results are bit-identical to one collective per group.

The plan (:func:`plan_buckets`) is integers only: groups in the order they run (the forward
order the root records in its first step, reversed for the backward), their unsharded bytes,
whether each may join a bucket, and the bucket size. Every rank derives it from facts every rank
shares, so every rank issues the same collectives. :class:`CommunicationSchedule` is the plan as
a record (``FSDPModule.communication_schedule()``).

The collectives (:func:`begin_unshard_coalesced`, :func:`issue_reduce_coalesced`) return one
handle per group, each the same type the one-group path returns
(:class:`~.transitions.PendingUnshard`, :class:`~.reduction.PendingReduce`), so landing and
finishing a group's part are the one-group code: the gather's handle lands as if the pieces had
arrived in the group's buffer (the bucket's output is copied out into every member's buffer when
the first member waits; or, on the pieces path of dim-0 groups, into each member's buffer as that
member lands, so no member's buffer exists before it is needed), and the reduction's output is
the group's slice of the bucket's.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import cast

import attrs
import torch

from .comm import Communicator, PiecesCommunicator, Work, check_comm, work_done
from .errors import StateError
from .records import GroupLayout, ShardedState
from .reduction import (
    NO_REDUCE_STATE,
    PendingReduce,
    ReduceInput,
    ReduceState,
    accumulate_local_grads,
    empty_buffer,
    finish_reduce,
)
from .reproducible import PendingTreeReduce, finish_tree_reduce
from .transitions import (
    GatherInput,
    PendingUnshard,
    copy_out,
    copy_out_rows,
    encode_unshard,
    gathers_in_place,
)

__all__ = [
    "Bucket",
    "CoalescedWork",
    "CommunicationSchedule",
    "begin_unshard_coalesced",
    "finish_reductions",
    "issue_reduce_coalesced",
    "lands_by_member",
    "packs_members",
    "plan_buckets",
]


@attrs.frozen
class Bucket:
    """Groups whose collectives travel together, in the order they run.

    Attributes:
        groups: the groups' names.
        unsharded_bytes: their all-gather outputs' bytes together (the bucket's memory).
    """

    groups: tuple[str, ...]
    unsharded_bytes: int

    @property
    def coalesced(self) -> bool:
        """Whether more than one group travels in this bucket."""
        return len(self.groups) > 1


@attrs.frozen
class CommunicationSchedule:
    """Which groups' collectives travel together (``FSDPModule.communication_schedule()``).

    Attributes:
        bucket_bytes: the bucket size the plan used (``0``: coalescing off).
        forward: the forward's all-gathers, in forward order.
        backward: the backward's all-gathers (of the groups that gather again), in the order
            the backward reaches the groups (the reverse of the post-forward order).
        reduce: the backward's reduce-scatters, in the order the groups' post-backwards run
            (the reverse of the pre-forward order: autograd runs the groups' unshard nodes
            latest-made first, so the root's runs last).
    """

    bucket_bytes: int
    forward: tuple[Bucket, ...]
    backward: tuple[Bucket, ...]
    reduce: tuple[Bucket, ...] = ()

    def collectives(self) -> tuple[int, int, int]:
        """``(forward all-gathers, backward all-gathers, reduce-scatters)``: bucket counts."""
        return len(self.forward), len(self.backward), len(self.reduce)


def plan_buckets(
    names: Sequence[str],
    sizes: Sequence[int],
    eligible: Sequence[bool],
    bucket_bytes: int,
) -> tuple[Bucket, ...]:
    """Cut groups (in the order they run) into buckets of adjacent groups.

    A bucket holds consecutive eligible groups whose unsharded bytes add up to at most
    ``bucket_bytes``; an ineligible group, or one larger than the bucket, travels alone.
    ``bucket_bytes <= 0`` turns coalescing off (one bucket per group).

    Example:
        >>> [b.groups for b in plan_buckets("abcde", [4, 4, 4, 9, 1], [True] * 5, 8)]
        [('a', 'b'), ('c',), ('d',), ('e',)]
    """
    if not len(names) == len(sizes) == len(eligible):
        raise StateError("plan_buckets: names, sizes and eligible must have the same length")
    out: list[Bucket] = []
    cur: list[str] = []
    cur_bytes = 0

    def close() -> None:
        nonlocal cur, cur_bytes
        if cur:
            out.append(Bucket(tuple(cur), cur_bytes))
        cur, cur_bytes = [], 0

    for name, size, ok in zip(names, sizes, eligible):
        if not ok or bucket_bytes <= 0 or size > bucket_bytes:
            close()
            out.append(Bucket((name,), size))
            continue
        if cur_bytes + size > bucket_bytes:
            close()
        cur.append(name)
        cur_bytes += size
    close()
    return tuple(out)


class CoalescedWork:
    """A *handle*: one collective for several groups, then (once, at the first ``wait``) the
    step that hands each group its part (e.g. the gather's copy-out into every member's
    buffer). Every member's handle holds the same one; waiting twice is free."""

    __slots__ = ("_then", "_work")

    def __init__(self, work: Work, then: Callable[[], None] | None = None) -> None:
        self._work: Work | None = work
        self._then = then

    def wait(self) -> None:
        """Wait for the collective, then run the hand-out step (the first time only)."""
        if self._work is not None:
            self._work.wait()  # (kept until waited: a failed wait leaves it in flight)
            self._work = None
        if self._then is not None:
            then, self._then = self._then, None
            then()

    def is_completed(self) -> bool | None:
        """Whether the collective completed (the hand-out may not have run yet); ``None``
        when its work cannot say."""
        return True if self._work is None else work_done(self._work)


def _check_bucket(states: Sequence[ShardedState], comm: Communicator, what: str) -> None:
    if not states:
        raise StateError(f"{what}: an empty bucket")
    ws = states[0].layout.world_size
    for s in states:
        if not isinstance(s, ShardedState):
            raise StateError(f"{what}: buckets hold ShardedStates, got {type(s).__name__}")
        if s.layout.world_size != ws:
            raise StateError(f"{what}: groups of different world sizes cannot share a bucket")
    check_comm(comm, ws, what)


def begin_unshard_coalesced(
    states: Sequence[ShardedState],
    comm: Communicator,
    intos: Sequence[torch.Tensor] | Callable[[], Sequence[torch.Tensor]] | None,
    *,
    async_op: bool = True,
    guard: Callable[[tuple[torch.Tensor, ...]], AbstractContextManager[object]] | None = None,
    alloc: Callable[[int, torch.dtype, torch.device], torch.Tensor] | None = None,
    free: Callable[[torch.Tensor], None] | None = None,
) -> list[PendingUnshard]:
    """One all-gather for several groups: each group's :class:`PendingUnshard`.

    Each rank sends its groups' packed shards: with the pieces collectives, each member's as it
    is (one message per member and peer, no packing copy), otherwise side by side in one
    message per peer. They land rank-major in one output (with the pieces collectives and
    dim-0 members, only the peers' rows: this rank's are its shards); when the first member
    waits, the output is copied out into every member's buffer (``intos[k]``, laid out as
    :func:`~.transitions.copy_out` lays out one group's) and freed.
    Each handle then lands like a gather whose pieces arrived in its buffer. Identity codecs
    only, one wire dtype for the bucket.

    Without ``intos`` (:func:`lands_by_member` buckets only) each handle carries its part of
    the received rows (``PendingUnshard.share``), laid out when it lands into the buffer the
    caller passes then; the rows are freed once every member has landed or dropped its part.

    Args:
        states: the members' sharded states, in bucket order (every rank the same).
        comm: the shard group.
        intos: per member, its unsharded buffer (``world_size`` rows of its packing), or
            ``None``: laid out member by member at landing (see above). A callable giving
            them is called only when the bucket needs them now (not :func:`lands_by_member`):
            otherwise the members land one by one, as with ``None``, and each buffer is
            allocated by its own landing.
        async_op: return before the collective completes.
        guard: a context the copy-out into the buffers runs in (the shell keeps their
            autograd version counters, as for a one-group landing).
        alloc: makes the rank-major output, ``alloc(numel, dtype, device)`` (default
            ``torch.empty``).
        free: frees it after the copy-out (default: ``resize_(0)`` of its storage).
    """
    _check_bucket(states, comm, "coalesced unshard")
    encoded = [encode_unshard(s, comm) for s in states]
    dtypes = {e.tensor.dtype for e in encoded}
    if len(dtypes) != 1 or any(e.metadata is not None for e in encoded):
        raise StateError(
            "coalesced unshard: a bucket's groups must share one wire dtype and identity "
            f"codecs (got dtypes {sorted(str(d) for d in dtypes)})"
        )
    if lands_by_member(states, comm):
        given = None if callable(intos) else intos
        return _gather_peer_rows(states, encoded, comm, given, async_op, guard, alloc, free)
    if callable(intos):
        intos = intos()
    if intos is None:
        raise StateError("coalesced unshard: pass every member's buffer (not a pieces gather)")
    return _gather_rank_major(states, encoded, comm, intos, async_op, guard, alloc, free)


def _gather_rank_major(
    states: Sequence[ShardedState],
    encoded: Sequence[GatherInput],
    comm: Communicator,
    intos: Sequence[torch.Tensor],
    async_op: bool,
    guard: Callable[[tuple[torch.Tensor, ...]], AbstractContextManager[object]] | None,
    alloc: Callable[[int, torch.dtype, torch.device], torch.Tensor] | None,
    free: Callable[[torch.Tensor], None] | None,
) -> list[PendingUnshard]:
    """The gather of a bucket whose output holds every rank's row (this rank's too), copied
    out into every member's buffer ``intos`` when the first member waits."""
    sizes = [e.tensor.numel() for e in encoded]
    total = sum(sizes)
    ws = comm.world_size
    first = encoded[0].tensor
    out = (alloc or empty_buffer)(ws * total, first.dtype, first.device)
    rows = out.view(ws, total)
    parts = list(rows.split(sizes, dim=1))
    send: torch.Tensor | None = None
    if comm.supports_pieces:
        # one message per member and peer, straight from each member's shards: no packing copy
        pieces = cast(PiecesCommunicator, comm)
        outputs = [[p[r] for p in parts] for r in range(ws)]
        work = pieces.all_gather_pieces(outputs, [e.tensor for e in encoded], async_op=async_op)
    else:
        send = torch.cat([e.tensor for e in encoded])
        work = comm.all_gather(out, send, async_op=async_op)

    def hand_out() -> None:
        with contextlib.nullcontext() if guard is None else guard(tuple(intos)):
            for s, part, into in zip(states, parts, intos):
                copy_out(s.layout, part, into)
        (free or _free)(out)
        if send is not None:
            _free(send)

    shared = CoalescedWork(work, hand_out)
    return [
        PendingUnshard(s.layout, s.rank, None, shared, s, into) for s, into in zip(states, intos)
    ]


def packs_members(comm: Communicator, row_bytes: Sequence[int]) -> bool:
    """Whether a coalesced gather of members whose rows (this rank's bytes of each) are
    ``row_bytes`` sends one packed message per peer (a copy of this rank's row into a send
    buffer) rather than one message per member and peer.

    A message costs a fixed amount of CPU that ``pieces_min_bytes`` amortizes over a group's
    parameters (about a dozen in a block); members averaging under 1/16 of it (64 KiB of row
    on gloo) cost less copied than sent alone. Rank-consistent: it reads only the
    communicator's declaration and the layouts, so every rank sends the same messages.
    """
    if not comm.supports_pieces or not row_bytes:
        return False
    per_message = cast(PiecesCommunicator, comm).pieces_min_bytes // 16
    return sum(row_bytes) < per_message * len(row_bytes)


def lands_by_member(states: Sequence[ShardedState], comm: Communicator) -> bool:
    """Whether a coalesced gather of ``states`` receives only the peers' rows (the pieces
    collectives, dim-0 members), so that it can hand them out member by member."""
    return comm.supports_pieces and all(gathers_in_place(s.layout) for s in states)


class _BucketRows:
    """A *handle*: a bucket's received rows (and packed send buffer, in the same allocation),
    handed out member by member (:class:`_MemberRows`), freed once every member has landed or
    dropped its part."""

    __slots__ = ("_free", "_left", "_whole", "_work", "rows")

    def __init__(
        self,
        work: Work,
        rows: torch.Tensor,
        whole: torch.Tensor,
        members: int,
        free: Callable[[torch.Tensor], None],
    ) -> None:
        self._work: Work | None = work
        self.rows, self._whole = rows, whole
        self._left = members
        self._free = free

    def wait(self) -> None:
        """Wait for the collective (the first time only)."""
        if self._work is not None:
            self._work.wait()  # (kept until waited: a failed wait leaves it in flight)
            self._work = None

    def is_completed(self) -> bool | None:
        """Whether the collective completed (no row can be written any more); ``None`` when
        its work cannot say."""
        return True if self._work is None else work_done(self._work)

    def done(self) -> None:
        """One member is done with its part; the last frees the rows and the send row (one allocation)."""
        self._left -= 1
        if self._left == 0:
            self._free(self._whole)


class _MemberRows:
    """One member's part of :class:`_BucketRows` (a :class:`~.transitions.RowShare`); also
    the member's ``work`` (waiting waits for the bucket's collective)."""

    __slots__ = ("_bucket", "_done", "_layout", "_own", "_part", "_rank")

    def __init__(
        self,
        bucket: _BucketRows,
        layout: GroupLayout,
        rank: int,
        own: torch.Tensor,
        part: torch.Tensor,
    ) -> None:
        self._bucket, self._layout, self._rank = bucket, layout, rank
        self._own, self._part = own, part
        self._done = False

    @property
    def rows(self) -> torch.Tensor:
        """The bucket's received rows."""
        return self._bucket.rows

    def wait(self) -> None:
        """Wait for the bucket's collective."""
        self._bucket.wait()

    def is_completed(self) -> bool | None:
        """Whether the bucket's collective completed (``None``: its work cannot say)."""
        return self._bucket.is_completed()

    def fill(self, into: torch.Tensor) -> None:
        """Lay this member's rows (the peers' received, this rank's own shards) out in
        ``into``; its part is then done."""
        self._bucket.wait()
        _lay_out_member(self._layout, self._rank, self._own, self._part, into)
        self.drop()

    def drop(self) -> None:
        """This member's part is done (landed, or given up unlanded); idempotent."""
        if not self._done:
            self._done = True
            self._bucket.done()


def _lay_out_member(
    layout: GroupLayout, rank: int, own: torch.Tensor, part: torch.Tensor, into: torch.Tensor
) -> None:
    """Lay one member's rows out in its buffer ``into``: the peers' received rows (``part``,
    one row per peer) with this rank's own shards (``own``) in its place."""
    rows = list(part.unbind(0))
    rows.insert(rank, own)
    copy_out_rows(layout, rows, into)


def _gather_peer_rows(
    states: Sequence[ShardedState],
    encoded: Sequence[GatherInput],
    comm: Communicator,
    intos: Sequence[torch.Tensor] | None,
    async_op: bool,
    guard: Callable[[tuple[torch.Tensor, ...]], AbstractContextManager[object]] | None,
    alloc: Callable[[int, torch.dtype, torch.device], torch.Tensor] | None,
    free: Callable[[torch.Tensor], None] | None,
) -> list[PendingUnshard]:
    """The pieces gather of dim-0 members: each member's shards go to every peer as they are
    (one message per member and peer), or, for small members (:func:`packs_members`), packed
    into one message per peer; the output holds only the peers' rows, and the hand-out lays
    every member's rows out in its buffer from those and this rank's own shards (no copy of
    this rank's row into the output, whose memory is ``(ws - 1) / ws`` of it)."""
    sizes = [e.tensor.numel() for e in encoded]
    total, ws, me = sum(sizes), comm.world_size, comm.rank
    first = encoded[0].tensor
    peers = [r for r in range(ws) if r != me]
    packs = packs_members(comm, [e.tensor.numel() * e.tensor.element_size() for e in encoded])
    # One allocation: the peers' rows, then (packing) this rank's send row.
    whole = (alloc or empty_buffer)((len(peers) + packs) * total, first.dtype, first.device)
    out = whole[: len(peers) * total]
    peer_rows = out.view(len(peers), total)
    parts = list(peer_rows.split(sizes, dim=1))
    outputs: list[list[torch.Tensor]] = [[] for _ in range(ws)]  # none for me: no local copy
    send: torch.Tensor | None = None
    if packs:
        send = whole[len(peers) * total :]
        torch.cat([e.tensor for e in encoded], out=send)
        for k, r in enumerate(peers):
            outputs[r] = [peer_rows[k]]
        inputs = [send]
    else:
        for k, r in enumerate(peers):
            outputs[r] = [p[k] for p in parts]
        inputs = [e.tensor for e in encoded]
    work = cast(PiecesCommunicator, comm).all_gather_pieces(outputs, inputs, async_op=async_op)
    if intos is None:
        bucket = _BucketRows(work, out, whole, len(states), free or _free)
        shares = [
            _MemberRows(bucket, s.layout, me, e.tensor, part)
            for s, e, part in zip(states, encoded, parts)
        ]
        return [
            PendingUnshard(s.layout, s.rank, None, m, s, None, share=m)
            for s, m in zip(states, shares)
        ]

    def hand_out() -> None:
        assert intos is not None
        with contextlib.nullcontext() if guard is None else guard(tuple(intos)):
            for s, e, part, into in zip(states, encoded, parts, intos):
                _lay_out_member(s.layout, me, e.tensor, part, into)
        (free or _free)(whole)

    shared = CoalescedWork(work, hand_out)
    return [
        PendingUnshard(s.layout, s.rank, None, shared, s, into) for s, into in zip(states, intos)
    ]


def issue_reduce_coalesced(
    rins: Sequence[ReduceInput],
    comm: Communicator,
    *,
    async_op: bool = True,
    alloc: Callable[[int, torch.dtype, torch.device], torch.Tensor] | None = None,
) -> list[PendingReduce]:
    """One reduce-scatter for several groups' packed gradients: each group's
    :class:`PendingReduce`, whose output is its slice of the bucket's output.

    Each rank sends every peer that peer's rows of all members side by side; each element is
    summed over the same ranks in the same order as in a reduce-scatter per group.

    Args:
        rins: the members' copy-ins (:func:`~.reduction.reduce_input`, the packed path: no
            compression), in bucket order; one reduce dtype and one divide rule for all.
        comm: the shard group.
        async_op: return before the collective completes.
        alloc: makes the output buffer (default ``torch.empty``).
    """
    _check_bucket([r.sharded for r in rins], comm, "coalesced reduce-scatter")
    if any(r.packed is None or r.compression is not None for r in rins):
        raise StateError(
            "coalesced reduce-scatter: every member needs a packed input without compression"
        )
    ops = {r.factors.op for r in rins}
    dtypes = {r.rdtype for r in rins}
    if len(ops) != 1 or len(dtypes) != 1:
        raise StateError(
            "coalesced reduce-scatter: a bucket's groups must share one reduce dtype and one "
            "reduce op"
        )
    ws = comm.world_size
    sizes = [r.packed.numel() // ws for r in rins if r.packed is not None]
    total = sum(sizes)
    device = rins[0].device
    cols = [r.packed.view(ws, -1) for r in rins if r.packed is not None]
    send = _columns_buffer(cols, total)
    if send is None:
        send = torch.cat(cols, dim=1).view(-1)
    out = (alloc or empty_buffer)(total, send.dtype, device)
    work = comm.reduce_scatter(out, send, op=ops.pop(), async_op=async_op)
    shared = CoalescedWork(work)
    pendings = []
    # One narrow per member, not out.split(): split's views are "outputs of a function that
    # returns multiple views", which autograd forbids viewing after an in-place change with
    # grad mode on (a create_graph=True backward lands the reductions with it on).
    parts = [out.narrow(0, o, n) for o, n in zip(itertools.accumulate(sizes, initial=0), sizes)]
    for r, part in zip(rins, parts):
        pendings.append(
            PendingReduce(
                r.sharded,
                part,
                shared,
                r.factors,
                r.present,
                r.replicate_comm,
                r.all_reduce,
                r.reduce_state,
                send,
                r.flagged,
            )
        )
    return pendings


def _columns_buffer(cols: Sequence[torch.Tensor], total: int) -> torch.Tensor | None:
    """The ``(ws, total)`` buffer that ``cols`` tile side by side, flat, when the members
    packed into their columns of one send buffer (``pack_grads(out=...)``): the reduce-scatter
    then sends it as it is, without a concatenating copy. ``None`` otherwise."""
    cols = [c for c in cols if c.numel() > 0]  # empty members take no columns
    if not cols:
        return None
    first = cols[0]
    storage = first.untyped_storage()
    off = first.storage_offset()
    for c in cols:
        if (
            c.untyped_storage().data_ptr() != storage.data_ptr()
            or c.dtype != first.dtype
            or c.stride() != (total, 1)
            or c.storage_offset() != off
        ):
            return None
        off += c.shape[1]
    if off != first.storage_offset() + total:
        return None
    base = first.as_strided((first.shape[0] * total,), (1,), first.storage_offset())
    if (base.storage_offset() + base.numel()) * base.element_size() > storage.nbytes():
        return None
    return base


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


Landed = tuple[ShardedState, ReduceState, tuple[torch.Tensor | None, ...] | None]


def finish_reductions(
    pendings: Sequence[PendingReduce | PendingTreeReduce],
    currents: Sequence[Sequence[torch.Tensor | None]] | None = None,
    *,
    donate: bool = False,
) -> list[Landed]:
    """Finish reductions that land together (a bucket's members, which share one collective,
    or one group's) into each group's current local gradients, in one call: for each,
    :func:`~.reduction.finish_reduce` (or the reproducible tree's finish) without accumulating
    into the record, then :func:`~.reduction.accumulate_local_grads` into ``currents[i]`` (one
    unpadded local gradient or ``None`` per parameter, e.g. what a module's ``.grad`` holds;
    ``donate=True``: added in place). ``currents=None``: the records only.

    Returns, per reduction: the new record, the :class:`~.reduction.ReduceState` to hand on
    (the tree keeps none) and the new local gradients (``None`` when the reduction landed
    none, HSDP keeping its partial sum for later, or without ``currents``)."""
    if currents is not None and len(currents) != len(pendings):
        raise StateError(
            f"finish_reductions: {len(currents)} gradient lists for {len(pendings)} reductions"
        )
    out: list[Landed] = []
    for i, pending in enumerate(pendings):
        current = None if currents is None else currents[i]
        if isinstance(pending, PendingTreeReduce):
            new, state = finish_tree_reduce(pending, accumulate=False), NO_REDUCE_STATE
        else:
            new, state = finish_reduce(pending, accumulate=False)
        grads = (
            None
            if new.grads is None or current is None
            else accumulate_local_grads(new, current, donate=donate)
        )
        out.append((new, state, grads))
    return out
