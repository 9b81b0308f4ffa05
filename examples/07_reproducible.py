"""Reproducible at any scale: the same training run on 1 and on 2 ranks ends with the same bits.

One command (it spawns its own gloo ranks, one run per world size)::

    python examples/07_reproducible.py
    python examples/07_reproducible.py --steps 5 --virtual-world-size 8

Every ``fully_shard`` call gets the same ``ReproduciblePolicy(virtual_world_size=V)``. The
global batch of each step is ``V`` micro-batches; on ``N`` ranks, rank ``r`` runs micro-batches
``policy.micro_batches(r, N)`` in order with the usual accumulation loop (each loss divided by
``V / N``), then ``functional_fsdp.clip_grad_norm_`` and ``AdamW``. The run prints a hash of the
parameters and the optimizer state on each world size: they are equal. For contrast it also
trains without the policy (plain FSDP2 semantics), whose hashes differ between 1 and 2 ranks.
"""

from __future__ import annotations

import argparse
import hashlib
from typing import Any

import torch
import torch.distributed as dist

from functional_fsdp import ReproduciblePolicy, clip_grad_norm_, fully_shard, run_local
from functional_fsdp.testing.models import GPT, GPTConfig, pattern_batch

CFG = GPTConfig(vocab=128, dim=64, n_layers=2, n_heads=4, seq=32)


def _hash(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.full_tensor().detach().numpy().tobytes())  # type: ignore[operator]
        for key in ("exp_avg", "exp_avg_sq"):
            h.update(opt.state[p][key].full_tensor().numpy().tobytes())
    return h.hexdigest()[:16]


def train(steps: int, virtual: int, reproducible: bool) -> tuple[str, float]:
    """One rank's part of the run; returns (hash of parameters + optimizer state, last loss)."""
    torch.set_num_threads(1)  # the promise holds for one fixed thread count per rank
    n, rank = dist.get_world_size(), dist.get_rank()
    policy = ReproduciblePolicy(virtual_world_size=virtual)
    extra: dict[str, Any] = {"reproducible": policy} if reproducible else {}
    torch.manual_seed(0)
    model = GPT(CFG)
    for block in model.blocks:
        fully_shard(block, **extra)
    fully_shard(model, **extra)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    mine = list(policy.micro_batches(rank, n))
    loss_sum = torch.zeros(())
    for step in range(steps):
        x, y = pattern_batch(CFG, 2 * virtual, seed=step)
        loss_sum = torch.zeros(())
        for j, k in enumerate(mine):
            model.set_requires_gradient_sync(j == len(mine) - 1)
            loss = model.loss(x[2 * k : 2 * k + 2], y[2 * k : 2 * k + 2]) / len(mine)
            loss.backward()
            loss_sum += loss.detach()
        if reproducible:
            clip_grad_norm_(model.parameters(), 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    dist.all_reduce(loss_sum)
    return _hash(model, opt), loss_sum.item() / n


def main() -> None:
    """Train on 1 and 2 ranks, with and without the policy, and compare the hashes."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--virtual-world-size", type=int, default=4)
    args = ap.parse_args()
    for reproducible in (True, False):
        label = "with ReproduciblePolicy" if reproducible else "without it (FSDP2 semantics)"
        hashes = {}
        for n in (1, 2):
            (h, loss), *_ = run_local(train, n, args.steps, args.virtual_world_size, reproducible)
            hashes[n] = h
            print(f"{label:<30} {n} rank(s): state hash {h}  last loss {loss:.4f}")
        print(f"{label:<30} equal on 1 and 2 ranks: {hashes[1] == hashes[2]}")


if __name__ == "__main__":
    main()
