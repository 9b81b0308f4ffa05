"""The schedule check's vocabulary: collective kinds, bounded waits and positions.

* :data:`OPS`: the kind of a collective (the low bits of its fingerprint) by name.
* :class:`Waiter`: a thread that blocks in gloo's uninterruptible ``Work.wait()`` while the
  caller waits on an event in slices, checking its deadline and the peers' abort flag.
* :class:`Position`: where a rank waits (which collective of which group), published to the
  store after a short grace period so the ranks can tell a mismatch from a slow peer.

The communicators that use them are in :mod:`.process_group` (one per process group) and
:mod:`.scoped` (one parameter group's view of it, and the resync after a failed step).

See ``docs/design.md`` ("Rank-divergent use").
"""

from __future__ import annotations

import json
import queue
import threading
import time
from typing import Any

import attrs

__all__ = ["ALL_REDUCE", "OPS", "Position", "Waiter", "reap", "thread_waiter"]

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
    wait starts a new one.

    One per calling thread (:func:`thread_waiter`), shared by every communicator that thread
    waits on: a thread waits for one collective at a time, so one waiter thread serves them
    all (a waiter per communicator kept a thread per ``fully_shard`` call alive: 33 on the
    deep benchmark model, about 2 MiB of resident memory between steps)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, works: list) -> tuple[threading.Event, list]:
        """Hand ``works`` to the thread; ``(done, box)``: set when they completed, and the
        exception a wait raised, if any."""
        if self._thread is None or not self._thread.is_alive():
            self._jobs = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._run, args=(self._jobs,), daemon=True)
            self._thread.start()
        done = threading.Event()
        box: list[BaseException] = []
        self._jobs.put((works, done, box))
        return done, box

    def abandon(self) -> threading.Thread | None:
        """Give up the job in flight: its thread (returned, for :func:`reap`) finishes it once
        resync completes the works, then exits; the next :meth:`submit` starts a new one."""
        # A thread still blocked in gloo when the process exits is woken by the peer's
        # closing connection during interpreter shutdown and aborts the process (SIGABRT).
        retired = self._thread
        if retired is not None:
            self._jobs.put(None)
        self._thread = None
        return retired

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


def reap(threads: list[threading.Thread], timeout_s: float) -> list[threading.Thread]:
    """Wait (at most ``timeout_s``) for ``threads`` (of abandoned waits) to exit, once their
    works were completed; those still alive."""
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [t for t in threads if t.is_alive()]


_LOCAL = threading.local()


def thread_waiter() -> Waiter:
    """The calling thread's :class:`Waiter` (made on first use)."""
    waiter: Waiter | None = getattr(_LOCAL, "waiter", None)
    if waiter is None:
        waiter = _LOCAL.waiter = Waiter()
    return waiter


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
