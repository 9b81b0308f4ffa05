"""A gather bucket whose members land one by one is waited once (``ordering.BucketWait``):
on the stream-ordering simulator, in a simulated world, every member lands its own gather's
bits with no ordering violation when a member restarts while another still holds the old
bucket, when the first wait raises and is retried, and when every member is dropped unlanded
(the rows are then freed after the bucket's wait)."""

from __future__ import annotations

from typing import Any

import torch

from functional_fsdp.core.coalesce import lands_by_member
from functional_fsdp.core.transitions import shard, unshard
from functional_fsdp.shell.device.simulator import StreamSimulator
from functional_fsdp.shell.engine.gather import GatherSlot, start_coalesced
from functional_fsdp.testing import SimulatedWorld

WS = 2


def _trees() -> list[Any]:
    g = torch.Generator().manual_seed(0)
    return [
        {"w": torch.randn(4, 3, generator=g), "b": torch.randn(4, generator=g)} for _ in range(3)
    ]


def _setup(c: Any, strict: bool = True) -> tuple[Any, Any, Any, Any]:
    rt = StreamSimulator(strict=strict)
    states = [shard(t, world_size=WS, rank=c.rank) for t in _trees()]
    alone = [unshard(s, c).params for s in states]
    slots = [GatherSlot(s.layout, torch.device("cpu"), lambda t: None, runtime=rt) for s in states]
    assert lands_by_member(states, c)
    return rt, states, alone, slots


def _same(slot: GatherSlot, want: Any) -> bool:
    return all(torch.equal(x, y) for x, y in zip(slot.views, want))


def case_restart_while_old_bucket_held(c: Any) -> list[Any]:
    rt, states, alone, (a, b, cc) = _setup(c)
    start_coalesced([a, b], [states[0], states[1]], c, [0, 0])
    old = b.bucket
    a.wait()
    assert a.bucket is None and old is not None and old.gathered is not None
    a.free()
    start_coalesced([a, cc], [states[0], states[2]], c, [1, 1])
    assert a.bucket is not old and a.bucket.gathered is None
    b.wait()
    cc.wait()
    a.wait()
    return [_same(a, alone[0]), _same(b, alone[1]), _same(cc, alone[2]), rt.violations]


def case_first_wait_raises(c: Any) -> list[Any]:
    rt, states, alone, (a, b, _) = _setup(c)
    start_coalesced([a, b], [states[0], states[1]], c, [0, 0])
    rows = a.pending.share._bucket
    real = rows._work

    class Boom:
        n = 0

        def wait(self) -> None:
            Boom.n += 1
            if Boom.n == 1:
                raise RuntimeError("peer aborted")
            real.wait()

    rows._work = Boom()
    try:
        a.wait()
        raised = False
    except RuntimeError:
        raised = True
    kept = a.pending is not None and a.bucket is b.bucket and a.bucket.gathered is None
    b.wait()
    a.wait()
    return [raised, kept, _same(a, alone[0]), _same(b, alone[1]), rt.violations]


def case_every_member_dropped(c: Any) -> list[Any]:
    rt, states, _alone, (a, b, _) = _setup(c, strict=False)
    start_coalesced([a, b], [states[0], states[1]], c, [0, 0])
    a.discard()
    b.discard()
    return [[v.kind for v in rt.violations]]


def test_restart_while_another_member_holds_the_old_bucket() -> None:
    for r in SimulatedWorld(WS, pieces=True).run(case_restart_while_old_bucket_held):
        assert r == [True, True, True, []], r


def test_first_member_wait_raises_then_retried() -> None:
    for r in SimulatedWorld(WS, pieces=True).run(case_first_wait_raises):
        assert r == [True, True, True, True, []], r


def test_every_member_dropped_unlanded() -> None:
    for r in SimulatedWorld(WS, pieces=True).run(case_every_member_dropped):
        assert r == [[]], r
