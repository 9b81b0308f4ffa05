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


def _environment_and_print(name: str) -> tuple[str | None, int]:
    print(f"rank {dist.get_rank()} prints", flush=True)
    return __import__("os").environ.get(name), torch.get_num_threads()


def test_ranks_inherit_the_environment_and_output_at_each_call(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The ranks fork from a server started by the session's first launch: they still see the
    caller's environment and standard output as they are at this call (a variable set and an
    output captured after the server started), as spawned ranks would."""
    run_local(_rank_sum, 2, 1, timeout_s=120)  # the server runs from here on
    capfd.readouterr()
    monkeypatch.setenv("FFSDP_LAUNCH_MARK", "set after the server started")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    got = run_local(_environment_and_print, 2, "FFSDP_LAUNCH_MARK", timeout_s=120)
    assert got == [("set after the server started", 3)] * 2
    out = capfd.readouterr().out
    assert "rank 0 prints" in out and "rank 1 prints" in out, out


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


def test_the_main_job_survives_a_killed_rank(capfd: pytest.CaptureFixture[str]) -> None:
    """``python -m functional_fsdp.train --kill-rank 1 --kill-at-step 3`` on 3 ranks: rank 1
    is SIGKILLed in the forward of step 3; the two survivors rebuild from memory, redo step 3
    and finish, and the summary says so."""
    from functional_fsdp import train

    argv = "--world-size 3 --kill-rank 1 --kill-at-step 3 --steps 5 --dim 32 --layers 2"
    argv += " --vocab 128 --seq 16 --batch 2"
    assert train.main(argv.split()) == 0
    out = capfd.readouterr().out
    assert "rank(s) [1] killed, finished on 2" in out
    assert "lost rank(s) [1] in step 3: detected and rebuilt from memory" in out
    assert "restarting from step 2 on 2 rank(s)" in out  # the interrupted step is redone
    assert "5/5" in out


def _die_on_rank_one() -> int:
    import os
    import signal

    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return dist.get_rank()


def test_a_survivable_run_reports_a_killed_rank_as_none() -> None:
    from functional_fsdp.shell.launch import launcher_store

    assert run_local(_die_on_rank_one, 2, timeout_s=120, survivable=True) == [0, None]
    with pytest.raises(RuntimeError, match="survivable=True"):
        launcher_store()


def _many_tensors(n: int, big_numel: int) -> dict[str, torch.Tensor]:
    rank = dist.get_rank()
    out = {f"t{i}": torch.full((3,), float(i + 1000 * rank)) for i in range(n)}
    out["big"] = torch.arange(big_numel, dtype=torch.float32) + rank
    return out


def test_a_result_of_many_tensors_and_a_large_one_comes_back_intact() -> None:
    """400 small tensors and a 50 MB one per rank: each rank serialises its result to bytes,
    so the queue passes no shared-memory file descriptors (as tensors, 120 of them already
    broke the launcher)."""
    big = 50_000_000 // 4
    results = run_local(_many_tensors, 2, 400, big, timeout_s=120)
    for rank, res in enumerate(results):
        assert len(res) == 401
        for i in range(400):
            assert torch.equal(res[f"t{i}"], torch.full((3,), float(i + 1000 * rank)))
        assert torch.equal(res["big"], torch.arange(big, dtype=torch.float32) + rank)


def _unpicklable() -> object:
    return lambda: None


def test_a_result_that_cannot_be_pickled_fails_its_rank_at_once() -> None:
    """Not a silent loss in the queue's feeder thread (the run then waited out its timeout):
    the rank reports the pickling error."""
    import time

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)rank 0.*pickle"):
        run_local(_unpicklable, 1, timeout_s=40)
    assert time.monotonic() - t0 < 30
