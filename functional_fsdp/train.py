"""The main job: a real sharded training run of the small GPT with ``fully_shard``.

By default it spawns 2 local CPU ranks (gloo on 127.0.0.1) by itself::

    python -m functional_fsdp.train                 # 2 ranks, 30 steps
    python -m functional_fsdp.train --steps 200 --world-size 4
    torchrun --nproc-per-node 2 -m functional_fsdp.train   # launched ranks are used as they are
    python -m functional_fsdp.train --world-size 3 --kill-rank 1 --kill-at-step 10

``--kill-rank R --kill-at-step S`` keeps neighbour copies (``keep_neighbour_copies``) and
SIGKILLs rank ``R`` in the forward of step ``S``: the survivors rebuild the model from memory
(``rebuild_on_survivors``), redo the interrupted step with the same global batch and finish the
run; the summary says what was lost and how long the recovery took.

Rank 0 shows a progress bar and prints a summary: final loss, step time, throughput and the peak
resident memory of every rank.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import resource
import signal
import statistics
import sys
import time
from typing import Any, cast

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
    ap.add_argument(
        "--kill-rank",
        type=int,
        default=None,
        help="SIGKILL this rank in the forward of --kill-at-step; the others recover from memory",
    )
    ap.add_argument("--kill-at-step", type=int, default=10, help="the step --kill-rank dies in")
    args = ap.parse_args(argv)
    if args.kill_rank is not None and not 0 <= args.kill_rank < args.world_size:
        ap.error(f"--kill-rank must be a rank of --world-size {args.world_size}")
    if args.kill_rank is not None and args.world_size < 2:
        ap.error("--kill-rank needs --world-size 2 or more (someone must survive)")
    return args


def _bar(step: int, total: int, loss: float, ms: float) -> None:
    width = 30
    done = int(width * step / total)
    sys.stdout.write(
        f"\r[{'#' * done}{'.' * (width - done)}] {step}/{total}  loss {loss:7.4f}  {ms:7.1f} ms/step"
    )
    sys.stdout.flush()
    if step == total:
        sys.stdout.write("\n")


def _build(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model, sharded over the default world, and its optimizer (the same every time)."""
    torch.manual_seed(0)
    model = GPT(_config(args))
    kw: dict[str, Any] = {}
    if args.bf16:
        from .core.records import MixedPrecisionPolicy

        kw["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)


def _config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(
        vocab=args.vocab,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=max(1, args.dim // 64),
        seq=args.seq,
    )


def _batch(
    args: argparse.Namespace, step: int, rank: int, ws: int, launched: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of the global batch of ``step``: the launched world's shares (one per
    launched rank), split over the ``ws`` ranks training now (all of them, before any loss)."""
    mine = [r for r in range(launched) if r * ws // launched == rank]
    cfg = _config(args)
    parts = [pattern_batch(cfg, args.batch, seed=step * launched + r) for r in mine]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def _arm_kill(model: torch.nn.Module) -> None:
    def die(*_: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    blocks = cast(torch.nn.ModuleList, model.blocks)
    blocks[-1].register_forward_pre_hook(die)


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Train on this rank (the process group is initialised); returns this rank's summary."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # RSS follows live tensors
    torch.set_num_threads(args.threads)
    rank, ws = dist.get_rank(), dist.get_world_size()
    logging.getLogger("functional_fsdp.recovery").disabled = True  # rank 0 prints it
    me, launched = rank, ws  # this process's rank in the launched world, and its size
    model, opt = _build(args)
    n_params = sum(p.numel() for p in model.parameters())
    copies = None
    if args.kill_rank is not None:
        from .shell.recovery.copies import keep_neighbour_copies

        copies = keep_neighbour_copies(model, opt)
    times: list[float] = []
    losses: list[float] = []
    recoveries: list[str] = []
    step = 0
    while step < args.steps:
        t0 = time.perf_counter()
        try:
            if me == args.kill_rank and step + 1 == args.kill_at_step:
                _arm_kill(model)
            x, y = _batch(args, step + 1, rank, ws, launched)
            loss = model.loss(x, y)  # type: ignore[operator]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            avg = loss.detach().clone()
            dist.all_reduce(avg)
        except Exception:
            if copies is None:
                raise
            t_kill = time.perf_counter()
            from .shell.launch import launcher_store
            from .shell.recovery.rebuild import rebuild_on_survivors

            rb = rebuild_on_survivors(
                model,
                opt,
                copies,
                launcher_store(),
                lambda: _build(args),
                epoch=len(recoveries) + 1,
            )
            if rb.spare:
                break
            assert rb.model is not None and rb.optimizer is not None
            model, opt, copies = rb.model, rb.optimizer, rb.copies
            interrupted = len(times) + 1
            rank, ws, step = rb.rank, rb.world_size, rb.step
            del losses[step:], times[step:]
            recoveries.append(
                f"lost rank(s) {list(rb.lost)} in step {interrupted}: detected and rebuilt "
                f"from memory in {1e3 * (time.perf_counter() - t_kill):.0f} ms, redoing step "
                f"{step + 1} on {ws} rank(s)"
            )
            if rank == 0:
                sys.stdout.write(f"\n{rb.message}\n")  # the log line, once, after the bar
            continue
        times.append(time.perf_counter() - t0)
        losses.append(avg.item() / ws)
        step += 1
        if rank == 0:
            _bar(step, args.steps, losses[-1], 1e3 * times[-1])
    local = sum(p.to_local().numel() for p in model.parameters())  # type: ignore[attr-defined]
    return {
        "rank": me,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "step_ms": 1e3 * statistics.median(times[min(2, len(times) - 1) :]),
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "params": n_params,
        "local_params": local,
        "tokens_per_step": args.batch * _config(args).seq * launched,
        "world_size": ws,
        "recoveries": recoveries,
    }


def _summary(rows: list[dict[str, Any] | None]) -> None:
    alive = [r for r in rows if r is not None]
    r0 = alive[0]
    tok_s = r0["tokens_per_step"] / (r0["step_ms"] / 1e3)
    print("== functional_fsdp training summary ==")
    world = f"world size        {len(rows)} (gloo, CPU)"
    if len(alive) < len(rows):
        lost = [i for i, r in enumerate(rows) if r is None]
        world += f"; rank(s) {lost} killed, finished on {r0['world_size']}"
    print(world)
    for line in r0.get("recoveries", []):
        print(f"recovery          {line}")
    print(
        f"parameters        {r0['params'] / 1e6:.2f} M total, {r0['local_params'] / 1e6:.2f} M per rank (sharded)"
    )
    print(f"loss              {r0['first_loss']:.4f} -> {r0['final_loss']:.4f}")
    print(f"step time         {r0['step_ms']:.1f} ms (median), {tok_s:,.0f} tokens/s")
    for r in alive:
        print(f"peak memory       rank {r['rank']}: {r['peak_rss_mib']:.0f} MiB resident")


def main(argv: list[str] | None = None) -> int:
    """Entry point: train under torchrun, or spawn ``--world-size`` local CPU ranks."""
    args = _parse(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if args.kill_rank is not None:
            print(
                "--kill-rank needs the built-in launcher (its store outlives every rank): run "
                "python -m functional_fsdp.train without torchrun",
                file=sys.stderr,
            )
            return 2
        dist.init_process_group("gloo")
        row = train(args)
        rows: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(rows, row)
        if dist.get_rank() == 0:
            _summary(rows)
        dist.destroy_process_group()
        return 0
    try:
        rows = run_local(train, args.world_size, args, survivable=args.kill_rank is not None)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    _summary(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
