"""Rebuilding a model on the survivors of a lost rank, from memory (a first version).

:func:`rebuild_on_survivors` is what a training loop calls after a collective failed because a
rank died (on gloo the survivors' waits fail within milliseconds: the peer's sockets close). It
covers a rank lost *between* steps, after the last step's neighbour copies arrived:

1. the survivors agree through the launcher's store on who is alive (each posts its rank; the
   first to decide writes the list with ``compare_set``, so every survivor reads one answer);
2. the old default process group is dropped and a new one of the survivors is initialised over
   a fresh store prefix (``torch.distributed`` itself, ranked in old-rank order);
3. each group is re-sharded onto the survivors with :func:`functional_fsdp.core.recovery.regroup`
   (its own shards and the neighbour copy held: one all-gather), parameters and Adam's moments
   alike;
4. the caller's ``build()`` makes the model and optimizer afresh on the new world, and the
   re-sharded values are written into them (parameters' local shards; optimizer state as
   ``DTensor`` s placed like their parameters); new neighbour copies start.

Not covered yet (issue "Lose a rank, lose no step"): a rank lost during a step or during the
copies' exchange (agreeing on the last step every survivor completed, rolling back), several
losses, spares for the reproducible policy, and the in-place variant that keeps the user's
module and optimizer objects.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, cast

import attrs
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ...core.errors import StateError
from ...core.recovery import recoverable, regroup
from ...core.transitions import pack_locals
from ..comm.process_group import ProcessGroupComm
from .copies import NeighbourCopies, keep_neighbour_copies, model_groups

__all__ = ["Rebuilt", "rebuild_on_survivors"]


@attrs.frozen(eq=False)
class Rebuilt:
    """What :func:`rebuild_on_survivors` returns.

    Attributes:
        model: the new model (on the survivors' world).
        optimizer: its optimizer, with the re-sharded state.
        copies: its neighbour copies (started at the next step).
        rank: this rank in the new world; ``survivors``: the old ranks alive, in order.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    copies: NeighbourCopies
    rank: int
    survivors: tuple[int, ...]


def _agree(store: Any, epoch: int, rank: int, world_size: int, wait_s: float) -> tuple[int, ...]:
    """The old ranks alive, the same list on every survivor (first decision wins)."""
    prefix = f"ffsdp/recover/{epoch}/"
    store.set(f"{prefix}alive/{rank}", "1")
    deadline = time.monotonic() + wait_s
    keys = [f"{prefix}alive/{r}" for r in range(world_size)]
    while time.monotonic() < deadline and not store.check(keys):
        time.sleep(0.01)
    mine = ",".join(str(r) for r in range(world_size) if store.check([keys[r]]))
    decided = store.compare_set(f"{prefix}decision", "", mine)
    return tuple(int(r) for r in decided.decode().split(","))


def rebuild_on_survivors(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    copies: NeighbourCopies,
    store: Any,
    build: Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer]],
    *,
    epoch: int = 1,
    wait_s: float = 2.0,
) -> Rebuilt:
    """Continue on the survivors of a lost rank from memory (see the module docstring).

    Args:
        model, optimizer: the old ones (their shards are read; then they are dropped).
        copies: their :func:`~.copies.keep_neighbour_copies` (the last completed exchange).
        store: the launcher's store (it must outlive every rank: not rank 0's).
        build: makes the model (``fully_shard`` on the default world) and its optimizer.
        epoch: a number new to this store for each recovery (names the new group's prefix).
        wait_s: how long survivors wait for each other to report alive.

    Raises:
        StateError: this rank is not among the agreed survivors, or the lost ranks' copies
            were lost with them (two neighbours).
    """
    rank, ws = copies.rank, copies.world_size
    alive = _agree(store, epoch, rank, ws, wait_s)
    lost = [r for r in range(ws) if r not in alive]
    if rank not in alive:
        raise StateError(f"rank {rank} was declared lost by the survivors {list(alive)}")
    if not lost or not recoverable(ws, lost):
        raise StateError(
            f"ranks {lost} of {ws}: nothing to recover, or two neighbours were lost together "
            "(their copies with them); resume from the last checkpoint"
        )
    held = copies.last_complete()
    groups = model_groups(model)
    own_states = [
        {
            k: pack_locals(
                [_local(optimizer.state[p][k]) for p in g.params], g.layout, g.state.rank
            )
            for k in held[name].moments
        }
        for g, name in groups
    ]
    steps = [[optimizer.state[p]["step"] for p in g.params] for g, _ in groups]
    dist.destroy_process_group()
    new_rank = alive.index(rank)
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"ffsdp-epoch{epoch}/", store),
        rank=new_rank,
        world_size=len(alive),
    )
    comm = ProcessGroupComm()
    rebuilt = []
    for (g, name), moments in zip(groups, own_states):
        params = regroup(g.state, held[name].params, lost, comm)
        moved = {k: regroup(moments[k], held[name].moments[k], lost, comm) for k in moments}
        rebuilt.append((name, params, moved))
    new_model, new_opt = build()
    _write(new_model, new_opt, rebuilt, steps)
    return Rebuilt(new_model, new_opt, keep_neighbour_copies(new_model, new_opt), new_rank, alive)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _write(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rebuilt: list[tuple[str, Any, dict[str, Any]]],
    steps: list[list[torch.Tensor]],
) -> None:
    """The re-sharded values into the new model's parameters and optimizer state."""
    by_name = {name: g for g, name in model_groups(model)}
    with torch.no_grad():
        for (name, params, moved), step in zip(rebuilt, steps):
            g = by_name[name]
            for i, param in enumerate(g.params):
                p = cast(DTensor, param)
                _local(p).copy_(params.local(i))
                state: dict[str, Any] = {"step": step[i].clone()}
                for k, m in moved.items():
                    state[k] = DTensor.from_local(
                        m.local(i).clone(),
                        p.device_mesh,
                        p.placements,
                        shape=p.shape,
                        stride=p.stride(),
                    )
                optimizer.state[p] = state
