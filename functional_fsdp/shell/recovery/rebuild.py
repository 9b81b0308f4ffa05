"""Rebuilding a model on the survivors of a lost rank, from memory.

:func:`rebuild_on_survivors` is what a training loop calls when a step failed because a rank
died (on gloo the survivors' waits fail within milliseconds: the peer's sockets close; a
survivor blocked on another survivor is woken when that one enters this function). Whatever
point of the step the rank was lost at (forward, backward, a reduce-scatter, the optimizer
step, the copies' exchange, between steps):

1. every peer still blocked in a collective with this rank is told through the store that
   this rank gave up (its wait raises :class:`~functional_fsdp.core.errors.PeerAbortedError`
   within 0.1 s, and it calls this function too); the step in flight is abandoned on the old
   model (each group's ``reset_iter_state``, local: no collective) and the old default process
   group is dropped (its sockets close only once the old model is gone: that alone wakes
   nobody);
2. the survivors agree through the launcher's store on who is alive (each posts what it can
   restore: :class:`~functional_fsdp.core.recovery.Restorable`; the first to decide writes the
   list with ``compare_set``, so every survivor reads one answer), and on the step to restart
   from (:func:`~functional_fsdp.core.recovery.restart_step`: the latest step at which every
   survivor holds its own state and the lost ranks' copies exist). Two neighbours lost together
   end here in :class:`~functional_fsdp.core.errors.UnrecoverableLossError` on every survivor,
   before any collective;
3. a new default process group of the survivors is initialised over a fresh store prefix
   (``torch.distributed`` itself, ranked in old-rank order);
4. each group is re-sharded onto the survivors with
   :func:`functional_fsdp.core.recovery.regroup` (each survivor's own state at that step and
   the copy it holds: one all-gather), parameters and the optimizer's moments alike. With a
   :class:`~functional_fsdp.core.reproducible.ReproduciblePolicy` only the largest power of two
   of survivors that divides ``V`` trains on (the rest are told they are spares and leave), so
   the run stays bit-identical to one that never lost a rank;
5. the caller's ``build()`` makes the model and optimizer afresh on the new world, the
   re-sharded values are written into them, and new neighbour copies start.

Spares: with ``standby=True`` a survivor that does not train on waits (:func:`stand_by`) in
the store; at the next loss the survivors claim it for the lost rank's place (in the agreement,
step 2), the lost rank's copy holder sends it the copy, and the world keeps its size: nothing is
re-sharded, and under the reproducible policy the run stays bit-identical. At the end of
training :func:`release_spares` lets waiting spares go.

The caller continues from :attr:`Rebuilt.step` (the steps completed: the interrupted one is
redone, with the same global batch split over the survivors).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any, cast

import attrs
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ...core.errors import ArgumentTypeError, StateError
from ...core.records import ShardedState
from ...core.recovery import (
    Redundancy,
    Restorable,
    active_world_size,
    copy_holder,
    regroup,
    restart_step,
)
from ...core.reproducible import ReproduciblePolicy
from ..comm.process_group import ProcessGroupComm, post_abort_everywhere
from ..engine.dtensors import shard_like
from .copies import (
    HAS_STATE,
    HeldCopy,
    NeighbourCopies,
    _local,
    keep_neighbour_copies,
    model_groups,
)

__all__ = ["Rebuilt", "rebuild_on_survivors", "release_spares", "stand_by"]

log = logging.getLogger("functional_fsdp.recovery")


@attrs.frozen(eq=False)
class Rebuilt:
    """What :func:`rebuild_on_survivors` returns.

    Attributes:
        model: the new model on the survivors' world (``None`` on a spare).
        optimizer: its optimizer, with the re-sharded state (``None`` on a spare).
        copies: its neighbour copies (``None`` on a spare).
        rank: this rank in the new world (``-1`` on a spare).
        world_size: the ranks training on.
        survivors: the old ranks alive, in order; ``lost``: the old ranks lost.
        step: the optimizer steps completed in the state restored: continue from there.
        seconds: the time the rebuild took on this rank.
        message: the log line describing what happened.
        epoch: the recovery epoch that made this world (the next recovery's is ``epoch + 1``;
            a spare learns it when it is claimed).
    """

    model: torch.nn.Module | None
    optimizer: torch.optim.Optimizer | None
    copies: NeighbourCopies | None
    rank: int
    world_size: int
    survivors: tuple[int, ...]
    lost: tuple[int, ...]
    step: int
    seconds: float
    message: str
    epoch: int = 0

    @property
    def spare(self) -> bool:
        """Whether this survivor does not train on (a spare of the reproducible policy)."""
        return self.model is None


def _agree(
    store: Any, epoch: int, report: Restorable, copies: NeighbourCopies, wait_s: float
) -> tuple[list[Restorable], dict[int, int]]:
    """What each survivor can restore, for the same survivors on every one of them (the first
    decision wins), and the waiting spares that take the lost ranks' places (lost rank ->
    spare id; empty unless there is one for each). A rank that has not reported is dead once
    its heartbeat stood still for :func:`_dead_after` (0.5 s, longer when this rank itself is
    starved). A rank whose heartbeat moves is alive and is waited for (it reports once its own
    wait fails, which can take seconds on a loaded machine); nobody waits longer than
    ``wait_s``."""
    prefix = f"ffsdp/recover/{epoch}/"
    world_size = copies.world_size
    _report_alive(store, epoch, report)  # (again: the first report came before the teardown)
    deadline = time.monotonic() + wait_s
    keys = [f"{prefix}alive/{r}" for r in range(world_size)]
    beats: dict[int, tuple[int | None, float]] = {}  # rank -> (counter, when it last moved)
    last = time.monotonic()
    stall = 0.0  # the longest this rank went between two looks (its own scheduling delay)
    while time.monotonic() < deadline:
        pending = [r for r in range(world_size) if not store.check([keys[r]])]
        now = time.monotonic()
        stall, last = max(stall, now - last), now
        for r in pending:
            beat = copies.heartbeat(r)
            if r not in beats or beats[r][0] != beat:
                beats[r] = (beat, now)
        if all(now - beats[r][1] > _dead_after(stall) for r in pending):
            break
        time.sleep(0.01)
    copies.stop_heartbeat()
    alive = [r for r in range(world_size) if store.check([keys[r]])]
    lost = [r for r in range(world_size) if r not in alive]
    mine = json.dumps([alive, _claim_spares(store, lost)])
    decided, spares = json.loads(store.compare_set(f"{prefix}decision", "", mine).decode())
    out = []
    for r in decided:
        own, copy = json.loads(store.get(keys[r]).decode())
        out.append(Restorable(r, tuple(own), tuple(copy)))
    return out, {int(d): int(i) for d, i in spares.items()}


def _report_alive(store: Any, epoch: int, report: Restorable) -> None:
    """Tell the other survivors this rank is alive and what it can restore."""
    key = f"ffsdp/recover/{epoch}/alive/{report.rank}"
    store.set(key, json.dumps([report.own, report.copy]))


def _claim_spares(store: Any, lost: list[int]) -> dict[int, int]:
    """Waiting spares for the lost slots (lost rank -> spare id), claimed for good; none unless
    there are enough for every lost rank."""
    count = int(store.add(_SPARES, 0))
    waiting = [i for i in range(1, count + 1) if store.get(f"{_SPARES}/{i}") == b"waiting"]
    if not lost or len(waiting) < len(lost):
        return {}
    claimed: dict[int, int] = {}
    for d in lost:
        while waiting:
            i = waiting.pop(0)
            if store.compare_set(f"{_SPARES}/{i}", "waiting", "claimed") == b"claimed":
                claimed[d] = i
                break
    if len(claimed) < len(lost):  # another recovery took some: give them back
        for i in claimed.values():
            store.set(f"{_SPARES}/{i}", "waiting")
        return {}
    return claimed


_SPARES = "ffsdp/spares"


_DEAD_AFTER_S = 0.5  # five heartbeats missed
_STALLS = 5  # a still heartbeat counts only past five of this rank's own scheduling stalls


def _dead_after(stall_s: float) -> float:
    """How long a silent rank's heartbeat must stand still before it is declared lost, given
    the longest this survivor itself went unscheduled while it watched (``stall_s``). On a
    loaded machine a live peer's heartbeat thread is starved as this one is: the threshold
    grows with the starvation this rank sees, within the wait's bound (``wait_s``)."""
    return max(_DEAD_AFTER_S, _STALLS * stall_s)


