"""Smoke tests: the examples run end to end (2 or 4 gloo ranks each).

Each example's ``main()`` runs in this process, with its command line in ``sys.argv``: its ranks
fork from the session's fork server (torch already imported there), so an example costs its own
work, not three to five fresh interpreters importing torch (the module took 123 s of the suite
run as scripts, two at a time). Their output (the parent's and the ranks') is captured from the
file descriptors. Two commands still run as a user types them, in a fresh interpreter: one
example as a script, and the README's main job.
"""

from __future__ import annotations

import importlib
import pathlib
import subprocess
import sys
from collections.abc import Callable

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
TIMEOUT_S = 240

# The command line each test runs.
COMMANDS = {
    "test_shard_unshard_example_runs": ("01_shard_unshard.py",),
    "test_checkpoint_reshard_example_resumes_on_another_world_size": (
        "03_checkpoint_reshard.py",
        "--steps",
        "2",
    ),
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
    "test_int8_all_gather_example_runs": ("06_int8_all_gather.py", "--steps", "2"),
    "test_use_as_fsdp2_example_runs": ("08_use_as_fsdp2.py",),
    "test_compiled_step_example_runs": ("09_compiled_step.py", "--steps", "2"),
}


@pytest.fixture
def example(
    request: pytest.FixtureRequest,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> Callable[[], str]:
    """Runs this test's command in :data:`COMMANDS` (the script's ``main()`` with its
    arguments): its standard output, parent's and ranks'."""

    def run() -> str:
        script, *args = COMMANDS[request.node.name]
        # The ranks import the example by this name to find their function (sys.path travels
        # with each rank's start).
        monkeypatch.syspath_prepend(str(EXAMPLES))
        module = importlib.import_module(script.removesuffix(".py"))
        monkeypatch.setattr(sys, "argv", [str(EXAMPLES / script), *args])
        capfd.readouterr()
        module.main()
        return capfd.readouterr().out

    return run


def _command(*argv: str) -> str:
    """``python *argv`` in a fresh interpreter: its stdout once it exited with status 0."""
    p = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return p.stdout


def test_an_example_runs_as_a_script() -> None:
    """``python examples/02_functional_train.py``: the ranks find their function in the
    script's ``__main__`` module (this is the example's one run: it was also run in-process)."""
    out = _command(str(EXAMPLES / "02_functional_train.py"), "--steps", "3")
    assert "loss" in out, out


def test_the_readmes_main_job_runs() -> None:
    """``python -m functional_fsdp.train`` (small): 2 ranks spawned by the program, a summary."""
    argv = [
        "--steps",
        "3",
        "--dim",
        "32",
        "--layers",
        "1",
        "--vocab",
        "64",
        "--seq",
        "16",
        "--batch",
        "2",
    ]
    out = _command("-m", "functional_fsdp.train", *argv)
    assert "functional_fsdp training summary" in out and "world size        2" in out, out


def test_shard_unshard_example_runs(example: Callable[[], str]) -> None:
    """examples/01_shard_unshard.py: the pure transitions on 4 simulated ranks."""
    out = example()
    assert "round trip exact on all 4 ranks" in out, out


def test_checkpoint_reshard_example_resumes_on_another_world_size(
    example: Callable[[], str],
) -> None:
    """examples/03_checkpoint_reshard.py: saved on 2 ranks, resumed on 4 (the script asserts
    the resumed losses equal the uninterrupted run's), the full state dict loads into a plain
    module."""
    out = example()
    assert "max |resumed - uninterrupted|" in out, out
    assert "plain nn.Module loaded the exported full state dict" in out, out


def test_custom_trainer_runs_and_resumes_identically(example: Callable[[], str]) -> None:
    out = example()
    assert "step   4" in out and "eval (EMA weights) loss" in out
    assert "resumed from step 2: final state identical = True" in out


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
