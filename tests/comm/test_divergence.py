"""Rank-divergent use and faults on one rank end in a named error on every rank, in seconds
under the default (600 s) collective timeout, and reset_iter_state() on every rank recovers
(2 gloo ranks); a merely slow peer is waited for; a process that recovered exits cleanly."""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from _dist import World

pytestmark = pytest.mark.multiprocess

# The ranks' positions are compared after FFSDP_MISMATCH_GRACE (2 s) of waiting: a mismatch
# must be found well before the default collective timeout (600 s).
DETECT_S = 10.0


def _models() -> tuple[Any, Any, Any, Any]:
    from functional_fsdp import fully_shard
    from functional_fsdp.testing.models import GPT, GPTConfig

    os.environ.pop("FFSDP_COLLECTIVE_TIMEOUT", None)  # the default, 600 s
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=64, dim=32, n_layers=2, n_heads=2, seq=16)
    model = GPT(cfg)
    ref = copy.deepcopy(model)
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    return cfg, model, ref, torch.optim.SGD(model.parameters(), lr=0.1)


def _batch(cfg: Any, rank: int, step: int) -> Any:
    from functional_fsdp.testing.models import synthetic_batch

    return synthetic_batch(cfg, 2, seed=10 * step + rank)


def _step(model: Any, opt: Any, batch: Any) -> float:
    loss = model.loss(*batch)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _ref_step(cfg: Any, ref: Any, opt: Any, step: int) -> float:
    ws, rank = dist.get_world_size(), dist.get_rank()
    losses = [ref.loss(*_batch(cfg, r, step)) for r in range(ws)]
    (sum(losses) / ws).backward()  # type: ignore[union-attr]
    opt.step()
    opt.zero_grad()
    return losses[rank].item()


def _diverge_then_recover(kind: str, nap_s: float = 0.0) -> dict[str, Any]:
    """Run a divergent (or failing) piece on the ranks, catch what each rank raises, recover
    with reset_iter_state() on every rank (then wait ``nap_s``), then train two steps against
    a plain reference."""
    cfg, model, ref, opt = _models()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    rank = dist.get_rank()
    h = torch.randn(2, cfg.seq, cfg.dim)
    out: dict[str, Any] = {}
    losses = [_step(model, opt, _batch(cfg, rank, 0))]
    want = [_ref_step(cfg, ref, ref_opt, 0)]
    t0 = time.monotonic()
    try:
        _DIVERGE[kind](cfg, model, opt, rank, h)
        out["error"] = None
    except Exception as e:
        out["error"] = type(e).__name__
        out["message"] = str(e)
    out["seconds"] = time.monotonic() - t0
    model.reset_iter_state()
    opt.zero_grad()
    time.sleep(nap_s)
    for step in (1, 2):
        losses.append(_step(model, opt, _batch(cfg, rank, step)))
        want.append(_ref_step(cfg, ref, ref_opt, step))
    out["losses"], out["want"] = losses, want
    return out


def _different_submodules(cfg: Any, model: Any, opt: Any, rank: int, h: Any) -> None:
    with torch.no_grad():
        model.blocks[rank](h)  # rank 0 runs block 0, rank 1 runs block 1


def _sync_off_on_one_rank(cfg: Any, model: Any, opt: Any, rank: int, h: Any) -> None:
    model.set_requires_gradient_sync(rank == 0)
    model.loss(*_batch(cfg, rank, 9)).backward()
    model.set_requires_gradient_sync(True)
    model.loss(*_batch(cfg, rank, 9)).backward()


def _more_micro_batches_on_one_rank(cfg: Any, model: Any, opt: Any, rank: int, h: Any) -> None:
    n = 2 if rank == 0 else 1
    for i in range(n):
        model.set_requires_gradient_sync(i == n - 1)
        model.loss(*_batch(cfg, rank, 9)).backward()
    model.set_requires_gradient_sync(True)
    # A second iteration on both: its collectives never pair with the first's leftovers.
    model.loss(*_batch(cfg, rank, 8)).backward()


