"""Rebuilding a model on the survivors of a lost rank, from memory.

:func:`rebuild_on_survivors` is what a training loop calls when a step failed because a rank
died (on gloo the survivors' waits fail within milliseconds: the peer's sockets close; a
survivor blocked on another survivor is woken when that one drops the old group). Whatever
point of the step the rank was lost at (forward, backward, a reduce-scatter, the optimizer
step, the copies' exchange, between steps):

1. the step in flight is abandoned on the old model (each group's ``reset_iter_state``, local:
   no collective) and the old default process group is dropped (this wakes any survivor still
   blocked on this one);
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

from ...core.errors import StateError
from ...core.recovery import Restorable, active_world_size, regroup, restart_step
from ...core.reproducible import ReproduciblePolicy
from ..comm.process_group import ProcessGroupComm
from .copies import NeighbourCopies, keep_neighbour_copies, model_groups

__all__ = ["Rebuilt", "rebuild_on_survivors"]

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

    @property
    def spare(self) -> bool:
        """Whether this survivor does not train on (a spare of the reproducible policy)."""
        return self.model is None


def _agree(
    store: Any, epoch: int, report: Restorable, copies: NeighbourCopies, wait_s: float
) -> list[Restorable]:
    """What each survivor can restore, for the same survivors on every one of them (the first
    decision wins). A rank that has not reported is dead once its heartbeat stood still for
    ``_DEAD_AFTER_S``; nobody waits longer than ``wait_s``."""
    prefix = f"ffsdp/recover/{epoch}/"
    world_size = copies.world_size
    store.set(f"{prefix}alive/{report.rank}", json.dumps([report.own, report.copy]))
    deadline = time.monotonic() + wait_s
    keys = [f"{prefix}alive/{r}" for r in range(world_size)]
    beats: dict[int, tuple[int | None, float]] = {}  # rank -> (counter, when it last moved)
    while time.monotonic() < deadline:
        pending = [r for r in range(world_size) if not store.check([keys[r]])]
        now = time.monotonic()
        for r in pending:
            beat = copies.heartbeat(r)
            if r not in beats or beats[r][0] != beat:
                beats[r] = (beat, now)
        if all(now - beats[r][1] > _DEAD_AFTER_S for r in pending):
            break
        time.sleep(0.01)
    copies.stop_heartbeat()
    mine = ",".join(str(r) for r in range(world_size) if store.check([keys[r]]))
    decided = store.compare_set(f"{prefix}decision", "", mine).decode()
    out = []
    for r in (int(x) for x in decided.split(",")):
        own, copy = json.loads(store.get(keys[r]).decode())
        out.append(Restorable(r, tuple(own), tuple(copy)))
    return out


_DEAD_AFTER_S = 0.5  # five heartbeats missed


def rebuild_on_survivors(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    copies: NeighbourCopies,
    store: Any,
    build: Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer]],
    *,
    epoch: int = 1,
    wait_s: float = 2.0,
    reproducible: ReproduciblePolicy | None = None,
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
        wait_s: the longest survivors wait for each other to report alive (a rank whose
            heartbeat stopped is declared lost sooner).
        reproducible: the run's :class:`ReproduciblePolicy`, if any (chooses how many survivors
            train on).

    Raises:
        UnrecoverableLossError: the lost ranks' copies were lost with them (two neighbours).
        StateError: this rank is not among the agreed survivors, or nobody was lost.
    """
    t0 = time.monotonic()
    rank, ws = copies.rank, copies.world_size
    report = copies.restorable()
    for g, _ in model_groups(model):  # abandon the step in flight, locally (no collective)
        g.reset_iter_state()
    if dist.is_initialized():
        dist.destroy_process_group()  # closes our sockets: survivors blocked on us fail now
    reports = _agree(store, epoch, report, copies, wait_s)
    alive = tuple(r.rank for r in reports)
    lost = tuple(r for r in range(ws) if r not in alive)
    if rank not in alive:
        raise StateError(f"rank {rank} was declared lost by the survivors {list(alive)}")
    if not lost:
        raise StateError(
            "rebuild_on_survivors: every rank reported alive; the failure was not a lost rank "
            "(see the original exception)"
        )
    step = restart_step(reports, ws)  # raises UnrecoverableLossError on every survivor alike
    active = active_world_size(
        len(alive), None if reproducible is None else reproducible.virtual_world_size
    )
    new_rank = alive.index(rank)
    _init_world(store, f"ffsdp-epoch{epoch}/", new_rank, len(alive))
    rebuilt = _regroup_all(model, copies, step, lost, active)
    what = (
        f"lost rank(s) {list(lost)} of {ws}; restarting from step {step} on {active} rank(s) "
        f"(old ranks {list(alive[:active])})"
        + (f", spare(s) {list(alive[active:])}" if active < len(alive) else "")
    )
    if new_rank >= active:
        dist.destroy_process_group()
        message = f"recovery: {what}; old rank {rank} is a spare and leaves training"
        log.warning(message)
        seconds = time.monotonic() - t0
        return Rebuilt(None, None, None, -1, active, alive, lost, step, seconds, message)
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
        new_model, new_opt, new_copies, new_rank, active, alive, lost, step, seconds, message
    )


def _regroup_all(
    model: torch.nn.Module, copies: NeighbourCopies, step: int, lost: tuple[int, ...], active: int
) -> list[tuple[str, Any, dict[str, Any], dict[str, torch.Tensor]]]:
    """Every group's parameters and moments at ``step``, re-sharded onto the ``active`` first
    survivors (the new default world): ``(path, params, moments, scalars)`` per group."""
    own, held = copies.own_at(step), copies.copy_at(step)
    comm = ProcessGroupComm()
    rebuilt = []
    for _, name in model_groups(model):
        params = regroup(own[name].params, held[name].params, lost, comm, active=active)
        moved = {
            k: regroup(own[name].moments[k], held[name].moments[k], lost, comm, active=active)
            for k in own[name].moments
        }
        rebuilt.append((name, params, moved, own[name].scalars))
    return rebuilt


def _init_world(store: Any, prefix: str, rank: int, world_size: int) -> None:
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(prefix, store), rank=rank, world_size=world_size
    )


def _write(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rebuilt: list[tuple[str, Any, dict[str, Any], dict[str, torch.Tensor]]],
) -> None:
    """The re-sharded values into the new model's parameters and optimizer state."""
    by_name = {name: g for g, name in model_groups(model)}
    with torch.no_grad():
        for name, params, moved, scalars in rebuilt:
            g = by_name[name]
            for i, param in enumerate(g.params):
                p = cast(DTensor, param)
                _local(p).copy_(params.local(i))
                if not moved and not scalars:
                    continue  # restarted before the first step: no optimizer state yet
                state: dict[str, Any] = {k: v[i].clone() for k, v in scalars.items()}
                for k, m in moved.items():
                    state[k] = DTensor.from_local(
                        m.local(i).clone(),
                        p.device_mesh,
                        p.placements,
                        shape=p.shape,
                        stride=p.stride(),
                    )
                optimizer.state[p] = state


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t
