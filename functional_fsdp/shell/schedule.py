"""The schedule check's moving parts: bounded waits, positions, group-scoped communicators, resync.

* :class:`Waiter`: a thread that blocks in gloo's uninterruptible ``Work.wait()`` while the
  caller waits on an event in slices, checking its deadline and the peers' abort flag.
* :class:`Position`: where a rank waits (which collective of which group), published to the
  store after a short grace period so the ranks can tell a mismatch from a slow peer.
* :class:`ScopedComm`: one parameter group's view of a
  :class:`~functional_fsdp.shell.comm.ProcessGroupComm`, stamping the group's key on its tags.
* :func:`resync`: after a failed step, on every rank, complete what the step left posted and
  start a fresh epoch of tags.

See ``docs/design.md`` ("Rank-divergent use").
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from ..comm import Work

if TYPE_CHECKING:
    from .comm import ProcessGroupComm

__all__ = ["Position", "ScopedComm", "Waiter", "introduce", "resync"]

# The kind of a collective (the low bits of its fingerprint) and what the messages call it.
OPS = {
    0: "all-to-all",
    1: "all-gather",
    2: "reduce-scatter",
    3: "all-gather",
    4: "reduce-scatter",
    5: "summon_full_params all-gather",
    6: "summon_full_params reduce-scatter",
    7: "summon_full_params all-gather",
    8: "summon_full_params reduce-scatter",
    15: "all-reduce",
}
ALL_REDUCE = 15


class Waiter:
    """A thread that blocks in gloo's ``Work.wait()`` (which cannot be interrupted, and whose
    own timeout closes the connection) while the caller waits on an event in slices, checking
    the deadline and the peers' abort flag in between. An abandoned wait keeps its thread
    until the works complete (:func:`resync` completes them), then that thread exits; the next
    wait starts a new one."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._retired: list[threading.Thread] = []  # threads of abandoned waits

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
        # The blocked thread finishes its job once resync completes the works, then exits: a
        # thread still blocked in gloo when the process exits is woken by the peer's closing
        # connection during interpreter shutdown and aborts the process (SIGABRT).
        if self._thread is not None:
            self._jobs.put(None)
            self._retired.append(self._thread)
        self._thread = None

    def reap(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) for the threads of abandoned waits to exit, once their
        works were completed."""
        deadline = time.monotonic() + timeout_s
        for t in self._retired:
            t.join(max(0.0, deadline - time.monotonic()))
        self._retired = [t for t in self._retired if t.is_alive()]

    @staticmethod
    def _run(jobs: queue.SimpleQueue) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            works, done, box = job
            try:
                for w in works:
                    w.wait()
            except BaseException as e:  # handed to the waiting caller
                box.append(e)
            done.set()
            # Drop the finished works before blocking for the next job: a work keeps its
            # tensors alive (a receive's whole output buffer, a group's sharded gradients).
            job = works = w = None


@attrs.frozen
class Position:
    """Where one rank waits: the ``seq``-th collective of ``epoch`` on a communicator.

    Attributes:
        rank: the rank (in the communicator's group).
        uid: the communicator (ids agree across ranks, like group keys).
        epoch: the communicator's epoch (``reset_iter_state`` starts a new one).
        seq: the collective's number since the epoch began (every rank counts alike).
        fp: the collective's identity, ``key * 16 + kind`` (group key and kind).
        op: what it is (``"all-gather"``, ``"reduce-scatter"``, ...).
        group: the group's module name (its path from the root when known).
        nth: it is the ``nth`` collective of this kind and group since the epoch began
            (``0``: not known).
    """

    rank: int
    uid: int
    epoch: int
    seq: int
    fp: int
    op: str
    group: str
    nth: int = 0

    def describe(self) -> str:
        """``"the reduce-scatter of group blocks.1 (its 2nd since the last reset)"``."""
        when = f"its {_ordinal(self.nth)} since the last reset" if self.nth else f"#{self.seq}"
        return f"the {self.op} of group {self.group} ({when})"

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Position:
        return cls(**json.loads(text))


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


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
            while c is not None and not isinstance(c, ScopedComm):
                c = getattr(c, "inner", None)
            if c is None:
                continue
            c.name = label
            if all(c.base is not b for b in bases):
                bases.append(c.base)
    for b in bases:
        b.meet(bases)


class ScopedComm:
    """One parameter group's view of a :class:`ProcessGroupComm`: the same process group and
    tag counter, with the group's key stamped on every collective (the schedule check).

    Attributes:
        base: the shared communicator.
        key: the group's key (``fully_shard`` order).
        kinds: offset added to each collective's kind in the tag (0: training; see
            :meth:`for_summon`), so collectives issued for different purposes never pair.
        name: the group's name, for messages (set by the group that owns this view).
    """

    supports_pieces: bool
    pieces_min_bytes: int

    def __init__(
        self, base: ProcessGroupComm, key: int, *, kinds: int = 0, name: str | None = None
    ) -> None:
        self.base = base
        self.key = key
        self.kinds = kinds
        self.name = name
        self.supports_pieces = base.supports_pieces
        self.pieces_min_bytes = base.pieces_min_bytes

    def for_summon(self) -> ScopedComm:
        """The same group's communicator for ``summon_full_params``: its tags differ from the
        training collectives', so a summon on one rank never pairs with a forward's all-gather
        on another (same sizes, same group) and silently swaps their data."""
        return ScopedComm(self.base, self.key, kinds=4, name=self.name)

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
    for c in comms:
        c.drain()
    for c in comms:
        c._epoch += 1
        c._calls = 0
