"""The engine's side of :class:`~functional_fsdp.core.reproducible.ReproduciblePolicy`.

Under the policy a group's micro-batch gradients are not reduced one by one: each backward
packs the full gradients (as a reduce-scatter would) and adds them to a
:class:`~functional_fsdp.core.reproducible.TreeSums` in the canonical tree's order; after the
step's ``V / N`` micro-batches the subtree sum goes out in one all-to-all and every rank adds
the ``N`` pieces of its shard in rank order (``core.reproducible.begin_tree_reduce``). Whether
the user turned gradient sync off for the first micro-batches or not changes only when nothing
is sent, never the bits.

:class:`TreeAccumulator` is that per-group state: the module path's group owns one, the
functional step's :class:`TreeReductions` one per group it runs.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from ...core.comm import Communicator
from ...core.errors import ReproducibilityError
from ...core.records import GroupLayout, ShardedState
from ...core.reduction import pack_grads
from ...core.reproducible import (
    PendingTreeReduce,
    ReproduciblePolicy,
    TreeSums,
    begin_tree_reduce,
    push_leaf,
)
from ..device.runtime import DeviceRuntime
from . import ordering

__all__ = [
    "TreeAccumulator",
    "TreeReductions",
    "check_no_partial_trees",
    "install_step_check",
    "steps_taken",
]

# Accumulators holding some but not all of a step's micro-batches (checked before an
# optimizer step: see check_no_partial_trees).
_PARTIAL: weakref.WeakSet[TreeAccumulator] = weakref.WeakSet()
# Accumulators whose step is complete (reduced) and waits for the optimizer step: another
# micro-batch backward before it is refused (see TreeAccumulator.commit).
_COMPLETE: weakref.WeakSet[TreeAccumulator] = weakref.WeakSet()
_STEP_CHECK: list[Any] = []


class TreeAccumulator:
    """One group's micro-batch gradients of the current step, summed in the canonical tree.

    Args:
        policy: the policy.
        dp_size: the data-parallel world size (shard x replicate ranks).
        name: the group's name, for messages.
    """

    __slots__ = ("__weakref__", "awaits_step", "name", "open", "per_rank", "present", "sums")

    def __init__(
        self, policy: ReproduciblePolicy, dp_size: int, name: str, *, awaits_step: bool = False
    ) -> None:
        # The module path: after a complete step, the next backward waits for an optimizer
        # step (the functional step makes a new accumulator per step).
        self.awaits_step = awaits_step
        self.per_rank = policy.micro_batches_per_rank(dp_size)
        self.name = name
        self.sums = TreeSums()
        self.present: list[bool] | None = None
        # The running micro-batch's leaf while more of its uses are to come (a module called
        # more than once in the forward: one backward, several gradients, one leaf).
        self.open: torch.Tensor | None = None

    @property
    def count(self) -> int:
        """Micro-batches accumulated so far this step."""
        return self.sums.count

    def push(
        self, grads: Sequence[torch.Tensor | None], layout: GroupLayout, *, last: bool = True
    ) -> bool:
        """Add one use's full gradients to the running micro-batch's leaf; with ``last`` (no
        other use of the group in this backward is to come) the leaf joins the tree. ``True``
        when the step's last micro-batch arrived."""
        leaf = pack_grads(grads, layout, flags=True)  # ranks may differ: see agreed_present
        now = [g is not None for g in grads]
        self.present = now if self.present is None else [a or b for a, b in zip(self.present, now)]
        if self.open is not None:
            leaf = self.open.add_(leaf)  # the earlier uses' sum, donated
        self.open = leaf
        return self.commit() if last else False

    def commit(self) -> bool:
        """The running micro-batch's leaf (if any) joins the tree (the end of its backward);
        ``True`` when that was the step's last micro-batch."""
        leaf, self.open = self.open, None
        if leaf is None:
            return False
        if self in _COMPLETE:
            raise ReproducibilityError(
                f"group {self.name!r}: a micro-batch backward after the step's "
                f"{self.per_rank} were reduced, before the optimizer step, under "
                f"ReproduciblePolicy (exactly {self.per_rank} per rank: virtual world size / "
                "data-parallel world size); call optimizer.step() after the step's last "
                "micro-batch, or reset_iter_state() to drop the step"
            )
        self.sums = push_leaf(self.sums, leaf, donate=True)
        if self.sums.count > self.per_rank:
            raise ReproducibilityError(self._wrong_count(self.sums.count))
        done = self.sums.count == self.per_rank
        if done:
            _PARTIAL.discard(self)
        else:
            _PARTIAL.add(self)
        return done

    def begin(
        self,
        sharded: ShardedState,
        comm: Communicator,
        replicate_comm: Communicator | None,
        *,
        runtime: DeviceRuntime,
        async_op: bool = True,
        reduce_unused: bool = False,
    ) -> PendingTreeReduce:
        """Send the step's subtree sum (after the last micro-batch, on the reduce-scatter
        stream of ``runtime``); start the next step. ``reduce_unused``
        (``set_reduce_scatter_unused_params``): every trainable parameter takes its reduced
        gradient, also one with no gradient on this rank (data-dependent routing)."""
        if self.sums.count != self.per_rank:
            raise ReproducibilityError(self._wrong_count(self.sums.count))
        root = self.sums.root()
        present = _with_unused(self.present or [], sharded, reduce_unused)
        self.reset()
        if self.awaits_step:
            _COMPLETE.add(self)
        return ordering.issue_tree_reduce(
            runtime,
            root,
            lambda: begin_tree_reduce(
                root,
                sharded,
                comm,
                present=present,
                replicate_comm=replicate_comm,
                async_op=async_op,
            ),
        )

    def reduce_one(
        self,
        grads: Sequence[torch.Tensor | None],
        sharded: ShardedState,
        comm: Communicator,
        replicate_comm: Communicator | None,
        *,
        runtime: DeviceRuntime,
        reduce_unused: bool = False,
    ) -> ShardedState:
        """Reduce one backward's gradients at once (``torch.autograd.grad`` returns them):
        possible only when the step has one micro-batch per rank (``V == N``)."""
        if self.per_rank != 1 or self.sums.count:
            raise ReproducibilityError(
                f"group {self.name!r}: torch.autograd.grad returns each backward's reduced "
                f"gradients, but ReproduciblePolicy sums {self.per_rank} micro-batches per rank "
                "before reducing; use loss.backward() for each micro-batch, or "
                "functional_fsdp.functional.make_train_step(..., reproducible=policy)"
            )
        leaf = pack_grads(grads, sharded.layout, flags=True)
        present = _with_unused([g is not None for g in grads], sharded, reduce_unused)
        pending = ordering.issue_tree_reduce(
            runtime,
            leaf,
            lambda: begin_tree_reduce(
                leaf,
                sharded,
                comm,
                present=present,
                replicate_comm=replicate_comm,
                async_op=False,
            ),
        )
        return ordering.finish_reduce(runtime, pending)[0]

    def reset(self) -> None:
        """Forget the micro-batches of a step that will not complete (``reset_iter_state``)."""
        self.sums = TreeSums()
        self.present = None
        self.open = None
        _PARTIAL.discard(self)

    def abandon(self) -> None:
        """``reset_iter_state``: forget the step, complete or not."""
        self.reset()
        _COMPLETE.discard(self)

    def _wrong_count(self, n: int) -> str:
        return (
            f"group {self.name!r}: {n} micro-batch backward(s) this step under "
            f"ReproduciblePolicy, which needs exactly {self.per_rank} per rank (virtual world "
            "size / data-parallel world size) before the optimizer step; run every micro-batch "
            "of the step (each loss divided by that count), or call reset_iter_state() to drop "
            "a step you abandon"
        )