def _exception_in_forward_on_one_rank(cfg: Any, model: Any, opt: Any, rank: int, h: Any) -> None:
    def boom(*args: Any) -> None:
        raise ValueError("user code failed on rank 0")

    handle = model.blocks[1].register_forward_pre_hook(boom) if rank == 0 else None
    try:
        model.loss(*_batch(cfg, rank, 9)).backward()
    finally:
        if handle is not None:
            handle.remove()


def _exception_in_backward_on_one_rank(cfg: Any, model: Any, opt: Any, rank: int, h: Any) -> None:
    loss = model.loss(*_batch(cfg, rank, 9))
    if rank == 0:

        def boom(grad: torch.Tensor) -> torch.Tensor:
            raise ValueError("backward hook failed on rank 0")

        loss.register_hook(boom)
    loss.backward()


def _summon_on_one_rank(cfg: Any, model: Any, opt: Any, rank: int, h: Any) -> None:
    from functional_fsdp import summon_full_params

    if rank == 0:
        with summon_full_params(model):
            pass
    else:
        model.loss(*_batch(cfg, rank, 9)).backward()


_DIVERGE: dict[str, Callable[..., None]] = {
    "different_submodules": _different_submodules,
    "sync_off_on_one_rank": _sync_off_on_one_rank,
    "more_micro_batches_on_one_rank": _more_micro_batches_on_one_rank,
    "exception_in_forward_on_one_rank": _exception_in_forward_on_one_rank,
    "exception_in_backward_on_one_rank": _exception_in_backward_on_one_rank,
    "summon_on_one_rank": _summon_on_one_rank,
}
# Ranks that run different collectives: every rank raises CollectiveMismatchError naming both
# positions by module. (The exceptions on one rank: that rank raises the user's error, its
# reset_iter_state() tells the other, which raises PeerAbortedError.)
_MISMATCH = {
    "different_submodules": ("all-gather of group blocks.0", "all-gather of group blocks.1"),
    # The model's groups coalesce (one bucket of all three): the message names the bucket.
    "sync_off_on_one_rank": (
        "reduce-scatter of group bucket (blocks.1, blocks.0, GPT (the root))",
        "all-gather of group bucket (GPT (the root), blocks.0, blocks.1)",
    ),
    "more_micro_batches_on_one_rank": (
        "reduce-scatter of group bucket (blocks.1, blocks.0, GPT (the root))",
    ),
    "summon_on_one_rank": ("summon_full_params all-gather of group GPT (the root)",),
}
_NAMED = {"PeerAbortedError", "ValueError"}


@pytest.mark.parametrize("kind", sorted(_DIVERGE))
def test_divergence_is_a_named_error_then_recovers(world2: World, kind: str) -> None:
    results = world2.run(_diverge_then_recover, kind, timeout=120)
    errors = [r["error"] for r in results]
    if kind in _MISMATCH:
        assert errors == ["CollectiveMismatchError"] * 2, results
        for r in results:
            assert r["message"].startswith("the ranks wait for different collectives: rank 0 "), r
            assert all(word in r["message"] for word in _MISMATCH[kind]), r
    else:
        assert all(e in _NAMED for e in errors), results
        assert "PeerAbortedError" in errors, results
    for r in results:
        assert r["seconds"] < DETECT_S, r  # found, not waited out (600 s)
        assert r["losses"] == pytest.approx(r["want"], abs=1e-5), r


def _diverge_on_the_stream_simulator(kind: str) -> dict[str, Any]:
    """:func:`_diverge_then_recover` with the model's groups on the stream-ordering simulator
    (strict: an access CUDA streams could race on raises ``StreamOrderError``)."""
    from functional_fsdp.testing.streams import simulate_streams

    with simulate_streams():
        return _diverge_then_recover(kind)


def test_a_failed_steps_abandoned_bucket_is_freed_in_stream_order(world2: World) -> None:
    """A failed step abandons its prefetched bucket's all-gather; once that work reports
    itself complete the rows are freed. The simulator found them freed with no event after
    the collective's accesses (nobody had waited for it): a free racing the all-gather
    stream on CUDA. Now freed after an event on that stream."""
    for r in world2.run(_diverge_on_the_stream_simulator, "more_micro_batches_on_one_rank"):
        assert r["losses"] == pytest.approx(r["want"], abs=1e-5), r


