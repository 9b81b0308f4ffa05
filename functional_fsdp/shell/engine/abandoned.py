"""Work a failed step left in flight, kept only until it can no longer land.

``reset_iter_state`` drops a group's all-gather and reduce-scatter in flight without waiting (a
peer may never complete them). Their buffers must outlive any message still on its way: freed
early, a late message lands in memory the allocator has handed to something else. Kept for
ever, every failed step leaks them (a prefetched bucket's rows, its members' sources and
buffers: about half a MiB per failure on a small GPT, growing with the model).

So each abandoned piece of work is kept here until it is known complete, checked without
waiting whenever the group abandons more work or starts an iteration: its ``is_completed()``
(torch's ``Work`` and every handle of this package report it; a work that failed counts as
complete). By then ``reset_iter_state`` has paired every message the failed step left posted
(:meth:`~functional_fsdp.shell.comm.process_group.ProcessGroupComm.drain`). Known leak: a gloo
point-to-point work reports itself complete only once waited for, and nobody waits for a
paired one the failed step dropped, so its entry stays (about 1 MiB per backward fault on a
model of 256-wide blocks). Waiting for them in ``drain`` fixed the leak, but a full-suite run
with that change once ended in a rank's heap corruption (``free(): invalid size``), so it was
taken back until that is understood. A work that cannot say (a custom communicator's ``Work``
without ``is_completed``) is kept until the group has landed a later all-gather: the peers
issued that collective after the failed step's on the same group, so they finished those first.
"""

from __future__ import annotations

from typing import Any

from ...core.comm import work_done

__all__ = ["AbandonedWork"]


class AbandonedWork:
    """A group's abandoned in-flight work and the buffers it may still write (see the module
    docstring): what :meth:`keep` received stays referenced until :meth:`release_landed`
    finds it complete."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        # (the handles kept, the group's landings when they were abandoned)
        self._entries: list[tuple[list[Any], int]] = []

    def __len__(self) -> int:
        return len(self._entries)

    def keep(self, kept: list[Any], landings: int) -> None:
        """Keep ``kept`` (handles with a ``work``, and buffers) referenced; ``landings``: how
        many all-gathers the group has landed so far."""
        if kept:
            self._entries.append((kept, landings))

    def release_landed(self, landings: int) -> None:
        """Drop every entry whose work completed, or (when its work cannot say) that the
        group's later landed all-gathers (``landings`` now) prove finished; a bucket member's
        unlanded share of rows is given up so the bucket frees them."""
        if not self._entries:
            return
        left = []
        for kept, at in self._entries:
            if _landed(kept, moved_on=landings > at):
                for k in kept:
                    share = getattr(k, "share", None)
                    if share is not None:
                        share.drop()
            else:
                left.append((kept, at))
        self._entries = left


def _landed(kept: list[Any], *, moved_on: bool) -> bool:
    """Whether no message can land in ``kept``'s buffers any more."""
    for k in kept:
        work = getattr(k, "work", None)
        if work is None:
            continue  # a buffer, kept for the work beside it
        done = work_done(work)
        if done is False or (done is None and not moved_on):
            return False
    return True
