"""One parameter a group manages (FSDP2's ``FSDPParam``): its spec, the modules that hold it,
its sharded ``DTensor``, its full tensor during a forward and where its reduced gradient lands.

A :class:`ShardedParam` holds no data of its own: its sharded parameter's local tensor is a
view of the group's packed shards (the group's one mutable cell, ``ParamGroup.state``), and its
full tensor is a view of the group's one unsharded buffer (or the autograd output over it).
The group (:class:`~.group.ParamGroup`) creates, updates and registers its parameters; nobody
else writes their fields.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Placement

from ...core.records import ParamSpec
from .dtensors import wrap
from .local_step import own_step

__all__ = ["Holders", "ShardedParam"]

Holders = list[tuple[nn.Module, str]]
"""The ``(module, attribute name)`` pairs that register one parameter (several when tied)."""


class ShardedParam:
    """One managed parameter of a group.

    Attributes:
        index: its position in the group (``layout.specs[index]``, its slice of the packed
            shards and of the unsharded buffer).
        spec: its :class:`~functional_fsdp.core.records.ParamSpec` (shape, dtype, name).
        holders: the ``(module, attribute name)`` pairs that register it.
        requires_grad: whether it trains (a frozen one gets no gradient and no reduction).
        placements: its sharded ``DTensor``'s placements (``Shard(d)``, HSDP's
            ``(Replicate(), Shard(d))``, or the 2-D placements under tensor parallelism).
        dtensor_spec: its sharded ``DTensor``'s spec (mesh, placements, global shape).
        sharded: the ``nn.Parameter`` (a ``DTensor``) that the optimizer and state dicts see.
        full: the full tensor this forward registered (the autograd output of the group's
            unshard, TP-local under 2-D), ``None`` outside forward and backward.
        lent: the ``(module, attribute name)`` pairs of *other* groups' modules that use it too
            (a weight tied across groups, :mod:`.tied`): they hold the sharded parameter
            except while their module runs, when its :class:`~.tied.TiedUse` puts this
            forward's full tensor there.
    """

    __slots__ = (
        "dtensor_spec",
        "full",
        "holders",
        "index",
        "lent",
        "placements",
        "requires_grad",
        "sharded",
        "spec",
    )

    def __init__(
        self,
        index: int,
        spec: ParamSpec,
        holders: Holders,
        requires_grad: bool,
        placements: tuple[Placement, ...],
        dtensor_spec: DTensorSpec,
        local: torch.Tensor,
    ) -> None:
        self.index = index
        self.spec = spec
        self.holders = holders
        self.requires_grad = requires_grad
        self.placements = placements
        self.dtensor_spec = dtensor_spec
        self.sharded: nn.Parameter = own_step(
            nn.Parameter(self.dtensor(local), requires_grad=requires_grad)
        )
        self.full: torch.Tensor | None = None
        self.lent: Holders = []

    @property
    def fqn(self) -> str:
        """Its name under the module passed to ``fully_shard`` (for messages)."""
        return self.spec.fqn

    def dtensor(self, local: torch.Tensor) -> DTensor:
        """``local`` (its shard, or a sharded gradient) as a ``DTensor`` with its spec."""
        return wrap(local, self.dtensor_spec)

    def relayout(
        self, spec: ParamSpec, placements: tuple[Placement, ...], dtensor_spec: DTensorSpec
    ) -> None:
        """Take a new spec (``module.to(dtype)`` changed its dtype: the group re-laid out)."""
        self.spec, self.placements, self.dtensor_spec = spec, placements, dtensor_spec

    def adopt(self, current: torch.Tensor, local: torch.Tensor) -> None:
        """Make ``current`` (the parameter now on its module) view ``local`` in the group's
        new packed shards; a tensor that is not a ``DTensor`` parameter is replaced by one."""
        if isinstance(current, nn.Parameter) and isinstance(current, DTensor):
            current._local_tensor = local
            self.sharded = own_step(current)
        else:
            self.sharded = own_step(
                nn.Parameter(self.dtensor(local), requires_grad=self.requires_grad)
            )

    # ------------------------------------------------------------------ on its modules

    def registered(self) -> torch.Tensor | None:
        """The tensor its first holder registers now (its own, or a caller's substitute)."""
        module, name = self.holders[0]
        return module._parameters.get(name)

    def to_sharded(self) -> None:
        """Register the sharded parameter on every holder."""
        p = self.sharded
        for m, n in self.holders:
            m._parameters[n] = p

    def register(self, t: torch.Tensor) -> None:
        """Register ``t`` (a full tensor, or a caller's source put back) on every holder."""
        for m, n in self.holders:
            m._parameters[n] = t  # type: ignore[assignment]

    def lend(self, holders: Holders) -> None:
        """Let ``holders`` (modules of another group) use it; they hold the sharded parameter."""
        self.lent = [*self.lent, *holders]
        self.register_lent(self.sharded)

    def register_lent(self, t: torch.Tensor) -> None:
        """Register ``t`` on the modules of other groups that use it (:attr:`lent`)."""
        for m, n in self.lent:
            m._parameters[n] = t  # type: ignore[assignment]

    def owns_full(self, t: object, view: torch.Tensor | None) -> bool:
        """Whether ``t`` is its own full tensor: ``view`` (of the group's live unsharded
        buffer) or this forward's autograd output."""
        return (view is not None and t is view) or (self.full is not None and t is self.full)

    # ------------------------------------------------------------------ its gradient

    def grad_local(self) -> torch.Tensor | None:
        """The local tensor of its sharded ``.grad`` (``None`` when it has none)."""
        g = self.sharded.grad
        return None if g is None else g._local_tensor  # type: ignore[attr-defined]

    def land_grad(self, local: torch.Tensor | None, prev: torch.Tensor | None) -> None:
        """Land a reduced shard: ``local`` is the new ``.grad`` data (``prev`` accumulated in
        place, or a fresh tensor that becomes the ``.grad``; ``None``: no gradient)."""
        if local is not None and local is not prev:
            self.sharded.grad = self.dtensor(local)
