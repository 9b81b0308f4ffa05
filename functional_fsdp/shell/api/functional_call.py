"""Entering and leaving the functional path from the root's hooks (``functional_call``,
``torch.func``).

:func:`pre_forward` decides, once per root forward, whether the tensors registered on the
modules are the caller's (any substituted slot, or a ``torch.func`` transform active); then each
group's forward gathers them through :class:`~..engine.autograd.GatherFn` into a per-call
:class:`~..engine.functional_path.GatherCall`, and :func:`post_forward` puts the caller's
tensors back and hooks the re-gather for backward. The engine side (the gathers, the
reductions) is :mod:`functional_fsdp.shell.engine.functional_path`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor

from ...core.errors import UnsupportedError
from ...core.lifecycle import Event, RootAct, RootEvent
from ..engine.functional_path import (
    FunctionalForward,
    GatherCall,
    Prefetch,
    check_sources,
    pack_sources,
    registered_sources,
    substituted,
)
from ..engine.group import ParamGroup
from ..engine.tied import LentCall, TiedUse

__all__ = ["TP_TRANSFORM_MESSAGE", "ForwardState", "Functional", "post_forward", "pre_forward"]


class _Marker:
    """A state without a group inside a functional forward (nothing to gather)."""

    __slots__ = ()


Functional = FunctionalForward | GatherCall | _Marker
"""A state's record of the functional forward in progress (``FSDPState.functional``): the
root's :class:`FunctionalForward`, a group's :class:`GatherCall`, or a marker."""


class ForwardState(Protocol):
    """What this module reads and writes of a module's FSDP state (``shell/api/state.py``'s
    ``FSDPState``): its group, its root, and the root's record of the forward in progress."""

    group: ParamGroup | None
    depth: int
    functional: Functional | None
    tied: list[TiedUse]
    lent_calls: dict[int, LentCall]

    @property
    def in_forward(self) -> bool:
        """Root: a forward through it is running."""
        ...

    def _root_event(self, event: RootEvent) -> tuple[RootAct, ...]:
        """Root: advance its iteration (``FSDPState._root_event``)."""
        ...

    @property
    def root(self) -> ForwardState | None:
        """The root's state (``None`` before lazy init)."""
        ...

    @property
    def all_states(self) -> Sequence[ForwardState]:
        """The root's: every state below it."""
        ...

    @property
    def is_root(self) -> bool:
        """Whether this state is its root's."""
        ...

    def forward_prefetch_targets(self) -> Sequence[ForwardState]:
        """The states whose groups this one's forward prefetches."""
        ...


def _wants_functional(states: Sequence[ForwardState]) -> bool:
    if torch._C._are_functorch_transforms_active():
        return True
    return any(s.group is not None and substituted(s.group) for s in states)


def pre_forward(state: ForwardState) -> bool:
    """Take the functional path for ``state``'s forward if this forward is functional.

    Decided once at the root (any substituted slot in any group, or a ``torch.func`` transform
    active); a state run outside a root forward decides for itself. Returns ``True`` when the
    path was taken (the shell then skips its own unshard and prefetch).
    """
    root = state.root
    assert root is not None
    state.functional = None
    if state.is_root or not root.in_forward:
        states = root.all_states if state.is_root else [state]
        if not _wants_functional(states):
            return False
        _refuse_transform_over_tp(state, states)
        fwd = FunctionalForward()
        if state.is_root:
            root.functional = fwd
            root.lent_calls = {}
    else:
        rec = root.functional
        if not isinstance(rec, (FunctionalForward, GatherCall)):
            return False
        maybe = rec if isinstance(rec, FunctionalForward) else rec.forward
        if maybe is None:
            return False
        fwd = maybe
    g = state.group
    if g is not None:
        lent = root.lent_calls.get(id(g)) if g.lends else None
        if lent is None:
            sources = tuple(registered_sources(g))
            check_sources(g, sources)
            call = GatherCall(g, fwd, sources, fwd.prefetched.pop(state, None))
            fwd.calls.append(call)
            if g.lends:  # other groups' modules use its weights: they take this gather
                lent = root.lent_calls[id(g)] = LentCall(call, sources)
        else:  # another group's use of its weight gathered it earlier in this forward
            call, sources = lent.call, lent.sources
        call.restore = sources
        # Gathers (again, when another use's end resharded it) and registers the full tensors.
        call.event(Event.PRE_FORWARD, grad=torch.is_grad_enabled())
        call.is_root = state.is_root
        state.functional = call
    elif not state.is_root:
        state.functional = _Marker()
    for use in state.tied:  # weights of other groups: their owner's gather of this call
        owner = use.owner
        if id(owner) not in root.lent_calls:
            root.lent_calls[id(owner)] = LentCall.make(owner, fwd)
        use.functional_pre_forward(root.lent_calls[id(owner)])
    _prefetch_next(state, fwd)
    return True


