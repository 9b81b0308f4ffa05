"""Weights tied across groups: a parameter that one group owns and modules of other groups use.

The usual case is a language model whose output head shares the token embedding's weight
(``head.weight is tok.weight``) with ``fully_shard(model.tok)`` and ``fully_shard(model.head)``
as separate groups. The first group to be sharded that holds the parameter *owns* it: it is
sharded once, in the owner's buffer; the optimizer, state dicts and checkpoints see one
``DTensor`` (registered on every module that holds it). Every other FSDP state whose modules
hold it gets a :class:`TiedUse`:

- **Forward.** Before the using module's forward, the owner's unsharded buffer is made live
  (gathered again if it was resharded) and the use registers the owner's full tensor *of this
  iteration*: the owner makes its autograd outputs once per iteration, at the first use (its own
  forward or another group's, :meth:`ParamGroup.lent_full`), and every later use takes them. So
  each use sees the same unsharded tensor, and autograd sums every use's gradient into that one
  output before the owner's unshard Function runs its backward: **one reduction of the summed
  gradient per step**, however the group reductions are ordered, whichever use runs backward
  first. A use's tensor is a view through a :class:`~.autograd.UseFn`, whose backward tells
  the owner the use is done; the owner's own modules take theirs the same way. So the buffer
  is resharded between uses, whichever order they run in.
- **Memory.** The owner's buffer is live while any use (its own modules or another group's)
  runs forward or backward, and resharded as the owner's own settings say when none does. The
  gradient of the tied weight is one full-size tensor held by autograd from the first use's
  backward to the last one's (the price of reducing once instead of once per use).

The functional path (``functional_call``, ``torch.func``, the functional step) works the same
way on the caller's tensors: the owner's :class:`~.functional_path.GatherCall` of the call is
made once (:class:`LentCall`) and lent to the other groups' uses.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

import torch

from ...core.errors import TiedParameterError, UnsupportedError
from ...core.lifecycle import Event
from .autograd import UseFn
from .functional_path import GatherCall, check_sources, registered_sources
from .group import ParamGroup
from .param import Holders, ShardedParam

__all__ = ["LentCall", "Lender", "TiedUse"]


class Lender(Protocol):
    """What a use's :class:`~.autograd.UseFn` tells when the use's backward is done: the
    owner group (module path) or its :class:`LentCall` (functional path)."""

    def lent_done(self, *, after_backward: bool) -> None:
        """One use ended: reshard when no other needs the buffer."""
        ...


def _lent_view(lender: Lender, full: torch.Tensor) -> torch.Tensor:
    """One use's view of the owner's full tensor: through a :class:`~.autograd.UseFn`, whose
    backward tells ``lender`` that the use's backward is done (as is without a gradient)."""
    if torch.is_grad_enabled() and full.requires_grad:
        return UseFn.apply(functools.partial(lender.lent_done, after_backward=True), full)[0]
    return full


class LentCall:
    """A lending group's gather in one functional forward, shared by its own modules and the
    other groups' uses (the functional path's :meth:`ParamGroup.lent_full`). The uses are the
    call's life cycle's lent uses (``LENT_FULL``, ``LENT_LIVE``, ``LENT_DONE``): the buffer is
    resharded when neither a use nor the owner's own forward or backward needs it.

    Attributes:
        call: the owner's gather for this call.
        sources: the caller's tensors it gathers (a use must hold the same).
    """

    __slots__ = ("call", "sources")

    def __init__(self, call: GatherCall, sources: tuple) -> None:
        self.call = call
        self.sources = sources

    @classmethod
    def make(cls, owner: ParamGroup, forward: Any) -> LentCall:
        """The owner's call for this forward, made at a use that runs before the owner's
        modules (the use's ``LENT_FULL`` gathers)."""
        sources = tuple(registered_sources(owner))
        check_sources(owner, sources)
        call = GatherCall(owner, forward, sources)
        if forward is not None:
            forward.calls.append(call)
        return cls(call, sources)

    @property
    def fulls(self) -> tuple[torch.Tensor, ...]:
        """The owner's full tensors of this call (every use views them)."""
        assert self.call.fulls is not None
        return self.call.fulls

    def lent_full(self) -> None:
        """A use starts its forward: the buffer is gathered (or live again) until
        :meth:`lent_done`."""
        self.call.event(Event.LENT_FULL, grad=torch.is_grad_enabled())

    def lent_live(self, _grad: Any = None) -> None:
        """A use starts its backward: the buffer is live until :meth:`lent_done`."""
        self.call.event(Event.LENT_LIVE)

    def lent_done(self, *, after_backward: bool) -> None:
        """A use ended: free the buffer as the owner's settings say, unless another use or the
        owner's own modules still need it."""
        self.call.event(Event.LENT_DONE, after_backward=after_backward)


