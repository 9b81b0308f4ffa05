"""Neighbour copies: after each optimizer step every rank also holds its neighbour's shards.

:func:`keep_neighbour_copies` registers an optimizer step post-hook. After each step, for each
group of the model, a rank packs its *state* — the sharded parameters (the group's packed
buffer) and every optimizer-state tensor shaped like a parameter's shard (Adam's moments),
packed in the group's layout as the parameters are (:func:`~functional_fsdp.core.transitions.pack_locals`,
zero padding), plus the scalar state (Adam's ``step``) — and sends it, tensor by tensor as they
are (no packing copy), to the rank that keeps its copy
(:func:`~functional_fsdp.core.recovery.copy_holder`), while it receives its neighbour's
(:func:`~functional_fsdp.core.recovery.copy_source`) straight into the copy's packed buffers
(each shard's place in the group's layout, so the copy is a record at once). The sizes follow
from the layout (the neighbour's local shapes), so no size handshake is needed. The messages travel while the next forward runs; :meth:`NeighbourCopies.wait` (called
at the next step's post-hook, or by the user) completes them.

The copies are records: :meth:`NeighbourCopies.held` returns, per group, the neighbour's
parameters and moment buffers as :class:`~functional_fsdp.core.records.ShardedState` s of the
neighbour's rank — what :func:`~functional_fsdp.core.recovery.regroup` takes to re-shard the
group onto the survivors when that neighbour is lost.

Not here yet (issue "Lose a rank, lose no step"): detecting a dead peer during a step, building
the survivors' process group, re-sharding every group and the optimizer in place, and redoing
the interrupted step. The spike that measured the gloo side is in the issue's note.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ...core.errors import StateError
from ...core.records import GroupLayout, ShardedState
from ...core.recovery import Redundancy, copy_holder, copy_source
from ..comm.custom import base_comm
from ..engine.group import ParamGroup

__all__ = ["HeldCopy", "NeighbourCopies", "keep_neighbour_copies", "model_groups"]


@attrs.frozen(eq=False)
class HeldCopy:
    """The copy a rank holds of its neighbour's state of one group (after a step).

    Attributes:
        params: the neighbour's sharded parameters (``rank``: the neighbour's).
        moments: per optimizer-state key shaped like the parameters (e.g. ``exp_avg``), the
            neighbour's values packed in the same layout.
        scalars: per key of scalar state (e.g. ``step``), one value per parameter.
    """

    params: ShardedState
    moments: dict[str, ShardedState]
    scalars: dict[str, torch.Tensor]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class _GroupPlan:
    """What one group sends: the byte layout of its parameters, moments and scalars."""

    def __init__(self, group: ParamGroup, optimizer: torch.optim.Optimizer) -> None:
        self.group = group
        state = [optimizer.state.get(p, {}) for p in group.params]
        first: dict[str, Any] = next((s for s in state if s), {})
        local0 = [_local(p) for p in group.params]
        self.moment_keys = sorted(
            k
            for k, v in first.items()
            if isinstance(v, torch.Tensor) and v.dim() > 0 and _like_param(state, local0, k)
        )
        self.scalar_keys = sorted(
            k for k, v in first.items() if isinstance(v, torch.Tensor) and v.dim() == 0
        )
        self.optimizer = optimizer

    def sends(self) -> list[torch.Tensor]:
        """This rank's tensors to send, in order, as they are (no packing copy): the packed
        parameters, each moment's non-empty local shards, the scalars."""
        g = self.group
        out: list[torch.Tensor] = [g.state.flat]
        states = [self.optimizer.state.get(p, {}) for p in g.params]
        for k in self.moment_keys:
            out.extend(_local(s[k]).contiguous() for s in states if _local(s[k]).numel())
        for k in self.scalar_keys:
            out.append(torch.cat([s[k].detach().float().reshape(1) for s in states]))
        return out

    def receives(self, source: int) -> tuple[HeldCopy, list[torch.Tensor]]:
        """The neighbour's copy to be (its records, zero padded) and the views the messages
        land in, in :meth:`sends`' order on the neighbour."""
        lay: GroupLayout = self.group.layout
        flat = self.group.state.flat
        params = ShardedState(lay, source, torch.empty_like(flat))
        views: list[torch.Tensor] = [params.flat]
        moments = {}
        for k in self.moment_keys:
            m = ShardedState(lay, source, torch.zeros_like(flat))
            views.extend(v for v in m.locals() if v.numel())
            moments[k] = m
        scalars = {k: torch.empty(len(lay)) for k in self.scalar_keys}
        views.extend(scalars.values())
        return HeldCopy(params, moments, scalars), views


def _like_param(states: list[dict[str, Any]], locals_: list[torch.Tensor], key: str) -> bool:
    """Whether optimizer state ``key`` has each parameter's local shard shape."""
    return all(
        key not in s or tuple(_local(s[key]).shape) == tuple(p.shape)
        for s, p in zip(states, locals_)
    )