def rebuild_on_survivors(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    copies: NeighbourCopies,
    store: Any,
    build: Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer]],
    *,
    epoch: int = 1,
    wait_s: float = 60.0,
    reproducible: ReproduciblePolicy | None = None,
    standby: bool = False,
    standby_timeout_s: float | None = None,
) -> Rebuilt:
    """Continue on the survivors of a lost rank from memory (see the module docstring).

    Call it on every survivor after a step raised because a peer died (a
    :class:`~functional_fsdp.core.errors.CollectiveError` or gloo's ``RuntimeError``).

    Args:
        model, optimizer: the old ones (their shards are read; then they are dropped).
        copies: their :func:`~.copies.keep_neighbour_copies`.
        store: the launcher's store (it must outlive every rank: not rank 0's).
        build: makes the model (``fully_shard`` on the default world) and its optimizer.
        epoch: a number new to this store for each recovery (names the new group's prefix).
        wait_s: the longest survivors wait for a live rank (its heartbeat moves) to report
            alive; past it the rank is declared lost. A rank whose heartbeat stopped is
            declared lost after 0.5 s, whatever ``wait_s``. Keep it well above the time a
            survivor's failed collective takes to reach every live rank on a loaded machine
            (a live rank declared lost cannot rejoin: it raises ``StateError``).
        reproducible: the run's :class:`ReproduciblePolicy`, if any (chooses how many survivors
            train on).
        standby: a survivor that does not train on (a spare) waits in this call
            (:func:`stand_by`) until a later loss needs it, then returns as a training rank in
            the lost rank's place (the world keeps its size, so nothing is re-sharded), or
            until :func:`release_spares` (``rb.spare`` then). Without it a spare returns at once.
        standby_timeout_s: the longest a spare waits (``None``: until needed or released).

    Raises:
        ArgumentTypeError: ``copies`` is not a :class:`~.copies.NeighbourCopies` (e.g.
            ``None``: no copies were kept); raised before anything changes.
        UnrecoverableLossError: the lost ranks' copies were lost with them (two neighbours).
        StateError: this rank is not among the agreed survivors.

    A failure that lost no rank (every rank reports alive: an exception on some rank, a
    timeout) is recovered the same way, on every rank: the world is rebuilt whole and the
    step in flight redone, each rank from its own state.
    """
    if not isinstance(copies, NeighbourCopies):
        raise ArgumentTypeError(
            f"rebuild_on_survivors needs the neighbour copies the lost ranks are rebuilt from, "
            f"got copies={copies!r}: call copies = keep_neighbour_copies(model, optimizer) on "
            "every rank before training and pass them here (without copies a lost rank's shards "
            "exist nowhere in memory: resume from the last checkpoint instead)"
        )
    t0 = time.monotonic()
    rank, ws = copies.rank, copies.world_size
    report = copies.restorable()
    # Report alive first: the teardown below can take a while on a loaded machine, and a
    # survivor that reports late is declared lost.
    _report_alive(store, epoch, report)
    # Release peers blocked on this rank (step 1 of the module docstring): dropping the group
    # below does not close its sockets while the old model references it.
    post_abort_everywhere()
    for g, _ in model_groups(model):  # abandon the step in flight, locally (no collective)
        g.reset_iter_state()
    if dist.is_initialized():
        dist.destroy_process_group()
    reports, spares = _agree(store, epoch, report, copies, wait_s)
    alive = tuple(r.rank for r in reports)
    if rank not in alive:
        raise StateError(f"rank {rank} was declared lost by the survivors {list(alive)}")
    # Nobody lost (an ordinary exception on some rank, e.g. a bad batch): the world was
    # already torn down above, so it is rebuilt whole, each rank from its own state, and the
    # failed step is redone (as for a loss).
    step = restart_step(reports, ws)  # raises UnrecoverableLossError on every survivor alike
    ctx = _Recovery(model, copies, store, build, epoch, step, alive, t0)
    if spares:
        return _replace(ctx, spares)
    virtual = None if reproducible is None else reproducible.virtual_world_size
    return _shrink(ctx, virtual, standby, standby_timeout_s)


