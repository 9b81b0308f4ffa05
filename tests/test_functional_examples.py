"""Smoke tests: the examples run end to end in one command (2 or 4 spawned gloo ranks)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _run(script: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def test_custom_trainer_runs_and_resumes_identically() -> None:
    out = _run("05_custom_trainer.py", "--steps", "4", "--eval-every", "2")
    assert "step   4" in out and "eval (EMA weights) loss" in out
    assert "resumed from step 2: final state identical = True" in out


def test_functional_train_example_runs() -> None:
    out = _run("02_functional_train.py", "--steps", "8")
    assert "loss" in out


def test_fsdp_tp_example_runs() -> None:
    """examples/04_fsdp_tp.py: 4 spawned ranks (2 dp x 2 tp); it asserts its losses match one
    plain model's on the global batch (exit status 1 otherwise)."""
    out = _run("04_fsdp_tp.py", "--steps", "2", "--layers", "1")
    assert "(_StridedShard(dim=0, sf=2), Shard(dim=0))" in out
    assert "max loss difference vs single process" in out


def test_int8_all_gather_example_runs() -> None:
    """examples/06_int8_all_gather.py: 2 spawned ranks; int8 all-gather through a tensor
    subclass's FSDP2 hooks equals torch FSDP2 with the same subclass and sends fewer bytes."""
    out = _run("06_int8_all_gather.py", "--steps", "2")
    assert "bit for bit: True" in out
    fewer = float(out.split("KiB (")[1].split("x fewer")[0])
    assert fewer > 2.5, out


def test_float8_all_gather_example_runs() -> None:
    """examples/06_int8_all_gather.py --float8: torchao's float8 all-gather on CPU, equal to
    torch FSDP2 with the same conversion, fewer bytes."""
    out = _run("06_int8_all_gather.py", "--steps", "2", "--float8")
    assert "float8 under functional_fsdp == float8 under torch FSDP2, bit for bit: True" in out
    fewer = float(out.split("KiB (")[1].split("x fewer")[0])
    assert fewer > 2.5, out


def test_reproducible_example_prints_equal_hashes() -> None:
    """examples/07_reproducible.py: the same run on 1 and 2 spawned ranks, equal state hashes
    with ReproduciblePolicy."""
    out = _run("07_reproducible.py", "--steps", "2")
    assert "with ReproduciblePolicy        equal on 1 and 2 ranks: True" in out, out
