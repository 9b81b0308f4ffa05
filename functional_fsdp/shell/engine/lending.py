"""Weights tied across groups: one group owns a parameter, others' modules use it.

The room of :class:`~.group.ParamGroup` that lends (:class:`GroupLending`, one of its bases).
``fully_shard`` finds a parameter registered on modules of several groups (a tied embedding
and head) and gives it to one group, which lends it to the others' modules
(:meth:`~GroupLending.lend`): one shard, one all-gather, one reduction. Each use opens and
closes (:class:`~.tied.TiedUse` calls :meth:`~GroupLending.lent_full`,
:meth:`~GroupLending.lent_live`, :meth:`~GroupLending.lent_done`); the owner's buffer stays
live while any use is open, and is resharded as after the owner's own forward or backward
when the last one closes.

The fields here are the group's (its ``__init__`` calls :meth:`~GroupLending._init_lending`);
only the group's modules write them (``tests/integration/test_architecture.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...core.lifecycle import Act, Event, Phase
from .autograd import UseFn
from .config import GroupConfig
from .param import Holders, ShardedParam

__all__ = ["GroupLending"]


class GroupLending:
    """The lending half of :class:`~.group.ParamGroup` (a base class).

    Attributes:
        lends: whether any parameter is lent to another group's modules.

    The uses open now, whether this iteration's outputs were made and whether the group's own
    use is open are the life cycle's (``ParamGroup.phase``): each method here is an event.
    """

    # The group's fields this room reads (ParamGroup.__init__ sets them).
    config: GroupConfig
    phase: Phase
    sharded_params: tuple[ShardedParam, ...]
    _requires_grad: tuple[bool, ...]
    # ... and the methods it calls
    _event: Callable[..., tuple[Act, ...]]
    _carry_out: Callable[..., Any]
    _settings_changed: Callable[[], None]

    def _init_lending(self) -> None:
        """Nothing lent (``ParamGroup.__init__``)."""
        self.lends = False
        # This group's own use: its modules' UseFn views of the outputs (open until its
        # backward).
        self._own_views: tuple[torch.Tensor, ...] | None = None

    @property
    def lent_open(self) -> int:
        """The other groups' uses open now (their forward or backward)."""
        return self.phase.lent_open

    def lend(self, index: int, holders: Holders) -> None:
        """Let ``holders`` (modules of another group) use parameter ``index`` (a weight tied
        across groups, ``fully_shard``): this group stays its only owner (one shard, one
        gather, one reduction); their :class:`~.tied.TiedUse` registers it during their
        forward."""
        self.sharded_params[index].lend(holders)
        self.lends = True
        self._settings_changed()

    def register_lent_sharded(self) -> None:
        """Put the sharded parameters on the other groups' modules that use them."""
        for sp in self.sharded_params:
            sp.register_lent(sp.sharded)

    def register_lent_full(self, tensors: Sequence[torch.Tensor]) -> None:
        """Put full tensors (``summon_full_params``') on the other groups' modules too."""
        for sp, t in zip(self.sharded_params, tensors):
            sp.register_lent(t)

    def lent_full(self, index: int) -> torch.Tensor:
        """Another group's module starts its forward with parameter ``index``: the unsharded
        buffer is live until :meth:`lent_done`, and the parameter's full tensor of this
        iteration is returned (made now, with this group's other outputs, when this group's
        own forward has not run yet in the iteration)."""
        self._carry_out(self._event(Event.LENT_FULL, grad=torch.is_grad_enabled()))
        full = self.sharded_params[index].full
        assert full is not None
        return full

    def lent_live(self) -> None:
        """Another group's module starts its backward (or recomputes its forward) with one of
        this group's parameters: the buffer is live until :meth:`lent_done`."""
        self._carry_out(self._event(Event.LENT_LIVE))

    def lent_done(self, *, after_backward: bool) -> None:
        """Another group's use ended (its forward, or its backward reached the parameter):
        once no use is open and this group's own forward or backward is not running, reshard
        as this group would after its own forward (or backward; not under a
        ``create_graph=True`` backward, whose double backward reads the buffer)."""
        acts = self._event(
            Event.LENT_DONE, after_backward=after_backward, grad=torch.is_grad_enabled()
        )
        self._carry_out(acts)

    def lent_recompute(self) -> None:
        """Another group's activation-checkpoint recompute reads a tied weight: the buffer
        holds the full parameters again."""
        self._carry_out(self._event(Event.LENT_RECOMPUTE))

    def own_backward_done(self) -> None:
        """The backward of this lending group's own modules is over (:meth:`_own_use`)."""
        self._carry_out(self._event(Event.OWN_BACKWARD_DONE, grad=torch.is_grad_enabled()))

    def _own_use(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """A lending group's own modules' views of its outputs: their :class:`UseFn` backward
        ends this group's own use, so the buffer can be freed before another group's use of a
        tied weight reaches the unshard's backward (all parameters trained: a frozen one gets
        no gradient to wait for, and the buffer then stays until ``post_backward``)."""
        if not (torch.is_grad_enabled() and all(self._requires_grad)):
            return outputs
        self._own_views = tuple(UseFn.apply(self.own_backward_done, *outputs))
        return self._own_views
