"""Oracles shared by the transition test modules (dense means, sharding every rank)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from _helpers import leaves, oracle_local
from hypothesis import strategies as st

from functional_fsdp.core.records import ShardedState, UnshardedState
from functional_fsdp.core.transitions import (
    shard,
    unshard,
)
from functional_fsdp.testing import SimulatedWorld

FP32 = [torch.float32]
SEEDS = st.integers(0, 2**16)


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def shard_all(tree: Any, ws: int, **kw: Any) -> list[ShardedState]:
    """Every rank's shard (sharding needs no communication)."""
    return [shard(tree, world_size=ws, rank=r, **kw) for r in range(ws)]


def unshard_all(
    world: SimulatedWorld, states: list[Any], comm: Callable[[Any], Any] | None = None
) -> list[UnshardedState]:
    return world.run(lambda c, s: unshard(s, comm(c) if comm else c), states)


def mean_of(per_rank: list[Any], i: int) -> torch.Tensor:
    """Dense mean (in float64) of leaf ``i`` over ranks' full gradients."""
    return torch.stack([leaves(g)[i].double() for g in per_rank]).mean(0)


# Default tolerances by the dtype the gradient comes back in. float32: a mean of a few values
# of magnitude <= 4, rounded at each of a few adds and one divide. bfloat16 reduced in float32:
# one rounding of the float32 mean to bfloat16 (at most one bfloat16 ulp, 2**-7 relative).
_GRAD_TOL = {
    torch.float32: {"atol": 1e-6, "rtol": 1e-5},
    torch.bfloat16: {"atol": 1e-6, "rtol": 2**-7},
}


def assert_grads(
    states: list[ShardedState], full: list[torch.Tensor | None], ws: int, **tol: Any
) -> None:
    """Each rank's sharded grads equal its slice of ``full``; padding rows are zero.

    ``tol`` (``atol``/``rtol``) applies to every leaf; without it each leaf gets its dtype's
    tolerance from ``_GRAD_TOL``.
    """
    for r, s in enumerate(states):
        for i, want in enumerate(full):
            got = s.local_grad(i)
            if want is None:
                assert got is None
                continue
            assert got is not None and got.dtype == s.layout.specs[i].dtype
            expected = oracle_local(want, ws, r).to(got.dtype)
            torch.testing.assert_close(got, expected, **(tol or _GRAD_TOL[got.dtype]))
            padded = s.grads[i]
            assert not padded.narrow(0, got.shape[0], padded.shape[0] - got.shape[0]).any()
