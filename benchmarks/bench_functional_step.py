"""Step time of the functional step against the module API (``fully_shard`` + ``torch.optim.AdamW``).

World size 2 on gloo (one thread per rank), the benchmark GPT (``GPTConfig()`` defaults, ~13M
parameters), batch 4 per rank, FSDP2's recipe (each block, then the root). Both variants live in
the same two processes and their steps alternate, so machine noise hits both alike; the median
over the timed steps is reported (rank 0's clock, after a barrier).

    python benchmarks/bench_functional_step.py [--steps 10] [--warmup 3] [--donate]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from functional_fsdp import fully_shard
from functional_fsdp.functional import adamw, init, make_train_step
from functional_fsdp.testing.models import GPT, GPTConfig, synthetic_batch


def _build(cfg: GPTConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _worker(rank: int, ws: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ws)
    cfg = GPTConfig()
    shell = _build(cfg)
    opt = torch.optim.AdamW(shell.parameters(), lr=1e-4)
    model = _build(cfg)
    fopt = adamw(1e-4)
    state = init(model, fopt)
    step = make_train_step(model, lambda m, b: m.loss(*b), fopt, donate=args.donate)
    times: dict[str, list[float]] = {"shell": [], "functional": []}
    for i in range(args.warmup + args.steps):
        x, y = synthetic_batch(cfg, args.batch, seed=1000 * i + rank)
        dist.barrier()
        t0 = time.perf_counter()
        loss = shell.loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss.item()
        dist.barrier()
        t1 = time.perf_counter()
        state, metrics = step(state, (x, y))
        metrics["loss"].item()
        dist.barrier()
        t2 = time.perf_counter()
        if i >= args.warmup:
            times["shell"].append(t1 - t0)
            times["functional"].append(t2 - t1)
    if rank == 0:
        s, f = statistics.median(times["shell"]), statistics.median(times["functional"])
        print(
            f"GPTConfig() ws={ws} batch={args.batch} steps={args.steps} donate={args.donate}: "
            f"shell (fully_shard + torch AdamW) {s * 1e3:.1f} ms, functional step {f * 1e3:.1f} ms, "
            f"ratio {f / s:.3f}",
            flush=True,
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--donate", action="store_true")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port, args), nprocs=2)


if __name__ == "__main__":
    main()
