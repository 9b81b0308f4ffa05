"""The schedule check's moving parts: bounded waits, group-scoped communicators, resync.

* :class:`Waiter`: a thread that blocks in gloo's uninterruptible ``Work.wait()`` while the
  caller waits on an event in slices, checking its deadline and the peers' abort flag.
* :class:`ScopedComm`: one parameter group's view of a
  :class:`~functional_fsdp.shell.comm.ProcessGroupComm`, stamping the group's key on its tags.
* :func:`resync`: after a failed step, on every rank, a fresh epoch of tags.

See ``docs/design.md`` ("Rank-divergent use").
"""

from __future__ import annotations

import queue
import threading
from typing import TYPE_CHECKING, Any

import torch

from ..comm import Work

if TYPE_CHECKING:
    from .comm import ProcessGroupComm

__all__ = ["ScopedComm", "Waiter", "resync"]


class Waiter:
    """A thread that blocks in gloo's ``Work.wait()`` (which cannot be interrupted, and whose
    own timeout closes the connection) while the caller waits on an event in slices, checking
    the deadline and the peers' abort flag in between. A wait that is abandoned leaves its
    thread blocked; the next wait starts a new one."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, works: list) -> tuple[threading.Event, list]:
        if self._thread is None or not self._thread.is_alive():
            self._jobs = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._run, args=(self._jobs,), daemon=True)
            self._thread.start()
        done = threading.Event()
        box: list[BaseException] = []
        self._jobs.put((works, done, box))
        return done, box

    def abandon(self) -> None:
        self._thread = None

    @staticmethod
    def _run(jobs: queue.SimpleQueue) -> None:
        while True:
            works, done, box = jobs.get()
            try:
                for w in works:
                    w.wait()
            except BaseException as e:  # handed to the waiting caller
                box.append(e)
            done.set()
            # Drop the finished works before blocking for the next job: a work keeps its
            # tensors alive (a receive's whole output buffer, a group's sharded gradients).
            works = w = None


class ScopedComm:
    """One parameter group's view of a :class:`ProcessGroupComm`: the same process group and
    tag counter, with the group's key stamped on every collective (the schedule check).

    Attributes:
        base: the shared communicator.
        key: the group's key (``fully_shard`` order).
        kinds: offset added to each collective's kind in the tag (0: training; see
            :meth:`for_summon`), so collectives issued for different purposes never pair.
    """

    supports_pieces: bool
    pieces_min_bytes: int

    def __init__(self, base: ProcessGroupComm, key: int, *, kinds: int = 0) -> None:
        self.base = base
        self.key = key
        self.kinds = kinds
        self.supports_pieces = base.supports_pieces
        self.pieces_min_bytes = base.pieces_min_bytes

    def for_summon(self) -> ScopedComm:
        """The same group's communicator for ``summon_full_params``: its tags differ from the
        training collectives', so a summon on one rank never pairs with a forward's all-gather
        on another (same sizes, same group) and silently swaps their data."""
        return ScopedComm(self.base, self.key, kinds=4)

    @property
    def rank(self) -> int:
        """This rank's index in the group."""
        return self.base.rank

    @property
    def world_size(self) -> int:
        """Ranks in the group."""
        return self.base.world_size

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False
    ) -> Work:
        """See :meth:`ProcessGroupComm.all_gather`."""
        return self.base.all_gather(
            output, input, async_op=async_op, key=self.key, kind=3 + self.kinds
        )

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, op: str = "sum", async_op: bool = False
    ) -> Work:
        """See :meth:`ProcessGroupComm.reduce_scatter`."""
        return self.base.reduce_scatter(
            output, input, op=op, async_op=async_op, key=self.key, kind=4 + self.kinds
        )

    def all_reduce(self, tensor: torch.Tensor, *, op: str = "sum", async_op: bool = False) -> Work:
        """See :meth:`ProcessGroupComm.all_reduce`."""
        return self.base.all_reduce(tensor, op=op, async_op=async_op, key=self.key)

    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False
    ) -> Work:
        """See :meth:`ProcessGroupComm.all_to_all`."""
        return self.base.all_to_all(output, input, async_op=async_op, key=self.key, kind=0)

    def all_gather_pieces(
        self,
        outputs: list[list[torch.Tensor]],
        inputs: list[torch.Tensor],
        *,
        async_op: bool = False,
    ) -> Work:
        """See :meth:`ProcessGroupComm.all_gather_pieces`."""
        return self.base.all_gather_pieces(
            outputs, inputs, async_op=async_op, key=self.key, kind=1 + self.kinds
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
            outputs, inputs, op=op, async_op=async_op, key=self.key, kind=2 + self.kinds
        )


def resync(comms: list[ProcessGroupComm]) -> None:
    """After a failed step, on every rank: tell the peers to stop waiting (they raise
    :class:`PeerAbortedError`), wait until every rank resyncs, and start a fresh epoch of tags on
    each communicator, so nothing the failed step left in flight pairs with the next step.
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
        c._epoch += 1
        c._calls = 0
        c._aborts_seen = c._aborts()
