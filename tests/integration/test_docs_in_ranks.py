"""The multi-rank snippets of docs/reproducibility.md and docs/recovery.md, run on real ranks.

Their ```python blocks that need ranks carry ``# doctest: +SKIP`` (``tests/integration/test_docs.py`` only
compiles those). Here every block of each file runs verbatim, in order, in one namespace on
every rank of ``run_local``, after a harness defines what the text leaves to the reader (a
model, a loader, ``build``, ``train_step``, the store): the contract loop on 1 and 2 ranks must
give the same bits, and the recovery loop must survive a rank killed in the middle of training.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_docs import DOCS, _blocks

from functional_fsdp import run_local

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

CFG = dict(vocab=64, dim=32, n_layers=2, n_heads=2, seq=8)


def _code(name: str) -> str:
    """Every python block of ``docs/<name>``, in order (the SKIP marker is a comment)."""
    blocks = [code for _, code in _blocks(DOCS / name)]
    assert blocks, name
    return "\n".join(blocks)


def _exec_doc(name: str, namespace: dict[str, Any]) -> dict[str, Any]:
    exec(compile(_code(name), f"docs/{name}", "exec"), namespace)
    return namespace


# ------------------------------------------------------------------ reproducibility.md


def _reproducibility_rank(steps: int) -> dict[str, torch.Tensor]:
    """The contract loop: ``model`` a small GPT (``blocks``, ``loss``), ``loader`` ``steps``
    global batches of the snippet's ``V = 8`` sequences, ``micro_batch(batch, k)`` the k-th."""
    from functional_fsdp.testing.models import GPT, GPTConfig, synthetic_batch

    torch.set_num_threads(1)  # the contract: one thread count on every rank
    torch.manual_seed(0)
    cfg = GPTConfig(**CFG)

    def micro_batch(batch: Any, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        return x[k : k + 1], y[k : k + 1]

    ns = _exec_doc(
        "reproducibility.md",
        {
            "torch": torch,
            "dist": dist,
            "model": GPT(cfg),
            "loader": [synthetic_batch(cfg, 8, seed=100 + s) for s in range(steps)],
            "micro_batch": micro_batch,
        },
    )
    out = {f"param/{n}": p.detach().full_tensor() for n, p in ns["model"].named_parameters()}
    for i, st in enumerate(ns["opt"].state.values()):
        for key, value in st.items():
            out[f"state{i}/{key}"] = getattr(value, "full_tensor", lambda v=value: v)()
    return out


def test_the_reproducibility_contract_runs_and_gives_the_same_bits_on_1_and_2_ranks() -> None:
    one = run_local(_reproducibility_rank, 1, 2, timeout_s=240)[0]
    for res in run_local(_reproducibility_rank, 2, 2, timeout_s=240):
        assert res.keys() == one.keys()
        unequal = [k for k in one if not torch.equal(res[k], one[k])]
        assert not unequal, unequal


# ------------------------------------------------------------------ recovery.md

KILL_RANK, KILL_STEP, STEPS, GLOBAL = 1, 2, 4, 4


def _recovery_rank() -> dict[str, Any]:
    """The recovery loop on 2 ranks of ``run_local(survivable=True)``: old rank 1 kills
    itself at the start of step 2; rank 0 rebuilds from its copy and finishes alone."""
    from functional_fsdp import fully_shard
    from functional_fsdp.shell.launch import launcher_store
    from functional_fsdp.testing.models import GPT, GPTConfig, synthetic_batch

    torch.set_num_threads(1)
    cfg = GPTConfig(**CFG)
    me = dist.get_rank()

    def build() -> tuple[Any, Any]:
        torch.manual_seed(0)
        model = GPT(cfg)
        for b in model.blocks:
            fully_shard(b)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train_step(model: Any, opt: Any, step: int, rank: int, world_size: int) -> None:
        if me == KILL_RANK and step == KILL_STEP:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = synthetic_batch(cfg, GLOBAL, seed=step)
        rows = slice(rank * GLOBAL // world_size, (rank + 1) * GLOBAL // world_size)
        model.loss(x[rows], y[rows]).backward()
        opt.step()
        opt.zero_grad()

    ns = _exec_doc(
        "recovery.md",
        {
            "build": build,
            "train_step": train_step,
            "store": launcher_store(),
            "steps": STEPS,
            "rank": me,
            "world_size": dist.get_world_size(),
        },
    )
    return {k: ns[k] for k in ("step", "epoch", "rank", "world_size")}


def test_the_recovery_loop_survives_a_killed_rank() -> None:
    results = run_local(_recovery_rank, 2, timeout_s=240, survivable=True)
    assert results[KILL_RANK] is None  # killed
    assert results[0] == {"step": STEPS, "epoch": 2, "rank": 0, "world_size": 1}
