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


def _exit_on_rank_one() -> int:
    import os

    if dist.get_rank() == 1:
        os._exit(3)  # dies without a result (as a killed rank would)
    return dist.get_rank()


def test_a_rank_that_dies_without_a_result_fails_the_run_at_once() -> None:
    import time

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with code 3"):
        run_local(_exit_on_rank_one, 2, timeout_s=120)
    assert time.monotonic() - t0 < 60  # noticed, not waited out


def test_a_taken_port_is_retried_with_another(monkeypatch: pytest.MonkeyPatch) -> None:
    """The port chosen is taken (here: held by a listening socket) before rank 0 binds it:
    the launch is retried on a fresh port instead of failing or hanging."""
    import socket

    from functional_fsdp.shell import launch

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    ports = [busy.getsockname()[1]]
    real = launch._free_port
    monkeypatch.setattr(launch, "_free_port", lambda: ports.pop() if ports else real())
    try:
        assert run_local(_rank_sum, 2, 1, timeout_s=120) == [(0, 2, 3.0), (1, 2, 3.0)]
    finally:
        busy.close()
    assert not ports  # the busy port was tried first
