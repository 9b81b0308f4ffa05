"""A parameter group's life cycle as a pure state machine.

A group's control state is one frozen record, :class:`Phase`: its stage in the iteration
(FSDP2's training states), what it holds (:class:`Storage`) and the counters of this
iteration's uses. PyTorch's hooks hand the shell *events* (:class:`Event`: a forward begins, a
backward reaches the parameters, the final callback, ...); :func:`advance` maps
``(phase, event, config)`` to the next phase and the *actions* the shell carries out (start or
wait an all-gather, register the full or the sharded parameters, free the buffer, reduce, ...).
Nothing here touches a tensor: the machine is tested in one process, over any sequence of
events (``tests/core/test_lifecycle.py`` model-checks it with hypothesis), and the shell's
``ParamGroup`` is its interpreter: it holds the phase, calls :func:`advance` and runs the actions
in order.

An event the machine cannot take in its stage (a ``post_forward`` with no forward open, leaving
``summon_full_params`` that was never entered) raises :class:`~.errors.LifecycleError`, naming
the group, its stage and the events that stage accepts, before any action runs.

What the machine decides is *when*; the data layer decides *whether the bytes are there*: a
``WAIT_GATHER`` on a group the machine holds unsharded still re-gathers when the shards were
written since (an optimizer step between forward and backward), and a ``FREE`` of a buffer
already freed costs nothing.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, Final

import attrs

from .errors import LifecycleError

__all__ = [
    "Act",
    "Event",
    "LifecycleConfig",
    "Phase",
    "RootAct",
    "RootEvent",
    "RootPhase",
    "Stage",
    "Storage",
    "advance",
    "advance_root",
]


class Stage(enum.Enum):
    """Where a group is in an iteration (FSDP2's ``TrainingState``; FSDP1's summon state)."""

    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"
    SUMMON_FULL_PARAMS = "summon_full_params"


class Storage(enum.Enum):
    """What the group holds of its parameters, as the life cycle sees it.

    ``SHARDED``: only the shards (a prefetched all-gather may be in flight: that is the
    communication plan's, not a change of life cycle). ``UNSHARDED``: the full parameters, for
    the forward or backward running now, for another group's use of a tied weight, or held by
    an explicit ``unshard()``. ``KEPT``: the full parameters kept after the forward for the
    backward (``reshard_after_forward=False``, the root) or after a ``create_graph=True``
    backward for a double backward. ``ROWS``: the rows of a ``k``-rank sub-group kept after
    the forward (``reshard_after_forward=k``); the backward gathers from them.
    """

    SHARDED = "sharded"
    UNSHARDED = "unsharded"
    KEPT = "kept"
    ROWS = "rows"


class Act(enum.Enum):
    """What the shell does for an event, in the order :func:`advance` lists them."""

    RELEASE_LANDED = "release the abandoned work that has landed"
    WAIT_GATHER = "finish (or issue and finish) the all-gather into the unsharded buffer"
    START_PREFETCH = "start the all-gathers the hook passed to prefetch"
    START_GATHER = "issue this group's all-gather (a prefetch), unless in flight or unsharded"
    MAKE_OUTPUTS = "make this iteration's full tensors (autograd outputs of the unshard)"
    MAKE_PLAIN_OUTPUTS = "make this iteration's full tensors as plain views (no gradient)"
    REUSE_OUTPUTS = "take this iteration's full tensors, made by an earlier use"
    OWN_USE = "wrap a lending group's own use (its end may free before the tied users')"
    REGISTER_OUTPUTS = "put this forward's full tensors on the modules"
    REGISTER_REGISTERED = "put the open forward's full tensors back on the modules, if any"
    REGISTER_RECOMPUTE = "put full tensors for an activation-checkpoint recompute"
    REGISTER_VIEWS = "put the unsharded buffer's views on the modules (unshard())"
    REGISTER_SHARDED = "put the sharded DTensor parameters on the modules"
    REGISTER_LENT_SHARDED = "put the sharded parameters on the other groups' tied modules too"
    KEEP_ROWS = "keep the sub-group's rows of the all-gather (reshard_after_forward=k)"
    FREE = "free the unsharded buffer's storage"
    DISCARD_PENDING = "drop an all-gather prefetched and not used"
    FORGET_OUTPUTS = "forget this iteration's full tensors"
    FORGET_ROWS = "forget the sub-group's rows"
    HOLD_USE = "hold the gradients of a use that is not the micro-batch's last"
    REDUCE_LAST = (
        "reduce (or accumulate: sync off) the micro-batch's gradients at its last use, the "
        "held ones included"
    )
    REDUCE_RETURNED = "reduce the gradients and return them to torch.autograd.grad"
    CLOSE_USES = (
        "land what a micro-batch's uses left open when its last use's backward never ran "
        "(the reproducible tree's leaf, the earlier uses' held gradients)"
    )
    FINISH_REDUCE = "wait the reduction in flight and write the sharded gradients"
    HOST_MAY_WRITE = "order the host's writes of offloaded shards after their copies"
    ABANDON = "abandon in-flight work and drop the failed iteration's gradients"


@attrs.frozen
class LifecycleConfig:
    """The facts and settings :func:`advance` reads (the shell rebuilds it when they change).

    Attributes:
        forward_users: modules forwarding through the group (``fully_shard([m1, m2])``).
        reshard_after_forward: ``True``, ``False`` or a sub-group size ``k``.
        reshard_after_backward: free the full parameters after backward.
        unshard_in_backward: all-gather the parameters for backward.
        trains: some parameter requires a gradient.
        all_train: every parameter requires a gradient (a lending group's own use can end
            before its post-backward only then).
        lends: some parameter is tied to another group's modules.
        offload: the shards live on the host (CPU offload).
    """

    forward_users: int = 1
    reshard_after_forward: bool | int = True
    reshard_after_backward: bool = True
    unshard_in_backward: bool = True
    trains: bool = True
    all_train: bool = True
    lends: bool = False
    offload: bool = False


@attrs.frozen(cache_hash=True)
class Phase:
    """A group's control state.

    Attributes:
        stage: where the group is in the iteration.
        storage: what it holds of its parameters.
        forward_done: modules of a ``fully_shard([m1, m2])`` group that finished this forward.
        ran_forward: this iteration's forward finished (a prefetch skips the group).
        ran_post_backward: this iteration's backward reached the parameters.
        grad_uses: this micro-batch's uses whose backward reduces (a module called twice
            makes two).
        backward_uses: how many of those backwards ran (the last closes the micro-batch).
        no_grad_uses: this micro-batch's forwards of the group's modules under ``no_grad``
            while something trains (a reentrant checkpoint's: each may be recomputed, and
            become a use, in the backward).
        recomputed: how many of those were recomputed (``REENTRANT_RECOMPUTE``) so far.
        holding: a use's gradients are held (``HOLD_USE``) for a use still to come; the
            final callback lands them when none came.
        keep_for_double_backward: a ``create_graph=True`` backward keeps the full parameters.
        lent_open: other groups' uses of a tied weight that are open now.
        own_open: a lending group's own use is open until its backward.
        outputs_fresh: this iteration's full tensors were made, as autograd outputs, and
            later uses take them (a lending group's: the uses share one set).
        tracked: the full tensors of the forward in progress are autograd outputs (their
            backward reduces): a later module of a ``fully_shard([m1, m2])`` group that records
            (grad on) after one that did not (``no_grad``) must make such tensors.
    """

    stage: Stage = Stage.IDLE
    storage: Storage = Storage.SHARDED
    forward_done: int = 0
    ran_forward: bool = False
    ran_post_backward: bool = False
    grad_uses: int = 0
    backward_uses: int = 0
    no_grad_uses: int = 0
    recomputed: int = 0
    holding: bool = False
    keep_for_double_backward: bool = False
    lent_open: int = 0
    own_open: bool = False
    outputs_fresh: bool = False
    tracked: bool = False


class Event(enum.Enum):
    """What PyTorch (through the shell's hooks) or the user hands a group.

    Events that carry a fact take it as :func:`advance`'s keyword arguments: ``grad`` (autograd
    records: grad mode on), ``force``/``keep`` (``POST_FORWARD``: reshard fully, or not at all),
    ``last`` (``FINAL_CALLBACK``: the iteration's last backward), ``after_backward``
    (``LENT_DONE``).
    """

    START_ITERATION = "the root's forward begins"
    PRE_FORWARD = "a module of the group starts its forward"
    POST_FORWARD = "a module of the group finished its forward"
    FORWARD_ENDS = "the root's forward ended"
    RECOMPUTE = "a forward inside backward (activation-checkpoint recompute)"
    REENTRANT_RECOMPUTE = (
        "a recording forward inside backward of a module whose forwards all ran under no_grad "
        "(a reentrant activation checkpoint's recompute)"
    )
    PRE_BACKWARD = "the backward reaches the group's outputs"
    PREFETCH_FOR_BACKWARD = "another group's backward prefetches this one"
    POST_BACKWARD = "the backward reaches the parameters (gradients into .grad)"
    PARTIAL_BACKWARD = (
        "a nested backward (a reentrant checkpoint's, of a submodule whose recompute the group "
        "does not see) reaches the parameters of a use whose own backward is still to come"
    )
    RETURNED_BACKWARD = "the backward reaches the parameters under torch.autograd.grad"
    FINAL_CALLBACK = "the root's final callback (the backward is over)"
    RESET = "reset_iter_state(): a step failed"
    UNSHARD = "FSDPModule.unshard()"
    RESHARD = "FSDPModule.reshard()"
    SHARDS_WRITTEN = "the shards were written (summon_full_params' writeback)"
    ENTER_SUMMON = "summon_full_params opens"
    EXIT_SUMMON = "summon_full_params closes"
    LENT_FULL = "another group's module starts its forward with a tied weight"
    LENT_LIVE = "another group's backward (or recompute) reads a tied weight"
    LENT_DONE = "another group's use of a tied weight ended"
    LENT_RECOMPUTE = "another group's activation-checkpoint recompute reads a tied weight"
    SETTLE = "FSDP2's post_backward() called outside autograd (manual finalization)"
    OWN_BACKWARD_DONE = "a lending group's own use finished its backward"


# Which stages take which events (any other pair raises LifecycleError). Events not listed
# are taken in every stage.
_ACCEPTS: Final[dict[Event, frozenset[Stage]]] = {
    Event.POST_FORWARD: frozenset({Stage.FORWARD}),
    Event.PARTIAL_BACKWARD: frozenset({Stage.PRE_BACKWARD, Stage.POST_BACKWARD}),
    Event.ENTER_SUMMON: frozenset({Stage.IDLE}),
    Event.EXIT_SUMMON: frozenset({Stage.SUMMON_FULL_PARAMS}),
    Event.PRE_FORWARD: frozenset(set(Stage) - {Stage.SUMMON_FULL_PARAMS}),
    Event.UNSHARD: frozenset(set(Stage) - {Stage.SUMMON_FULL_PARAMS}),
}

_NONE: Final[tuple[Act, ...]] = ()
_IDLE: Final = Phase()
# A micro-batch's uses, counted afresh (the iteration's start; the backward's final callback).
_NO_USES: Final[dict[str, Any]] = {
    "grad_uses": 0,
    "backward_uses": 0,
    "no_grad_uses": 0,
    "recomputed": 0,
    "holding": False,
}

Step = tuple[Phase, tuple[Act, ...]]


def _reshard_after_forward(size: bool | int, storage: Storage) -> tuple[Storage, tuple[Act, ...]]:
    """Free after a forward: fully (``True``), to a sub-group's rows (``k``), or keep (``False``)."""
    if size is False:
        return (Storage.KEPT if storage is Storage.UNSHARDED else storage), _NONE
    if size is True:
        return Storage.SHARDED, _free(storage)
    if storage is Storage.SHARDED:
        return storage, _NONE  # nothing gathered (unshard_in_backward off): no rows to keep
    return Storage.ROWS, (Act.KEEP_ROWS, Act.FREE)


def _free(storage: Storage) -> tuple[Act, ...]:
    """Free the buffer when the group holds one: each gathered buffer is freed once."""
    return _NONE if storage is Storage.SHARDED or storage is Storage.ROWS else (Act.FREE,)


def _make_outputs(p: Phase, c: LifecycleConfig, grad: bool) -> tuple[int, Act]:
    """This iteration's full tensors: tracked (their backward reduces) when autograd records
    and something trains, else plain views. Returns the new ``grad_uses`` and the action."""
    if grad and c.trains:
        return p.grad_uses + 1, Act.MAKE_OUTPUTS
    return p.grad_uses, Act.MAKE_PLAIN_OUTPUTS


def _free_after_use(
    c: LifecycleConfig, grad: bool, storage: Storage
) -> tuple[Storage, tuple[Act, ...]]:
    """After a use's backward, as after the group's own (not under ``create_graph=True``,
    whose double backward reads the buffer)."""
    if c.reshard_after_backward and not grad:
        return Storage.SHARDED, _free(storage)
    return storage, _NONE


def advance(
    p: Phase,
    e: Event,
    c: LifecycleConfig,
    *,
    grad: bool = False,
    force: bool = False,
    keep: bool = False,
    last: bool = True,
    after_backward: bool = False,
    group: str = "",
) -> Step:
    """The phase after event ``e`` and the actions that carry it out, in order.

    Args:
        p: the group's phase now.
        e: the event.
        c: the group's settings and facts.
        grad: autograd records now (``torch.is_grad_enabled()``; the use's backward reduces).
        force: ``POST_FORWARD``: reshard fully (the root, with no backward to serve).
        keep: ``POST_FORWARD``: keep the full parameters (the backward that follows needs
            them first).
        last: ``FINAL_CALLBACK``: this is the iteration's last backward (FSDP2's
            ``set_is_last_backward``); otherwise the reduction stays in flight.
        after_backward: ``LENT_DONE``: the use's backward ended (else its forward).
        group: the group's name, for the error.

    Raises:
        LifecycleError: ``e`` is not accepted in ``p.stage``.
    """
    allowed = _ACCEPTS.get(e)
    if allowed is not None and p.stage not in allowed:
        raise LifecycleError(
            f"group {group or '<unnamed>'!r} got {e.name} ({e.value}) in stage "
            f"{p.stage.value!r}; {e.name} is accepted only in "
            f"{', '.join(sorted(repr(s.value) for s in allowed))}. " + _HINTS.get(e, "")
        )
    return _HANDLERS[e](p, c, grad, force, keep, last, after_backward)


_HINTS: Final[dict[Event, str]] = {
    Event.POST_FORWARD: "A post-forward hook ran with no forward open: call the module (not "
    "its hooks), or reset_iter_state() after a failed step.",
    Event.ENTER_SUMMON: "Open summon_full_params outside forward and backward (after the "
    "backward's final callback), or call reset_iter_state() after a failed step.",
    Event.EXIT_SUMMON: "summon_full_params closes only what it opened.",
    Event.PRE_FORWARD: "Leave summon_full_params before running a forward through the "
    "module (its full parameters are not autograd outputs).",
    Event.UNSHARD: "Leave summon_full_params before calling unshard().",
}


def _start_iteration(p: Phase, c: LifecycleConfig, *_: bool) -> Step:
    return (
        attrs.evolve(
            p,
            ran_post_backward=False,
            ran_forward=False,
            **_NO_USES,
            outputs_fresh=False,
            lent_open=0,
        ),
        (Act.RELEASE_LANDED,),
    )


def _registers(c: LifecycleConfig) -> tuple[Act, ...]:
    return (Act.OWN_USE, Act.REGISTER_OUTPUTS) if c.lends else (Act.REGISTER_OUTPUTS,)


def _pre_forward(p: Phase, c: LifecycleConfig, grad: bool, *_: bool) -> Step:
    no_grad_uses = p.no_grad_uses + (c.trains and not grad)
    if c.forward_users > 1 and p.stage is Stage.FORWARD:
        if p.tracked or not (grad and c.trains):
            # Another module of the group already unsharded this forward.
            return attrs.evolve(p, no_grad_uses=no_grad_uses), _NONE
        # The modules before this one ran under no_grad (plain views): this one records.
        return (
            attrs.evolve(p, grad_uses=p.grad_uses + 1, tracked=True, outputs_fresh=c.lends),
            (Act.MAKE_OUTPUTS, *_registers(c)),
        )
    grad_uses, fresh, tracked = p.grad_uses, p.outputs_fresh, p.tracked
    if fresh:
        make = Act.REUSE_OUTPUTS
    else:
        grad_uses, make = _make_outputs(p, c, grad)
        tracked = make is Act.MAKE_OUTPUTS
        # Later uses share autograd outputs; plain views (no_grad) are made again by a use
        # that records.
        fresh = c.lends and tracked
    acts: tuple[Act, ...] = (Act.WAIT_GATHER, Act.START_PREFETCH, make, *_registers(c))
    return (
        attrs.evolve(
            p,
            stage=Stage.FORWARD,
            storage=Storage.UNSHARDED,
            forward_done=0,
            grad_uses=grad_uses,
            no_grad_uses=no_grad_uses,
            outputs_fresh=fresh,
            tracked=tracked,
        ),
        acts,
    )


def _post_forward(
    p: Phase, c: LifecycleConfig, grad: bool, force: bool, keep: bool, *_: bool
) -> Step:
    done = p.forward_done + 1
    if done < c.forward_users:
        return attrs.evolve(p, forward_done=done), _NONE
    storage, acts = p.storage, _NONE
    if not p.lent_open:  # else the last other group's use reshards (LENT_DONE)
        keep = keep and c.unshard_in_backward
        size = False if keep else True if force else c.reshard_after_forward
        storage, acts = _reshard_after_forward(size, p.storage)
    return (
        attrs.evolve(p, stage=Stage.IDLE, storage=storage, forward_done=done, ran_forward=True),
        acts + (Act.REGISTER_SHARDED,),
    )


def _forward_ends(
    p: Phase, c: LifecycleConfig, grad: bool, force: bool, keep: bool, *_: bool
) -> Step:
    # A fully_shard([m1, m2]) group counts its modules' post-forwards: if they did not each
    # finish this forward once (one ran alone, or ran again after the group had closed), the
    # forward is still open. Left open, the next forward would find it unsharded and run on
    # the last forward's full tensors (no gather, and no gradient under no_grad). Close it as
    # its last module's post-forward would.
    if p.stage is not Stage.FORWARD:
        return p, _NONE
    return _post_forward(attrs.evolve(p, forward_done=c.forward_users - 1), c, grad, force, keep)


def _recompute(p: Phase, c: LifecycleConfig, *_: bool) -> Step:
    return attrs.evolve(p, storage=Storage.UNSHARDED), (Act.WAIT_GATHER, Act.REGISTER_RECOMPUTE)


def _reentrant_recompute(p: Phase, c: LifecycleConfig, *_: bool) -> Step:
    if not c.trains:
        return _recompute(p, c)
    # The module's forward ran under no_grad (a reentrant checkpoint), so it made no use whose
    # backward reduces. As FSDP2 runs it, the recompute is a use of its own: autograd outputs
    # whose backward (the checkpoint's nested one) reduces it; it closes the uses unless
    # another no_grad forward of the group may still be recomputed (see _closes).
    return (
        attrs.evolve(
            p,
            storage=Storage.UNSHARDED,
            grad_uses=p.grad_uses + 1,
            recomputed=p.recomputed + 1,
            tracked=True,
            outputs_fresh=c.lends,
        ),
        (Act.WAIT_GATHER, Act.MAKE_OUTPUTS, *_registers(c)),
    )


def _pre_backward(p: Phase, c: LifecycleConfig, *_: bool) -> Step:
    if not c.unshard_in_backward:  # the backward does not read the parameters (an embedding)
        return attrs.evolve(p, stage=Stage.PRE_BACKWARD, own_open=c.lends), _NONE
    return (
        attrs.evolve(p, stage=Stage.PRE_BACKWARD, storage=Storage.UNSHARDED, own_open=c.lends),
        (Act.WAIT_GATHER, Act.REGISTER_REGISTERED),
    )


def _prefetch_for_backward(p: Phase, c: LifecycleConfig, *_: bool) -> Step:
    if p.ran_post_backward or not c.unshard_in_backward:
        return p, _NONE
    return p, (Act.START_GATHER,)


def _closes(p: Phase, uses: int) -> bool:
    """Whether the backward of use number ``uses`` closes the micro-batch's uses (reduces what
    they hold): every use made so far has had its backward, and every ``no_grad`` forward of
    the group has been recomputed. A ``no_grad`` forward in training may be a reentrant
    checkpoint's, whose recompute and nested backward come later in the backward (a
    ``fully_shard([rep, mid])`` group whose ``mid`` runs after a checkpointed ``rep``: mid's
    backward comes first); which one it is, is known only when the recompute comes. Until then
    the uses stay open, and the final callback closes what a plain ``no_grad`` forward (never
    recomputed) left held: one reduction either way (one micro-batch's leaf under
    ``ReproduciblePolicy``), the plain case's only later."""
    return uses >= p.grad_uses and p.recomputed >= p.no_grad_uses


def _post_backward(p: Phase, c: LifecycleConfig, *_: bool) -> Step:
    uses = p.backward_uses + 1
    storage, acts = p.storage, _NONE
    if c.reshard_after_backward:
        # The gradients are separate tensors: free before packing them (unless another
        # group's use still reads the buffer: LENT_DONE frees then).
        if not p.lent_open:
            storage, acts = Storage.SHARDED, _free(storage)
        acts += (Act.REGISTER_SHARDED,)
    closes = _closes(p, uses)
    acts += (Act.REDUCE_LAST if closes else Act.HOLD_USE,)
    return (
        attrs.evolve(
            p,
            stage=Stage.POST_BACKWARD,
            storage=storage,
            ran_post_backward=True,
            backward_uses=uses,
            holding=not closes,
        ),
        acts,
    )


def _partial_backward(p: Phase, c: LifecycleConfig, *_: bool) -> Step:
    # A plain submodule of the group checkpointed reentrantly: its recompute runs on the full
    # parameters the group's pre-backward registered (no hook of the group sees it), and the
    # checkpoint's nested backward reaches them with part of the gradient of a use recorded in
    # the forward. That use's own backward (in the outer one) is still to come and closes it:
    # the part is held, not counted as a use, and the full parameters stay registered, since
    # another checkpoint's recompute may read them next.
    return attrs.evolve(p, holding=True), (Act.HOLD_USE,)


def _returned_backward(p: Phase, c: LifecycleConfig, grad: bool, *_: bool) -> Step:
    # ``grad``: a create_graph=True backward, whose double backward reads the full parameters.
    # The gradients are separate tensors: free before reducing them (as _post_backward).
    storage: Storage = p.storage
    acts: tuple[Act, ...] = (Act.REDUCE_RETURNED,)
    if c.reshard_after_backward and not grad:
        storage, acts = Storage.SHARDED, _free(storage) + (Act.REGISTER_SHARDED,) + acts
    elif grad and storage is Storage.UNSHARDED:
        storage = Storage.KEPT
    return (
        attrs.evolve(
            p,
            stage=Stage.POST_BACKWARD,
            storage=storage,
            ran_post_backward=True,
            backward_uses=p.backward_uses + 1,  # the use is done (its gradients returned)
            keep_for_double_backward=grad,
        ),
        acts,
    )


def _final_callback(
    p: Phase, c: LifecycleConfig, grad: bool, force: bool, keep: bool, last: bool, *_: bool
) -> Step:
    # A use's backward (or a reentrant recompute) never ran: land what the others held. (A
    # backward under torch.autograd.grad reduces its own gradients and lands nothing held.)
    acts: tuple[Act, ...] = (Act.CLOSE_USES,) if p.holding else ()
    if last:
        # Otherwise (gradient accumulation) the reduction overlaps the next micro-batch; the
        # group's next reduction or the last backward's callback finishes it.
        acts += (Act.FINISH_REDUCE,)
    acts += (Act.DISCARD_PENDING,)
    if c.offload:
        acts += (Act.HOST_MAY_WRITE,)
    storage = p.storage
    if (c.reshard_after_backward or not p.ran_post_backward) and not p.keep_for_double_backward:
        acts += _free(storage)
        storage = Storage.SHARDED
    elif storage is Storage.ROWS:
        storage = Storage.SHARDED  # the rows are forgotten below; nothing full was kept
    acts += (Act.REGISTER_SHARDED, Act.FORGET_OUTPUTS, Act.FORGET_ROWS)
    return (
        attrs.evolve(
            p,
            stage=Stage.IDLE,
            storage=storage,
            **_NO_USES,
            lent_open=0,
            own_open=False,
            keep_for_double_backward=False,
            outputs_fresh=False,
        ),
        acts,
    )


def _reset(p: Phase, c: LifecycleConfig, *_: bool) -> Step:
    return _IDLE, (
        Act.ABANDON,
        Act.FREE,
        Act.REGISTER_SHARDED,
        Act.FORGET_OUTPUTS,
        Act.FORGET_ROWS,
    )


def _unshard(p: Phase, c: LifecycleConfig, *_: bool) -> Step:
    return attrs.evolve(p, storage=Storage.UNSHARDED), (Act.WAIT_GATHER, Act.REGISTER_VIEWS)


def _reshard(p: Phase, c: LifecycleConfig, *_: bool) -> Step:
    return (
        attrs.evolve(p, storage=Storage.SHARDED, outputs_fresh=False),
        (Act.DISCARD_PENDING, Act.FREE, Act.FORGET_ROWS, Act.FORGET_OUTPUTS, Act.REGISTER_SHARDED),
    )


def _shards_written(p: Phase, c: LifecycleConfig, *_: bool) -> Step:
    return (
        attrs.evolve(p, storage=Storage.SHARDED),
        (Act.DISCARD_PENDING, Act.FREE, Act.FORGET_ROWS),
    )


def _enter_summon(p: Phase, c: LifecycleConfig, *_: bool) -> Step:
    return attrs.evolve(p, stage=Stage.SUMMON_FULL_PARAMS), _NONE


def _exit_summon(p: Phase, c: LifecycleConfig, *_: bool) -> Step:
    return attrs.evolve(p, stage=Stage.IDLE), (Act.REGISTER_SHARDED, Act.REGISTER_LENT_SHARDED)


def _lent_full(p: Phase, c: LifecycleConfig, grad: bool, *_: bool) -> Step:
    grad_uses = p.grad_uses
    acts: tuple[Act, ...] = (Act.WAIT_GATHER,)
    fresh = p.outputs_fresh
    if not fresh:
        grad_uses, make = _make_outputs(p, c, grad)
        acts += (make,)
        # Plain views (no_grad) are made again by a use that records.
        fresh = make is Act.MAKE_OUTPUTS
    else:
        acts += (Act.REUSE_OUTPUTS,)
    return (
        attrs.evolve(
            p,
            storage=Storage.UNSHARDED,
            grad_uses=grad_uses,
            outputs_fresh=fresh,
            lent_open=p.lent_open + 1,
        ),
        acts,
    )


def _lent_live(p: Phase, c: LifecycleConfig, *_: bool) -> Step:
    return (
        attrs.evolve(p, storage=Storage.UNSHARDED, lent_open=p.lent_open + 1),
        (Act.WAIT_GATHER,),
    )


def _lent_done(
    p: Phase,
    c: LifecycleConfig,
    grad: bool,
    force: bool,
    keep: bool,
    last: bool,
    after_backward: bool,
) -> Step:
    p = attrs.evolve(p, lent_open=max(0, p.lent_open - 1))
    busy = p.stage is Stage.FORWARD or (p.stage is Stage.PRE_BACKWARD and p.own_open)
    if p.lent_open or busy:
        return p, _NONE
    if not after_backward:
        storage, acts = _reshard_after_forward(c.reshard_after_forward, p.storage)
    else:
        storage, acts = _free_after_use(c, grad, p.storage)
    return attrs.evolve(p, storage=storage), acts


def _lent_recompute(p: Phase, c: LifecycleConfig, *_: bool) -> Step:
    return attrs.evolve(p, storage=Storage.UNSHARDED), (Act.WAIT_GATHER,)


def _settle(p: Phase, c: LifecycleConfig, *_: bool) -> Step:
    if not c.reshard_after_backward:
        return p, _NONE
    return attrs.evolve(p, storage=Storage.SHARDED), _free(p.storage) + (Act.REGISTER_SHARDED,)


def _own_backward_done(p: Phase, c: LifecycleConfig, grad: bool, *_: bool) -> Step:
    p = attrs.evolve(p, own_open=False)
    if p.lent_open:
        return p, _NONE
    storage, acts = _free_after_use(c, grad, p.storage)
    return attrs.evolve(p, storage=storage), acts


_Handler = Callable[[Phase, LifecycleConfig, bool, bool, bool, bool, bool], Step]
_HANDLERS: Final[dict[Event, _Handler]] = {
    Event.START_ITERATION: _start_iteration,
    Event.PRE_FORWARD: _pre_forward,
    Event.POST_FORWARD: _post_forward,
    Event.FORWARD_ENDS: _forward_ends,
    Event.RECOMPUTE: _recompute,
    Event.REENTRANT_RECOMPUTE: _reentrant_recompute,
    Event.PRE_BACKWARD: _pre_backward,
    Event.PREFETCH_FOR_BACKWARD: _prefetch_for_backward,
    Event.POST_BACKWARD: _post_backward,
    Event.PARTIAL_BACKWARD: _partial_backward,
    Event.RETURNED_BACKWARD: _returned_backward,
    Event.FINAL_CALLBACK: _final_callback,
    Event.RESET: _reset,
    Event.UNSHARD: _unshard,
    Event.RESHARD: _reshard,
    Event.SHARDS_WRITTEN: _shards_written,
    Event.ENTER_SUMMON: _enter_summon,
    Event.EXIT_SUMMON: _exit_summon,
    Event.LENT_FULL: _lent_full,
    Event.LENT_LIVE: _lent_live,
    Event.LENT_DONE: _lent_done,
    Event.OWN_BACKWARD_DONE: _own_backward_done,
    Event.LENT_RECOMPUTE: _lent_recompute,
    Event.SETTLE: _settle,
}


# ---------------------------------------------------------------------- the root's iteration


@attrs.frozen(cache_hash=True)
class RootPhase:
    """The root's control state: where the model is in its iteration.

    Attributes:
        in_forward: a forward through the root is running (prefetch follows the recorded
            order only then).
        callback_queued: the backward began and its final callback is queued.
        interrupted: a forward, or the final callback's finishing, raised since the last
            reset.
        order_recorded: the first forward recorded the order groups run in.
    """

    in_forward: bool = False
    callback_queued: bool = False
    interrupted: bool = False
    order_recorded: bool = False


class RootEvent(enum.Enum):
    """What the hooks hand the root."""

    FORWARD_BEGINS = "the root's pre-forward (outside backward)"
    FORWARD_ENDS = "the root's post-forward"
    FORWARD_RAISED = "a forward through the model raised"
    FORWARD_REFUSED = "a forward was refused in its pre-forward (nothing started)"
    BACKWARD_BEGINS = "a group's pre-backward"
    FINAL_CALLBACK = "the backward's final callback"
    FINISH_RAISED = "finishing the groups' backward (the final callback's work) raised"
    RESET = "reset_iter_state()"


class RootAct(enum.Enum):
    """What the shell does for a root event."""

    RESET_FIRST = "reset the iteration a raised forward or backward left (as reset_iter_state)"
    START_ITERATIONS = "every group starts its iteration; wait the user's post-optimizer event"
    FORGET_PREFETCHES = "drop all-gathers prefetched and not used; the forward's memory ends"
    QUEUE_CALLBACK = "queue the final callback on autograd's engine"
    FINISH_GROUPS = "finish every group's backward (reductions, groups without gradients)"


def advance_root(p: RootPhase, e: RootEvent) -> tuple[RootPhase, tuple[RootAct, ...]]:
    """The root's phase after ``e`` and the actions that carry it out, in order.

    A forward that begins while the previous forward raised, while a backward's callback is
    still queued (a backward that raised before it ran), or after the callback's finishing
    raised (a reduction that could not land), first resets: every rank then does what
    ``reset_iter_state()`` does, and the forward starts clean.
    """
    if e is RootEvent.FORWARD_BEGINS:
        acts: tuple[RootAct, ...] = ()
        if p.interrupted or p.callback_queued:
            acts = (RootAct.RESET_FIRST,)
        new = RootPhase(True, False, False, p.order_recorded)
        return new, acts + (RootAct.START_ITERATIONS,)
    if e is RootEvent.FORWARD_ENDS:
        return attrs.evolve(p, in_forward=False, order_recorded=True), (RootAct.FORGET_PREFETCHES,)
    if e is RootEvent.FORWARD_RAISED or e is RootEvent.FINISH_RAISED:
        return attrs.evolve(p, interrupted=True), _NO_ROOT_ACTS
    if e is RootEvent.FORWARD_REFUSED:
        return attrs.evolve(p, in_forward=False), _NO_ROOT_ACTS
    if e is RootEvent.BACKWARD_BEGINS:
        if p.callback_queued:
            return p, _NO_ROOT_ACTS
        return attrs.evolve(p, callback_queued=True), (RootAct.QUEUE_CALLBACK,)
    if e is RootEvent.FINAL_CALLBACK:
        return attrs.evolve(p, callback_queued=False), (RootAct.FINISH_GROUPS,)
    # RESET
    return RootPhase(order_recorded=p.order_recorded), _NO_ROOT_ACTS


_NO_ROOT_ACTS: Final[tuple[RootAct, ...]] = ()
