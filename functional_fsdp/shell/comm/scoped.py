"""One parameter group's view of a process-group communicator, and the resync after a fault.

* :class:`ScopedComm`: a group's view of a :class:`~.process_group.ProcessGroupComm`, stamping
  the group's key on its tags (:func:`scoped` hands out the keys).
* :func:`introduce`: name every group's communicators by module path at the root's lazy init.
* :func:`resync`: after a failed step, on every rank, complete what the step left posted and
  start a fresh epoch of tags.

See ``docs/design.md`` ("Rank-divergent use").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...core.comm import CommCapabilities, Work, capabilities
from .process_group import LIVE, ProcessGroupComm

__all__ = ["ScopedComm", "bucket_view", "introduce", "resync", "scoped"]


def scoped(base: ProcessGroupComm) -> ScopedComm:
    """A view of ``base`` for one parameter group: its collectives carry the group's key in
    their tags (keys are handed out in ``fully_shard`` order, the same on every rank, unique
    within the process group)."""
    return ScopedComm(base, base.next_group_key())


def introduce(named: Sequence[tuple[str, Sequence[Any]]]) -> None:
    """Name each group's scoped communicators by the group's module path and tell every
    process-group communicator the others on its process group (a root's lazy init).

    ``named``: per group, its module path (``blocks.0``) and its communicators (custom ones
    are unwrapped through ``inner``). A collective that waits past the grace period then names
    modules, not class names that cannot tell ``blocks.0`` from ``blocks.1``, and can look a
    peer's position up on whichever of this rank's communicators the peer waits on (each
    ``fully_shard`` mesh has its own, over one process group).
    """
    bases: list[ProcessGroupComm] = []
    for label, comms in named:
        for c in comms:
            while c is not None and not capabilities(c).scoped:
                c = getattr(c, "inner", None)
            if c is None:
                continue
            c.name = label
            if all(c.base is not b for b in bases):
                bases.append(c.base)
    for b in bases:
        b.meet(bases)


def bucket_view(comms: Sequence[Any], names: Sequence[str]) -> Any:
    """The communicator of one collective run by several groups together (a bucket): the
    first group's scoped view :meth:`~ScopedComm.for_bucket`, named after the groups (their
    views' names; ``names`` for a communicator without one); the first communicator itself
    when it is not a scoped view. The engine asks this module rather than the communicator's
    class."""
    first = comms[0]
    if not isinstance(first, ScopedComm):
        return first
    shown = [c.name if isinstance(c, ScopedComm) else n for c, n in zip(comms, names)]
    return first.for_bucket(shown)


class ScopedComm:
    """One parameter group's view of a :class:`ProcessGroupComm`: the same process group and
    tag counter, with the group's key stamped on every collective (the schedule check).

    Attributes:
        base: the shared communicator.
        key: the group's key (``fully_shard`` order).
        kinds: offset added to each collective's kind in the tag (0: training; see
            :meth:`for_summon`), so collectives issued for different purposes never pair.
        name: the group's name, for messages (set by the group that owns this view).
        rank: this rank's index in the group (the base's; plain attributes, read by the core
            at every collective).
        world_size: ranks in the group.
    """

    capabilities = CommCapabilities(scoped=True)
    supports_pieces: bool
    pieces_min_bytes: int
    rank: int
    world_size: int

    def __init__(
        self, base: ProcessGroupComm, key: int, *, kinds: int = 0, name: str | None = None
    ) -> None:
        self.base = base
        self.key = key
        self.kinds = kinds
        self.name = name
        self.supports_pieces = base.supports_pieces
        self.pieces_min_bytes = base.pieces_min_bytes
        self.rank = base.rank
        self.world_size = base.world_size

    def for_summon(self) -> ScopedComm:
        """The same group's communicator for ``summon_full_params``: its tags differ from the
        training collectives', so a summon on one rank never pairs with a forward's all-gather
        on another (same sizes, same group) and silently swaps their data."""
        return ScopedComm(self.base, self.key, kinds=4, name=self.name)

    def for_bucket(self, names: Sequence[str | None]) -> ScopedComm:
        """The communicator of a bucket of groups (``names``, this group first) that this
        group leads: one collective for all of them (:mod:`functional_fsdp.core.coalesce`).
        Its tags differ from this group's own collectives' and from other bucket sizes', so
        ranks that coalesce differently never pair messages of different sizes; they get a
        named mismatch error, which names the bucket's groups."""
        shown = ", ".join(str(n) for n in names[:3])
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        label = f"bucket ({shown}{more})"
        key = -(1 + self.key * 64 + len(names) % 64)
        return ScopedComm(self.base, key, kinds=self.kinds, name=label)

    @property
    def coalesces(self) -> bool:
        """Capability: its process group's (several groups' collectives as one bucket)."""
        return self.base.coalesces

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False
    ) -> Work:
        """See :meth:`ProcessGroupComm.all_gather`."""
        return self.base.all_gather(
            output, input, async_op=async_op, key=self.key, kind=3 + self.kinds, name=self.name
        )

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, op: str = "sum", async_op: bool = False
    ) -> Work:
        """See :meth:`ProcessGroupComm.reduce_scatter`."""
        return self.base.reduce_scatter(
            output,
            input,
            op=op,
            async_op=async_op,
            key=self.key,
            kind=4 + self.kinds,
            name=self.name,
        )

    def all_reduce(self, tensor: torch.Tensor, *, op: str = "sum", async_op: bool = False) -> Work:
        """See :meth:`ProcessGroupComm.all_reduce`."""
        return self.base.all_reduce(tensor, op=op, async_op=async_op, key=self.key, name=self.name)

    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False
    ) -> Work:
        """See :meth:`ProcessGroupComm.all_to_all`."""
        return self.base.all_to_all(
            output, input, async_op=async_op, key=self.key, kind=0, name=self.name
        )

    def all_gather_pieces(
        self,
        outputs: list[list[torch.Tensor]],
        inputs: list[torch.Tensor],
        *,
        async_op: bool = False,
    ) -> Work:
        """See :meth:`ProcessGroupComm.all_gather_pieces`."""
        return self.base.all_gather_pieces(
            outputs, inputs, async_op=async_op, key=self.key, kind=1 + self.kinds, name=self.name
        )

    def reduce_scatter_pieces(
        self,
        outputs: list[torch.Tensor],
        inputs: list[list[torch.Tensor]],
        *,
        op: str = "sum",
        async_op: bool = False,
    ) -> Work:
        """See :meth:`ProcessGroupComm.reduce_scatter_pieces`."""
        return self.base.reduce_scatter_pieces(
            outputs,
            inputs,
            op=op,
            async_op=async_op,
            key=self.key,
            kind=2 + self.kinds,
            name=self.name,
        )


