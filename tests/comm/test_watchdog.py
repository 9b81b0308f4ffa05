"""The watchdog: a rank waiting for a peer that left, or that runs other collectives, raises a
named error within seconds; a peer that only takes long (a slow data loader) is waited for.

On 2 gloo ranks, with the grace period (``FFSDP_PEER_IDLE_GRACE``) at 2 s so the cases stay
short; every detection must come within 10 s of the wait's start.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import World
from torch import nn

pytestmark = pytest.mark.multiprocess

GRACE_S = 2.0
LIMIT_S = 10.0


def _model() -> nn.Module:
    from functional_fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 2))
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    return model


def _micro_batch(model: nn.Module, k: int) -> None:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(k))
    model(x).pow(2).mean().backward()


def case_peer_left_the_loop() -> dict[str, Any]:
    """Rank 0 runs 2 micro-batches and waits in a barrier (the end of its script); rank 1
    runs 3: its third forward waits for rank 0."""
    from functional_fsdp import PeerLeftError

    os.environ["FFSDP_PEER_IDLE_GRACE"] = str(GRACE_S)
    model = _model()
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for k in range(2):
        _micro_batch(model, k)
    if rank == 0:
        dist.barrier()  # left the loop
    else:
        start = time.monotonic()
        try:
            _micro_batch(model, 2)
            out["error"] = None
        except PeerLeftError as e:
            out["error"] = str(e)
        out["after_s"] = time.monotonic() - start
        dist.barrier()  # meets rank 0's, so both can reset
    model.reset_iter_state()
    _micro_batch(model, 3)  # the ranks go on together
    return out


def test_a_rank_that_left_the_loop_is_named_within_seconds(world2: World) -> None:
    _, waiting = world2.run(case_peer_left_the_loop)
    assert waiting["error"] is not None, waiting
    assert waiting["after_s"] < LIMIT_S, waiting
    text = waiting["error"]
    assert "rank 0 has issued no collective" in text
    assert "torch.distributed barrier" in text and "outside functional_fsdp" in text
    assert "left the training loop" in text


def case_summon_on_one_rank() -> dict[str, Any]:
    """Rank 0 enters ``summon_full_params``; rank 1 has moved on and waits in a barrier."""
    from functional_fsdp import PeerLeftError, summon_full_params

    os.environ["FFSDP_PEER_IDLE_GRACE"] = str(GRACE_S)
    model = _model()
    _micro_batch(model, 0)
    out: dict[str, Any] = {}
    if dist.get_rank() == 0:
        start = time.monotonic()
        try:
            with summon_full_params(model):
                pass
            out["error"] = None
        except PeerLeftError as e:
            out["error"] = str(e)
        out["after_s"] = time.monotonic() - start
    dist.barrier()
    model.reset_iter_state()
    _micro_batch(model, 1)
    return out


def test_summon_entered_on_one_rank_is_named_within_seconds(world2: World) -> None:
    waiting, _ = world2.run(case_summon_on_one_rank)
    assert waiting["error"] is not None and waiting["after_s"] < LIMIT_S, waiting
    assert "rank 1 has issued no collective" in waiting["error"], waiting
    assert "summon_full_params" in waiting["error"], waiting


def case_slow_data_loader() -> list[float]:
    """Rank 0 takes the grace period and 1.5 s more loading its next batch: rank 1 waits, no
    error, and the step gives the numbers of a step without the delay."""
    os.environ["FFSDP_PEER_IDLE_GRACE"] = str(GRACE_S)
    model = _model()
    _micro_batch(model, 0)
    if dist.get_rank() == 0:
        time.sleep(GRACE_S + 1.5)
    _micro_batch(model, 1)
    return [float(p.grad.full_tensor().norm()) for p in model.parameters()]


def case_no_delay() -> list[float]:
    model = _model()
    _micro_batch(model, 0)
    _micro_batch(model, 1)
    return [float(p.grad.full_tensor().norm()) for p in model.parameters()]


def test_a_slow_peer_is_waited_for(world2: World) -> None:
    slow = world2.run(case_slow_data_loader)
    assert slow[0] == slow[1] == world2.run(case_no_delay)[0]


def case_place_read_when_asked() -> dict[str, int]:
    """Both ranks train for 3 s (the publisher beats about 6 times; the first 1.5 s let asks
    of the module's earlier cases lapse), then rank 0 sleeps 4 s in user code while rank 1's
    next forward waits for it (and asks from its 2nd second on): how often each rank's
    publisher read its main thread's place in the last 1.5 s of training and after."""
    from functional_fsdp.shell.comm import watchdog

    os.environ["FFSDP_PEER_IDLE_GRACE"] = str(GRACE_S)
    model = _model()
    calls: list[int] = []
    real = watchdog._main_thread_place

    def counted() -> tuple[str, str | None]:
        calls.append(1)
        return real()

    store, ask = watchdog._store(), f"{watchdog._ASK}{dist.get_rank()}"
    asks = int(store.add(ask, 0))  # a training step that stalls 2 s under load asks too
    watchdog._main_thread_place = counted
    try:
        start, k, lapsed = time.monotonic(), 0, -1
        go = torch.ones(1)
        while go.item():  # the same micro-batches on both ranks, for rank 0's 3 s
            _micro_batch(model, k)
            k += 1
            if lapsed < 0 and time.monotonic() > start + 1.5:
                lapsed = len(calls)
            go.fill_(float(time.monotonic() < start + 3.0))
            dist.broadcast(go, src=0)
        training = len(calls) - lapsed
        asked_in_training = int(store.add(ask, 0)) - asks
        if dist.get_rank() == 0:
            time.sleep(4.0)  # rank 1 asks from its wait's 2nd second, every 0.5 s
        _micro_batch(model, k)
    finally:
        watchdog._main_thread_place = real
    return {
        "training": training,
        "asked_in_training": asked_in_training,
        "waited_for": len(calls) - lapsed - training,
    }


def test_the_main_threads_place_is_read_only_while_a_peer_asks(world2: World) -> None:
    """faulthandler's all-thread dump (how the place is read) runs only while a peer waits for
    this rank, never beside a training step."""
    r0, r1 = world2.run(case_place_read_when_asked)
    for r in (r0, r1):  # before: 3 reads in the 1.5 s, with no ask
        assert r["training"] == 0 or r["asked_in_training"] > 0, (r0, r1)
    assert r0["waited_for"] >= 1, r0  # rank 1 asked
    assert r1["waited_for"] == 0, r1  # it waited itself: nobody asks a waiting rank


def case_optimizer_step_skipped_on_one_rank() -> dict[str, Any]:
    """Rank 0 skips ``Muon.step()`` (a local NaN guard) and runs the next forward; rank 1
    steps: each waits for something the other never posts."""
    from functional_fsdp import CollectiveError
    from functional_fsdp.optim import Muon

    os.environ["FFSDP_PEER_IDLE_GRACE"] = str(GRACE_S)
    model = _model()
    opt = Muon(model.parameters(), lr=0.02)
    _micro_batch(model, 0)
    start = time.monotonic()
    out: dict[str, Any] = {"error": None}
    try:
        if dist.get_rank() == 1:
            opt.step()
        _micro_batch(model, 1)
    except CollectiveError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["after_s"] = time.monotonic() - start
    # Neither rank leaves (closing its connections) before both have their error, and rank 0,
    # whose process hosts the store, leaves once rank 1 is done with it (rank 1's last poll
    # once met a store already gone: "Connection reset by peer").
    store = dist.distributed_c10d._get_default_store()
    store.add("named", 1)
    _store_wait(store, "named", 2)
    if dist.get_rank() == 1:
        store.add("left", 1)
    else:
        _store_wait(store, "left", 1)
    return out


def _store_wait(store: Any, key: str, count: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while int(store.add(key, 0)) < count and time.monotonic() < deadline:
        time.sleep(0.05)


def test_an_optimizer_step_skipped_on_one_rank_is_named_on_both() -> None:
    from functional_fsdp import run_local

    # Ranks of their own: the abandoned exchange leaves messages that no reset completes.
    results = run_local(case_optimizer_step_skipped_on_one_rank, 2, timeout_s=120)
    for rank, res in enumerate(results):
        assert res["error"] is not None, (rank, res)
        assert res["after_s"] < LIMIT_S, (rank, res)
        assert "whole-matrix exchange" in res["error"], (rank, res)
        assert res["error"].startswith("CollectiveMismatchError"), (rank, res)


def test_every_wait_in_the_package_goes_through_the_watchdog() -> None:
    """A plain ``Work.wait()`` on a torch.distributed work outside the watchdog's waits would
    hang where a peer left: only the bounded waits may call it (the waiter thread, the
    communicators' already-complete fast path and NCCL's stream waits), and the listed few
    with their reasons. (Found by the names the package gives works: ``work``, ``w``.)"""
    import ast
    import pathlib

    import functional_fsdp

    root = pathlib.Path(functional_fsdp.__file__).parent
    allowed = {
        # the waiter thread, and waits on works already complete or on NCCL streams
        ("shell/comm/schedule.py", "_run"),
        ("shell/comm/process_group.py", "wait_works"),
        ("shell/comm/watchdog.py", "watched_wait"),
        # a communicator's synchronous call waits on its own (watched) work object
        ("shell/comm/process_group.py", "all_to_all"),
        ("shell/comm/process_group.py", "all_gather_pieces"),
        ("shell/comm/process_group.py", "reduce_scatter_pieces"),
        ("shell/comm/process_group.py", "all_gather"),
        ("shell/comm/process_group.py", "reduce_scatter"),
        ("shell/comm/process_group.py", "all_reduce"),
        # a custom collective's work, which waits through its base communicator
        ("shell/comm/custom.py", "_finish"),
        # the rebuild's sends to a spare, on the new world the survivors agreed on
        ("shell/recovery/rebuild.py", "_wait_all"),
    }
    raw = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "wait"
                    and not node.args
                    and not node.keywords  # wait(timeout=...) is bounded by itself
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id in {"work", "w", "works"}
                    and (rel, fn.name) not in allowed
                ):
                    raw.append(f"{rel}:{node.lineno} in {fn.name}")
    assert not raw, raw


def test_the_main_threads_place_is_read_from_another_thread() -> None:
    """The publisher thread reads where the main thread is (faulthandler's dump): blocked in a
    torch.distributed call outside the package, or elsewhere."""
    import threading

    from functional_fsdp.shell.comm import watchdog

    seen: dict[str, Any] = {}
    ready, done = threading.Event(), threading.Event()

    def observer() -> None:
        ready.wait(10)
        seen["frames"] = watchdog._main_thread_frames()
        seen["place"] = watchdog._main_thread_place()
        done.set()

    def somewhere_in_user_code() -> None:
        ready.set()
        done.wait(10)  # blocked in threading (not torch.distributed): may come back

    t = threading.Thread(target=observer)
    t.start()
    somewhere_in_user_code()
    t.join(10)
    names = [name for _, _, name in seen["frames"]]
    assert "somewhere_in_user_code" in names, names
    assert names[0] == "wait", names  # innermost first
    inner, outside = seen["place"]
    assert inner.startswith("wait (threading.py:"), inner
    assert outside is None


def test_no_thread_walks_another_threads_frames() -> None:
    """``sys._current_frames()`` and ``f_back`` on another thread's frame corrupt the heap now
    and then on CPython 3.11 (a rank aborted with "malloc(): unaligned tcache chunk detected"
    in CI); the watchdog reads stacks through faulthandler instead."""
    import pathlib

    import functional_fsdp

    root = pathlib.Path(functional_fsdp.__file__).parent
    found = [
        path.relative_to(root).as_posix()
        for path in sorted(root.rglob("*.py"))
        if "_current_frames(" in path.read_text().replace("``sys._current_frames()``", "")
    ]
    assert not found, found
