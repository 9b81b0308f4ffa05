"""A custom training loop written only with the functional API, on 2 CPU ranks.

Runs in well under a minute: ``python examples/02_functional_train.py``. It spawns its own gloo
ranks on 127.0.0.1 (no torchrun needed); under torchrun it uses the launched ranks instead::

    torchrun --nproc-per-node 2 examples/02_functional_train.py

The loop is ``state = init(model, opt)`` then ``state, metrics = step(state, batch)``: the
:class:`~functional_fsdp.functional.TrainState` holds each rank's shards of the parameters and
of the AdamW moments, and every step returns a new state (the old one is untouched, so keeping
it around, e.g. for an EMA or a rollback, is just keeping a reference). The model sharded with
``fully_shard`` only provides the computation: the step runs it through
``torch.func.functional_call`` on the state's parameters, one group unsharded at a time, and
gets the reduce-scattered gradients back as sharded ``DTensor`` s.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from functional_fsdp import fully_shard, run_local
from functional_fsdp.functional import adamw, chain, clip_by_global_norm, init, make_train_step
from functional_fsdp.testing.models import GPT, GPTConfig, pattern_batch

CFG = GPTConfig(vocab=256, dim=64, n_layers=2, n_heads=4, seq=32)


def train(steps: int, batch: int, accum: int) -> list[float]:
    """The whole training program of one rank; returns its losses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # same initial weights on every rank
    model = GPT(CFG)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)

    opt = chain(clip_by_global_norm(1.0), adamw(3e-3, weight_decay=0.01))
    state = init(model, opt)
    step = make_train_step(model, lambda m, b: m.loss(*b), opt, grad_accum=accum)

    losses = []
    t0 = time.perf_counter()
    for i in range(steps):
        batch_i = pattern_batch(CFG, batch, seed=1000 * i + rank)  # each rank its own data
        state, metrics = step(state, batch_i)
        losses.append(metrics["loss"].item())  # the mean over the ranks
        if rank == 0 and (i % 5 == 0 or i == steps - 1):
            print(
                f"step {int(state.step):3d}  loss {losses[-1]:.4f}  "
                f"grad norm {metrics['grad_norm'].item():.3f}",
                flush=True,
            )
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(
            f"{world} ranks, {n / 1e6:.2f}M parameters, {steps} steps in "
            f"{time.perf_counter() - t0:.1f}s; each rank holds {_local_numel(state) / 1e6:.2f}M "
            "elements of parameters + optimizer state",
            flush=True,
        )
    return losses


def _local_numel(state: Any) -> int:
    from functional_fsdp.core._tree import tree_leaves

    return sum(getattr(t, "_local_tensor", t).numel() for t in tree_leaves(state))


def _rank(args: argparse.Namespace) -> list[float]:
    torch.set_num_threads(1)
    return train(args.steps, args.batch, args.accum)


def spawn(world_size: int, args: argparse.Namespace) -> list[float]:
    """Run :func:`train` on ``world_size`` local CPU gloo ranks; returns rank 0's losses."""
    return run_local(_rank, world_size, args)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument(
        "--batch", type=int, default=8, help="per-rank batch (split into --accum micro-batches)"
    )
    ap.add_argument("--accum", type=int, default=2, help="gradient accumulation micro-batches")
    ap.add_argument("--world-size", type=int, default=2)
    args = ap.parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        dist.init_process_group("gloo")
        try:
            train(args.steps, args.batch, args.accum)
        finally:
            dist.destroy_process_group()
        return
    losses = spawn(args.world_size, args)
    assert losses[-1] < losses[0], "the loss should fall on this learnable task"
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")


if __name__ == "__main__":
    main()