TP_TRANSFORM_MESSAGE = (
    "torch.func transforms (grad, vjp, vmap, jvp, ...) over a module with tensor-parallel "
    "DTensor parameters are not supported: DTensor's own autograd Functions (DTensor.from_local "
    "in parallelize_module's input hooks, to_local, redistribute) have no setup_context in "
    "torch 2.13, so functorch cannot run them even without FSDP. Use "
    "torch.autograd.grad(loss, params) with torch.func.functional_call (what "
    "functional_fsdp.functional.make_train_step does), or loss.backward()"
)


def _refuse_transform_over_tp(state: ForwardState, states: Sequence[ForwardState]) -> None:
    """Raise before any collective when a ``torch.func`` transform runs over 2-D (FSDP + TP),
    undoing what the shell's pre-forward did so far (the module stays usable)."""
    if torch._C._are_functorch_transforms_active() and any(
        s.group is not None and s.group.tp is not None for s in states
    ):
        state.depth = max(0, state.depth - 1)
        if state.is_root and state.root is not None:
            state.root._root_event(RootEvent.FORWARD_REFUSED)
        raise UnsupportedError(TP_TRANSFORM_MESSAGE)


def _prefetch_next(state: ForwardState, fwd: FunctionalForward) -> None:
    """Start the next group's all-gather now, as the shell prefetches (plain DTensor sources
    only: under a ``torch.func`` transform the sources are wrapped until the Function runs)."""
    for target in state.forward_prefetch_targets():
        g = target.group
        if g is None or target in fwd.prefetched or any(c.group is g for c in fwd.calls):
            continue
        sources = tuple(registered_sources(g))
        if not all(isinstance(s, DTensor) for s in sources):
            continue
        try:
            check_sources(g, sources)
        except (TypeError, ValueError):
            continue  # raised, with the parameter's name, when that group's forward runs
        sharded = pack_sources(g, sources)
        slot = g.new_slot()
        slot.start(sharded, g.comm)
        fwd.prefetched[target] = Prefetch(sources, sharded, slot)


def post_forward(state: ForwardState, output: Any) -> Any:
    """Put the caller's tensors back on the modules, reshard, hook the re-gather for backward."""
    rec = state.functional
    state.functional = None
    root = state.root
    tensors = []
    if torch.is_grad_enabled():
        tensors = [
            t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad
        ]
    for use in state.tied:
        lent = use.functional_post_forward()
        if lent is not None and tensors:  # its backward reads the owner's buffer again
            torch.autograd.graph.register_multi_grad_hook(tensors, lent.lent_live, mode="any")
    if state.is_root or (root is not None and not root.in_forward):
        # The state that opened this functional forward closes it.
        fwd = rec.forward if isinstance(rec, GatherCall) else rec
        if isinstance(fwd, FunctionalForward):
            fwd.drain()
            fwd.calls.clear()  # the graph keeps the calls it needs (no reference cycle)
        if root is not None:
            root.lent_calls = {}
    if not isinstance(rec, GatherCall):
        return output
    return _close_call(rec, tensors, output)


def _close_call(rec: GatherCall, tensors: list, output: Any) -> Any:
    """A group's functional forward ended: the caller's tensors back on its modules, its buffer
    resharded (unless another group's use still reads it), the re-gather hooked for backward."""
    rec.end_forward(saved=bool(tensors))
    if not tensors:
        # Nothing saved for backward: drop the buffer (outputs aliasing it keep it alive).
        if not rec.group.lends:
            rec.slot = None
        return output
    torch.autograd.graph.register_multi_grad_hook(tensors, rec.pre_backward_hook, mode="any")
    return output
