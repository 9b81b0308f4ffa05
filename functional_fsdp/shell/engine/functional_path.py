"""The functional path: forward and backward through the parameters the caller passes.

``torch.func.functional_call(model, params, args)`` registers ``params`` on the holder modules
for the duration of the call. The ordinary shell ignores them (it all-gathers the group's own
shards), which is what torch FSDP2 does too. Here, when the root's forward starts and any managed
parameter slot holds something other than the group's own parameter (or a ``torch.func``
transform is active), the whole forward takes this path: every group all-gathers *the tensors
registered on its modules*, through an autograd Function whose backward reduce-scatters the
gradients and **returns** them as sharded ``DTensor`` s (instead of setting ``.grad``), so
``torch.autograd.grad``, ``torch.func.grad`` and ``torch.func.vjp`` see them.

Memory behaves as in the shell: each call gathers into one fresh buffer per group; after the
group's forward the buffer's storage is freed (``reshard_after_forward``; the root keeps it), a
hook on the group's outputs gathers it again just before the group's backward (and starts the
previous group's re-gather, as the shell prefetches), and the reduction frees it again.

Per-call state lives in :class:`GatherCall` records owned by the autograd graph (and by the
``FSDPState`` only between the group's pre- and post-forward), never in module-level globals.
A call's control state is the group life cycle's (:mod:`functional_fsdp.core.lifecycle`): each
call holds its own :class:`~functional_fsdp.core.lifecycle.Phase` (the group's stays idle), the
hooks hand it the same events the module path hands a group, and the call carries out the
actions on its buffer (gather, prefetch, free, register); a tied weight's other uses are the
machine's lent uses (:class:`~.tied.LentCall`).

The root's hooks enter and leave this path in :mod:`functional_fsdp.shell.api.functional_call`
(two small branches in ``shell/api/state.py``); nothing else in the shell knows about it.

Transforms (each claim is a test in ``tests/functional/test_functional_step.py``; see
``docs/functional.md``): ``grad`` and ``vjp`` w.r.t. the parameters, and ``grad``, ``jvp`` and
``vmap`` w.r.t. the inputs work. ``vmap`` over the sharded parameters, batched gradients
(``jacrev``, ``vmap(grad(...))``) and higher-order derivatives raise ``NotImplementedError``
here; forward-mode AD w.r.t. the parameters (``jvp``, ``jacfwd``, ``hessian``) is refused by
``DTensor`` itself (torch 2.13 has no forward-AD support for ``DTensor`` primals).

Speed: the next group's all-gather is issued when a group's forward starts (plain ``DTensor``
sources; under a transform the sources are wrapped until the Function runs), backward re-gathers
are prefetched one group ahead, and :class:`DeferredReductions` lets a caller that owns the
gradients (the functional training step) overlap the reduce-scatters with the rest of backward.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import attrs
import torch
from torch.distributed.tensor import DTensor

from ...core import layout as L
from ...core import transitions as T
from ...core.errors import UnsupportedError
from ...core.lifecycle import Act, Event, LifecycleConfig, Phase, Stage, advance
from ...core.records import ShardedState
from ...core.reduction import NO_REDUCE_STATE
from ..device.runtime import DeviceRuntime
from . import ordering
from .autograd import GatherFn
from .gather import GatherSlot
from .group import ParamGroup
from .group_common import profiled
from .param import ShardedParam
from .reproducible import TreeReductions

__all__ = [
    "DeferredReductions",
    "FunctionalForward",
    "GatherCall",
    "Prefetch",
    "check_sources",
    "pack_sources",
    "refuse_functional_sources",
    "registered_sources",
    "substituted",
]


def substituted(group: ParamGroup) -> bool:
    """Whether any parameter slot of ``group`` holds a tensor other than the group's own."""
    for sp in group.sharded_params:
        slot = sp.registered()
        # After FSDPModule.unshard() (or a forward that kept the group unsharded) the group's
        # own full parameters sit in the slots.
        if slot is not sp.sharded and not group.owns_full(sp.index, slot):
            return True
    return False