@attrs.frozen(eq=False)
class _Recovery:
    """What both ways of going on (:func:`_shrink`, :func:`_replace`) start from: the old
    model and its copies, the store, the caller's ``build``, the epoch, the agreed restart step
    and survivors, and the time the recovery began."""

    model: torch.nn.Module
    copies: NeighbourCopies
    store: Any
    build: Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer]]
    epoch: int
    step: int
    alive: tuple[int, ...]
    t0: float


def _shrink(
    ctx: _Recovery, virtual: int | None, standby: bool, standby_timeout_s: float | None
) -> Rebuilt:
    """The survivors train on without the lost ranks: every group re-sharded onto the
    ``active_world_size`` first of them; the others are spares (they stand by, or leave)."""
    model, copies, store, build, epoch = ctx.model, ctx.copies, ctx.store, ctx.build, ctx.epoch
    step, alive, t0 = ctx.step, ctx.alive, ctx.t0
    rank, ws = copies.rank, copies.world_size
    lost = tuple(r for r in range(ws) if r not in alive)
    active = active_world_size(len(alive), virtual)
    new_rank = alive.index(rank)
    _init_world(store, f"ffsdp-epoch{epoch}/", new_rank, len(alive))
    rebuilt = _regroup_all(model, copies, step, lost, active)
    what = (
        (f"lost rank(s) {list(lost)} of {ws}" if lost else f"no rank of {ws} was lost")
        + f"; restarting from step {step} on {active} rank(s) (old ranks {list(alive[:active])})"
        + (f", spare(s) {list(alive[active:])}" if active < len(alive) else "")
    )
    if new_rank >= active:
        dist.destroy_process_group()
        if standby:
            log.warning(f"recovery: {what}; old rank {rank} stands by")
            return stand_by(store, build, copies.policy, timeout_s=standby_timeout_s)
        message = f"recovery: {what}; old rank {rank} is a spare and leaves training"
        log.warning(message)
        seconds = time.monotonic() - t0
        return Rebuilt(None, None, None, -1, active, alive, lost, step, seconds, message, epoch)
    if active < len(alive):
        dist.destroy_process_group()
        _init_world(store, f"ffsdp-epoch{epoch}/active/", new_rank, active)
    new_model, new_opt = build()
    _write(new_model, new_opt, rebuilt)
    new_copies = keep_neighbour_copies(new_model, new_opt, copies.policy, step=step)
    seconds = time.monotonic() - t0
    message = f"recovery: {what}; rebuilt in {seconds:.2f} s"
    log.warning(message)
    return Rebuilt(
        new_model, new_opt, new_copies, new_rank, active, alive, lost, step, seconds, message, epoch
    )


