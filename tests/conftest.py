"""Test configuration: hypothesis profiles and a deterministic torch seed.

Profiles (choose with ``HYPOTHESIS_PROFILE``, default ``dev``):

- ``dev``: fast, for the edit-test loop.
- ``ci``: twice ``dev``'s examples, derandomized so CI runs are reproducible (60: 120 cost the
  in-process tests about 30 more core-seconds of a suite bound by its 2 cores' CPU).

Warnings are errors (``filterwarnings`` in ``pyproject.toml``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# One thread per process for OpenMP and OpenBLAS (numpy's), set before torch loads them: the
# suite runs two workers and their ranks on two cores, where an idle pool thread spinning for
# work takes a core from a rank (every rank sets torch's intra-op threads to 1 already).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# The suite is a CPU suite on gloo. On a machine with a GPU, torch's FSDP2 (the parity tests'
# reference) builds its default mesh on the accelerator, and a rank forked from a server in
# which an import had initialised CUDA cannot use it at all ("Cannot re-initialize CUDA in
# forked subprocess"): seen on an H200, where most multi-rank tests failed so. The GPU is hidden
# from the suite and every process it starts, unless FFSDP_TEST_GPU=1 asks for the `gpu` tests
# (benchmarks/gpu_check.sh runs those alone, on NCCL in the test process).
if os.environ.get("FFSDP_TEST_GPU") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest
import torch
from hypothesis import HealthCheck, settings

# The tests mirror the package (tests/core, tests/engine, ...); their helpers (_dist, _helpers,
# strategies, ...) live here, and a rank spawned by a test imports the test's module by name:
# every test folder is importable by module name, in the parent and in its spawned ranks.
_TESTS = Path(__file__).resolve().parent
for _d in [_TESTS, *sorted(p for p in _TESTS.iterdir() if p.is_dir() and p.name[0] not in "._")]:
    if str(_d) not in sys.path:
        sys.path.insert(0, str(_d))

import multiprocessing  # noqa: E402

from _dist import PRELOAD, lean_gc  # noqa: E402

lean_gc()
# Whoever starts a test process's fork server (a World, run_local, an example's main()), it
# preloads what the tests' ranks import (a first compile's modules among them): the package's
# rank_context keeps a list set before it and adds its own.
multiprocessing.set_forkserver_preload(list(PRELOAD))

settings.register_profile("dev", max_examples=30, deadline=None)
settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture(autouse=True)
def _deterministic_seed() -> None:
    """Every test starts from the same torch RNG state."""
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def world2():
    """A real 2-rank gloo world shared by every case of the session."""
    from _dist import World

    w = World(2)
    yield w
    w.close()


@pytest.fixture(scope="session")
def world4():
    """A real 4-rank gloo world shared by every case of the session."""
    from _dist import World

    w = World(4)
    yield w
    w.close()


@pytest.fixture(scope="module")
def one_rank():
    """A 1-rank gloo world in this process (for a module's single-process cases)."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


# Every file that took 5 core-seconds or more of a suite run on 2 cores, heaviest first (the
# rest, 45 files of 68 core-seconds in all, follow in their own order). ``-n 2 --dist
# loadfile`` hands whole files to the two workers in collection order: the heaviest started
# first, each worker's last files are short ones, and neither finishes long after the other.
HEAVY_FIRST = (
    "functional/test_compiled_step.py",
    "integration/test_tensor_parallel.py",
    "integration/test_functional_examples.py",
    "engine/test_tied_weights.py",
    "recovery/test_recovery.py",
    "integration/test_reproducible.py",
    "engine/test_module_reuse.py",
    "engine/test_coalesce.py",
    "io/test_tp_checkpoint.py",
    "engine/test_local_step.py",
    "api/test_fully_shard.py",
    "io/test_checkpoint.py",
    "integration/test_architecture.py",
    "functional/test_functional_step.py",
    "core/test_transitions.py",
    "engine/test_contracts.py",
    "functional/test_tp_functional.py",
    "comm/test_custom_comm.py",
    "api/test_launch.py",
    "api/test_reliability.py",
    "integration/test_compile.py",
    "device/test_streams_engine.py",
    "core/test_compression.py",
    "comm/test_divergence.py",
    "functional/test_muon.py",
    "core/test_transitions_machine.py",
    "device/test_stream_races.py",
    "device/test_cuda_runtime.py",
    "functional/test_functional_api.py",
    "io/test_summon.py",
    "integration/test_pipelining.py",
)


def pytest_configure(config: pytest.Config) -> None:
    """Keep the collection order when handing out files: pytest-xdist (3.6 and later) hands
    them out by number of tests, most first (``--loadscope-reorder``, its default), which
    started the workers on the many quick cases of ``test_records.py`` and
    ``test_architecture.py`` and left :data:`HEAVY_FIRST` to wherever its files' counts fell."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Collect :data:`HEAVY_FIRST`'s files first (in that order), the rest as they were."""

    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        for i, name in enumerate(HEAVY_FIRST):
            if path.endswith(name):
                return i
        return len(HEAVY_FIRST)

    items.sort(key=rank)  # stable: within a file and among the rest, the order is kept


@pytest.fixture
def nccl_one_rank():
    """A 1-rank NCCL world in this process (the ``gpu`` tests: one GPU, a ``HashStore``)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    torch.cuda.set_device(0)  # before the mesh (else DeviceMesh warns and guesses the device)
    dist.init_process_group("nccl", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