def registered_sources(group: ParamGroup) -> list[Any]:
    """The tensors registered on ``group``'s modules now (the caller's, in a functional call)."""
    return [sp.registered() for sp in group.sharded_params]


def refuse_functional_sources(group: ParamGroup) -> None:
    """Raise :class:`UnsupportedError` (before any collective) when ``group`` uses a feature
    the functional path (``functional_call``, ``torch.func``, the functional step) cannot run
    on caller-passed tensors: tensor-subclass all-gather hooks, compressed reduction."""
    if group.layout.codec_inputs is not None:
        raise UnsupportedError(
            f"group {group.name!r} all-gathers tensor subclasses through their "
            "fsdp_pre_all_gather / fsdp_post_all_gather hooks, which functional_call / "
            "torch.func / the functional step do not run yet; train it with the module path "
            "(loss.backward()), or use plain parameters for the functional path"
        )
    if group.config.grad_compression is not None:
        raise UnsupportedError(
            f"group {group.name!r} compresses its gradient reduction "
            "(set_gradient_compression), whose error-feedback residual is state that "
            "functional_call / torch.func / the functional step do not carry yet; call "
            "set_gradient_compression(None) on the model, or train it with the module "
            "path (loss.backward())"
        )


class FunctionalForward:
    """The root's record of one functional forward: gathers in order, prefetches in flight."""

    __slots__ = ("calls", "prefetched")

    def __init__(self) -> None:
        self.calls: list[GatherCall] = []
        self.prefetched: dict[object, Prefetch] = {}  # by the FSDP state of the target

    def drain(self) -> None:
        """Wait for prefetched all-gathers nobody consumed (every rank issued them)."""
        for pre in self.prefetched.values():
            pre.slot.discard()
        self.prefetched.clear()


class Prefetch:
    """An all-gather issued ahead of a group's forward from the sources then registered."""

    __slots__ = ("sharded", "slot", "sources")

    def __init__(self, sources: tuple[Any, ...], sharded: ShardedState, slot: GatherSlot) -> None:
        self.sources = sources
        self.sharded = sharded
        self.slot = slot


class DeferredReductions:
    """Opt-in overlap of gradient reductions with the rest of backward.

    Tag the tensors passed to ``functional_call`` with :meth:`tag`; groups whose sources are
    tagged start their reduce-scatter asynchronously in backward and return sharded gradients
    whose data is filled in by :meth:`wait`. Read the gradients only after :meth:`wait`, and
    only when each tagged tensor receives its gradient through ``torch.autograd.grad`` (no
    ``.grad`` accumulation, no tensor hooks): that is how the functional training step uses it.

    A group used more than once in the forward (a module called twice) reduces once per use,
    and autograd adds the uses' gradients as soon as the later one arrives: only its first
    reduction is deferred; a later one first lands every reduction in flight (:meth:`first`)
    and then reduces synchronously, so autograd adds landed values.
    """

    __slots__ = ("_pending", "_seen")

    ATTR = "_ffsdp_deferred_reductions"

    def __init__(self) -> None:
        self._pending: list[tuple[T.PendingReduce, list[torch.Tensor | None], DeviceRuntime]] = []
        self._seen: set[int] = set()  # id() of the groups that reduced in this backward

    def first(self, group: object) -> bool:
        """Whether this is ``group``'s first reduction since the last :meth:`wait` (it may be
        deferred); otherwise land every reduction in flight now (autograd is about to add
        this use's gradients to an earlier use's)."""
        if id(group) not in self._seen:
            self._seen.add(id(group))
            return True
        self._land()
        return False

    def tag(self, tensors: Sequence[torch.Tensor]) -> None:
        """Mark ``tensors`` (the parameters a forward will use) as deferring into ``self``."""
        for t in tensors:
            setattr(t, self.ATTR, self)

    def add(
        self,
        pending: T.PendingReduce,
        results: list[torch.Tensor | None],
        runtime: DeviceRuntime,
    ) -> None:
        """Record a reduction in flight (issued on ``runtime``'s streams) and the tensors its
        results must land in."""
        self._pending.append((pending, results, runtime))

    def wait(self) -> None:
        """Finish every reduction in flight (in issue order); the next backward starts anew."""
        self._land()
        self._seen.clear()

    def _land(self) -> None:
        pending, self._pending = self._pending, []
        for p, results, runtime in pending:
            new = ordering.finish_reduce(runtime, p)[0]
            for i, dst in enumerate(results):
                src = new.local_grad(i)
                if dst is None:
                    continue
                if src is None:  # no rank had it (see _deferred_results)
                    dst.zero_()
                    continue
                if src.data_ptr() != dst.data_ptr() or src.stride() != dst.stride():
                    dst.copy_(src)


