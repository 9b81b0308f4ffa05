"""Buckets at run time: several groups' all-gathers, or reduce-scatters, in one collective.

The root's schedule (:mod:`functional_fsdp.shell.api.buckets`) cuts its groups into buckets of
adjacent small groups (:func:`functional_fsdp.core.coalesce.plan_buckets`). Here is what a
bucket does during a step:

- :func:`start_together`: the groups of a forward (or backward) bucket that need their
  parameters start one all-gather (:func:`~.gather.start_coalesced`); each group's own
  ``wait_unshard`` then lands its part, as it lands a prefetch. A group that cannot travel in a
  bucket right now (see :meth:`~.group.ParamGroup.coalesce_gather`) gathers alone, as before.
- :class:`ReduceBucket`: the members' ``post_backward`` hand it their packed gradients (the
  copy-in runs at once, on compute, and frees autograd's gradients); the last member's
  issues one reduce-scatter for all, and every member gets its part as its reduction in
  flight; the first member to finish its reduction finishes every member still waiting on the
  collective (they land together: one wait, one core call,
  :func:`.gradients.finish_together`). The root's final callback flushes a bucket some
  members of which got no gradient this step. A member whose post-backward runs again
  before the bucket went out (a module called twice in one forward) first sends what the
  bucket holds, so each use's gradients are reduced once and add up in ``.grad``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ...core import transitions as T
from ...core.comm import Communicator
from ...core.records import ShardedState
from ..comm.scoped import bucket_view
from ..device.runtime import DeviceRuntime
from . import ordering
from .gather import GatherSlot, start_coalesced
from .group_common import profiled

__all__ = ["Chain", "Member", "ReduceBucket", "Reducer", "bucket_comm", "start_together"]


class Chain(Protocol):
    """The root's one reduction in flight (:class:`~.gradients.ReduceChain` is one)."""

    def hand_over(self, *groups: Any) -> None: ...

    def settle(self, *groups: Any) -> None: ...


class Reducer(Protocol):
    """What a reduce bucket needs of a group (:class:`~.gradients.GroupGradients` is one)."""

    name: str
    comm: Communicator
    runtime: DeviceRuntime
    state: ShardedState
    device: torch.device

    @property
    def reduce_chain(self) -> Chain: ...

    @property
    def pending_reduce(self) -> Any: ...

    def take_reduce(self, pending: T.PendingReduce) -> None: ...

    def reduce_row_numel(self) -> int: ...

    def alloc_advised(self, numel: int, dtype: torch.dtype, device: torch.device) -> Any: ...


class Member(Reducer, Protocol):
    """What a bucket needs of a group, gathering too (:class:`~.group.ParamGroup` is one)."""

    @property
    def is_unsharded(self) -> bool: ...

    @property
    def pending(self) -> T.PendingUnshard | None: ...

    def coalesce_gather(self) -> tuple[GatherSlot, ShardedState, int] | None: ...

    def start_unshard(self, version: int | None = None) -> None: ...


def start_together(groups: Sequence[Member]) -> None:
    """Start the all-gathers ``groups`` need: one collective for those that can travel
    together (the same wire dtype as the first of them), alone for the others. Every rank
    calls it with the same groups in the same state, so every rank issues the same
    collectives."""
    joined: list[tuple[Member, tuple[GatherSlot, ShardedState, int]]] = []
    alone: list[Member] = []
    for g in groups:
        if g.is_unsharded or g.pending is not None:
            continue  # nothing to start (a stale one is dropped by its own wait_unshard)
        req = g.coalesce_gather()
        if req is None or (joined and _wire(req) != _wire(joined[0][1])):
            alone.append(g)  # alone now, or another wire dtype than the bucket's first
        else:
            joined.append((g, req))
    if len(joined) == 1:
        alone.insert(0, joined.pop()[0])
    if joined:
        with profiled(lambda: f"FSDP::all_gather ({joined[0][0].name})"):
            start_coalesced(
                [r[0] for _, r in joined],
                [r[1] for _, r in joined],
                bucket_comm([g for g, _ in joined]),
                [r[2] for _, r in joined],
            )
    for g in alone:
        g.start_unshard()


def bucket_comm(members: Sequence[Reducer]) -> Communicator:
    """The communicator a bucket of ``members`` runs on: the first member's process group with
    tags and a name of its own (:func:`~functional_fsdp.shell.comm.scoped.bucket_view`); a
    bucket of one is that group's own collective."""
    if len(members) == 1:
        return members[0].comm
    return bucket_view([m.comm for m in members], [m.name for m in members])


