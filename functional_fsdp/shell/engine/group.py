"""The runtime of one parameter group: one mutable cell holding the current sharded record.

Everything else here is a cache (views, DTensor parameters) or a buffer in flight. The
unsharded parameters are views into one persistent buffer per group; "resharding" frees that
buffer's storage (``resize_(0)``) and "unsharding" re-allocates it and copies the all-gather into
it, so tensors autograd saved during forward see the data again in backward. Gradient reduction
is the backward of the unshard (:class:`~.autograd.UnshardFn`).

The group owns its state: each parameter's facts live in its :class:`~.param.ShardedParam`, the
settings in a frozen :class:`~.config.GroupConfig`, and the phases of an iteration are methods
(:meth:`ParamGroup.pre_forward`, :meth:`~ParamGroup.post_forward`,
:meth:`~ParamGroup.pre_backward`, :meth:`~ParamGroup.post_backward`,
:meth:`~ParamGroup.finish_backward`) that the module hooks (``shell/api/state.py``) call.

A group is one object in three rooms: this module (parameters, settings, the unsharded copy,
the phases), :mod:`.gradients` (reduction into ``.grad``, its base
:class:`~.gradients.GroupGradients`) and :mod:`.lending` (weights tied across groups, its base
:class:`~.lending.GroupLending`). Nothing outside them and :mod:`.param` assigns a group's
fields (``tests/integration/test_architecture.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement

from ...core import transitions as T
from ...core._tree import tree_map
from ...core.comm import Communicator, coalesces, scoped_view
from ...core.errors import ReproducibilityError, UnsupportedError
from ...core.lifecycle import Act, Event, LifecycleConfig, Phase, advance
from ...core.plan import SharingFacts, gathers_together
from ...core.records import (
    CPUOffloadPolicy,
    GroupLayout,
    MixedPrecisionPolicy,
    OffloadPolicy,
    PostForwardState,
    ShardedState,
)
from ..comm.custom import CustomCollectiveComm, base_comm, unwrap
from ..comm.process_group import ProcessGroupComm
from ..device import runtime_for
from ..device.runtime import DeviceRuntime
from ..parallel.tensor_parallel import TensorParallelPlan
from . import optimizer_access, ordering
from .abandoned import AbandonedWork
from .autograd import UnshardFn, reduce_differentiably
from .coalesced import start_together
from .config import GroupConfig
from .gather import GatherSlot
from .gradients import GroupGradients, OwnReduction
from .group_common import TrainingState, _contiguous_stride, layout_for, traced
from .lending import GroupLending
from .memory import huge_page_advisor
from .param import Holders, ShardedParam

__all__ = ["ParamGroup", "TrainingState", "layout_for"]

# Settings a deep copy carries over (FSDPModule setters; the others start at their defaults).
_COPIED_SETTINGS = (
    "reshard_after_forward",
    "reshard_after_backward",
    "requires_gradient_sync",
    "requires_all_reduce",
    "divide_factor",
    "force_sum",
    "reduce_unused",
    "reproducible",
)


class ParamGroup(GroupGradients, GroupLending):
    """Runtime of one ``fully_shard`` group.

    Args:
        layout: the group layout.
        state: the initial sharded record (the one mutable cell).
        holders: per parameter, the ``(module, attribute name)`` pairs that register it.
        requires_grad: per parameter, whether it trains.
        mesh: the device mesh (1-D, or 2-D ``(replicate, shard)`` for HSDP).
        comm: communicator over the shard group.
        replicate_comm: communicator over the replicate group (HSDP) or ``None``.
        sub_comm: communicator over the ``reshard_after_forward=k`` sub-group, or ``None``.
        device: the compute device.
        mp_policy: mixed-precision policy.
        offload_policy: offload policy.
        name: the group's name (its module's, for messages and profiler labels).
        tp: the :class:`~.tensor_parallel.TensorParallelPlan` of 2-D FSDP + TP, or ``None``.
        config: the settings (``FSDPModule.set_*`` replace it through :meth:`configure`).
        forward_users: how many modules forward through the group (``fully_shard([m1, m2])``).
        runtime: the device runtime its copies, collectives and frees run on (default: the
            device's, :func:`~functional_fsdp.shell.device.runtime_for`); the root's lazy init
            gives every group of the model the root's (:meth:`use_runtime`).
    """

    # The actions _carry_out runs by a method of no arguments (filled in below the class).
    _CARRY_OUT: dict[Act, Callable[[ParamGroup], Any]]

    def __init__(
        self,
        layout: GroupLayout,
        state: ShardedState,
        holders: Sequence[Holders],
        requires_grad: Sequence[bool],
        *,
        mesh: DeviceMesh,
        comm: Communicator,
        replicate_comm: Communicator | None,
        sub_comm: Communicator | None,
        device: torch.device,
        mp_policy: MixedPrecisionPolicy,
        offload_policy: OffloadPolicy,
        name: str,
        tp: TensorParallelPlan | None = None,
        config: GroupConfig | None = None,
        forward_users: int = 1,
        runtime: DeviceRuntime | None = None,
    ) -> None:
        self.layout = layout
        self.runtime: DeviceRuntime = runtime_for(device) if runtime is None else runtime
        self.tp = tp
        self.state = state
        self.mesh = mesh
        self.comm = comm
        self.replicate_comm = replicate_comm
        self.sub_comm = sub_comm
        self.device = device
        self.mp_policy = mp_policy
        self.offload = isinstance(offload_policy, CPUOffloadPolicy)
        self.name = name
        self.config = GroupConfig() if config is None else config
        for c in (comm, replicate_comm, sub_comm):
            if (view := scoped_view(c)) is not None:
                view.name = name  # collective errors name the group (schedule.py)
        placements, specs = self._dtensor_specs(layout)
        self.sharded_params: tuple[ShardedParam, ...] = tuple(
            ShardedParam(i, s, h, bool(rg), pl, ds, state.local(i))
            for i, (s, h, rg, pl, ds) in enumerate(
                zip(layout.specs, holders, requires_grad, placements, specs)
            )
        )
        self._index_params()
        self.register_sharded()
        # Caches (not state): the unsharded copy (buffer, views, gather in flight, the version
        # of the shards it was gathered from), the post-forward rows and their version. Any
        # write to a sharded parameter since (load_state_dict, an optimizer step, copy_, summon
        # writeback) changes sharded_version() and makes that data stale.
        self._advise = huge_page_advisor()
        self.slot = GatherSlot(layout, device, self._advise, runtime=self.runtime)
        self._post_forward_state: PostForwardState | None = None
        self._post_forward_version = -1
        self._init_gradients()
        # The control state (core/lifecycle.py): the only record the phase methods change.
        self.phase = Phase()
        self._lc: LifecycleConfig | None = None  # its settings, rebuilt when they change
        # advance's answers under _lc, and the plan's sharing answers (caches of pure
        # functions, cleared by _settings_changed).
        self._transitions: dict[tuple[Any, ...], tuple[Phase, tuple[Act, ...]]] = {}
        self._decided: dict[Any, Any] = {}
        self._abandoned = AbandonedWork()  # in-flight work a failed step left, until it lands
        # The autograd graph task of this iteration's backward (its first pre-backward's): a
        # nested one (a reentrant checkpoint's) reaching a use recorded in the forward sends
        # PARTIAL_BACKWARD. A fact about autograd, not a decision: None outside a backward.
        self._backward_task: int | None = None
        # fully_shard([m1, m2]): the modules sharing this group.
        self.forward_users = forward_users
        self._init_lending()  # weights tied across groups (.tied)

    # ------------------------------------------------------------------ parameters

    def _index_params(self) -> None:
        """Cache the tuples the per-step code reads (rebuilt when parameters are re-adopted)."""
        sps = self.sharded_params
        self._params = tuple(sp.sharded for sp in sps)
        self._holders = tuple(sp.holders for sp in sps)
        self._requires_grad = tuple(sp.requires_grad for sp in sps)
        self._trains = any(self._requires_grad)
        self._settings_changed()  # the life cycle reads whether the group trains

    @property
    def params(self) -> tuple[torch.nn.Parameter, ...]:
        """The sharded ``DTensor`` parameters, in layout order (read-only)."""
        return self._params

    @property
    def holders(self) -> tuple[Holders, ...]:
        """Per parameter, the ``(module, attribute name)`` pairs that register it (read-only)."""
        return self._holders

    @property
    def requires_grad(self) -> tuple[bool, ...]:
        """Per parameter, whether it trains (read-only)."""
        return self._requires_grad

    def _dtensor_specs(
        self, layout: GroupLayout
    ) -> tuple[list[tuple[Placement, ...]], list[DTensorSpec]]:
        """Each parameter's sharded placements and ``DTensor`` spec under ``layout``."""
        hsdp = self.replicate_comm is not None
        placements: list[tuple[Placement, ...]] = [
            ((Replicate(), Shard(d)) if hsdp else (Shard(d),)) for d in layout.shard_dims
        ]
        specs = [
            DTensorSpec(
                self.mesh,
                pl,
                tensor_meta=TensorMeta(torch.Size(s.shape), _contiguous_stride(s.shape), s.dtype),
            )
            for s, pl in zip(layout.specs, placements)
        ]
        if self.tp is not None:  # TP parameters: DTensors on the full (dp, tp) mesh
            placements, specs = self.tp.sharded_specs(layout, placements, specs)
        return placements, specs

    def _relayout(self, layout: GroupLayout) -> None:
        """Take ``layout`` (new parameter dtypes) and each parameter's new spec."""
        self.layout = layout
        self._settings_changed()
        placements, specs = self._dtensor_specs(layout)
        for sp, s, pl, ds in zip(self.sharded_params, layout.specs, placements, specs):
            sp.relayout(s, pl, ds)

    # ------------------------------------------------------------------ settings

    def configure(self, **changes: Any) -> None:
        """Replace :attr:`config` with ``changes`` applied (``FSDPModule.set_*``, lazy init).

        Raises:
            TypeError: a name is not a :class:`~.config.GroupConfig` field.
            ReproducibilityError: a setting the group's ``ReproduciblePolicy`` cannot keep
                bit-identical (nothing is changed then).
        """
        new = attrs.evolve(self.config, **changes)
        if new.reproducible is not None and (bad := new.conflicts_with_reproducible()):
            raise ReproducibilityError(
                f"group {self.name!r} reduces under ReproduciblePolicy, whose sums "
                f"{', '.join(bad)} would change (and make them depend on the world size); "
                "drop that setting, or shard without reproducible="
            )
        self.config = new
        self._settings_changed()
        self.refit_partial()

    def use_custom_collectives(self, **kw: Any) -> None:
        """Run the all-gather and/or reduce-scatter through FSDP2 ``AllGather`` /
        ``ReduceScatter`` objects (``all_gather=`` / ``reduce_scatter=``; ``None`` restores the
        built-in one). The sub-group all-gather takes the custom all-gather too (as FSDP2's)."""
        for attr in ("comm", "sub_comm"):
            c = getattr(self, attr)
            if c is None or (attr == "sub_comm" and "all_gather" not in kw):
                continue
            ag = kw.get("all_gather", getattr(c, "all_gather_comm", None))
            rs = kw.get("reduce_scatter", getattr(c, "reduce_scatter_comm", None))
            if attr == "sub_comm":
                rs = None
            inner = unwrap(c)
            wrapped = CustomCollectiveComm(inner, all_gather=ag, reduce_scatter=rs, name=self.name)
            setattr(self, attr, inner if ag is None and rs is None else wrapped)
        # A gather in flight went through the old communicator: drop it (it is waited first).
        self.discard_pending()
        self._settings_changed()
        self.refit_partial()

    def use_gather_codecs(self, layout: GroupLayout, slot: GatherSlot) -> None:
        """All-gather through tensor-subclass codecs from now on (``fully_shard``, once):
        ``layout`` describes their all-gather inputs, ``slot`` runs them."""
        self.layout = layout
        self.state = attrs.evolve(self.state, layout=layout)
        self.slot = slot
        self._settings_changed()

    def use_runtime(self, runtime: DeviceRuntime) -> None:
        """Run on ``runtime`` from now on: the root's (its lazy init: one set of streams and
        events per model), or a test's stream-ordering simulator. The group must be idle."""
        self.runtime = runtime
        self.slot.runtime = runtime
        if runtime.checks:
            optimizer_access.watch(self)

    def summon_comm(self) -> Communicator:
        """The shard group's communicator for ``summon_full_params`` (tags of their own)."""
        view = scoped_view(self.comm)
        return self.comm if view is None else view.for_summon()

    def comms(self) -> list[Communicator]:
        """The communicators this group's collectives run on (shard, replicate, sub-group)."""
        return [c for c in (self.comm, self.replicate_comm, self.sub_comm) if c is not None]

    def base_comms(self) -> list[ProcessGroupComm]:
        """The shared process-group communicators this group's collectives run on."""
        return [b for c in self.comms() if (b := base_comm(c)) is not None]

    # ------------------------------------------------------------------ registration

    def register_sharded(self) -> None:
        """Put the sharded DTensor parameters on every holding module."""
        for sp in self.sharded_params:  # ShardedParam.to_sharded, inlined: it runs per step
            p = sp.sharded
            for m, n in sp.holders:
                m._parameters[n] = p

    def register_full(self, tensors: Sequence[torch.Tensor]) -> None:
        """Put full tensors (autograd outputs of the unshard) on every holding module."""
        if self.tp is not None:  # the module sees TP DTensors of the TP-local full tensors
            tensors = self.tp.wrap_full(tensors)
        for t, sp in zip(tensors, self.sharded_params):  # ShardedParam.register, inlined
            for m, n in sp.holders:
                m._parameters[n] = t  # type: ignore[assignment]

    def _set_outputs(self, outputs: Sequence[torch.Tensor] | None) -> None:
        """Record this forward's full outputs on the parameters (``None``: forget them)."""
        if outputs is None:
            self._own_views = None
            for sp in self.sharded_params:
                sp.full = None
        else:
            for sp, t in zip(self.sharded_params, outputs):
                sp.full = t

    def _outputs(self) -> list[torch.Tensor] | None:
        """This forward's full outputs, or ``None`` (the parameters get theirs together)."""
        fulls = [sp.full for sp in self.sharded_params]
        return None if not fulls or fulls[0] is None else fulls  # type: ignore[return-value]

    def _registered_outputs(self) -> Sequence[torch.Tensor] | None:
        """What this forward registered on the modules: a lending group's own views, else
        the outputs (``None`` outside forward and backward)."""
        return self._own_views if self._own_views is not None else self._outputs()

    def owns_full(self, i: int, t: Any) -> bool:
        """Whether ``t`` is this group's own unsharded parameter ``i`` (a view or autograd output)."""
        if not self.slot.live:
            return False
        views = self.views
        return self.sharded_params[i].owns_full(t, views[i] if views else None) or (
            self.tp is not None and self.tp.owns(i, t)
        )

    def refresh_from_modules(self) -> None:
        """Re-adopt the parameters now on the modules (after ``_apply``, e.g. ``to_empty``).

        Rebuilds the packed sharded buffer on the parameters' device and re-points every
        parameter's local tensor into it, so the all-gather input stays zero-copy.
        """
        current: list[Any] = [sp.registered() for sp in self.sharded_params]
        locals_: list[torch.Tensor] = [
            p._local_tensor if isinstance(p, DTensor) else p for p in current
        ]
        device = locals_[0].device if locals_ else self.device
        dtypes = [loc.dtype for loc in locals_]
        if any(d != s.dtype for d, s in zip(dtypes, self.layout.specs)):
            # module.to(dtype) (or another _apply cast) changed the parameters' dtype: train in it.
            specs = [attrs.evolve(s, dtype=d) for s, d in zip(self.layout.specs, dtypes)]
            self._relayout(layout_for(specs, self.layout.world_size, self.mp_policy))
        state = T.pack_locals(locals_, self.layout, self.state.rank, device=device)
        self.state = state
        # The reduction's state goes where the group's tensors live (the group's device).
        self.reduce_state = tree_map(lambda t: t.to(self.device), self.reduce_state)
        for sp, p in zip(self.sharded_params, current):
            sp.adopt(p, state.local(sp.index))
        self._index_params()
        self._grad_accumulator = None
        self.register_sharded()
        self.register_lent_sharded()
        self.free()
        self.slot = self.new_slot()

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
            for p in self._params:
                v += p._version + p._local_tensor._version  # type: ignore[attr-defined]
        except RuntimeError:  # inference tensors have no version counter
            return -1
        return v

    def drop_stale(self) -> int:
        """Forget unsharded data (buffer, gather in flight, post-forward rows) that was
        gathered before the latest write to the sharded parameters; return the shards' current
        :meth:`sharded_version` (read once: dropping reads and frees, it writes no shard)."""
        now = self.sharded_version()
        if self._post_forward_state is not None and self._post_forward_version != now:
            self._post_forward_state = None
        slot = self.slot
        if slot.pending is not None and slot.pending_version != now:
            self.discard_pending()
        if slot.live and slot.version != now:
            self.free()
        return now

    def new_slot(self) -> GatherSlot:
        """A fresh unsharded copy of this group's layout (a functional call gathers into one)."""
        return GatherSlot(self.layout, self.device, self._advise, runtime=self.runtime)

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
        if self._post_forward_state is not None and self.sub_comm is not None:
            self.slot.start(
                self._post_forward_state, self.sub_comm, version=self._post_forward_version
            )
            return
        # CPU offload: the slot copies the shards to the device on the copy-in stream.
        self.slot.start(
            self.state,
            self.comm,
            version=now,
            direct=not self.config.keeps_gather_output,
            stage_to=self.device if self.offload else None,
        )

    @traced("all_gather_copy_out")
    def wait_unshard(self) -> None:
        """Finish the all-gather into the persistent buffer (issuing it first if needed)."""
        now = self.drop_stale()
        if not self.slot.live:
            self.start_unshard(now)
            self.slot.wait(keep_output=self.config.keeps_gather_output)
            self._post_forward_state = None
        self.slot.mark_read("compute", self.name)

    def unshard_onto_modules(self) -> None:
        """Finish the all-gather and put the full parameters on the modules
        (``FSDPModule.unshard``: they stay until resharded)."""
        self._carry_out(self._event(Event.UNSHARD))

    def free(self) -> None:
        """Free the unsharded buffer's storage (views saved by autograd stay valid objects)."""
        self.slot.free()

    def drop_unsharded(self) -> None:
        """Forget every unsharded copy (gather in flight, buffer, post-forward rows): the
        shards were just written (``summon_full_params``' writeback)."""
        self._carry_out(self._event(Event.SHARDS_WRITTEN))

    @traced("reshard")
    def reshard(self) -> None:
        """Drop every unsharded copy and register the sharded parameters (FSDP2's reshard)."""
        self._carry_out(self._event(Event.RESHARD))

    def abandon_in_flight(self) -> None:
        """``reset_iter_state``: drop the collectives a failed step left in flight without
        waiting (a peer may never complete them). Their buffers, the unsharded one included,
        stay referenced until they can no longer land (:mod:`.abandoned`), so a late message
        never lands in freed or reused memory; the group gathers into a fresh buffer from now
        on."""
        self._abandoned.release_landed(self.slot.landings)
        kept = self.slot.abandon()
        if self.pending_reduce is not None:
            kept.append(self.pending_reduce)
        self._abandoned.keep(kept, self.slot.landings)
        self.pending_reduce = None

    def abandon_reduction(self, pending: Any) -> None:
        """A reduction whose finish failed: never finished again, kept referenced (its
        buffers) until its collective is known complete (:mod:`.abandoned`)."""
        self._abandoned.keep([pending], self.slot.landings)

    def discard_pending(self) -> None:
        """Drop an all-gather that was prefetched but not used (it may now be stale)."""
        self.slot.discard()

    # ------------------------------------------------------------------ the life cycle

    # The group's control state is one record, ``self.phase`` (core/lifecycle.py); every
    # phase method below hands the machine an event and carries out the actions it returns
    # (``_carry_out``). Nothing else writes the control state.

    @property
    def training_state(self) -> TrainingState:
        """Where the group is in the iteration (FSDP2's training state; read-only)."""
        return self.phase.stage

    @property
    def ran_forward(self) -> bool:
        """This iteration's forward finished (a forward prefetch skips the group)."""
        return self.phase.ran_forward

    @property
    def ran_post_backward(self) -> bool:
        """This iteration's backward reached the parameters."""
        return self.phase.ran_post_backward

    def _lifecycle_config(self) -> LifecycleConfig:
        """The facts and settings the life cycle reads (rebuilt when they change)."""
        c = self.config
        return LifecycleConfig(
            forward_users=self.forward_users,
            reshard_after_forward=c.reshard_after_forward,
            reshard_after_backward=c.reshard_after_backward,
            unshard_in_backward=c.unshard_in_backward,
            trains=self._trains,
            all_train=all(self._requires_grad),
            lends=self.lends,
            offload=self.offload,
        )

    def lifecycle_config(self) -> LifecycleConfig:
        """The life cycle's settings and facts now (built once per change of settings)."""
        lc = self._lc
        if lc is None:
            lc = self._lc = self._lifecycle_config()
        return lc

    def _settings_changed(self) -> None:
        """A setting, a communicator or the layout changed: rebuild the life cycle's settings
        and forget the answers of the life cycle and the plan (pure functions of them)."""
        self._lc = None
        self._transitions = {}
        self._decided = {}

    def _event(
        self,
        event: Event,
        grad: bool = False,
        force: bool = False,
        keep: bool = False,
        last: bool = True,
        after_backward: bool = False,
    ) -> tuple[Act, ...]:
        """Advance the life cycle by ``event``; return the actions to carry out.

        :func:`~functional_fsdp.core.lifecycle.advance` is pure, so its answers are
        remembered per group: from the second step on, a steady step's events are lookups
        (a group meets a handful of phases), and the step stays on the shell's side.
        """
        key = (self.phase, event, grad, force, keep, last, after_backward)
        known = self._transitions.get(key)
        if known is None:
            known = advance(
                self.phase,
                event,
                self.lifecycle_config(),
                grad=grad,
                force=force,
                keep=keep,
                last=last,
                after_backward=after_backward,
                group=self.name,
            )
            if len(self._transitions) > 1024:  # counters that grow without bound: start over
                self._transitions.clear()
            self._transitions[key] = known
        self.phase, acts = known
        return acts

    def _carry_out(
        self,
        acts: tuple[Act, ...],
        prefetch: Sequence[ParamGroup] = (),
        together: bool = False,
        grads: Sequence[torch.Tensor | None] = (),
    ) -> Any:
        """Run the life cycle's actions in order; return what ``REDUCE_RETURNED`` or the
        outputs actions produced."""
        outputs: Any = None
        for a in acts:
            if a is Act.WAIT_GATHER:
                self.wait_unshard()
            elif a is Act.FREE:
                self.free()
            elif a is Act.REGISTER_SHARDED:
                self.register_sharded()
            elif a is Act.MAKE_OUTPUTS:
                outputs = tuple(UnshardFn.apply(self, *self._params))
                self._set_outputs(outputs)
            elif a is Act.MAKE_PLAIN_OUTPUTS:
                outputs = tuple(v.view_as(v) for v in self.views)
                self._set_outputs(outputs)
            elif a is Act.REUSE_OUTPUTS:
                outputs = tuple(self._outputs() or ())
            elif a is Act.REGISTER_OUTPUTS:
                self.register_full(outputs)
            elif a is Act.OWN_USE:  # a lending group's own modules see views (_own_use)
                outputs = self._own_use(outputs)
            elif a is Act.START_PREFETCH:
                if together:
                    start_together(prefetch)
                else:
                    for g in prefetch:
                        g.start_unshard()
            elif a is Act.HOLD_USE or a is Act.REDUCE_LAST:
                masked = [g if rg else None for g, rg in zip(grads, self._requires_grad)]
                self.reduce_gradients(masked, last_use=a is Act.REDUCE_LAST)
            elif a is Act.REDUCE_RETURNED:
                outputs = tuple(reduce_differentiably(OwnReduction(self), grads))
            else:
                self._CARRY_OUT[a](self)
        return outputs

    def _register_registered(self) -> None:
        outputs = self._registered_outputs()
        if outputs is not None:
            self.register_full(outputs)

    def _register_recompute(self) -> None:
        outputs = self._registered_outputs()
        if (
            outputs is not None
            and torch.is_grad_enabled()
            and self._trains
            and not any(o.requires_grad for o in outputs)
        ):
            # A recording recompute of a module whose forwards did not all run under no_grad,
            # on full tensors that do not record: which forward it repeats is not known here.
            raise UnsupportedError(
                f"group {self.name!r}: an activation checkpoint recomputes a forward that ran "
                "under no_grad (torch.utils.checkpoint(..., use_reentrant=True)) in a module "
                "that also ran with grad in this iteration; its gradients would be lost. Pass "
                "use_reentrant=False (or use the composable checkpoint) for this module"
            )
        if outputs is None and torch.is_grad_enabled() and self._trains:
            # The forward's outputs are gone: another forward and backward through this group
            # ran between the checkpointed forward and its backward (and its end forgot them).
            # The recompute must save what the forward saved, and an operator saves its
            # operands by whether they require grad: stand-ins that do (the same values, their
            # graph unused: the forward's own UnshardFn node takes the gradients).
            outputs = tuple(
                v.detach().requires_grad_(rg) for v, rg in zip(self.views, self._requires_grad)
            )
        self.register_full(outputs if outputs is not None else self.views)

    def _keep_rows(self) -> None:
        """Keep the rows of a ``k``-rank sub-group of the all-gather (``reshard_after_forward=k``)."""
        size = self.config.reshard_after_forward
        if self.slot.output is not None:
            self._post_forward_state = T.post_forward_from_gather(
                self.layout, self.comm.rank, int(size), self.slot.output, self.state
            )
            self._post_forward_version = self.slot.version

    def _forget_rows(self) -> None:
        self._post_forward_state = None

    def _host_may_write(self) -> None:
        # The host writes the offloaded shards next (a CPU optimizer step): the copies to the
        # device that read them must be done.
        ordering.host_may_write_shards(self.runtime)

    def _abandon_iteration(self) -> None:
        self.abandon_in_flight()
        self.drop_failed_gradients()

    def start_iteration(self) -> None:
        """The root's forward begins: no forward or backward has reached this group in this
        iteration."""
        self._carry_out(self._event(Event.START_ITERATION))

    def pre_forward(self, prefetch: Sequence[ParamGroup], *, together: bool = False) -> None:
        """Unshard (consuming a prefetch), start the ``prefetch`` groups' all-gathers (in one
        collective where they can travel together, with ``together``: the next bucket), and
        put this forward's full parameters on the modules (autograd outputs whose backward
        reduces the gradients). Nothing when another module of a ``fully_shard([m1, m2])``
        group already did it in this forward."""
        self._carry_out(
            self._event(Event.PRE_FORWARD, grad=torch.is_grad_enabled()), prefetch, together
        )

    def unshard_for_recompute(self, *, reentrant: bool = False) -> None:
        """A forward inside backward (activation-checkpoint recompute): only make sure the
        full parameters are on the modules (this forward's outputs, else the buffer's views).
        ``reentrant``: the module's forwards all ran under no_grad and this one records (a
        reentrant checkpoint): the recompute is a use of its own, whose backward reduces."""
        self._carry_out(self._event(Event.REENTRANT_RECOMPUTE if reentrant else Event.RECOMPUTE))

    def post_forward(self, *, force_reshard: bool = False, keep: bool = False) -> None:
        """A module of this group finished its forward; after the last one, reshard as
        configured (fully with ``force_reshard``: the root with no backward to serve; not at
        all with ``keep``: the backward that follows needs it first), put the sharded
        parameters back on the modules and go idle.

        The sharded DTensors go back on the modules after every forward, also where the
        unsharded buffer stays for the backward (the root): ``model.parameters()`` are then
        always the tensors the optimizer, clipping, EMA and autograd.grad must see. FSDP2
        leaves the unsharded tensors registered, and those silently take local-only gradients
        and updates that are lost (docs/fsdp2_mapping.md)."""
        self._carry_out(self._event(Event.POST_FORWARD, force=force_reshard, keep=keep))

    def forward_ends(self) -> None:
        """The root's forward ended: a ``fully_shard([m1, m2])`` group whose modules did not
        each finish it once is closed as by its last module's post-forward."""
        self._carry_out(self._event(Event.FORWARD_ENDS))

    def pre_backward(self) -> None:
        """The backward reaches this group's outputs: all-gather again (unless
        ``unshard_in_backward`` is off) and put this forward's full parameters back."""
        if self._backward_task is None:
            self._backward_task = torch._C._current_graph_task_id()
        self._carry_out(self._event(Event.PRE_BACKWARD))

    def prefetch_for_backward(self) -> None:
        """Start the all-gather another group's backward prefetches (unless this group's
        backward already ran or does not unshard)."""
        self._carry_out(self._event(Event.PREFETCH_FOR_BACKWARD))

    def unshard_backward(
        self, grads: Sequence[torch.Tensor | None], made_in_forward: bool = True
    ) -> tuple[Any, ...]:
        """:class:`~.autograd.UnshardFn`'s backward: reduce the full gradients into ``.grad``
        (:meth:`post_backward`), or return them reduced while ``torch.autograd.grad`` runs
        (kept unsharded under ``create_graph=True``: the double backward reads them).

        ``made_in_forward``: the full tensors were made by the forward (not by a recompute
        inside the backward). Their gradients arriving in a nested backward (a reentrant
        checkpoint of a submodule: its recompute read them) are part of that use's: held for
        the use's own backward, the parameters left full for the next recompute."""
        if self.gradients_captured():
            acts = self._event(Event.RETURNED_BACKWARD, grad=torch.is_grad_enabled())
            return self._carry_out(acts, grads=grads)
        task = self._backward_task
        if made_in_forward and task is not None and torch._C._current_graph_task_id() != task:
            self._carry_out(self._event(Event.PARTIAL_BACKWARD), grads=grads)
        else:
            self.post_backward(grads)
        return (None,) * len(grads)

    @traced("post_backward")
    def post_backward(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Reduce (or accumulate, without sync) the full gradients; reshard after backward."""
        self._carry_out(self._event(Event.POST_BACKWARD), grads=grads)

    def finish_backward(self, is_last_backward: bool) -> None:
        """The root's final callback: finish the reduction (the last backward of an
        iteration; otherwise it overlaps the next micro-batch), reshard and go idle."""
        self._backward_task = None
        self._carry_out(self._event(Event.FINAL_CALLBACK, last=is_last_backward))

    def reset_iter_state(self) -> None:
        """``reset_iter_state``: abandon in-flight work, drop the failed iteration's
        unsharded gradients (no-sync), reshard and go idle."""
        self._backward_task = None
        self._carry_out(self._event(Event.RESET))

    def settle(self) -> None:
        """FSDP2's ``post_backward()`` called outside autograd on a group whose reproducible
        tree reduces by itself: only reshard after backward (as configured)."""
        self._carry_out(self._event(Event.SETTLE))

    def enter_summon(self) -> None:
        """``summon_full_params`` opens over this group."""
        self._carry_out(self._event(Event.ENTER_SUMMON))

    def exit_summon(self) -> None:
        """``summon_full_params`` closes: the sharded parameters are back, the group is idle."""
        self._carry_out(self._event(Event.EXIT_SUMMON))

    # ------------------------------------------------------------------ coalescing

    def sharing_facts(self) -> SharingFacts:
        """What decides whether this group's all-gather may share a bucket now
        (:func:`~functional_fsdp.core.plan.gathers_together`)."""
        return SharingFacts(
            world_size=self.comm.world_size,
            coalesces=coalesces(self.comm),
            offload=self.offload,
            codecs=self.slot.codecs is not None,
            keeps_rows=self.config.keeps_gather_output
            or (self._post_forward_state is not None and self.sub_comm is not None),
            lends=self.lends,
            forward_users=self.forward_users,
        )

    def coalesce_gather(self) -> tuple[GatherSlot, ShardedState, int] | None:
        """What a bucket's one all-gather needs from this group (its slot, its shards and
        their version), or ``None`` when this group gathers alone now: already unsharded or in
        flight, tensor-subclass codecs, CPU offload, rows kept for ``reshard_after_forward=k``,
        custom collectives, or one rank."""
        rows = self._post_forward_state is not None and self.sub_comm is not None
        shares = self._decided.get(rows)
        if shares is None:  # the other facts change only with the settings
            shares = self._decided[rows] = gathers_together(self.sharing_facts())
        if not shares:
            return None
        now = self.drop_stale()
        if not self.slot.ready_to_coalesce():
            return None
        return self.slot, self.state, now

    # ------------------------------------------------------------------ copies

    def clone(self, holders: Sequence[Holders], lent: Sequence[Holders] = ()) -> ParamGroup:
        """An independent copy of this idle group for ``copy.deepcopy``: its own sharded buffer
        (cloned), parameters registered on ``holders`` (the copied modules) and lent to
        ``lent`` (the copied modules of other groups that use them), the same mesh and
        communicators (process-group handles, not state), the reduction settings, and copies
        of the sharded gradients and of the reduction's state (the no-sync gradients held
        there included)."""
        offload = CPUOffloadPolicy() if self.offload else OffloadPolicy()
        settings = {k: getattr(self.config, k) for k in _COPIED_SETTINGS}
        new = ParamGroup(
            self.layout,
            tree_map(torch.clone, self.state),  # the shards and sharded gradients, copied
            holders,
            self._requires_grad,
            mesh=self.mesh,
            comm=self.comm,
            replicate_comm=self.replicate_comm,
            sub_comm=self.sub_comm,
            device=self.device,
            mp_policy=self.mp_policy,
            offload_policy=offload,
            name=self.name,
            tp=self.tp,
            config=GroupConfig(**settings),
            forward_users=self.forward_users,
        )
        for i, users in enumerate(lent):
            if users:
                new.lend(i, users)
        # The reduction's state (held no-sync gradients, residual, partial sum): copied.
        new.reduce_state = tree_map(torch.clone, self.reduce_state)
        for old_p, new_p in zip(self._params, new._params):
            if old_p.grad is not None:
                new_p.grad = old_p.grad.detach().clone()
        return new


# The actions ``ParamGroup._carry_out`` runs by a method of no arguments.
ParamGroup._CARRY_OUT = {
    Act.RELEASE_LANDED: lambda g: g._abandoned.release_landed(g.slot.landings),
    Act.START_GATHER: lambda g: g.start_unshard(),
    Act.REGISTER_REGISTERED: ParamGroup._register_registered,
    Act.REGISTER_RECOMPUTE: ParamGroup._register_recompute,
    Act.REGISTER_VIEWS: lambda g: g.register_full(g.views),
    Act.REGISTER_LENT_SHARDED: ParamGroup.register_lent_sharded,
    Act.KEEP_ROWS: ParamGroup._keep_rows,
    Act.DISCARD_PENDING: ParamGroup.discard_pending,
    Act.FORGET_OUTPUTS: lambda g: g._set_outputs(None),
    Act.FORGET_ROWS: ParamGroup._forget_rows,
    Act.CLOSE_USES: ParamGroup.close_uses,
    Act.FINISH_REDUCE: ParamGroup.finish_reduce,
    Act.HOST_MAY_WRITE: ParamGroup._host_may_write,
    Act.ABANDON: ParamGroup._abandon_iteration,
}
