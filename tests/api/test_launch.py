"""run_local: N local gloo ranks, results by rank, failures raised (never a hang)."""

from __future__ import annotations

from typing import Any

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


def _inherited(name: str) -> dict[str, Any]:
    """What this rank inherited: an environment variable, its intra-op threads, umask, open
    files' limit, torch seed; and it prints."""
    import os
    import resource

    print(f"rank {dist.get_rank()} prints", flush=True)
    umask = os.umask(0)
    os.umask(umask)
    return {
        "env": os.environ.get(name),
        "threads": torch.get_num_threads(),
        "umask": umask,
        "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        "seed": torch.initial_seed(),
    }


def test_ranks_inherit_the_callers_process_at_each_call(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The ranks fork from a server started by the session's first launch: they still get what
    spawned ranks would, as the caller has it at this call (set after the server started):
    environment, intra-op threads, output, umask, resource limits; and a torch seed of their
    own (the server's, shared by every rank and launch, would repeat their random numbers)."""
    import os
    import resource

    run_local(_rank_sum, 2, 1, timeout_s=120)  # the server runs from here on
    capfd.readouterr()
    monkeypatch.setenv("FFSDP_LAUNCH_MARK", "set after the server started")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    umask = os.umask(0o027)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft - 1, hard))
        first = run_local(_inherited, 2, "FFSDP_LAUNCH_MARK", timeout_s=120)
        second = run_local(_inherited, 2, "FFSDP_LAUNCH_MARK", timeout_s=120)
    finally:
        os.umask(umask)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    for got in first + second:
        assert got["env"] == "set after the server started", got
        assert (got["threads"], got["umask"], got["nofile"]) == (3, 0o027, soft - 1), got
    seeds = [got["seed"] for got in first + second]
    assert len(set(seeds)) == 4, seeds
    out = capfd.readouterr().out
    assert out.count("rank 0 prints") == 2 and out.count("rank 1 prints") == 2, out


def test_a_module_the_ranks_import_sees_the_callers_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """The function's module is imported in the rank after the caller's environment is
    applied: its top level reads the variable set after the server started."""
    run_local(_rank_sum, 2, 1, timeout_s=120)  # the server runs from here on
    (tmp_path / "ffsdp_late_module.py").write_text(
        "import os\nSEEN = os.environ.get('FFSDP_LAUNCH_MARK')\n\n\ndef seen():\n    return SEEN\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("FFSDP_LAUNCH_MARK", "at import")
    import ffsdp_late_module

    assert run_local(ffsdp_late_module.seen, 2, timeout_s=120) == ["at import"] * 2


def _preloaded(name: str) -> tuple[bool, bool, int]:
    import os
    import sys

    module = sys.modules.get(name)
    server_threads = len(os.listdir(f"/proc/{os.getppid()}/task"))
    return (
        module is not None,
        module is not None and os.getpid() != module.IMPORTED_IN,
        server_threads,
    )


def test_the_fork_server_preloads_a_module_found_on_a_path_added_at_run_time() -> None:
    """The tests' folders join ``sys.path`` at run time (``conftest.py``), and the server of
    Python 3.11 and 3.12 ignores the path ``multiprocessing`` hands it: every rank imported
    ``_dist`` and ``_warm_compile`` (a first compile's 580 modules) itself, their preload
    having failed in silence. ``_warm_compile`` records where it was imported: in the server,
    before the rank was forked. And the server runs one thread: a thread it started (a
    compile's autograd engine in a CUDA build of torch) would not exist in the forked rank,
    whose backward then fails or hangs."""
    assert run_local(_preloaded, 2, "_warm_compile", timeout_s=120) == [(True, True, 1)] * 2


def test_spawned_ranks_where_there_is_no_fork_server(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Where the platform has no fork server the ranks are spawned, and inherit the same."""
    import multiprocessing as mp

    from functional_fsdp.shell import launch

    monkeypatch.setattr(launch, "rank_context", lambda: mp.get_context("spawn"))
    monkeypatch.setenv("FFSDP_LAUNCH_MARK", "spawned")
    got = run_local(_inherited, 2, "FFSDP_LAUNCH_MARK", timeout_s=120)
    assert [g["env"] for g in got] == ["spawned"] * 2
    assert got[0]["seed"] != got[1]["seed"]
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


def test_a_result_crosses_as_bytes_whatever_views_it_holds() -> None:
    """What a rank sends back (``processes.to_bytes``): ``torch.save`` keeps a storage two
    results share shared; where it refuses (views of one buffer as fp32 and bf16), each tensor
    crosses by value, its dtype, shape, ``requires_grad`` and ``Parameter``-ness kept."""
    from functional_fsdp.shell.processes import from_bytes, to_bytes

    flat = torch.arange(8, dtype=torch.float32)
    shared = from_bytes(to_bytes({"a": flat[:4], "b": flat[4:]}))
    assert shared["a"].untyped_storage().data_ptr() == shared["b"].untyped_storage().data_ptr()
    assert torch.equal(torch.cat([shared["a"], shared["b"]]), flat)

    param = torch.nn.Parameter(torch.ones(2, 3))
    mixed = {
        "fp32": flat[:4],
        "bf16": flat[4:].view(torch.bfloat16),
        "param": param,
        "grad": torch.zeros(2).requires_grad_(),
        "empty": torch.empty(0, 5),
        "strided": torch.arange(12.0).reshape(3, 4).t(),
    }
    back = from_bytes(to_bytes(mixed))
    for name, want in mixed.items():
        got = back[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got.detach(), want.detach()), name
        assert got.requires_grad == want.requires_grad, name
    assert type(back["param"]) is torch.nn.Parameter


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