def _slow_peer(sleep_s: float) -> dict[str, Any]:
    """Rank 1 stops for ``sleep_s`` inside its forward (past both grace periods: the position
    check's and, set to 2 s here, the watchdog's idle peer's): rank 0 waits at the same
    collectives, which is no mismatch; the step equals the reference."""
    cfg, model, ref, opt = _models()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    rank = dist.get_rank()

    def nap(*args: Any) -> None:
        time.sleep(sleep_s)

    handle = model.blocks[1].register_forward_pre_hook(nap) if rank == 1 else None
    t0 = time.monotonic()
    try:
        with mock.patch.dict(os.environ, {"FFSDP_PEER_IDLE_GRACE": "2"}):
            losses = [_step(model, opt, _batch(cfg, rank, step)) for step in (0, 1)]
    finally:
        if handle is not None:
            handle.remove()
    seconds = time.monotonic() - t0
    want = [_ref_step(cfg, ref, ref_opt, step) for step in (0, 1)]
    return {"losses": losses, "want": want, "seconds": seconds}


def test_a_slow_peer_is_waited_for(world2: World, recovered_runs: Any) -> None:
    # recovered_runs: the recovered-process runs below start now, in their own processes, and
    # mostly sleep while this test's ranks do.
    results = world2.run(_slow_peer, NAP_S, timeout=120)
    for r in results:
        assert r["seconds"] > 2 * NAP_S, r  # rank 0 waited through both naps without an error
        assert r["losses"] == pytest.approx(r["want"], abs=1e-5), r


def _recover_then_exit(rank: int, port: int, kind: str, out: Any) -> None:
    """One spawned rank: a fault or divergence, reset_iter_state(), a wait longer than the
    process group's timeout, more steps, destroy_process_group(), a normal exit."""
    import datetime

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # A short gloo timeout: a receive the failed step left posted would time out during the
    # nap below and close the connection (every later collective fails).
    dist.init_process_group(
        "gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S)
    )
    result = _diverge_then_recover(kind, nap_s=GLOO_TIMEOUT_S + 2)
    out.put((rank, result["error"], result["losses"], result["want"]))
    dist.destroy_process_group()


GLOO_TIMEOUT_S = 5
NAP_S = 3.5  # the slow peer's, twice: the recovered runs' naps (7 s) pass meanwhile
_EXIT_KINDS = ["exception_in_forward_on_one_rank", "different_submodules"]


@pytest.fixture(scope="module")
def recovered_runs(request: pytest.FixtureRequest) -> Any:
    """The 2-rank processes of every selected ``kind`` of
    :func:`test_a_recovered_process_exits_cleanly`, all started at once on first use (by
    :func:`test_a_slow_peer_is_waited_for`, whose ranks sleep 7 s): each mostly sleeps past
    its gloo timeout, so the naps overlap. Killed at the end."""

    from _dist import free_ports, process, rank_context

    name = "test_a_recovered_process_exits_cleanly"
    kinds = [
        item.callspec.params["kind"]
        for item in request.session.items
        if getattr(item, "originalname", None) == name and item.module is request.module
    ]
    ctx = rank_context()
    runs = {}
    try:
        for kind, port in zip(kinds, free_ports(len(kinds))):
            out = ctx.Queue()
            procs = [process(ctx, _recover_then_exit, r, port, kind, out) for r in (0, 1)]
            for p in procs:
                p.start()
            runs[kind] = (procs, out)
        yield runs
    finally:
        for procs, _ in runs.values():
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=10)


@pytest.mark.parametrize("kind", _EXIT_KINDS)
def test_a_recovered_process_exits_cleanly(kind: str, recovered_runs: Any) -> None:
    """Issue 18, item 12: after a fault and reset_iter_state(), destroy_process_group() and
    exit used to abort one rank (SIGABRT, ``terminate called without an active exception``):
    a waiter thread still blocked in an abandoned gloo receive was woken by the peer's exit
    during interpreter shutdown."""
    procs, out = recovered_runs[kind]
    try:
        results = sorted(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0], results
    for _, error, losses, want in results:
        assert error is not None
        assert losses == pytest.approx(want, abs=1e-5), results
