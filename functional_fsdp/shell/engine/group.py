"""The runtime of one parameter group: one mutable cell holding the current sharded record.

Everything else here is a cache (views, DTensor parameters) or a buffer in flight. The
unsharded parameters are views into one persistent buffer per group; "resharding" frees that
buffer's storage (``resize_(0)``) and "unsharding" re-allocates it and copies the all-gather into
it, so tensors autograd saved during forward see the data again in backward. Gradient reduction
is the backward of the unshard (:class:`~.autograd.UnshardFn`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ...core import transitions as T
from ...core.comm import Communicator
from ...core.compression import GradCompression
from ...core.records import (
    CPUOffloadPolicy,
    GroupLayout,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardedState,
)
from ..comm.custom import base_comm, with_all_reduce_hook
from ..comm.process_group import ProcessGroupComm
from ..comm.scoped import ScopedComm
from .gather import GatherSlot
from .group_common import ReduceChain, TrainingState, _contiguous_stride, layout_for, traced
from .memory import huge_page_advisor

__all__ = ["ParamGroup", "TrainingState", "layout_for"]


class ParamGroup:
    """Runtime of one ``fully_shard`` group.

    Args:
        layout: the group layout.
        state: the initial sharded record (the one mutable cell).
        holders: per parameter, the ``(module, attribute name)`` pairs that register it.
        mesh: the device mesh (1-D, or 2-D ``(replicate, shard)`` for HSDP).
        comm: communicator over the shard group.
        replicate_comm: communicator over the replicate group (HSDP) or ``None``.
        sub_comm: communicator over the ``reshard_after_forward=k`` sub-group, or ``None``.
        device: the compute device.
        mp_policy: mixed-precision policy.
        offload_policy: offload policy.
        tp: the :class:`~.tensor_parallel.TensorParallelPlan` of 2-D FSDP + TP, or ``None``.
    """

    def __init__(
        self,
        layout: GroupLayout,
        state: ShardedState,
        holders: list[list[tuple[nn.Module, str]]],
        requires_grad: Sequence[bool],
        *,
        mesh: Any,
        comm: Communicator,
        replicate_comm: Communicator | None,
        sub_comm: Communicator | None,
        device: torch.device,
        mp_policy: MixedPrecisionPolicy,
        offload_policy: OffloadPolicy,
        name: str,
        tp: Any = None,
    ) -> None:
        self.layout = layout
        self.tp = tp  # a TensorParallelPlan when parameters are TP DTensors (2-D), else None
        self.state = state
        self.holders = holders
        self.mesh = mesh
        self.comm = comm
        self.replicate_comm = replicate_comm
        self.sub_comm = sub_comm
        self.device = device
        self.mp_policy = mp_policy
        self.offload = isinstance(offload_policy, CPUOffloadPolicy)
        self.name = name
        for c in (comm, replicate_comm, sub_comm):
            if isinstance(c, ScopedComm):
                c.name = name  # collective errors name the group (schedule.py)
        self._set_layout(layout)
        self.params: list[nn.Parameter] = [
            nn.Parameter(self.dtensor(state.local(i), i), requires_grad=rg)
            for i, rg in enumerate(requires_grad)
        ]
        self.requires_grad = tuple(requires_grad)
        self.register_sharded()
        # Caches (not state): the unsharded copy (buffer, views, gather in flight, the version
        # of the shards it was gathered from), the post-forward rows and their version. Any
        # write to a sharded parameter since (load_state_dict, an optimizer step, copy_, summon
        # writeback) changes sharded_version() and makes that data stale.
        self._advise = huge_page_advisor()
        self.slot = GatherSlot(layout, device, self._advise)
        self.full_outputs: tuple[torch.Tensor, ...] | None = None
        self.post_forward: Any = None
        self._post_forward_version = -1
        self.pending_reduce: T.PendingReduce | None = None
        self.reduce_chain = ReduceChain()  # the root shares one among its groups (lazy_init)
        self.accumulated: list[torch.Tensor | None] | None = None
        self.training_state = TrainingState.IDLE
        self.ran_post_backward = False
        # The AccumulateGrad node of a trained parameter (to tell autograd.grad from backward),
        # and whether a create_graph backward needs the full parameters for a double backward.
        self._grad_accumulator: Any = None
        self._abandoned: list[Any] = []  # in-flight work a failed step left (kept referenced)
        self.keep_for_double_backward = False
        # fully_shard([m1, m2]): the modules sharing this group, and how many finished forward.
        self.forward_users = 1
        self.forward_done = 0
        # Flags (FSDPModule setters).
        self.reshard_after_forward: bool | int = True
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.divide_factor: float | None = None
        self.force_sum = False
        self.reduce_unused = False
        # FSDP2 extension points (FSDPModule.set_all_reduce_hook / set_unshard_in_backward).
        self.all_reduce_hook: Any = None
        self.unshard_in_backward = True
        self.allocate_from_process_group = False  # accepted FSDP2 hint; no effect (module.py)
        self.reduce_scatter_max_input_buffers = 1  # accepted FSDP2 knobs; no effect (module.py)
        self.separate_reduce_scatter_group = False
        # Beyond FSDP2: compressed reduce-scatter (its residual lives in self.state).
        self.grad_compression: GradCompression | None = None

    def summon_comm(self) -> Communicator:
        """The shard group's communicator for ``summon_full_params`` (tags of their own)."""
        return self.comm.for_summon() if isinstance(self.comm, ScopedComm) else self.comm

    def comms(self) -> list[Communicator]:
        """The communicators this group's collectives run on (shard, replicate, sub-group)."""
        return [c for c in (self.comm, self.replicate_comm, self.sub_comm) if c is not None]

    def base_comms(self) -> list[ProcessGroupComm]:
        """The shared process-group communicators this group's collectives run on."""
        return [b for c in self.comms() if (b := base_comm(c)) is not None]

    def _set_layout(self, layout: GroupLayout) -> None:
        self.layout = layout
        hsdp = self.replicate_comm is not None
        self.placements = [
            ((Replicate(), Shard(d)) if hsdp else (Shard(d),)) for d in layout.shard_dims
        ]
        self._specs = [
            DTensorSpec(
                self.mesh,
                pl,
                tensor_meta=TensorMeta(torch.Size(s.shape), _contiguous_stride(s.shape), s.dtype),
            )
            for s, pl in zip(layout.specs, self.placements)
        ]
        if self.tp is not None:  # TP parameters: DTensors on the full (dp, tp) mesh
            self.placements, self._specs = self.tp.sharded_specs(
                layout, self.placements, self._specs
            )

    # ------------------------------------------------------------------ registration

    def sharded_spec(self, i: int) -> DTensorSpec:
        """Parameter ``i``'s sharded ``DTensor`` spec (mesh, placements, global shape)."""
        return self._specs[i]

    def dtensor(self, local: torch.Tensor, i: int) -> DTensor:
        """Parameter ``i``'s local shard (or sharded gradient) as a ``DTensor`` on the mesh."""
        return DTensor(local, self._specs[i], requires_grad=False)

    def register_sharded(self) -> None:
        """Put the sharded DTensor parameters on every holding module."""
        for p, holders in zip(self.params, self.holders):
            for m, n in holders:
                m._parameters[n] = p

    def register_full(self, tensors: Sequence[torch.Tensor]) -> None:
        """Put full tensors (autograd outputs of the unshard) on every holding module."""
        if self.tp is not None:  # the module sees TP DTensors of the TP-local full tensors
            tensors = self.tp.wrap_full(tensors)
        for t, holders in zip(tensors, self.holders):
            for m, n in holders:
                m._parameters[n] = t  # type: ignore[assignment]

    def refresh_from_modules(self) -> None:
        """Re-adopt the parameters now on the modules (after ``_apply``, e.g. ``to_empty``).

        Rebuilds the packed sharded buffer on the parameters' device and re-points every
        parameter's local tensor into it, so the all-gather input stays zero-copy.
        """
        params: list[Any] = [holders[0][0]._parameters[holders[0][1]] for holders in self.holders]
        locals_: list[torch.Tensor] = [
            p._local_tensor if isinstance(p, DTensor) else p for p in params
        ]
        device = locals_[0].device if locals_ else self.device
        dtypes = [loc.dtype for loc in locals_]
        if any(d != s.dtype for d, s in zip(dtypes, self.layout.specs)):
            # module.to(dtype) (or another _apply cast) changed the parameters' dtype: train in it.
            specs = [attrs.evolve(s, dtype=d) for s, d in zip(self.layout.specs, dtypes)]
            self._set_layout(layout_for(specs, self.layout.world_size, self.mp_policy))
        state = T.pack_locals(locals_, self.layout, self.state.rank, device=device)
        residual = self.state.residual
        self.state = state = attrs.evolve(
            state, residual=None if residual is None else residual.to(self.device)
        )
        new_params = []
        for i, p in enumerate(params):
            if not isinstance(p, nn.Parameter) or not isinstance(p, DTensor):
                p = nn.Parameter(
                    self.dtensor(state.local(i), i), requires_grad=self.requires_grad[i]
                )
            else:
                p._local_tensor = state.local(i)
            new_params.append(p)
        self.params = new_params
        self._grad_accumulator = None
        self.register_sharded()
        self.free()
        self.slot = GatherSlot(self.layout, self.device, self._advise)

    # ------------------------------------------------------------------ unshard / reshard

    def sharded_version(self) -> int:
        """A counter that grows with every in-place write to the sharded parameters.

        Three version counters are summed, because ``DTensor`` runs its ops below autograd's
        in-place tracking: writes through the ``DTensor`` parameters (an optimizer step,
        ``load_state_dict``, ``p.copy_``) bump only the parameter's counter, writes to a local
        shard (``p.to_local().copy_``) only the local tensor's, and writes to the packed buffer
        (``summon_full_params``) only the buffer's. Writes through ``.data`` are not seen (as
        autograd does not see them).
        """
        try:
            v = self.state.flat._version
            for p in self.params:
                v += p._version + p._local_tensor._version  # type: ignore[attr-defined]
        except RuntimeError:  # inference tensors have no version counter
            return -1
        return v

    def drop_stale(self) -> int:
        """Forget unsharded data (buffer, gather in flight, post-forward rows) that was
        gathered before the latest write to the sharded parameters; return the shards' current
        :meth:`sharded_version` (read once: dropping reads and frees, it writes no shard)."""
        now = self.sharded_version()
        if self.post_forward is not None and self._post_forward_version != now:
            self.post_forward = None
        slot = self.slot
        if slot.pending is not None and slot.pending_version != now:
            self.discard_pending()
        if slot.live and slot.version != now:
            self.free()
        return now

    def new_slot(self) -> GatherSlot:
        """A fresh unsharded copy of this group's layout (a functional call gathers into one)."""
        return GatherSlot(self.layout, self.device, self._advise)

    # The unsharded copy (one GatherSlot; read-only views of it for callers and tests).

    @property
    def buffer(self) -> torch.Tensor | None:
        """The persistent unsharded buffer (storage freed while resharded)."""
        return self.slot.buffer

    @property
    def views(self) -> tuple[torch.Tensor, ...]:
        """The full parameters as views of :attr:`buffer`."""
        return self.slot.views

    @property
    def pending(self) -> T.PendingUnshard | None:
        """The all-gather in flight, if any."""
        return self.slot.pending

    @property
    def is_unsharded(self) -> bool:
        """Whether the buffer holds the full parameters now."""
        return self.slot.live

    @traced("all_gather")
    def start_unshard(self, version: int | None = None) -> None:
        """Issue the all-gather (async) unless unsharded or already in flight. ``version``: the
        shards' version when the caller just dropped stale data (saves reading it again)."""
        now = self.drop_stale() if version is None else version
        if self.post_forward is not None and self.sub_comm is not None:
            self.slot.start(self.post_forward, self.sub_comm, version=self._post_forward_version)
            return
        self.slot.start(
            self._gather_source(), self.comm, version=now, direct=not self._keeps_gather_output()
        )

    def _keeps_gather_output(self) -> bool:
        raf = self.reshard_after_forward
        return isinstance(raf, int) and not isinstance(raf, bool)

    def _gather_source(self) -> ShardedState:
        if self.offload and self.state.flat.device != self.device:
            return attrs.evolve(self.state, flat=self.state.flat.to(self.device, non_blocking=True))
        return self.state

    @traced("all_gather_copy_out")
    def wait_unshard(self) -> None:
        """Finish the all-gather into the persistent buffer (issuing it first if needed)."""
        now = self.drop_stale()
        if self.slot.live:
            return
        self.start_unshard(now)
        self.slot.wait(keep_output=self._keeps_gather_output())
        self.post_forward = None

    def free(self) -> None:
        """Free the unsharded buffer's storage (views saved by autograd stay valid objects)."""
        self.slot.free()

    def reshard_after_forward_now(self, size: bool | int) -> None:
        """Reshard after forward: fully (``True``), to a sub-group (``int``) or not (``False``)."""
        if size is False:
            return
        if size is not True and self.slot.output is not None:
            self.post_forward = T.post_forward_from_gather(
                self.layout, self.comm.rank, int(size), self.slot.output, self.state
            )
            self._post_forward_version = self.slot.version
        self.free()

    @traced("reshard")
    def reshard(self) -> None:
        """Drop every unsharded copy and register the sharded parameters (FSDP2's reshard)."""
        self.discard_pending()
        self.free()
        self.post_forward = None
        self.full_outputs = None
        self.register_sharded()

    def owns_full(self, i: int, t: Any) -> bool:
        """Whether ``t`` is this group's own unsharded parameter ``i`` (a view or autograd output)."""
        if not self.slot.live:
            return False
        return (
            (bool(self.views) and t is self.views[i])
            or (self.full_outputs is not None and t is self.full_outputs[i])
            or (self.tp is not None and self.tp.owns(i, t))
        )

    def abandon_in_flight(self) -> None:
        """``reset_iter_state``: drop the collectives a failed step left in flight without
        waiting (a peer may never complete them). Their buffers, the unsharded one included,
        stay referenced here so a late message never lands in freed or reused memory; the group
        gathers into a fresh buffer from now on."""
        kept = self.slot.abandon()
        if self.pending_reduce is not None:
            kept.append(self.pending_reduce)
        if kept:
            self._abandoned.append(kept)
        self.pending_reduce = None

    def discard_pending(self) -> None:
        """Drop an all-gather that was prefetched but not used (it may now be stale)."""
        self.slot.discard()

    # ------------------------------------------------------------------ gradients

    def enter_post_backward(self) -> None:
        """This group's backward has reached its parameters (a reduction follows)."""
        self.ran_post_backward = True
        self.training_state = TrainingState.POST_BACKWARD

    def after_returned_reduce(self, keep_full: bool) -> None:
        """The gradients were reduced and returned to ``torch.autograd.grad``; ``keep_full``:
        a ``create_graph=True`` backward needs the full parameters for a double backward."""
        self.keep_for_double_backward = keep_full
        if self.reshard_after_backward and not keep_full:
            self.free()
            self.register_sharded()

    @traced("post_backward")
    def post_backward(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Reduce (or accumulate, without sync) the full gradients; reshard after backward."""
        self.enter_post_backward()
        grads = [g if rg else None for g, rg in zip(grads, self.requires_grad)]
        if self.reshard_after_backward:
            # The gradients are separate tensors: free the full parameters before packing them.
            self.free()
            self.register_sharded()
        if not self.requires_gradient_sync:
            rdtype = self.layout.grad_reduce_dtype()
            acc = self.accumulated or [None] * len(grads)
            self.accumulated = [
                (a if g is None else (g.to(rdtype, copy=True) if a is None else a.add_(g)))
                for a, g in zip(acc, grads)
            ]
        else:
            if self.accumulated is not None:
                grads = [
                    (a if g is None else (g if a is None else a.add_(g)))
                    for a, g in zip(self.accumulated, grads)
                ]
                self.accumulated = None
            if any(g is not None for g in grads):
                self.finish_reduce()
                self.reduce_chain.hand_over(self)
                self.pending_reduce = self.begin_reduce(grads, self.state)

    @traced("post_backward_reduce")
    def begin_reduce(
        self,
        grads: Sequence[torch.Tensor | None],
        sharded: ShardedState,
        *,
        async_op: bool = True,
        all_reduce: bool | None = None,
    ) -> T.PendingReduce:
        """Issue the reduce-scatter of ``grads`` into ``sharded`` with this group's settings."""
        pending = T.begin_reduce(
            grads,
            sharded,
            self.comm,
            replicate_comm=self.replicate_comm,
            divide_factor=self.divide_factor,
            force_sum=self.force_sum,
            all_reduce=self.requires_all_reduce if all_reduce is None else all_reduce,
            reduce_unused=self.reduce_unused,
            async_op=async_op,
            alloc=self._alloc_advised,
            compression=self.grad_compression,
        )
        if self.all_reduce_hook is None:
            return pending
        return with_all_reduce_hook(
            pending, self.all_reduce_hook, bases=self.base_comms(), name=self.name
        )

    def set_grad_compression(self, compression: GradCompression | None) -> None:
        """Compress this group's reduce-scatter from now on (``None``: exact; drops the
        residual). The reduction in flight finishes with the policy it started with."""
        self.finish_reduce()
        self.grad_compression = compression
        if compression is None or not compression.error_feedback:
            self.reset_residual()

    def reset_residual(self) -> None:
        """Start compressed reduction from a zero residual (after parameters are loaded:
        docs/compression.md). A reduction in flight finishes first, so it cannot hand a
        residual from before back afterwards."""
        self.finish_reduce()
        if self.state.residual is not None:
            self.state = attrs.evolve(self.state, residual=None)

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

    def _find_grad_accumulator(self) -> Any:
        """The ``AccumulateGrad`` node of a trained parameter, found through a view of it.

        ``DTensor`` refuses the view of an empty global shape (a ``(0, n)`` parameter): the
        largest parameters are tried first, so an empty one beside others never decides.
        """
        trains = sorted(
            (p for p in self.params if p.requires_grad), key=lambda p: p.numel(), reverse=True
        )
        for p in trains:
            with torch.enable_grad():  # backward runs without grad mode: record the view
                try:
                    view: Any = p.view_as(p)
                except RuntimeError:
                    continue
            return view.grad_fn.next_functions[0][0]
        return None

    def _alloc_advised(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype, device=device)
        self._advise(t)
        return t

    @traced("post_backward_rs_wait")
    def finish_reduce(self) -> None:
        """Wait for the reduce-scatter in flight and accumulate into each parameter's ``.grad``.

        ``.grad`` is the one place the module path keeps gradients (the cell's record holds
        none): the core adds the reduced shards to it, in place (donated).
        """
        pending, self.pending_reduce = self.pending_reduce, None
        if pending is None:
            return
        new = T.finish_reduce(pending, accumulate=False)
        self.state = attrs.evolve(self.state, partial=new.partial, residual=new.residual)
        if new.grads is None:
            return
        current = [None if p.grad is None else p.grad._local_tensor for p in self.params]  # type: ignore[attr-defined]
        grads = T.accumulate_local_grads(new, current, donate=True)
        for i, (p, g, prev) in enumerate(zip(self.params, grads, current)):
            if g is not None and g is not prev:
                p.grad = self.dtensor(g, i)