def resync(comms: list[ProcessGroupComm]) -> None:
    """After a failed step, on every rank: tell the peers to stop waiting (they raise
    :class:`PeerAbortedError`), wait until every rank resyncs, complete every point-to-point
    message the failed step left posted (:meth:`ProcessGroupComm.drain`), and start a fresh
    epoch of tags on each communicator, so nothing left over pairs with the next step.
    """
    comms = [c for c in comms if c.world_size > 1]
    for c in comms:
        c._post_abort()
    for c in comms:
        c._barrier("resync")
    # One more barrier per process group: every rank's abort posts are in before anyone reads
    # the counter it will compare against from now on.
    firsts: dict[str, ProcessGroupComm] = {}
    for c in comms:
        firsts.setdefault(c._pg_prefix, c)
    for c in firsts.values():
        c._barrier("resynced")
    for c in comms:
        c._aborts_seen = c._aborts()
    # The other communicators of these process groups (no group owns them: the functional
    # step's norm, a user's) have seen the same aborts: they must not raise on them later.
    prefixes = {c._pg_prefix for c in comms}
    for other in list(LIVE):
        if other._pg_prefix in prefixes and all(other is not c for c in comms):
            other._aborts_seen = other._aborts()
    for c in comms:
        c.drain()
    for c in comms:
        c._epoch += 1
        c._calls = 0
