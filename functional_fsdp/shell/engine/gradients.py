"""A group's gradients: from autograd's full gradients to each parameter's sharded ``.grad``.

The room of :class:`~.group.ParamGroup` that reduces (:class:`GroupGradients`, one of its
bases): a backward hands a group its full gradients (:meth:`~GroupGradients.reduce_gradients`,
from the group's ``post_backward``), which it accumulates (gradient sync off), pushes into the
reproducible tree, or reduce-scatters (alone, or in its reduce bucket with its neighbours:
:class:`~.coalesced.ReduceBucket`); the reduction stays in flight, overlapping the backward, until
the next group's starts (:class:`ReduceChain`: one in flight per root, as FSDP2 keeps one
reduce-scatter input) or the root's final callback, and then lands in ``.grad``
(:meth:`~GroupGradients.finish_reduce`). ``torch.autograd.grad`` takes the other way: the
reduced shards are returned to autograd, not accumulated (:class:`OwnReduction`).

The fields here are the group's (its ``__init__`` calls :meth:`~GroupGradients._init_gradients`);
only the group's modules write them (``tests/integration/test_architecture.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import attrs
import torch
from torch.autograd.graph import Node
from torch.distributed.tensor import DTensor

from ...core import transitions as T
from ...core.comm import Communicator, coalesces, uses_pieces
from ...core.compression import GradCompression
from ...core.plan import ReduceFacts, reduces_together
from ...core.records import GroupLayout, ShardedState
from ...core.reduction import (
    NO_REDUCE_STATE,
    ReducePolicy,
    hold_unsynced,
    hold_use,
    release_unsynced,
    release_uses,
)
from ...core.reproducible import PendingTreeReduce
from ..comm.custom import with_all_reduce_hook
from ..comm.process_group import ProcessGroupComm
from ..device.runtime import DeviceRuntime
from . import ordering
from .coalesced import ReduceBucket
from .config import GroupConfig
from .group_common import traced
from .param import ShardedParam
from .reproducible import TreeAccumulator, install_step_check

__all__ = ["GroupGradients", "OwnReduction", "ReduceChain"]


class GroupGradients:
    """The gradient half of :class:`~.group.ParamGroup` (a base class: the group's own
    fields, its gradient methods kept in one place).

    Attributes:
        tree: the reproducible reduction's accumulator (``ReproduciblePolicy``), else ``None``.
        pending_reduce: the reduction in flight, else ``None``.
        reduce_state: what the group's reductions hand the next one (the compression
            residual, HSDP's partial sum, the full gradients held while gradient sync is off:
            :class:`~functional_fsdp.core.reduction.ReduceState`).
        reduce_chain: the root's one reduction in flight, shared by its groups.
        reduce_bucket: the bucket this group reduces in (the root's schedule), else ``None``.
    """

    # The group's fields this room reads (ParamGroup.__init__ sets them).
    name: str
    layout: GroupLayout
    state: ShardedState
    comm: Communicator
    replicate_comm: Communicator | None
    runtime: DeviceRuntime
    config: GroupConfig
    device: torch.device
    sharded_params: tuple[ShardedParam, ...]
    _params: tuple[torch.nn.Parameter, ...]
    _requires_grad: tuple[bool, ...]
    _advise: Callable[[torch.Tensor], None]
    tp: Any  # the TensorParallelPlan, or None
    _decided: dict[Any, Any]  # the plan's answers (and the reduce policy) under the settings
    # ... and the methods it calls
    configure: Callable[..., None]
    base_comms: Callable[[], list[ProcessGroupComm]]
    abandon_reduction: Callable[[Any], None]

    def _init_gradients(self) -> None:
        """No gradients yet (``ParamGroup.__init__``, once its settings and communicators are
        set)."""
        # ReproduciblePolicy: this step's micro-batch gradients, summed in the canonical tree.
        self.tree: TreeAccumulator | None = None
        if self.config.reproducible is not None:
            rep = self.replicate_comm
            dp = self.comm.world_size * (1 if rep is None else rep.world_size)
            self.tree = TreeAccumulator(self.config.reproducible, dp, self.name, awaits_step=True)
            install_step_check()
        self.pending_reduce: T.PendingReduce | PendingTreeReduce | None = None
        self.reduce_state: T.ReduceState = NO_REDUCE_STATE
        # A module used more than once in the forward: the earlier uses' full gradients of this
        # backward, held until its last use's (one reduction per backward, as FSDP2).
        self.held_uses: tuple[torch.Tensor | None, ...] | None = None
        self.reduce_chain = ReduceChain()  # the root shares one among its groups (lazy init)
        self.reduce_bucket: ReduceBucket | None = None  # the root's schedule's, if any
        # The AccumulateGrad node of a trained parameter (to tell autograd.grad from backward).
        self._grad_accumulator: Node | None = None

    # ------------------------------------------------------------------ settings

    def set_grad_compression(self, compression: GradCompression | None) -> None:
        """Compress this group's reduce-scatter from now on (``None``: exact; drops the
        residual). The reduction in flight finishes with the policy it started with."""
        self.finish_reduce()
        self.configure(grad_compression=compression)
        if compression is None or not compression.error_feedback:
            self.reset_residual()

    def reset_residual(self) -> None:
        """Start compressed reduction from a zero residual (after parameters are loaded:
        docs/compression.md). A reduction in flight finishes first, so it cannot hand a
        residual from before back afterwards."""
        self.finish_reduce()
        if self.reduce_state.residual is not None:
            self.reduce_state = attrs.evolve(self.reduce_state, residual=None)

    def join_reduce_chain(self, chain: ReduceChain) -> None:
        """Share the root's one reduction in flight (its lazy init)."""
        self.reduce_chain = chain

    # ------------------------------------------------------------------ a backward's gradients

    def reduce_gradients(self, grads: Sequence[torch.Tensor | None], *, last_use: bool) -> None:
        """This backward's full gradients (``None`` for the frozen ones): push them into the
        reproducible tree, hold them (an earlier use of a module called again later in the
        forward: :func:`~functional_fsdp.core.reduction.hold_use`), keep them (gradient sync
        off: accumulation), or start their reduce-scatter with what was held (in the group's
        reduce bucket when it coalesces), after finishing the reduction still in flight.
        ``last_use``: no other use of the group in this forward has a backward to come."""
        if self.tp is not None:  # TP-replicated gradients reduced over TP in a wider dtype
            grads = self.tp.widen_grads(grads)
        if self.tree is not None:
            # The canonical tree: accumulate whatever the sync flag says; reduce once per step.
            # A micro-batch's uses make one leaf, whatever the world size.
            if self.tree.push(grads, self.layout, last=last_use):
                self._begin_tree_reduce()
        elif not last_use:
            self.held_uses = hold_use(self.held_uses, grads)
        else:
            if self.held_uses is not None:
                grads, self.held_uses = release_uses(self.held_uses, grads), None
            if not self.config.requires_gradient_sync:
                self.reduce_state = hold_unsynced(self.reduce_state, grads, self.layout)
                return
            if self.reduce_state.unsynced is not None:  # sync is on again after a no-sync step
                grads, self.reduce_state = release_unsynced(self.reduce_state, grads)
            if any(g is not None for g in grads):
                bucket = self.reduce_bucket
                if bucket is not None and bucket.holds(self):
                    # A second post-backward of this group in one backward (a module called
                    # twice in the forward): its first gradients wait in the bucket for the
                    # other members. Send what the bucket holds now, so this use's gradients
                    # are a reduction of their own that adds to .grad, as without a bucket
                    # (and as FSDP2), instead of overwriting the first use's columns.
                    bucket.flush()
                self.finish_reduce()
                if bucket is not None and self.coalesces_reduce():
                    bucket.add(self, self.reduce_copy_in(grads, bucket.columns(self)))
                else:
                    self.reduce_chain.hand_over(self)
                    self.pending_reduce = self.begin_reduce(
                        grads, self.state, reduce_state=self.reduce_state
                    )

    def drop_failed_gradients(self) -> None:
        """A step failed (``reset_iter_state``): drop its unsharded (no-sync) gradients, the
        reduce bucket's inputs and the reproducible tree's open leaves."""
        if self.reduce_state.unsynced is not None:
            self.reduce_state = attrs.evolve(self.reduce_state, unsynced=None)
        self.held_uses = None
        if self.reduce_bucket is not None:
            self.reduce_bucket.drop()
        if self.tree is not None:
            self.tree.abandon()

    def _begin_tree_reduce(self) -> None:
        """The step's last micro-batch joined the canonical tree: send its subtree sum."""
        assert self.tree is not None
        self.finish_reduce()
        self.reduce_chain.hand_over(self)
        self.pending_reduce = self.tree.begin(
            self.state,
            self.comm,
            self.replicate_comm,
            runtime=self.runtime,
            reduce_unused=self.config.reduce_unused,
        )

    def close_uses(self) -> None:
        """The backward ended (the root's final callback) before the backward of a use of
        this group (it never ran): the uses that reached it make the micro-batch's leaf, or
        its one reduction."""
        if self.tree is not None:
            if self.tree.commit():
                self._begin_tree_reduce()
        else:
            self.reduce_gradients([None] * len(self.layout), last_use=True)
            bucket = self.reduce_bucket
            if bucket is not None and bucket.holds(self):
                bucket.flush()  # the root flushed its buckets before the groups' callbacks

    @traced("post_backward_reduce")
    def begin_reduce(
        self,
        grads: Sequence[torch.Tensor | None],
        sharded: ShardedState,
        *,
        reduce_state: T.ReduceState,
        async_op: bool = True,
        all_reduce: bool | None = None,
    ) -> T.PendingReduce:
        """Issue the reduce-scatter of ``grads`` into ``sharded`` with this group's settings,
        from ``reduce_state`` (the copy-in on compute, the collective on the reduce-scatter
        stream: :mod:`.ordering`)."""
        cfg = self.config
        policy = self.reduce_policy()
        if all_reduce is not None and all_reduce != policy.all_reduce:
            policy = attrs.evolve(policy, all_reduce=all_reduce)
        pending = ordering.issue_reduce(
            self.runtime,
            grads,
            sharded,
            self.comm,
            replicate_comm=self.replicate_comm,
            policy=policy,
            reduce_state=reduce_state,
            async_op=async_op,
            alloc=self.alloc_advised,
        )
        if cfg.all_reduce_hook is None:
            return pending
        return with_all_reduce_hook(
            pending, cfg.all_reduce_hook, bases=self.base_comms(), name=self.name
        )

    def coalesces_reduce(self) -> bool:
        """Whether this group's reduction may travel in a bucket now: the packed path of a
        plain reduce-scatter (no compression, custom reduce-scatter, all-reduce hook,
        reproducible tree, gradient-sync-off accumulation or pieces path)."""
        known = self._decided.get("reduce")
        if known is None:  # the facts change only with the settings (the cache's clearer)
            cfg = self.config
            known = self._decided["reduce"] = reduces_together(
                ReduceFacts(
                    world_size=self.comm.world_size,
                    coalesces=coalesces(self.comm),
                    sync=cfg.requires_gradient_sync,
                    plain=self.tree is None
                    and cfg.grad_compression is None
                    and cfg.all_reduce_hook is None
                    and not uses_pieces(self.comm, self.layout.unsharded_bytes),
                )
            )
        return known

    def reduce_copy_in(
        self, grads: Sequence[torch.Tensor | None], out: torch.Tensor | None = None
    ) -> T.ReduceInput:
        """This group's reduction copy-in (packed, pre-divided, on compute), for a bucket;
        ``out``: its columns of the bucket's send buffer."""
        return ordering.reduce_copy_in(
            self.runtime,
            grads,
            self.state,
            self.comm,
            replicate_comm=self.replicate_comm,
            policy=self.reduce_policy(),
            reduce_state=self.reduce_state,
            out=out,
        )

    def reduce_policy(self) -> ReducePolicy:
        """The core's :class:`~functional_fsdp.core.reduction.ReducePolicy` from this group's
        settings (every reduction's; built once per settings, as the plan's answers)."""
        known = self._decided.get("policy")
        if known is None:
            cfg = self.config
            known = self._decided["policy"] = ReducePolicy(
                divide_factor=cfg.divide_factor,
                force_sum=cfg.force_sum,
                all_reduce=cfg.requires_all_reduce,
                reduce_unused=cfg.reduce_unused,
                compression=cfg.grad_compression,
            )
        return known

    def refit_partial(self) -> None:
        """A setting that decides the reduction's row width changed (``reduce_unused``,
        compression, a custom reduce-scatter): a partial sum HSDP holds takes the new width."""
        if self.reduce_state.partial is not None:
            self.reduce_state = T.refit_partial(
                self.reduce_state, self.layout, self._carries_presence()
            )

    def reduce_row_numel(self) -> int:
        """The width of this group's reduce-scatter row: the padded shard and, when the
        reduction carries them, the presence flags (asked once per settings)."""
        known = self._decided.get("row")
        if known is None:
            known = self._decided["row"] = T.reduce_row_numel(self.layout, self._carries_presence())
        return known

    def _carries_presence(self) -> bool:
        """:func:`~functional_fsdp.core.reduction.carries_presence` for this group's settings."""
        return T.carries_presence(
            self.comm, self.reduce_policy(), replicated=self.replicate_comm is not None
        )

    def join_reduce_bucket(self, bucket: ReduceBucket | None) -> None:
        """Reduce in ``bucket`` (a :class:`~.coalesced.ReduceBucket`) from now on, when
        :meth:`coalesces_reduce`; ``None``: alone."""
        self.reduce_bucket = bucket

    def take_reduce(self, pending: T.PendingReduce) -> None:
        """This group's part of a bucket's reduce-scatter, now in flight."""
        self.pending_reduce = pending

    # ------------------------------------------------------------------ torch.autograd.grad: the
    # reduced shards returned to autograd (OwnReduction)

    def trained(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """``grads`` with ``None`` for the frozen parameters."""
        return [g if rg else None for g, rg in zip(grads, self._requires_grad)]

    def reduce_now(
        self, grads: Sequence[torch.Tensor | None], sharded: ShardedState, *, own: bool
    ) -> list[torch.Tensor | None]:
        """Reduce-scatter ``grads`` into ``sharded`` and wait: this rank's reduced shards
        (``None`` where no gradient). ``own``: the shards are the group's own, so the
        reduction starts from the group's :attr:`reduce_state` and the state it returns
        becomes the group's (else it starts from none and keeps none)."""
        if self.tree is not None:  # torch.autograd.grad on the module path, one micro-batch
            new = self.tree.reduce_one(
                grads,
                sharded,
                self.comm,
                self.replicate_comm,
                runtime=self.runtime,
                reduce_unused=self.config.reduce_unused,
            )
            return [new.local_grad(i) for i in range(len(self.layout))]
        state = self.reduce_state if own else NO_REDUCE_STATE
        pending = self.begin_reduce(
            grads, sharded, reduce_state=state, async_op=False, all_reduce=True
        )
        new, state = ordering.finish_reduce(self.runtime, pending)
        if own:
            self._adopt_reduce_state(state)
        return [new.local_grad(i) for i in range(len(self.layout))]

    def sharded_grads(self, locals_: Sequence[torch.Tensor | None]) -> tuple[DTensor | None, ...]:
        """Reduced local shards as sharded ``DTensor`` gradients (``None`` kept)."""
        return tuple(
            None if loc is None else sp.dtensor(loc)
            for sp, loc in zip(self.sharded_params, locals_)
        )

    def gather_cotangents(self, cotangents: Sequence[Any]) -> tuple[torch.Tensor, ...]:
        """All-gather sharded cotangents of reduced gradients into full tensors (the adjoint
        of the reduction, for a double backward)."""
        locals_ = [c._local_tensor if isinstance(c, DTensor) else c for c in cotangents]
        state = T.pack_locals(locals_, self.layout, self.state.rank, device=self.device)
        return T.unshard(state, self.comm).params

    def gradients_captured(self) -> bool:
        """Whether the running backward is ``torch.autograd.grad`` (which returns gradients to
        the caller) rather than ``.backward()`` (which accumulates them into ``.grad``)."""
        if self._grad_accumulator is None:
            self._grad_accumulator = self._find_grad_accumulator()
            if self._grad_accumulator is None:
                return False
        try:
            torch._C._will_engine_execute_node(self._grad_accumulator)
        except RuntimeError:  # raised for a leaf's node exactly while autograd.grad() runs
            return True
        return False

    def _find_grad_accumulator(self) -> Node | None:
        """The ``AccumulateGrad`` node of a trained parameter, found through a view of it.

        ``DTensor`` refuses the view of an empty global shape (a ``(0, n)`` parameter): the
        largest parameters are tried first, so an empty one beside others never decides.
        """
        trains = sorted(
            (p for p in self._params if p.requires_grad), key=lambda p: p.numel(), reverse=True
        )
        for p in trains:
            with torch.enable_grad():  # backward runs without grad mode: record the view
                try:
                    view: Any = p.view_as(p)
                except RuntimeError:
                    continue
            return view.grad_fn.next_functions[0][0]
        return None

    # ------------------------------------------------------------------ landing in .grad

    def alloc_advised(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A new buffer from the runtime (reduction outputs, a bucket's send buffer), with the
        kernel advised about fresh memory."""
        t = self.runtime.empty(numel, dtype, device)
        self._advise(t)
        return t

    @traced("post_backward_rs_wait")
    def finish_reduce(self) -> None:
        """Wait for the reduce-scatter in flight and accumulate into each parameter's ``.grad``
        (with the other members of its bucket, which share the collective: they land
        together).

        ``.grad`` is the one place the module path keeps gradients (the cell's record holds
        none): the core adds the reduced shards to it, in place (donated), on the post-reduce
        stream; compute waits for it (:func:`finish_together`).
        """
        if self.pending_reduce is None:
            return
        bucket = self.reduce_bucket
        together = (self,) if bucket is None else bucket.landing_with(self)
        finish_together(cast("Sequence[GroupGradients]", together))

    def _adopt_reduce_state(self, after: T.ReduceState) -> None:
        """Keep what a finished reduction hands on (its residual, its partial sum). Only
        those: the state it started from is a snapshot, and gradients held without sync
        since it began (a reduction left in flight under manual backward finalization) are
        the group's current ones."""
        rs = self.reduce_state
        if after.residual is not rs.residual or after.partial is not rs.partial:
            self.reduce_state = attrs.evolve(rs, residual=after.residual, partial=after.partial)


def finish_together(groups: Sequence[GroupGradients]) -> None:
    """Finish the reductions in flight of ``groups``, which land together (a bucket's members
    share one collective; or one group): one wait, one core call that finishes each into its
    parameters' ``.grad`` (added in place: donated), each group keeping what its reduction
    hands on (:func:`.ordering.finish_reductions`)."""
    pendings: list[T.PendingReduce | PendingTreeReduce] = []
    for g in groups:
        assert g.pending_reduce is not None
        pendings.append(g.pending_reduce)
        g.pending_reduce = None
    currents = [[sp.grad_local() for sp in g.sharded_params] for g in groups]

    def land(i: int, grads: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor]:
        current = currents[i]
        for sp, g, prev in zip(groups[i].sharded_params, grads, current):
            sp.land_grad(g, prev)
        return [c for c in current if c is not None]

    try:
        landed = ordering.finish_reductions(groups[0].runtime, pendings, currents, land)
    except BaseException:
        # A wait failed (a peer aborted, a timeout), an all-reduce hook or an HSDP all-reduce
        # raised: the step is broken. No part is finished again (some may have landed), and
        # each stays referenced until its collective can no longer write into its buffers.
        for g, p in zip(groups, pendings):
            g.abandon_reduction(p)
        raise
    for g, (_, state, _) in zip(groups, landed):
        g._adopt_reduce_state(state)


class ReduceChain:
    """The one gradient reduction in flight among a root's groups, as FSDP2 keeps one
    reduce-scatter input buffer (``reduce_scatter_max_input_buffers=1``): a group starting its
    reduction first finishes the previous group's, so at most one group's full-size reduce
    buffers are alive at a time (33 groups otherwise pile them up until the end of backward).

    Attributes:
        group: the group whose reduction is in flight (or last was), else ``None``.
    """

    __slots__ = ("groups",)

    def __init__(self) -> None:
        self.groups: tuple[GroupGradients, ...] = ()

    @property
    def group(self) -> GroupGradients | None:
        """The (last) group whose reduction is in flight, else ``None``."""
        return self.groups[-1] if self.groups else None

    def hand_over(self, *groups: GroupGradients) -> None:
        """Finish the reduction in flight of other groups; ``groups`` (one, or a bucket's
        members reducing in one collective) issue the next one."""
        prev, self.groups = self.groups, groups
        for g in prev:
            if g not in groups:
                g.finish_reduce()

    def settle(self, *groups: GroupGradients) -> None:
        """Finish the reduction in flight of groups other than ``groups`` now: a bucket whose
        first member is about to pack its gradients into a new send buffer (otherwise the
        previous bucket's send buffer stayed alive beside it for the whole bucket)."""
        prev, self.groups = self.groups, tuple(g for g in self.groups if g in groups)
        for g in prev:
            if g not in groups:
                g.finish_reduce()


class OwnReduction:
    """The module path's gradients returned to ``torch.autograd.grad``: the reduction of the
    group's own shards, recorded through :class:`~.autograd.ReduceFn` (so a
    ``create_graph=True`` backward can differentiate it); the group keeps managing its own
    unsharded copy.

    Attributes:
        group: the group.
        sharded: the group's record when the backward reached it (the reduction's layout).
        create_graph: set by :func:`~.autograd.reduce_differentiably`.
    """

    __slots__ = ("create_graph", "group", "sharded")

    def __init__(self, group: GroupGradients) -> None:
        self.group = group
        self.sharded = group.state
        self.create_graph = False

    def reduce(self, grads: Sequence[torch.Tensor | None]) -> tuple[DTensor | None, ...]:
        """Reduce-scatter full gradients; the sharded gradients as ``DTensor`` s."""
        g = self.group
        grads = g.trained(grads)
        if not any(gr is not None for gr in grads):
            return (None,) * len(grads)
        return g.sharded_grads(g.reduce_now(grads, self.sharded, own=True))

    def gather_cotangents(self, cotangents: Sequence[Any]) -> tuple[torch.Tensor, ...]:
        """The adjoint of :meth:`reduce` (an all-gather)."""
        return self.group.gather_cotangents(cotangents)