# ------------------------------------------------------------------------------ the gather


class GatherCall:
    """One group's gather during one functional forward (owned by that forward's graph).

    Its control state is a life-cycle :class:`~functional_fsdp.core.lifecycle.Phase`:
    :meth:`event` advances it and carries out the actions on the call's buffer (the others are
    its callers', listed in :data:`CALLERS_ACTS`).

    Attributes:
        group: the group's runtime (layout, communicators, specs).
        forward: the functional forward this gather belongs to (until its post-forward).
        sources: the caller's tensors the first gather reads (then forgotten).
        restore: the tensors the group's own forward replaced on its modules (put back at
            its post-forward).
        fulls: the full parameters (:class:`~.autograd.GatherFn`'s outputs), made by the
            call's first gather.
        phase: the call's life cycle.
        sharded: the sources' shards packed as a :class:`ShardedState` (the gather input, kept
            for the re-gather in backward and the reduction's layout).
        slot: the engine's unsharded copy of ``sharded`` for this call (a buffer per call,
            storage freed when resharded); ``None`` when nothing is gathered.
        deferred: where reductions go when the sources were tagged by
            :class:`DeferredReductions` (``None``: reduce synchronously).
    """

    __slots__ = (
        "config",
        "create_graph",
        "deferred",
        "forward",
        "fulls",
        "group",
        "is_root",
        "phase",
        "prefetch",
        "prev",
        "restore",
        "sharded",
        "slot",
        "source_ids",
        "sources",
        "tree",
    )

    def __init__(
        self,
        group: ParamGroup,
        forward: FunctionalForward | None,
        sources: tuple[Any, ...] = (),
        prefetch: Prefetch | None = None,
    ) -> None:
        self.group = group
        self.forward = forward
        self.prev: GatherCall | None = forward.calls[-1] if forward and forward.calls else None
        self.sources: tuple[Any, ...] = sources
        self.restore: tuple[Any, ...] = ()
        self.fulls: tuple[torch.Tensor, ...] | None = None
        self.sharded: ShardedState | None = None
        self.slot: GatherSlot | None = None
        self.prefetch: Prefetch | None = prefetch
        self.deferred: DeferredReductions | None = None
        # ReproduciblePolicy in the functional step: the sources' TreeReductions (and their
        # identities, which name where each reduced gradient goes).
        self.tree: TreeReductions | None = None
        self.source_ids: tuple[int, ...] = ()
        self.is_root = False
        # Set by a backward run with create_graph=True: the reduction is recorded for double
        # backward (its adjoint is an all-gather) and the full parameters stay for it.
        self.create_graph = False
        self.phase = Phase()
        # The group's settings and facts, but each call: one module's forward, freed fully (a
        # sub-group's rows are the module path's), gathered again for its backward.
        self.config = attrs.evolve(
            group.lifecycle_config(),
            forward_users=1,
            reshard_after_forward=group.config.reshard_after_forward is not False,
            unshard_in_backward=True,
            offload=False,
        )

    @property
    def requires_grad(self) -> tuple[bool, ...]:
        """Per parameter, whether it trains (the group's)."""
        return self.group.requires_grad

    def event(self, e: Event, **facts: bool) -> tuple[Act, ...]:
        """Advance the call's life cycle by ``e`` and carry out the actions on its buffer, in
        order; returns the actions (those in :data:`CALLERS_ACTS` are the caller's)."""
        self.phase, acts = _advance(self.phase, e, self.config, self.group.name, **facts)
        for a in acts:
            carry = _CARRY_OUT.get(a)
            if carry is not None:
                carry(self)
            elif a not in CALLERS_ACTS:
                raise AssertionError(f"the functional path has no way to {a.value} ({a.name})")
        return acts

    # the actions on the call's buffer

    def _wait_gather(self) -> None:
        """The full parameters, live: the first gather makes them (through the autograd
        Function, whose forward runs :meth:`gather`); later ones gather into the same buffer
        again when it was freed."""
        if self.fulls is None:
            self.fulls = tuple(GatherFn.apply(self, *self.sources))
            self.sources = ()
        elif self.slot is not None and self.sharded is not None:
            with torch._C._DisableFuncTorch():
                self.slot.gather(self.sharded, self.group.comm)
            self.slot.mark_read(self._reader(), self.group.name)

    def _start_gather(self) -> None:
        """Issue the re-gather (async) unless the buffer is live or one is in flight."""
        if self.slot is not None and self.sharded is not None:
            with torch._C._DisableFuncTorch():
                self.slot.start(self.sharded, self.group.comm)

    def _free(self) -> None:
        """Free the buffer's storage (views saved by autograd stay valid objects)."""
        if self.slot is not None:
            self.slot.free()

    def _register_outputs(self) -> None:
        assert self.fulls is not None
        self.group.register_full(self.fulls)

    def _register_sources(self) -> None:
        """The caller's tensors back on the modules (once: the forward's end)."""
        for sp, src in zip(self.group.sharded_params, self.restore):
            sp.register(src)
        self.restore = ()

    def _reader(self) -> str:
        backward = self.phase.stage in (Stage.PRE_BACKWARD, Stage.POST_BACKWARD)
        return "the functional backward" if backward else "the functional forward"

    # forward

    def gather(self, sources: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """All-gather the (unwrapped) sources into this call's slot; return the full params
        (:class:`~.autograd.GatherFn`'s forward)."""
        refuse_functional_sources(self.group)
        with profiled(lambda: f"FSDP::all_gather ({self.group.name})"):
            return self._gather(sources)

    def _gather(self, sources: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        g = self.group
        pre, self.prefetch = self.prefetch, None
        if pre is not None and all(a is b for a, b in zip(pre.sources, sources)):
            self.sharded, self.slot = pre.sharded, pre.slot
        else:
            if pre is not None:
                pre.slot.discard()
            self.sharded, self.slot = pack_sources(g, sources), g.new_slot()
        tags = [getattr(s, DeferredReductions.ATTR, None) for s in sources]
        if tags and all(t is tags[0] for t in tags):
            self.deferred = tags[0]
        trees = [getattr(s, TreeReductions.ATTR, None) for s in sources]
        if trees and trees[0] is not None and all(t is trees[0] for t in trees):
            self.tree, self.source_ids = trees[0], tuple(id(s) for s in sources)
        with torch._C._DisableFuncTorch():
            # Plain tensors only (the sources were unwrapped): a torch.func transform must not
            # see the collective's writes into this call's buffer as mutations of its inputs.
            self.slot.gather(self.sharded, g.comm)
            self.slot.mark_read("the functional forward", g.name)
            return tuple(v.view_as(v) for v in self.slot.views)

    def end_forward(self, saved: bool) -> None:
        """The group's forward ended: the caller's tensors back on its modules; reshard (as
        configured, unless another group's use of a tied weight still reads the buffer), or
        keep the buffer when nothing was ``saved`` for backward (outputs may alias it)."""
        self.forward = None
        self.event(Event.POST_FORWARD, keep=not saved)

    # backward

    def start_regather(self) -> None:
        """Another group's backward prefetches this one: issue the re-gather."""
        self.event(Event.PREFETCH_FOR_BACKWARD)

    def pre_backward_hook(self, _grad: Any) -> None:
        """Before this group's backward: gather again; prefetch the previous group's re-gather."""
        self.event(Event.PRE_BACKWARD)
        if self.prev is not None and not self.prev.is_root:
            self.prev.start_regather()

    def reduce(self, grads: Sequence[torch.Tensor | None]) -> tuple[DTensor | None, ...]:
        """Reduce-scatter full gradients; the sharded gradients as ``DTensor`` s (``None`` kept)."""
        g = self.group
        assert self.sharded is not None
        grads = g.trained(grads)
        # Frees first (reshard_after_backward, not under create_graph=True): the gradients
        # are separate tensors; then REDUCE_RETURNED, carried out below.
        self.event(Event.RETURNED_BACKWARD, grad=self.create_graph)
        if not any(gr is not None for gr in grads):
            return (None,) * len(grads)
        if self.tree is not None and not self.create_graph:
            # The canonical tree: accumulated here, reduced once by the step after its last
            # micro-batch (TreeReductions.finish); autograd gets no gradient now.
            self.tree.push(g, self.sharded, self.source_ids, grads)
            return (None,) * len(grads)
        deferred = None if self.create_graph else self.deferred
        if deferred is not None and deferred.first(g):
            pending = g.begin_reduce(
                grads,
                self.sharded,
                reduce_state=NO_REDUCE_STATE,
                async_op=True,
                all_reduce=True,
            )
            locals_ = _deferred_results(pending, g.requires_grad)
            deferred.add(pending, locals_, g.runtime)
        else:
            # The functional path's reduction starts from no state and keeps none: compression
            # refuses it, and a partial sum a module-path backward kept (HSDP without the
            # all-reduce) stays the module's.
            locals_ = g.reduce_now(grads, self.sharded, own=False)
        return g.sharded_grads(locals_)

    def gather_cotangents(self, cotangents: Sequence[Any]) -> tuple[torch.Tensor, ...]:
        """The adjoint of :meth:`reduce` (an all-gather, for a double backward)."""
        return self.group.gather_cotangents(cotangents)


@functools.lru_cache(maxsize=4096)
def _advance(
    phase: Phase,
    e: Event,
    config: LifecycleConfig,
    name: str,
    grad: bool = False,
    keep: bool = False,
    after_backward: bool = False,
) -> tuple[Phase, tuple[Act, ...]]:
    """:func:`~functional_fsdp.core.lifecycle.advance`, remembered (it is pure: a steady
    functional step looks its transitions up, as a group's own table does)."""
    return advance(
        phase, e, config, grad=grad, keep=keep, after_backward=after_backward, group=name
    )


#: The actions a call carries out itself, on its buffer and its modules.
_CARRY_OUT = {
    Act.WAIT_GATHER: GatherCall._wait_gather,
    Act.START_GATHER: GatherCall._start_gather,
    Act.FREE: GatherCall._free,
    Act.REGISTER_OUTPUTS: GatherCall._register_outputs,
    Act.REGISTER_SHARDED: GatherCall._register_sources,
}
#: The actions the functional path's callers carry out, or that have nothing to do on a call:
#: the full tensors are :class:`~.autograd.GatherFn`'s outputs, made at the first gather and
#: shared by every use (no outputs to make, reuse or wrap, no registration for a recompute: it
#: reads what autograd saved); the next group's prefetch is ``functional_call``'s; the
#: reduction returned to autograd is :meth:`GatherCall.reduce`'s.
CALLERS_ACTS = frozenset(
    {
        Act.START_PREFETCH,
        Act.MAKE_OUTPUTS,
        Act.MAKE_PLAIN_OUTPUTS,
        Act.REUSE_OUTPUTS,
        Act.OWN_USE,
        Act.REGISTER_REGISTERED,
        Act.REDUCE_RETURNED,
    }
)


def _deferred_results(
    pending: T.PendingReduce, requires_grad: Sequence[bool]
) -> list[torch.Tensor | None]:
    """Where :meth:`DeferredReductions.wait` puts each sharded gradient: views of the
    reduce-scatter output when ``finish_reduce`` will return exactly those (same dtype, no
    post-division, no replica all-reduce), fresh tensors otherwise.

    A trainable parameter without a gradient here gets one too when the reduction carries
    presence flags: another rank may have had it, and which land is known only once the
    reduction did (``core.reduction.agreed_present``); where no rank had it, the tensor is
    zeros (:meth:`DeferredReductions.wait`). Whether a reduction is deferred must not depend
    on this rank's gradients: the ranks would run the replicas' all-reduces in other orders."""
    sharded, out = pending.sharded, pending.output
    lay = sharded.layout
    direct = (
        pending.replicate_comm is None
        and (pending.factors.post is None or pending.factors.post == 1)
        and all(s.dtype == out.dtype for s in lay.specs)
    )
    results: list[torch.Tensor | None] = []
    off = 0
    for i, spec in enumerate(lay.specs):
        n = L.prod(lay.shard_shapes[i])
        if not pending.present[i] and not (pending.flagged and requires_grad[i]):
            results.append(None)
        else:
            length = lay.extent(i, sharded.rank)[1]
            if direct:
                full = out.narrow(0, off, n).view(lay.shard_shapes[i])
            else:
                full = torch.empty(lay.shard_shapes[i], dtype=spec.dtype, device=out.device)
            results.append(full.narrow(lay.shard_dims[i], 0, length))
        off += n
    return results


def _local(group: ParamGroup, t: torch.Tensor, sp: ShardedParam) -> torch.Tensor:
    if isinstance(t, DTensor):
        mesh = sp.dtensor_spec.mesh
        if tuple(t.placements) != tuple(sp.placements) or t.device_mesh != mesh:
            raise ValueError(
                f"functional_call on a sharded module: the tensor for {sp.fqn!r} of {group.name} has placements "
                f"{tuple(t.placements)} on {t.device_mesh}; it must have the placement of the "
                f"module's own parameter, {tuple(sp.placements)} on {mesh}"
            )
        return t._local_tensor
    raise TypeError(
        f"functional_call on a sharded module: the tensor for {sp.fqn!r} of {group.name} is a "
        f"{type(t).__name__}; pass a DTensor with the placement of the module's own parameter "
        f"({tuple(sp.placements)}), e.g. a detached copy of model.get_parameter({sp.fqn!r})"
    )


def check_sources(group: ParamGroup, sources: Sequence[Any]) -> None:
    """Raise ``TypeError`` / ``ValueError`` naming the parameter when a source is not a tensor
    of the parameter's global shape and sharding (before any collective)."""
    for src, sp in zip(sources, group.sharded_params):
        spec = sp.spec
        if not isinstance(src, torch.Tensor):
            raise TypeError(
                f"functional_call on a sharded module: {spec.fqn!r} of {group.name} is a {type(src).__name__}"
            )
        shape = spec.global_shape or spec.shape  # under TP: the global, not the TP-local, shape
        if tuple(src.shape) != shape:
            raise ValueError(
                f"functional_call on a sharded module: the tensor for {spec.fqn!r} of {group.name} has shape "
                f"{tuple(src.shape)}, the parameter's global shape is {shape}"
            )
        if isinstance(src, DTensor) or not _functorch_wrapped(src):
            _local(group, src, sp)  # raises for a wrong placement or a plain tensor


def _functorch_wrapped(t: torch.Tensor) -> bool:
    return torch._C._functorch.is_functorch_wrapped_tensor(
        t
    ) or torch._C._functorch.is_batchedtensor(t)


def pack_sources(group: ParamGroup, sources: Sequence[torch.Tensor]) -> ShardedState:
    """The sources' local shards packed in the group's storage layout (zero-copy when they are
    the group's own parameters)."""
    if all(s is p for s, p in zip(sources, group.params)):
        return group.state
    locals_ = [_local(group, s, sp) for s, sp in zip(sources, group.sharded_params)]
    device = locals_[0].device if locals_ else group.device
    return T.pack_locals(locals_, group.layout, group.state.rank, device=device)