class TiedUse:
    """The modules of one FSDP state that use a parameter another group owns.

    Attributes:
        owner: the group that shards, gathers and reduces the parameter.
        index: the parameter's position in the owner.
        holders: the ``(module, attribute name)`` pairs of this state's modules that hold it.
        name: its name there, for messages (``"'weight' of Linear"``).
        full: the tensor this forward registered on them (a ``UseFn`` view of the owner's full
            tensor), kept for an activation-checkpoint recompute.
        lent: in a functional forward, the owner's :class:`LentCall` (until post-forward).
        source: in a functional forward, the caller's tensor the holders held.
    """

    __slots__ = ("full", "holders", "index", "lent", "name", "owner", "source")

    def __init__(self, owner: ParamGroup, index: int, holders: Holders, name: str) -> None:
        self.owner = owner
        self.index = index
        self.holders = holders
        self.name = name
        self.full: torch.Tensor | None = None
        self.lent: LentCall | None = None
        self.source: Any = None

    @property
    def param(self) -> ShardedParam:
        """The owner's parameter."""
        return self.owner.sharded_params[self.index]

    def registered(self) -> Any:
        """The tensor the first holder registers now."""
        module, name = self.holders[0]
        return module._parameters.get(name)

    def register(self, t: Any) -> None:
        """Put ``t`` on every holder."""
        for m, n in self.holders:
            m._parameters[n] = t

    def to_sharded(self) -> None:
        """Put the owner's sharded parameter on every holder."""
        self.register(self.param.sharded)

    def copied(self, owner: ParamGroup, holders: Holders) -> TiedUse:
        """The same use in a deep copy (the copied owner and modules)."""
        return TiedUse(owner, self.index, holders, self.name)

    def _substituted(self, source: Any) -> TiedParameterError:
        return TiedParameterError(
            f"{self.name} is tied to {self.param.fqn!r} of {self.owner.name}, but holds "
            f"another tensor ({type(source).__name__}) in this forward; a "
            "functional_call / torch.func call must pass the same tensor for every name of a "
            "tied weight (their default tie_weights=True does), and an assignment must tie "
            "both names again (model.head.weight = model.tok.weight)"
        )

    # ------------------------------------------------------------------ module path

    def pre_forward(self) -> None:
        """The module's forward starts: register the owner's full tensor of this iteration."""
        now = self.registered()
        if now is not self.param.sharded and now is not self.full:
            raise self._substituted(now)
        self.full = _lent_view(self.owner, self.owner.lent_full(self.index))
        self.register(self.full)

    def post_forward(self) -> None:
        """The module's forward ended: the sharded parameter back; the owner may reshard."""
        self.to_sharded()
        self.owner.lent_done(after_backward=False)

    def pre_backward(self) -> None:
        """The module's backward starts: the owner's buffer is live until its ``UseFn``
        backward (the gradient reached the use), and this forward's tensor is back on the
        holders (an activation-checkpoint recompute inside the module reads it there)."""
        self.owner.lent_live()
        if self.full is not None:
            self.register(self.full)

    def refuse_reentrant(self) -> None:
        """Raise before the recompute gathers anything when it records but this forward's
        tensor does not (the forward ran under ``no_grad``: a reentrant checkpoint), and the
        weight trains: a use of a tied weight is not made again in a recompute, so its
        gradient would be lost."""
        full = self.full
        if (
            torch.is_grad_enabled()
            and full is not None
            and not full.requires_grad
            and self.param.sharded.requires_grad
        ):
            raise UnsupportedError(
                f"{self.name} is tied to {self.param.fqn!r} of {self.owner.name}, and an "
                "activation checkpoint recomputes its forward, which ran under no_grad "
                "(torch.utils.checkpoint(..., use_reentrant=True)), as the owner's did: a "
                "reentrant checkpoint around a tied weight's use needs the owner's forward to "
                "record (outside the checkpoint); else pass use_reentrant=False (or use the "
                "composable checkpoint) here"
            )

    def recompute(self) -> None:
        """An activation-checkpoint recompute: this forward's tensor again, its data live."""
        self.owner.lent_recompute()
        if self.full is not None:
            self.register(self.full)

    def finish(self) -> None:
        """The iteration ended (the root's final callback, or ``reset_iter_state``)."""
        self.full = None
        self.lent = None
        self.source = None
        self.to_sharded()

    # ------------------------------------------------------------------ functional path

    def functional_pre_forward(self, lent: LentCall) -> None:
        """The module's forward starts on the caller's tensors: register the owner's full
        tensor of this call."""
        source = self.registered()
        if source is not lent.sources[self.index]:
            raise self._substituted(source)
        lent.lent_full()
        self.lent, self.source = lent, source
        self.register(_lent_view(lent, lent.fulls[self.index]))

    def functional_post_forward(self) -> LentCall | None:
        """The module's forward ended: the caller's tensor back on the holders; the owner's
        call for the backward hook (``None`` when no functional forward was open)."""
        lent, source = self.lent, self.source
        self.lent = self.source = None
        if lent is None:
            return None
        self.register(source)
        lent.lent_done(after_backward=False)
        return lent