def _regroup_all(
    model: torch.nn.Module, copies: NeighbourCopies, step: int, lost: tuple[int, ...], active: int
) -> dict[str, HeldCopy]:
    """Every group's parameters and moments at ``step``, re-sharded onto the ``active`` first
    survivors (the new default world), by group path (empty on a spare)."""
    own, held = copies.own_at(step), copies.copy_at(step)
    comm = ProcessGroupComm()
    rebuilt = {}
    for _, name in model_groups(model):  # every survivor joins every regroup (collectives)
        params = regroup(own[name].params, held[name].params, lost, comm, active=active)
        moved = {
            k: regroup(own[name].moments[k], held[name].moments[k], lost, comm, active=active)
            for k in own[name].moments
        }
        if params is not None:
            moments = cast(dict[str, ShardedState], moved)
            rebuilt[name] = HeldCopy(params, moments, own[name].scalars)
    return rebuilt


def _replace(ctx: _Recovery, spares: dict[int, int]) -> Rebuilt:
    """Spares take the lost ranks' places: the world keeps its size and layout, so nothing is
    re-sharded; each lost rank's copy holder sends the copy to the spare in its place."""
    copies, store, build, epoch = ctx.copies, ctx.store, ctx.build, ctx.epoch
    step, alive, t0 = ctx.step, ctx.alive, ctx.t0
    rank, ws = copies.rank, copies.world_size
    lost = tuple(sorted(spares))
    for d, i in spares.items():  # every survivor writes the same claim
        claim = {"epoch": epoch, "slot": d, "world_size": ws, "step": step, "lost": list(lost)}
        store.set(f"{_SPARES}/{i}/claim", json.dumps(claim))
    own = copies.own_at(step)
    sends = {d: copies.copy_at(step) for d in lost if copy_holder(d, ws) == rank}
    for held in sends.values():
        keys = {n: [sorted(c.moments), sorted(c.scalars)] for n, c in held.items()}
        store.set(f"ffsdp/recover/{epoch}/keys", json.dumps(keys))
    _init_world(store, f"ffsdp-epoch{epoch}/", rank, ws)
    new_model, new_opt = build()
    _write(new_model, new_opt, own)
    for d, held in sends.items():
        parts = [held[n] for _, n in model_groups(new_model)]
        _wait_all([dist.isend(t, d, tag=k) for k, t in enumerate(_copy_tensors(parts))])
    new_copies = keep_neighbour_copies(new_model, new_opt, copies.policy, step=step)
    seconds = time.monotonic() - t0
    message = (
        f"recovery: lost rank(s) {list(lost)} of {ws}; spare(s) took their places, restarting "
        f"from step {step} on {ws} rank(s); rebuilt in {seconds:.2f} s"
    )
    log.warning(message)
    return Rebuilt(
        new_model, new_opt, new_copies, rank, ws, alive, lost, step, seconds, message, epoch
    )


def _wait_all(works: list[Any]) -> None:
    for w in works:
        w.wait()


