"""The main job: a real sharded training run of the small GPT with ``fully_shard``.

By default it spawns 2 local CPU ranks (gloo on 127.0.0.1) by itself::

    python -m functional_fsdp.train                 # 2 ranks, 30 steps
    python -m functional_fsdp.train --steps 200 --world-size 4
    torchrun --nproc-per-node 2 -m functional_fsdp.train   # launched ranks are used as they are

Rank 0 shows a progress bar and prints a summary: final loss, step time, throughput and the peak
resident memory of every rank.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import resource
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from .shell import fully_shard
from .shell.launch import run_local
from .testing.models import GPT, GPTConfig, pattern_batch


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m functional_fsdp.train", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument(
        "--world-size", type=int, default=2, help="ranks to spawn when not under torchrun"
    )
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument(
        "--bf16", action="store_true", help="MixedPrecisionPolicy(param_dtype=bfloat16)"
    )
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    return ap.parse_args(argv)


def _bar(step: int, total: int, loss: float, ms: float) -> None:
    width = 30
    done = int(width * step / total)
    sys.stdout.write(
        f"\r[{'#' * done}{'.' * (width - done)}] {step}/{total}  loss {loss:7.4f}  {ms:7.1f} ms/step"
    )
    sys.stdout.flush()
    if step == total:
        sys.stdout.write("\n")


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Train on this rank (the process group is initialised); returns this rank's summary."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # RSS follows live tensors
    torch.set_num_threads(args.threads)
    rank, ws = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(
        vocab=args.vocab,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=max(1, args.dim // 64),
        seq=args.seq,
    )
    torch.manual_seed(0)
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    kw: dict[str, Any] = {}
    if args.bf16:
        from .core.records import MixedPrecisionPolicy

        kw["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    times, losses = [], []
    for step in range(1, args.steps + 1):
        x, y = pattern_batch(cfg, args.batch, seed=step * ws + rank)
        t0 = time.perf_counter()
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        losses.append(avg.item() / ws)
        if rank == 0:
            _bar(step, args.steps, losses[-1], 1e3 * times[-1])
    local = sum(p.to_local().numel() for p in model.parameters())  # type: ignore[attr-defined]
    return {
        "rank": rank,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "step_ms": 1e3 * statistics.median(times[min(2, len(times) - 1) :]),
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "params": n_params,
        "local_params": local,
        "tokens_per_step": args.batch * cfg.seq * ws,
    }


def _summary(rows: list[dict[str, Any]]) -> None:
    r0 = rows[0]
    tok_s = r0["tokens_per_step"] / (r0["step_ms"] / 1e3)
    print("== functional_fsdp training summary ==")
    print(f"world size        {len(rows)} (gloo, CPU)")
    print(
        f"parameters        {r0['params'] / 1e6:.2f} M total, {r0['local_params'] / 1e6:.2f} M per rank (sharded)"
    )
    print(f"loss              {r0['first_loss']:.4f} -> {r0['final_loss']:.4f}")
    print(f"step time         {r0['step_ms']:.1f} ms (median), {tok_s:,.0f} tokens/s")
    for r in rows:
        print(f"peak memory       rank {r['rank']}: {r['peak_rss_mib']:.0f} MiB resident")


def main(argv: list[str] | None = None) -> int:
    """Entry point: train under torchrun, or spawn ``--world-size`` local CPU ranks."""
    args = _parse(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
        row = train(args)
        rows: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(rows, row)
        if dist.get_rank() == 0:
            _summary(rows)
        dist.destroy_process_group()
        return 0
    try:
        rows = run_local(train, args.world_size, args)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    _summary(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
