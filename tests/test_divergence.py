"""Rank-divergent use and faults on one rank end in a named error on every rank, within the
collective timeout, and reset_iter_state() on every rank recovers (2 gloo ranks)."""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import World

pytestmark = pytest.mark.multiprocess

TIMEOUT_S = 3.0


def _models() -> tuple[Any, Any, Any, Any]:
    from functional_fsdp import fully_shard
    from functional_fsdp.testing.models import GPT, GPTConfig

    os.environ["FFSDP_COLLECTIVE_TIMEOUT"] = str(TIMEOUT_S)
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


def _diverge_then_recover(kind: str) -> dict[str, Any]:
    """Run a divergent (or failing) piece on the ranks, catch what each rank raises, recover
    with reset_iter_state() on every rank, then train two steps against a plain reference."""
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
_NAMED = {"CollectiveTimeoutError", "PeerAbortedError", "ValueError"}


@pytest.mark.parametrize("kind", sorted(_DIVERGE))
def test_divergence_is_a_named_error_then_recovers(world2: World, kind: str) -> None:
    results = world2.run(_diverge_then_recover, kind, timeout=60)
    errors = [r["error"] for r in results]
    assert all(e in _NAMED for e in errors), results
    assert any(e in ("CollectiveTimeoutError", "PeerAbortedError") for e in errors), results
    for r in results:
        assert r["seconds"] < 3 * TIMEOUT_S + 5, r  # bounded, never a hang
        assert r["losses"] == pytest.approx(r["want"], abs=1e-5), r