def install_step_check() -> None:
    """Register :func:`check_no_partial_trees` as a global optimizer step pre-hook and
    :func:`steps_taken` as a post-hook (once per process, when the first group with the policy
    is built)."""
    if not _STEP_CHECK:
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        _STEP_CHECK.append(register_optimizer_step_pre_hook(check_no_partial_trees))
        _STEP_CHECK.append(register_optimizer_step_post_hook(steps_taken))


def steps_taken(optimizer: Any, args: Any = (), kwargs: Any = None) -> None:
    """An optimizer step post-hook: the complete steps' gradients were used; the next
    micro-batch backward starts a new step."""
    del optimizer, args, kwargs
    _COMPLETE.clear()


def check_no_partial_trees(optimizer: Any, args: Any = (), kwargs: Any = None) -> None:
    """An optimizer step pre-hook: refuse to step while a reproducible group holds some but not
    all of a step's micro-batches (its gradients would be missing or stale)."""
    del optimizer, args, kwargs
    for acc in list(_PARTIAL):
        if 0 < acc.count < acc.per_rank:
            raise ReproducibilityError(acc._wrong_count(acc.count))


class TreeReductions:
    """The functional step's reductions under the policy: each group's micro-batch gradients
    are accumulated locally (no collective), and :meth:`finish` reduces every group once.

    Tag the tensors passed to ``functional_call`` with :meth:`tag` (as
    :class:`~.functional_path.DeferredReductions`); a group whose sources are tagged hands its
    full gradients to :meth:`push` and returns no gradient to autograd.
    """

    __slots__ = ("_groups", "policy")

    ATTR = "_ffsdp_tree_reductions"

    def __init__(self, policy: ReproduciblePolicy) -> None:
        self.policy = policy
        self._groups: dict[int, tuple[TreeAccumulator, ShardedState, Any, tuple[int, ...]]] = {}

    def tag(self, tensors: Sequence[torch.Tensor]) -> None:
        """Mark ``tensors`` (every parameter a forward will use, frozen ones too: a group
        reduces into ``self`` only when all its sources are tagged) as reducing into ``self``."""
        for t in tensors:
            setattr(t, self.ATTR, self)

    def push(
        self,
        group: Any,
        sharded: ShardedState,
        sources: tuple[int, ...],
        grads: Sequence[torch.Tensor | None],
    ) -> None:
        """One micro-batch's full gradients of ``group``; ``sources``: the identities of the
        tensors its parameters were gathered from (where the reduced gradients go)."""
        key = id(group)
        if key not in self._groups:
            rep = group.replicate_comm
            dp = group.comm.world_size * (1 if rep is None else rep.world_size)
            acc = TreeAccumulator(self.policy, dp, group.name)
            self._groups[key] = (acc, sharded, group, sources)
        acc = self._groups[key][0]
        acc.push(grads, sharded.layout, last=False)  # another use may follow: end_backward

    def end_backward(self) -> None:
        """A micro-batch's backward ended: each group's uses in it make one leaf."""
        for acc, *_ in self._groups.values():
            acc.commit()

    def finish(self) -> dict[int, torch.Tensor]:
        """Reduce every group; ``{id(source tensor): its local sharded gradient}``."""
        self.end_backward()
        out: dict[int, torch.Tensor] = {}
        pending = []
        for acc, sharded, group, sources in self._groups.values():
            p = acc.begin(
                sharded,
                group.comm,
                group.replicate_comm,
                runtime=group.runtime,
                reduce_unused=group.config.reduce_unused,
            )
            pending.append((p, sources, group.runtime))
        self._groups.clear()
        for p, sources, runtime in pending:
            new = ordering.finish_reduce(runtime, p)[0]
            for i, src in enumerate(sources):
                g = new.local_grad(i)
                if g is not None:
                    out[src] = g
        return out


def _with_unused(present: Sequence[bool], sharded: ShardedState, reduce_unused: bool) -> list[bool]:
    """The parameters that take their reduced gradient: those with one on this rank, and with
    ``reduce_unused`` every trainable one (the packed zeros of a rank without a gradient are
    summed with the others' gradients: the same sum on every rank and at every world size)."""
    if not reduce_unused:
        return list(present)
    return [p or s.requires_grad for p, s in zip(present, sharded.layout.specs)]
