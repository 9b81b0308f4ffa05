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
from the layout (the neighbour's local shapes), so no size handshake is needed. The messages
travel while the next forward runs; :meth:`NeighbourCopies.wait` (called in the next step's
pre-hook, before the state they were sent from changes, or by the user) completes them.

The copies are records: :meth:`NeighbourCopies.held` returns, per group, the neighbour's
parameters and moment buffers as :class:`~functional_fsdp.core.records.ShardedState` s of the
neighbour's rank — what :func:`~functional_fsdp.core.recovery.regroup` takes to re-shard the
group onto the survivors when that neighbour is lost.

Around every step the pre-hook also snapshots this rank's own state (before it changes), so a
loss at any point of a step leaves a step every survivor can restore
(:func:`~functional_fsdp.core.recovery.restart_step`); a daemon thread bumps this rank's
heartbeat in the store so survivors tell a dead peer from a slow one. Rebuilding on the
survivors is :mod:`.rebuild`.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import threading
from collections.abc import Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ...core.errors import StateError
from ...core.records import GroupLayout, ShardedState
from ...core.recovery import Redundancy, Restorable, copy_holder, copy_source
from ...core.transitions import pack_locals
from ..comm.custom import base_comm
from ..engine.group import ParamGroup
from ..engine.local_step import param_state, swap_aware

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


#: A :attr:`HeldCopy.scalars` key: 1 where the parameter had optimizer state, 0 where it had
#: none (frozen and left out of the optimizer, or never given a gradient): its moments travel
#: as zeros and a restore gives it no state again.
HAS_STATE = "_ffsdp_has_state"
_ZERO = torch.zeros(1)


def _moment(state: dict[str, Any], key: str, param: torch.Tensor) -> torch.Tensor:
    """``state[key]``'s local shard, or zeros shaped like ``param``'s where it has no state."""
    return _local(state[key]) if key in state else torch.zeros_like(_local(param))


class _GroupPlan:
    """What one group sends: the byte layout of its parameters, moments and scalars."""

    def __init__(self, group: ParamGroup, optimizer: torch.optim.Optimizer) -> None:
        self.group = group
        state = [param_state(optimizer, p) for p in group.params]
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
        states = [param_state(self.optimizer, p) for p in g.params]
        for k in self.moment_keys:
            moments = (_moment(s, k, p) for s, p in zip(states, g.params))
            out.extend(m.contiguous() for m in moments if m.numel())
        out.extend(self.scalars(states).values())
        return out

    def scalars(self, states: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """The scalar state (e.g. Adam's ``step``), one float per parameter, per key (0 where
        a parameter has none), and :data:`HAS_STATE` once the optimizer has state."""
        out = {
            k: torch.cat([s[k].detach().float().reshape(1) if k in s else _ZERO for s in states])
            for k in self.scalar_keys
        }
        names = self.scalar_names()
        if HAS_STATE in names:
            out[HAS_STATE] = torch.tensor([1.0 if s else 0.0 for s in states])
        return {k: out[k] for k in names}

    def scalar_names(self) -> list[str]:
        """The keys of :meth:`scalars`, in the order they travel."""
        if not (self.moment_keys or self.scalar_keys):
            return []
        return sorted([*self.scalar_keys, HAS_STATE])

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
        scalars = {k: torch.empty(len(lay)) for k in self.scalar_names()}
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
    (:func:`keep_neighbour_copies` makes it), and this rank's own state from before its last
    step: what a survivor restores from when a rank is lost.

    Around every ``optimizer.step()``: the step pre-hook completes the exchange in flight (the
    neighbour's state after the previous step) and snapshots this rank's own state; the
    post-hook counts the step and starts the next exchange (this rank's new state). So at any
    moment a rank holds its own state at :attr:`done` (live) and ``done - 1`` (the snapshot),
    and its neighbour's at ``done - 1`` or ``done``: whatever point of a step a rank is lost at,
    a step exists that every survivor can restore (:func:`~functional_fsdp.core.recovery.restart_step`).

    Attributes:
        policy: the :class:`~functional_fsdp.core.recovery.Redundancy` policy.
        rank: this rank in the data-parallel group; ``source`` the rank whose copy it holds.
        done: optimizer steps completed (counted from ``step`` given at construction).
        held_step: the step of the neighbour's copy last completed.
        bytes_per_step: bytes this rank sends per step (one copy of its state).
    """

    def __init__(
        self,
        groups: Sequence[ParamGroup],
        names: Sequence[str],
        optimizer: torch.optim.Optimizer,
        policy: Redundancy,
        step: int = 0,
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
        self._comm = comm  # its bounded, abort-aware waits (the watchdog's too)
        self.rank, self.world_size = comm.rank, comm.world_size
        self.source = copy_source(self.rank, self.world_size)
        self._holder = copy_holder(self.rank, self.world_size)
        self.done = step
        self._recvs: list[Any] = []
        self._sends: list[Any] = []
        self._incoming: dict[str, HeldCopy] = {}
        self._incoming_step: int | None = None
        self._arrived = False  # the exchange in flight was found complete (_incoming_arrived)
        self._held: dict[str, HeldCopy] = {}
        self.held_step: int | None = None
        self._snapshot: dict[str, HeldCopy] = {}
        self._snapshot_step: int | None = None
        self.bytes_per_step = 0
        # The groups' shard write counters when this rank's state was last sent: a later write
        # outside an optimizer step (a checkpoint load) leaves every copy of it stale.
        self._sent_versions: tuple[int, ...] | None = None
        self._heartbeat = _Heartbeat(self.rank) if self.world_size > 1 else None
        self._handles = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
        ]
        # The copies of the state training starts from: a loss in the first step restores it.
        self.start()
        self.wait()

    @property
    def steps(self) -> int:
        """Optimizer steps completed (:attr:`done`)."""
        return self.done

    def remove(self) -> None:
        """Stop keeping copies (completes the exchange in flight)."""
        self.wait()
        for h in self._handles:
            h.remove()
        self.stop_heartbeat()

    def stop_heartbeat(self) -> None:
        """Stop this rank's heartbeat (its world is gone or left)."""
        if self._heartbeat is not None:
            self._heartbeat.stop()

    def heartbeat(self, rank: int) -> int | None:
        """``rank``'s heartbeat counter in the store (``None``: never beat): a rank whose counter
        stops moving is dead."""
        return None if self._heartbeat is None else self._heartbeat.read(rank)

    @swap_aware
    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        del optimizer, args, kwargs
        self.wait()  # the previous step's copies (sent during this step's forward)
        if self.world_size == 1:
            return
        self._snapshot = {
            name: _own(plan, self._snapshot.get(name))
            for plan, name in zip(self._plans(), self._names)
        }
        self._snapshot_step = self.done

    @swap_aware
    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        del optimizer, args, kwargs
        self.done += 1
        self.start()

    def _plans(self) -> list[_GroupPlan]:
        # Rebuilt each time: the optimizer's state keys appear at its first step.
        return [_GroupPlan(g, self.optimizer) for g in self._groups]

    def start(self) -> None:
        """Send this rank's state to its copy holder and post the receives of the neighbour's,
        straight into the copy's buffers (asynchronous: the messages travel while the next
        forward runs; the next step's pre-hook completes them before the state changes)."""
        if self.world_size == 1:
            return
        holder = dist.get_global_rank(self._pg, self._holder)
        source = dist.get_global_rank(self._pg, self.source)
        sends: list[dist.P2POp] = []
        recvs: list[dist.P2POp] = []
        incoming, sent = {}, 0
        # The k-th message this rank sends is the k-th its holder receives (tag k): the
        # receiver's views follow the sender's order, shapes from the sender's rank.
        for plan, name in zip(self._plans(), self._names):
            copy, views = plan.receives(self.source)
            incoming[name] = copy
            for t in plan.sends():
                sends.append(dist.P2POp(dist.isend, t, holder, self._pg, len(sends)))
                sent += t.numel() * t.element_size()
            for v in views:
                recvs.append(dist.P2POp(dist.irecv, v, source, self._pg, len(recvs)))
        self._sent_versions = self._versions()
        works = dist.batch_isend_irecv(sends + recvs)
        self._sends, self._recvs = works[: len(sends)], works[len(sends) :]
        self._incoming, self._incoming_step = incoming, self.done
        self._arrived = False
        self.bytes_per_step = sent

    def wait(self) -> None:
        """Complete the exchange in flight (if any) and keep the received copies."""
        if self.world_size == 1:
            self.held_step = self.done  # nothing to copy: nobody else to lose
            return
        if not self._recvs and not self._sends:
            return
        works, self._sends, self._recvs = self._sends + self._recvs, [], []
        # Bounded and abort-aware: a survivor whose neighbour gave up on this exchange (its own
        # wait failed on the lost rank) is told at once instead of waiting for that
        # neighbour's sockets to close, long after the others stopped waiting for it.
        self._comm.wait_works(works, "the neighbour copies' exchange")
        self._held, self._incoming = self._incoming, {}
        self.held_step, self._incoming_step = self._incoming_step, None

    def _versions(self) -> tuple[int, ...]:
        return tuple(g.sharded_version() for g in self._groups)

    def restorable(self) -> Restorable:
        """What this rank can restore now (for the survivors' agreement), without waiting:
        its own state at :attr:`done` and at its snapshot's step, its neighbour's at the last
        completed exchange, and at the one in flight if all its messages already arrived.

        Raises:
            StateError: the sharded parameters were written since this rank's state was last
                sent, outside an optimizer step (a checkpoint loaded, ``summon_full_params``
                written back): every copy predates the write, and a rebuild would mix the
                states from before and after it.
        """
        if self._sent_versions is not None and self._versions() != self._sent_versions:
            raise StateError(
                f"rank {self.rank}: the model's sharded parameters were written after step "
                f"{self.done}'s neighbour copies were sent, outside an optimizer step (a "
                "checkpoint load, or summon_full_params writing back), so the copies hold the "
                "state from before that write and cannot rebuild a lost rank consistently. "
                "Resume from the checkpoint instead. To load while keeping copies: "
                "copies.remove(), load, then keep_neighbour_copies(model, optimizer, step=...) "
                "again (docs/recovery.md)"
            )
        own = (self.done,) + (() if self._snapshot_step is None else (self._snapshot_step,))
        copy: tuple[int, ...] = () if self.held_step is None else (self.held_step,)
        if self._incoming_arrived():
            assert self._incoming_step is not None
            copy += (self._incoming_step,)
        return Restorable(self.rank, tuple(sorted(set(own))), tuple(sorted(set(copy))))

    def _incoming_arrived(self) -> bool:
        """Whether the exchange in flight fully arrived (checked once: see :func:`_all_arrived`)."""
        if not self._arrived and self._incoming_step is not None and self._recvs:
            self._arrived = _all_arrived(self._recvs)
        return self._arrived

    def own_at(self, step: int) -> dict[str, HeldCopy]:
        """Per group, this rank's own state after ``step`` optimizer steps (live or snapshot)."""
        if step == self.done:
            return {name: _own(plan, None) for plan, name in zip(self._plans(), self._names)}
        if step == self._snapshot_step:
            return dict(self._snapshot)
        raise StateError(
            f"rank {self.rank} holds its own state at steps {self.restorable().own}, not {step}"
        )

    def copy_at(self, step: int) -> dict[str, HeldCopy]:
        """Per group, the neighbour's state after ``step`` steps (a completed exchange)."""
        if step == self.held_step:
            return dict(self._held)
        if step == self._incoming_step and self._incoming_arrived():
            return dict(self._incoming)
        raise StateError(
            f"rank {self.rank} holds its neighbour's state at steps {self.restorable().copy}, "
            f"not {step}"
        )

    def last_complete(self) -> dict[str, HeldCopy]:
        """The copies of the last exchange that completed, without waiting for the one in
        flight (after a rank was lost, that one may never complete)."""
        return dict(self._held)

    def held(self) -> dict[str, HeldCopy]:
        """Per group (by its module path), the neighbour's state after the last exchanged step
        (:meth:`wait` first)."""
        self.wait()
        return dict(self._held)


class _Heartbeat:
    """A daemon thread that bumps ``ffsdp/heartbeat/<rank>`` in the default group's store every
    ``interval_s``: how survivors tell a dead peer (its counter stops) from a slow one without
    waiting out a timeout."""

    def __init__(self, rank: int, interval_s: float = 0.1) -> None:
        self._store = dist.distributed_c10d._get_default_store()
        self._key = f"ffsdp/heartbeat/{rank}"
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ffsdp-heartbeat", daemon=True)
        self._thread.start()
        atexit.register(self.stop)  # never inside a store call while the interpreter ends

    def _run(self) -> None:
        while not self._stop.is_set():
            # A slow or failed store call (a loaded machine): beat again next time. Giving up
            # for good here made a live rank's counter stand still, and the survivors declared
            # it lost; at exit the atexit hook stops the thread.
            with contextlib.suppress(Exception):
                self._store.add(self._key, 1)
            self._stop.wait(self._interval_s)

    def read(self, rank: int) -> int | None:
        key = f"ffsdp/heartbeat/{rank}"
        if not self._store.check([key]):
            return None
        return int(self._store.add(key, 0))

    def stop(self) -> None:
        self._stop.set()


def _all_arrived(works: list[Any]) -> bool:
    """Whether every receive completed without error. Waits at most 50 ms each: gloo reports a
    point-to-point message complete only once waited for, and a message that arrived before its
    sender died is complete; a sender that died mid-message fails the wait."""
    for w in works:
        try:
            w.wait(timeout=datetime.timedelta(milliseconds=50))
        except Exception:  # not arrived, or the sender died mid-message
            return False
    return True


def _own(plan: _GroupPlan, reuse: HeldCopy | None) -> HeldCopy:
    """This rank's state of ``plan``'s group as a :class:`HeldCopy` (copied, into ``reuse``'s
    buffers, donated, when they fit)."""
    g = plan.group
    states = [param_state(plan.optimizer, p) for p in g.params]
    fits = reuse is not None and sorted(reuse.moments) == plan.moment_keys
    with torch.no_grad():
        if reuse is not None and fits:
            params = reuse.params
            params.flat.copy_(g.state.flat)
        else:
            params = ShardedState(g.layout, g.state.rank, g.state.flat.clone())
        moments = {
            k: pack_locals(
                [_moment(s, k, p) for s, p in zip(states, g.params)],
                g.layout,
                g.state.rank,
                donate=reuse.moments[k] if reuse is not None and fits else None,
            )
            for k in plan.moment_keys
        }
    return HeldCopy(params, moments, plan.scalars(states))


def keep_neighbour_copies(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    policy: Redundancy | None = None,
    *,
    step: int = 0,
) -> NeighbourCopies:
    """Keep, on every rank, a copy of its neighbour's sharded parameters and optimizer state,
    refreshed after every ``optimizer.step()`` (see the module docstring).

    Args:
        model: the root module (after ``fully_shard``).
        optimizer: its optimizer (its state is copied after each step).
        policy: :class:`~functional_fsdp.core.recovery.Redundancy` (default: one copy).
        step: optimizer steps already completed (after a recovery: the step restarted from).

    Every rank must call it together: it exchanges the first copies (of the state training
    starts from) before returning.

    Raises:
        StateError: not a sharded model, or HSDP.
    """
    found = model_groups(model)
    if not found:
        raise StateError("keep_neighbour_copies: the model has no fully_shard groups")
    groups, names = [g for g, _ in found], [n for _, n in found]
    return NeighbourCopies(
        groups, names, optimizer, Redundancy() if policy is None else policy, step
    )


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
