"""functional_fsdp.testing.SimulatedWorld: exact collectives, meshes, sub-groups, failure release."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

import functional_fsdp.testing._world as world_mod
from functional_fsdp.core.comm import Communicator
from functional_fsdp.testing import SimulatedWorld


def _sum_of_ones(comm) -> torch.Tensor:
    t = torch.ones(1)
    comm.all_reduce(t).wait()
    return t


def test_comms_implement_the_protocol() -> None:
    world = SimulatedWorld(2)
    assert isinstance(world.comm(0), Communicator)
    assert (world.comm(1).rank, world.comm(1).world_size) == (1, 2)


def test_all_gather_is_rank_major() -> None:
    world = SimulatedWorld(3)

    def body(c):
        out = torch.empty(6)
        c.all_gather(out, torch.tensor([10.0 * c.rank, 10.0 * c.rank + 1])).wait()
        return out

    for out in world.run(body):
        assert out.tolist() == [0, 1, 10, 11, 20, 21]


@pytest.mark.parametrize(("op", "divisor"), [("sum", 1.0), ("avg", 3.0)])
def test_reduce_scatter_and_all_reduce(op: str, divisor: float) -> None:
    world = SimulatedWorld(3)

    def body(c):
        inp = torch.arange(6.0) + c.rank
        out = torch.empty(2)
        c.reduce_scatter(out, inp, op=op).wait()
        t = torch.full((2,), float(c.rank))
        c.all_reduce(t, op=op).wait()
        return out, t, inp

    # Reductions add in rank order, then divide: the same float operations here give the bits.
    full = sum(torch.arange(6.0) + r for r in range(3)) / divisor
    for r, (out, t, inp) in enumerate(world.run(body)):
        assert torch.equal(out, full[2 * r : 2 * r + 2])
        assert torch.equal(t, torch.full((2,), 3.0) / divisor)
        assert torch.equal(inp, torch.arange(6.0) + r), "inputs are not modified"


def test_mesh_groups() -> None:
    world = SimulatedWorld(6, mesh_shape=(2, 3))
    assert [world.shard_comm(r).rank for r in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [world.replicate_comm(r).rank for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert world.shard_comm(4)._group.ranks == (3, 4, 5)
    assert world.replicate_comm(4)._group.ranks == (1, 4)
    assert world.sub_group_comm(5, 2)._group.ranks == (4, 5)
    with pytest.raises(ValueError, match="mesh_shape"):
        SimulatedWorld(6, mesh_shape=(2, 2))
    with pytest.raises(ValueError, match="world_size"):
        SimulatedWorld(0)


def test_a_failing_rank_releases_the_others_and_the_world_is_reusable() -> None:
    world = SimulatedWorld(4)

    def body(c):
        if c.rank == 2:
            raise KeyError("rank 2 broke")
        c.all_reduce(torch.ones(1))

    with pytest.raises(KeyError, match="rank 2 broke"):
        world.run(body)
    outs = world.run(_sum_of_ones)
    assert all(float(t) == 4.0 for t in outs)


def test_sub_groups_are_created_once_under_concurrency(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: ranks racing to create the same sub-group must share it (else they hang)."""
    monkeypatch.setattr(world_mod, "_TIMEOUT_S", 2.0)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # provoke thread switches inside group()
    try:
        for _ in range(100):
            world = SimulatedWorld(8)
            outs = world.run(lambda c, w=world: _sum_of_ones(w.sub_group_comm(c.rank, 4)))
            assert all(float(t) == 4.0 for t in outs)
    finally:
        sys.setswitchinterval(old)
    assert threading.active_count() < 50


def test_ranks_take_turns_between_collectives() -> None:
    """One rank runs at a time: a rank holds the turn from one collective to the next, so
    the ranks never fight for the interpreter (torch releases it inside every op)."""
    world = SimulatedWorld(4)
    lock = threading.Lock()
    running: list[int] = []
    overlaps: list[list[int]] = []

    def body(c) -> None:
        for _ in range(5):
            with lock:
                running.append(c.rank)
                if len(running) > 1:
                    overlaps.append(list(running))
            for _ in range(200):  # ops that release the GIL: a chance for another rank to run
                torch.ones(8).add_(1)
            with lock:
                running.remove(c.rank)
            c.all_reduce(torch.ones(1))

    world.run(body)
    assert overlaps == []
    assert world.world.calls == 5


def test_a_rank_that_skips_a_collective_breaks_it_after_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(world_mod, "_TIMEOUT_S", 0.5)
    world = SimulatedWorld(2)

    def body(c) -> None:
        if c.rank == 0:
            c.all_reduce(torch.ones(1))

    with pytest.raises(threading.BrokenBarrierError):
        world.run(body)
    assert all(float(t) == 2.0 for t in world.run(_sum_of_ones))  # the group was replaced