class ReduceBucket:
    """The reduce-scatters of a backward bucket's members, issued as one.

    Args:
        members: the groups, in backward order (the last one's post-backward issues).
    """

    __slots__ = ("_columns", "_flight", "_inputs", "_laid_out", "_send", "members")

    def __init__(self, members: Sequence[Reducer]) -> None:
        self.members = tuple(members)
        self._inputs: dict[int, T.ReduceInput] = {}
        self._send: torch.Tensor | None = None  # this backward's (ws, total) send buffer
        self._columns: dict[int, tuple[int, int]] = {}  # id(member) -> (offset, width)
        # The members' layouts (kept: compared by identity) and the send buffer's shape for
        # them: (world size, total width, dtype), or None when their reduce dtypes differ.
        # Laid out once, not per backward (the layouts change only with the settings).
        self._laid_out: (
            tuple[tuple[Any, ...], tuple[int, ...], tuple[int, int, torch.dtype] | None] | None
        ) = None
        self._flight: tuple[Reducer, ...] = ()  # the members of the reduce-scatter in flight

    def columns(self, group: Reducer) -> torch.Tensor | None:
        """``group``'s columns of the bucket's send buffer (allocated by the first member to
        pack, this backward), for it to pack its gradients into: the reduce-scatter then sends
        the buffer without concatenating the members' packed gradients. ``None`` (pack alone)
        when the members' reduce dtypes differ.

        The first member to pack finishes the reduction in flight first (the previous bucket's,
        still overlapping this member's backward until now), so at most one bucket's send
        buffer is alive at a time, as FSDP2 keeps one reduce-scatter input; it also lays the
        columns out once for the bucket's members."""
        if not self._inputs:
            group.reduce_chain.settle(*self.members)
            self._send = None
            shape = self._shape()
            if shape is None:
                return None
            ws, total, dtype = shape
            self._send = group.alloc_advised(ws * total, dtype, group.device).view(ws, total)
        if self._send is None:
            return None
        off, width = self._columns[id(group)]
        return self._send.narrow(1, off, width)

    def _shape(self) -> tuple[int, int, torch.dtype] | None:
        """The send buffer's (world size, width, dtype) and each member's columns, laid out
        again only when a member's layout or row width (its presence flags) changed."""
        layouts = tuple(m.state.layout for m in self.members)
        rows = tuple(m.reduce_row_numel() for m in self.members)  # with the presence flags
        known = self._laid_out
        if known is None or known[1] != rows or any(a is not b for a, b in zip(known[0], layouts)):
            dtype = layouts[0].grad_reduce_dtype()
            shape = None
            if all(lay.grad_reduce_dtype() == dtype for lay in layouts):
                sizes = list(rows)
                offsets = itertools.accumulate(sizes, initial=0)
                self._columns = {id(m): (o, n) for m, o, n in zip(self.members, offsets, sizes)}
                shape = (layouts[0].world_size, sum(sizes), dtype)
            known = self._laid_out = (layouts, rows, shape)
        return known[2]

    def holds(self, group: Reducer) -> bool:
        """Whether ``group`` handed in gradients that this bucket has not sent yet."""
        return id(group) in self._inputs

    def add(self, group: Reducer, rin: T.ReduceInput) -> None:
        """``group``'s packed gradients of this backward; issue when every member's is in."""
        self._inputs[id(group)] = rin
        if len(self._inputs) == len(self.members):
            self.flush()

    def flush(self) -> None:
        """Issue the reduce-scatter of the members that handed in gradients (in bucket
        order); nothing when none did."""
        posted = [g for g in self.members if id(g) in self._inputs]
        if not posted:
            return
        rins = [self._inputs[id(g)] for g in posted]
        self._inputs.clear()
        self._send = None  # the pendings' input now (freed when the reduction lands)
        first = posted[0]
        first.reduce_chain.hand_over(*posted)
        with profiled(lambda: f"FSDP::post_backward_reduce ({first.name})"):
            pendings = ordering.issue_reduce_coalesced_after_compute(
                first.runtime, rins, bucket_comm(posted), alloc=first.alloc_advised
            )
        for g, p in zip(posted, pendings):
            g.take_reduce(p)
        self._flight = tuple(posted)

    def landing_with(self, group: Reducer) -> tuple[Reducer, ...]:
        """The groups whose reductions land with ``group``'s (finished together: one wait,
        one core call): the members of this bucket's reduce-scatter in flight that still wait
        for it, when ``group``'s reduction is that one; else ``group`` alone."""
        flight, mine = self._flight, group.pending_reduce
        if mine is None or not any(m is group for m in flight):
            return (group,)
        self._flight = ()
        return tuple(
            m for m in flight if m.pending_reduce is not None and m.pending_reduce.work is mine.work
        )

    def drop(self) -> None:
        """Forget handed-in gradients (``reset_iter_state``: the step is abandoned)."""
        self._inputs.clear()
        self._send = None
        self._flight = ()


def _wire(req: tuple[GatherSlot, ShardedState, int]) -> torch.dtype:
    """The dtype a group sends in its all-gather."""
    return req[1].layout.gather_buffer_dtype
