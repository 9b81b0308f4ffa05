"""Surviving a lost rank, the pure part: redundant copies and re-sharding to the survivors.

With one redundant copy, rank ``r`` of ``N`` holds, besides its own shards, a copy of the shards
of rank ``r - 1`` (mod ``N``): its neighbour's (:func:`copy_source`). Any set of lost ranks in
which no two are neighbours can be rebuilt from memory (:func:`recoverable`).

:func:`regroup` re-shards one group from ``N`` ranks to the survivors: every survivor sends its
own packed shards and the copy it holds in one all-gather over the survivors' communicator, each
rank rebuilds the full tensors from the ``N`` old shards (a lost rank's from its neighbour's
copy) and cuts its shards of the new layout with :func:`~.transitions.shard_tensors`.
:func:`restart_step` chooses the step the survivors restart from (each reports what it can
restore: :class:`Restorable`), :func:`active_world_size` how many of them train on. Nothing
here knows about processes or failures: the shell detects them, builds the survivors'
communicator, and calls this per group (parameters and optimizer state alike). The property that
the result equals sharding the same full tensors for the new world directly is checked in the
simulated world (``tests/core/test_recovery_core.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from .comm import Communicator, check_comm
from .errors import LayoutMismatchError, StateError, UnrecoverableLossError
from .records import GroupLayout, ShardedState
from .transitions import shard_tensors

__all__ = [
    "Redundancy",
    "Restorable",
    "active_world_size",
    "restart_step",
    "copy_holder",
    "copy_source",
    "recoverable",
    "regroup",
    "relayout",
    "survivors",
]


def _one_copy(_inst: object, _attr: object, value: int) -> None:
    if isinstance(value, bool) or value != 1:
        raise StateError(
            f"Redundancy(copies={value!r}): one copy per rank (copies=1) is what is built; a "
            "rank and its neighbour lost together cannot be rebuilt from memory"
        )


@attrs.frozen
class Redundancy:
    """Keep ``copies`` copies of every rank's shards (parameters and optimizer state) on other
    ranks after each optimizer step, so a lost rank can be rebuilt from memory.

    Rank ``r`` holds the copy of rank :func:`copy_source` ``(r)``'s (its neighbour's).

    Args:
        copies: ``1`` (the neighbour's).
    """

    copies: int = attrs.field(default=1, validator=_one_copy)


def copy_source(rank: int, world_size: int) -> int:
    """The rank whose shards ``rank`` keeps a copy of (its neighbour: ``rank - 1`` mod ``N``)."""
    return (rank - 1) % world_size


def copy_holder(rank: int, world_size: int) -> int:
    """The rank that keeps a copy of ``rank``'s shards (``rank + 1`` mod ``N``)."""
    return (rank + 1) % world_size


def survivors(world_size: int, lost: Sequence[int]) -> tuple[int, ...]:
    """The old ranks still alive, in order: their new ranks are their positions here."""
    gone = set(lost)
    if not gone <= set(range(world_size)):
        raise StateError(f"lost ranks {sorted(gone)} are not all in a world of {world_size}")
    return tuple(r for r in range(world_size) if r not in gone)


def recoverable(world_size: int, lost: Sequence[int]) -> bool:
    """Whether every lost rank's copy survived (no two lost ranks are neighbours, and someone
    survives)."""
    gone = set(lost)
    return len(gone) < world_size and all(copy_holder(r, world_size) not in gone for r in gone)


def _unrecoverable(world_size: int, lost: Sequence[int]) -> str:
    return (
        f"ranks {sorted(set(lost))} of {world_size} were lost together with the copies of "
        "their shards (neighbours, or every rank): the model cannot be rebuilt from memory; "
        "resume from the last checkpoint"
    )


@attrs.frozen
class Restorable:
    """What one survivor can restore after a loss, reported to the others through the store.

    Attributes:
        rank: its rank in the old world.
        own: the steps (optimizer steps completed) at which it holds its own state: the live
            one and the snapshot taken before the last step.
        copy: the steps at which it holds a complete copy of its neighbour's state.
    """

    rank: int
    own: tuple[int, ...]
    copy: tuple[int, ...]


def restart_step(reports: Sequence[Restorable], world_size: int) -> int:
    """The step the survivors restart from: the latest one at which every survivor holds its
    own state and, for every lost rank, its copy holder holds that rank's copy.

    Survivors differ by at most one step (a loss after the last collective of a step: some
    stepped, the others failed in the copies' exchange); every rank keeps its own state from
    before its last step, so the latest step common to all is restorable. The step in flight
    is abandoned and redone.

    Raises:
        UnrecoverableLossError: the lost ranks' copies were lost with them (two neighbours), or
            no step is common to every survivor's own state and the lost ranks' copies.
    """
    alive = [r.rank for r in reports]
    lost = [r for r in range(world_size) if r not in alive]
    if not recoverable(world_size, lost):
        raise UnrecoverableLossError(_unrecoverable(world_size, lost))
    by_rank = {r.rank: r for r in reports}
    common = set.intersection(*(set(r.own) for r in reports))
    for d in lost:
        common &= set(by_rank[copy_holder(d, world_size)].copy)
    if not common:
        raise UnrecoverableLossError(
            f"ranks {lost} of {world_size} were lost at a moment when no step is restorable on "
            f"every survivor (own states: { {r.rank: list(r.own) for r in reports} }, copies: "
            f"{ {r.rank: list(r.copy) for r in reports} }); resume from the last checkpoint"
        )
    return max(common)


def active_world_size(alive: int, virtual_world_size: int | None = None) -> int:
    """How many of ``alive`` survivors train on: all of them, or with a
    :class:`~.reproducible.ReproduciblePolicy` of ``virtual_world_size`` ``V`` the largest power
    of two that divides ``V`` (the others become spares), so the run stays bit-identical."""
    if alive < 1:
        raise UnrecoverableLossError("no rank survived")
    if virtual_world_size is None:
        return alive
    k = 1
    while 2 * k <= alive and virtual_world_size % (2 * k) == 0:
        k *= 2
    return k


def relayout(layout: GroupLayout, world_size: int) -> GroupLayout:
    """``layout`` for another world size (same parameters, dtypes and pytree)."""
    param_dtype = next(
        (g for s, g in zip(layout.specs, layout.gather_dtypes) if g != s.dtype), None
    )
    return GroupLayout.build(
        layout.specs,
        world_size,
        param_dtype=param_dtype,
        reduce_dtype=layout.reduce_dtype,
        treespec=layout.treespec,
    )


def regroup(
    own: ShardedState,
    copy: ShardedState,
    lost: Sequence[int],
    comm: Communicator,
    *,
    active: int | None = None,
) -> ShardedState | None:
    """This survivor's shards after re-sharding from ``N`` ranks to the survivors.

    Args:
        own: this rank's shards in the old ``N``-rank layout (``own.rank`` its old rank).
        copy: the copy it holds of its neighbour's shards (``copy.rank`` must be
            :func:`copy_source` of ``own.rank``; every survivor keeps one).
        lost: the old ranks that were lost (recoverable: see :func:`recoverable`).
        comm: a communicator over the survivors, ranked in old-rank order.
        active: how many survivors train on (the first ones); the others become spares and get
            ``None``. Default: all survivors.

    Returns:
        The new :class:`ShardedState` (no gradients: the step in flight is redone), or ``None``
        on a spare.
    """
    old = own.layout
    n = old.world_size
    alive = survivors(n, lost)
    if not recoverable(n, lost):
        raise UnrecoverableLossError(_unrecoverable(n, lost))
    check_comm(comm, len(alive), "regroup")
    if alive[comm.rank] != own.rank:
        raise LayoutMismatchError(
            f"survivor {comm.rank} of {alive} holds the shards of old rank {own.rank}; the "
            "survivors' communicator must rank them in old-rank order"
        )
    shards = _all_old_shards(own, copy, alive, comm)
    fulls = [
        torch.cat([shards[r].local(i) for r in range(n)], dim=old.shard_dims[i])
        for i in range(len(old))
    ]
    k = len(alive) if active is None else active
    if not 1 <= k <= len(alive):
        raise StateError(f"active must be in 1..{len(alive)}, got {active}")
    if comm.rank >= k:
        return None
    return shard_tensors(fulls, relayout(old, k), comm.rank)


def _all_old_shards(
    own: ShardedState, copy: ShardedState, alive: tuple[int, ...], comm: Communicator
) -> list[ShardedState]:
    """Every old rank's shards, gathered from the survivors (own shards and held copies)."""
    old = own.layout
    n, total = old.world_size, old.storage.total
    if copy.layout != old or copy.rank != copy_source(own.rank, n):
        raise LayoutMismatchError(
            f"rank {own.rank} holds a copy of rank {copy.rank}'s shards; it keeps "
            f"{copy_source(own.rank, n)}'s, in the same layout"
        )
    # Each flat starts at a multiple of 16 bytes, as a packed buffer of mixed dtypes needs
    # (its regions are aligned relative to its start).
    stride = max(16, -(-total // 16) * 16)
    send = torch.zeros(2 * stride, dtype=own.flat.dtype, device=own.flat.device)
    send[:total] = own.flat
    send[stride : stride + total] = copy.flat
    recv = send.new_empty(len(alive) * 2 * stride)
    if len(alive) == 1:
        recv.copy_(send)
    else:
        comm.all_gather(recv, send).wait()
    flats: dict[int, torch.Tensor] = {}
    for j, r in enumerate(alive):
        flats[r] = recv.narrow(0, 2 * j * stride, total)
        src = copy_source(r, n)
        # the copy, unless the rank itself survived
        flats.setdefault(src, recv.narrow(0, (2 * j + 1) * stride, total))
    return [ShardedState(old, r, flats[r]) for r in range(n)]