def _copy_tensors(parts: list[HeldCopy]) -> list[torch.Tensor]:
    """The tensors of copies (per group: params, moments, scalars) in the order they travel."""
    out = []
    for c in parts:
        out.append(c.params.flat)
        out.extend(c.moments[k].flat for k in sorted(c.moments))
        out.extend(c.scalars[k] for k in sorted(c.scalars))
    return out


def stand_by(
    store: Any,
    build: Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer]],
    policy: Redundancy | None = None,
    *,
    timeout_s: float | None = None,
) -> Rebuilt:
    """Wait as a spare until a loss needs this process, then take the lost rank's place: join
    the new world in its rank, build the model and receive the lost rank's state (the copy its
    holder kept). Returns a training :class:`Rebuilt`, or one with ``spare`` true when
    :func:`release_spares` let it go.

    Raises:
        StateError: ``timeout_s`` passed without a claim.
    """
    t0 = time.monotonic()
    sid = int(store.add(_SPARES, 1))
    store.set(f"{_SPARES}/{sid}", "waiting")
    key = f"{_SPARES}/{sid}/claim"
    while not store.check([key]):
        late = timeout_s is not None and time.monotonic() - t0 > timeout_s
        if late and store.compare_set(f"{_SPARES}/{sid}", "waiting", "gone") == b"gone":
            raise StateError(f"spare {sid} waited {timeout_s:g} s and was not needed")
        time.sleep(0.05)
    claim = json.loads(store.get(key).decode())
    if claim == "leave":
        return Rebuilt(None, None, None, -1, 0, (), (), -1, 0.0, "released")
    slot, ws, step, epoch = claim["slot"], claim["world_size"], claim["step"], claim["epoch"]
    _init_world(store, f"ffsdp-epoch{epoch}/", slot, ws)
    model, opt = build()
    keys = json.loads(store.get(f"ffsdp/recover/{epoch}/keys").decode())
    received = {}
    for g, name in model_groups(model):
        flat, lay, r = g.state.flat, g.layout, g.state.rank
        moment_keys, scalar_keys = keys[name]
        moments = {k: ShardedState(lay, r, torch.zeros_like(flat)) for k in moment_keys}
        scalars = {k: torch.empty(len(lay)) for k in scalar_keys}
        received[name] = HeldCopy(ShardedState(lay, r, torch.empty_like(flat)), moments, scalars)
    holder = copy_holder(slot, ws)
    tensors = _copy_tensors([received[n] for _, n in model_groups(model)])
    _wait_all([dist.irecv(t, holder, tag=k) for k, t in enumerate(tensors)])
    _write(model, opt, received)
    copies = keep_neighbour_copies(model, opt, policy, step=step)
    seconds = time.monotonic() - t0
    message = f"recovery: a spare took lost rank {slot}'s place, restarting from step {step}"
    log.warning(message)
    lost = tuple(claim["lost"])
    return Rebuilt(model, opt, copies, slot, ws, (), lost, step, seconds, message, epoch)


def release_spares(store: Any) -> int:
    """Let every waiting spare go (at the end of training): their :func:`stand_by` returns
    with ``spare`` true. Returns how many were released."""
    released = 0
    for i in range(1, int(store.add(_SPARES, 0)) + 1):
        if store.compare_set(f"{_SPARES}/{i}", "waiting", "released") == b"released":
            store.set(f"{_SPARES}/{i}/claim", json.dumps("leave"))
            released += 1
    return released


def _init_world(store: Any, prefix: str, rank: int, world_size: int) -> None:
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(prefix, store), rank=rank, world_size=world_size
    )


def _write(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    states: dict[str, HeldCopy],
) -> None:
    """This rank's state (re-sharded, restored or received), by group path, into the new
    model's parameters and optimizer state."""
    by_name = {name: g for g, name in model_groups(model)}
    with torch.no_grad():
        for name, c in states.items():
            g, params, moved, scalars = by_name[name], c.params, c.moments, c.scalars
            for i, param in enumerate(g.params):
                p = cast(DTensor, param)
                _local(p).copy_(params.local(i))
                if not moved and not scalars:
                    continue  # restarted before the first step: no optimizer state yet
                if HAS_STATE in scalars and not bool(scalars[HAS_STATE][i]):
                    continue  # this parameter had none (frozen, or never given a gradient)
                state: dict[str, Any] = {
                    k: v[i].clone() for k, v in scalars.items() if k != HAS_STATE
                }
                for k, m in moved.items():
                    state[k] = shard_like(m.local(i).to(_local(p).device, copy=True), p)
                optimizer.state[p] = state
