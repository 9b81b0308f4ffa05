"""docs/design.md's walk names every file a steady training step runs.

A steady step (the third) of the 2-block GPT, each block and the root sharded, AdamW, on 2
gloo ranks, is traced with ``sys.setprofile``: every call into the package is recorded with its
file. The test fails when a file runs that the walk ("A steady step, file by file") does not
name, or when the walk names a file of the package that does not exist. It also measures how
often the step crosses the line between the pure core and the shell (a call from one side
into the other), and fails if that grows past today's count: the crossings are the design's
cost, and a change that adds some must say so here.
"""

from __future__ import annotations

import itertools
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "functional_fsdp"
# Measured (2 blocks + root, 2 ranks): 28, from 36 when a gather bucket's members each waited
# for the shared all-gather and recorded an event of their own (now: one wait, one event,
# ``ordering.BucketWait``), the shell asked the core whether the bucket lands member by member
# before issuing it (the core decides, and asks for buffers only when it needs them), and the
# peers' rows and the packed send row were two allocations. 36 from 50 when a bucket's members finished their
# shared reduce-scatter one by one (a wait, a finish and an accumulation each); 64 when a reduce bucket laid out its send
# buffer's columns again every backward (asking each member's layout for its reduce dtype)
# and a finished reduction rebuilt the group's record even when nothing in it changed; 72
# in an earlier measurement, 92 when a group's communicator still answered its rank and world size
# through properties the core called at every collective, and 98 before the life cycle and
# the plan were remembered per group. A ratchet: lower it as the shell thins.
MAX_CROSSINGS = 28


def case_trace_steady_step() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from functional_fsdp import fully_shard
    from functional_fsdp.testing.models import GPT, GPTConfig, synthetic_batch

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=64, dim=32, n_layers=2, n_heads=2, seq=16)
    model = GPT(cfg)
    for blk in model.blocks:
        fully_shard(blk)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pkg = str(PACKAGE) + "/"
    calls: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            f = frame.f_code.co_filename
            if f.startswith(pkg):
                calls.append(f[len(pkg) :])

    for step in range(3):
        x, y = synthetic_batch(cfg, 2, seed=100 * step + dist.get_rank())
        if step == 2:
            sys.setprofile(profile)
        try:
            model.loss(x, y).backward()
            opt.step()
            opt.zero_grad()
        finally:
            sys.setprofile(None)
    side = ["core" if c.startswith("core/") else "shell" for c in calls]
    switches = sum(a != b for a, b in itertools.pairwise(calls))
    crossings = sum(a != b for a, b in itertools.pairwise(side))
    return {
        "files": sorted(set(calls)),
        "calls": len(calls),
        "switches": switches,
        "crossings": crossings,
    }


def _walk() -> str:
    text = (ROOT / "docs" / "design.md").read_text()
    start = text.index("### A steady step, file by file")
    end = text.index("\n## ", start)
    return text[start:end]


def _named(walk: str) -> set[str]:
    return set(re.findall(r"`((?:core|shell|functional|optim|testing)/[\w/]+\.py|_\w+\.py)`", walk))


def test_the_walk_names_only_files_that_exist() -> None:
    named = _named(_walk())
    assert named, "the walk names no file"
    missing = sorted(n for n in named if not (PACKAGE / n).is_file())
    assert not missing, f"docs/design.md's walk names files that do not exist: {missing}"


@pytest.fixture(scope="module")
def fresh_world() -> Any:
    """A 2-rank world of its own: the session's shared one has run other cases, whose global
    hooks (the reproducible step check, the stream simulator's optimizer watch) stay
    installed in its processes and would run in the traced step."""
    from _dist import World

    w = World(2)
    yield w
    w.close(force=True)


@pytest.mark.skipif(
    os.environ.get("FFSDP_RUNTIME") == "simulator",
    reason="the walk is the CPU runtime's steady step (the simulator's own files run too)",
)
def test_a_steady_step_runs_only_files_the_walk_names(fresh_world: Any) -> None:
    named = _named(_walk())
    for res in fresh_world.run(case_trace_steady_step):
        unnamed = sorted(set(res["files"]) - named)
        assert not unnamed, (
            f"a steady step runs {unnamed}, which docs/design.md's walk ('A steady step, file "
            f"by file') does not name: add each where the step reaches it"
        )
        assert res["crossings"] <= MAX_CROSSINGS, (
            f"a steady step crosses the core/shell line {res['crossings']} times "
            f"(at most {MAX_CROSSINGS} until now): {res}"
        )


def test_the_walk_checker_sees_full_paths_only() -> None:
    walk = "`core/plan.py` and `shell/api/state.py`, `_compat.py`; not fully_shard.py"
    assert _named(walk) == {"core/plan.py", "shell/api/state.py", "_compat.py"}
