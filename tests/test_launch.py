"""run_local: N local gloo ranks, results by rank, failures raised (never a hang)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from functional_fsdp import run_local

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _rank_sum(scale: int) -> tuple[int, int, float]:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), scale * t.item()


def _fail_on_rank_one() -> int:
    if dist.get_rank() == 1:
        raise ValueError("rank one refuses")
    return dist.get_rank()


def test_results_by_rank() -> None:
    assert run_local(_rank_sum, 2, 10) == [(0, 2, 30.0), (1, 2, 30.0)]


def test_a_failing_rank_raises_with_its_traceback() -> None:
    with pytest.raises(RuntimeError, match="rank one refuses"):
        run_local(_fail_on_rank_one, 2, timeout_s=120)