class NeighbourCopies:
    """The copies of one model's neighbour state, refreshed after every optimizer step
    (:func:`keep_neighbour_copies` makes it).

    Attributes:
        policy: the :class:`~functional_fsdp.core.recovery.Redundancy` policy.
        rank: this rank in the data-parallel group; ``source`` the rank whose copy it holds.
        steps: how many steps' copies have been exchanged.
        bytes_per_step: bytes this rank sends per step (one copy of its state).
    """

    def __init__(
        self,
        groups: Sequence[ParamGroup],
        names: Sequence[str],
        optimizer: torch.optim.Optimizer,
        policy: Redundancy,
    ) -> None:
        self.policy = policy
        self._groups = list(groups)
        self._names = list(names)
        self.optimizer = optimizer
        comm = base_comm(self._groups[0].comm)
        if comm is None or self._groups[0].replicate_comm is not None:
            raise StateError(
                "keep_neighbour_copies needs 1-D FSDP groups over a torch.distributed process "
                "group (HSDP replicas already hold copies of each other)"
            )
        assert comm.group is not None  # ProcessGroupComm resolves None to the world
        self._pg: dist.ProcessGroup = comm.group
        self.rank, self.world_size = comm.rank, comm.world_size
        self.source = copy_source(self.rank, self.world_size)
        self._holder = copy_holder(self.rank, self.world_size)
        self._plans: list[_GroupPlan] | None = None
        self._works: list[Any] = []
        self._incoming: dict[str, HeldCopy] = {}
        self._held: dict[str, HeldCopy] = {}
        self.steps = 0
        self.bytes_per_step = 0
        self._handle = optimizer.register_step_post_hook(self._after_step)

    def remove(self) -> None:
        """Stop keeping copies (completes the exchange in flight)."""
        self.wait()
        self._handle.remove()

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        del optimizer, args, kwargs
        self.wait()  # the previous step's copies (sent during this step's forward)
        self.start()

    def start(self) -> None:
        """Send this rank's state to its copy holder and post the receives of the neighbour's,
        straight into the copy's buffers (asynchronous: the messages travel while the next
        forward runs)."""
        if self.world_size == 1:
            return
        if self._plans is None:
            self._plans = [_GroupPlan(g, self.optimizer) for g in self._groups]
        holder = dist.get_global_rank(self._pg, self._holder)
        source = dist.get_global_rank(self._pg, self.source)
        sends: list[dist.P2POp] = []
        recvs: list[dist.P2POp] = []
        incoming, sent = {}, 0
        # The k-th message this rank sends is the k-th its holder receives (tag k): the
        # receiver's views follow the sender's order, shapes from the sender's rank.
        for plan, name in zip(self._plans, self._names):
            copy, views = plan.receives(self.source)
            incoming[name] = copy
            for t in plan.sends():
                sends.append(dist.P2POp(dist.isend, t, holder, self._pg, len(sends)))
                sent += t.numel() * t.element_size()
            for v in views:
                recvs.append(dist.P2POp(dist.irecv, v, source, self._pg, len(recvs)))
        ops = sends + recvs
        self._works = dist.batch_isend_irecv(ops)
        self._incoming = incoming
        self.bytes_per_step = sent

    def wait(self) -> None:
        """Complete the exchange in flight (if any) and keep the received copies."""
        if not self._works:
            return
        works, self._works = self._works, []
        for w in works:
            w.wait()
        self._held, self._incoming = self._incoming, {}
        self.steps += 1

    def last_complete(self) -> dict[str, HeldCopy]:
        """The copies of the last exchange that completed, without waiting for the one in
        flight (after a rank was lost, that one may never complete)."""
        return dict(self._held)

    def held(self) -> dict[str, HeldCopy]:
        """Per group (by its module path), the neighbour's state after the last exchanged step
        (:meth:`wait` first)."""
        self.wait()
        return dict(self._held)


def keep_neighbour_copies(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, policy: Redundancy | None = None
) -> NeighbourCopies:
    """Keep, on every rank, a copy of its neighbour's sharded parameters and optimizer state,
    refreshed after every ``optimizer.step()`` (see the module docstring).

    Args:
        model: the root module (after ``fully_shard``).
        optimizer: its optimizer (its state is copied after each step).
        policy: :class:`~functional_fsdp.core.recovery.Redundancy` (default: one copy).

    Raises:
        StateError: not a sharded model, or HSDP.
    """
    found = model_groups(model)
    if not found:
        raise StateError("keep_neighbour_copies: the model has no fully_shard groups")
    groups, names = [g for g, _ in found], [n for _, n in found]
    return NeighbourCopies(groups, names, optimizer, Redundancy() if policy is None else policy)


def model_groups(model: torch.nn.Module) -> list[tuple[ParamGroup, str]]:
    """The model's groups, each once, with its module path (``"(root)"`` for the root)."""
    states = [s for m in model.modules() if (s := getattr(m, "_ffsdp_state", None)) is not None]
    seen: set[int] = set()
    out = []
    paths = {id(m): p for p, m in model.named_modules()}
    for s in states:
        g = s.group
        if g is not None and id(g) not in seen:
            seen.add(id(g))
            out.append((g, paths.get(id(s.module)) or "(root)"))
    return out
