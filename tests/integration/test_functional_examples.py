"""Smoke tests: the examples run end to end in one command (2 or 4 spawned gloo ranks)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
TIMEOUT_S = 240

# The command each test runs, longest first: the module starts the selected ones two at a time
# (a parent importing torch, or a 1-rank run, leaves the second core idle) and each test waits
# for its own and checks its output.
COMMANDS = {
    "test_reproducible_example_prints_equal_hashes": ("07_reproducible.py", "--steps", "2"),
    "test_fsdp_tp_example_runs": ("04_fsdp_tp.py", "--steps", "2", "--layers", "1"),
    "test_float8_all_gather_example_runs": ("06_int8_all_gather.py", "--steps", "2", "--float8"),
    "test_custom_trainer_runs_and_resumes_identically": (
        "05_custom_trainer.py",
        "--steps",
        "4",
        "--eval-every",
        "2",
    ),
    "test_functional_train_example_runs": ("02_functional_train.py", "--steps", "8"),
    "test_int8_all_gather_example_runs": ("06_int8_all_gather.py", "--steps", "2"),
    "test_use_as_fsdp2_example_runs": ("08_use_as_fsdp2.py",),
    "test_compiled_step_example_runs": ("09_compiled_step.py", "--steps", "3"),
}
PARALLEL = 2


class _Runs:
    """The example commands, run in the background ``PARALLEL`` at a time, each in its own
    process group: a run past ``TIMEOUT_S`` and every run left at :meth:`close` are killed
    with the ranks they spawned."""

    def __init__(self, names: list[str]) -> None:
        self._lock = threading.Lock()
        self._procs: list[subprocess.Popen] = []
        self._closed = False
        self._pool = ThreadPoolExecutor(max_workers=PARALLEL)
        self._futures: dict[str, Future] = {n: self._pool.submit(self._run, n) for n in names}

    def _run(self, name: str) -> tuple[int, str, str]:
        script, *args = COMMANDS[name]
        with self._lock:
            if self._closed:
                return -1, "", "not run: the module ended"
            p = subprocess.Popen(
                [sys.executable, str(EXAMPLES / script), *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            self._procs.append(p)
        try:
            out, err = p.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _kill(p)
            out, err = p.communicate()
            err += f"\n[killed after {TIMEOUT_S} s]"
        return p.returncode, out, err

    def stdout(self, name: str) -> str:
        """The command's stdout once it exited with status 0 (else the test fails)."""
        future = self._futures.get(name) or self._pool.submit(self._run, name)
        code, out, err = future.result(timeout=2 * TIMEOUT_S)
        assert code == 0, out[-2000:] + err[-4000:]
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
        for p in self._procs:
            _kill(p)
        self._pool.shutdown(wait=True, cancel_futures=True)


def _kill(p: subprocess.Popen) -> None:
    """Kill ``p``, if still running, and the processes it spawned (its process group)."""
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def _runs(request: pytest.FixtureRequest) -> Iterator[_Runs]:
    selected = {item.name for item in request.session.items if item.module is request.module}
    runs = _Runs([n for n in COMMANDS if n in selected])
    yield runs
    runs.close()


@pytest.fixture
def example(_runs: _Runs, request: pytest.FixtureRequest) -> Callable[[], str]:
    """Waits for this test's command in :data:`COMMANDS`: its stdout, once it exited with
    status 0."""
    return lambda: _runs.stdout(request.node.name)


def test_custom_trainer_runs_and_resumes_identically(example: Callable[[], str]) -> None:
    out = example()
    assert "step   4" in out and "eval (EMA weights) loss" in out
    assert "resumed from step 2: final state identical = True" in out


def test_functional_train_example_runs(example: Callable[[], str]) -> None:
    out = example()
    assert "loss" in out


def test_fsdp_tp_example_runs(example: Callable[[], str]) -> None:
    """examples/04_fsdp_tp.py: 4 spawned ranks (2 dp x 2 tp); it asserts its losses match one
    plain model's on the global batch (exit status 1 otherwise)."""
    out = example()
    assert "(_StridedShard(dim=0, sf=2), Shard(dim=0))" in out
    assert "max loss difference vs single process" in out


def test_int8_all_gather_example_runs(example: Callable[[], str]) -> None:
    """examples/06_int8_all_gather.py: 2 spawned ranks; int8 all-gather through a tensor
    subclass's FSDP2 hooks equals torch FSDP2 with the same subclass and sends fewer bytes."""
    out = example()
    assert "bit for bit: True" in out
    fewer = float(out.split("KiB (")[1].split("x fewer")[0])
    assert fewer > 2.5, out


def test_float8_all_gather_example_runs(example: Callable[[], str]) -> None:
    """examples/06_int8_all_gather.py --float8: torchao's float8 all-gather on CPU, equal to
    torch FSDP2 with the same conversion, fewer bytes."""
    out = example()
    assert "float8 under functional_fsdp == float8 under torch FSDP2, bit for bit: True" in out
    fewer = float(out.split("KiB (")[1].split("x fewer")[0])
    assert fewer > 2.5, out


def test_reproducible_example_prints_equal_hashes(example: Callable[[], str]) -> None:
    """examples/07_reproducible.py: the same run on 1 and 2 spawned ranks, equal state hashes
    with ReproduciblePolicy."""
    out = example()
    assert "with ReproduciblePolicy        equal on 1 and 2 ranks: True" in out, out


def test_use_as_fsdp2_example_runs(example: Callable[[], str]) -> None:
    """examples/08_use_as_fsdp2.py: a framework importing FSDP2 at call time shards with ours
    under use_as_fsdp2() and trains with FSDP2's losses (the script asserts them)."""
    out = example()
    assert "under use_as_fsdp2(), FSDP2's losses" in out, out


def test_compiled_step_example_runs(example: Callable[[], str]) -> None:
    """examples/09_compiled_step.py: the step compiled with aot_eager, its collectives in the
    graphs, equal to the eager step bit for bit (the script asserts it)."""
    out = example()
    assert "bit-identical: True" in out, out
    # 3 groups in 2 buckets (the root; both blocks): one reduce-scatter each, in the graph.
    assert "'reduce_scatter_tensor': 2" in out, out
