"""Compressed gradient reduction vs the exact one: bytes, step time and loss curve, side by side.

World size 2 on gloo, the benchmark GPT (``GPTConfig()``, ~13M parameters; ``--model small``
for a quick run), each block then the root sharded, AdamW on the learnable pattern batches of
``python -m functional_fsdp.train``, the same seeds for every variant:

- ``fsdp2``: torch's FSDP2 (exact fp32 reduce-scatter);
- ``ours``: functional_fsdp, exact (FSDP2's numbers);
- ``int8``: ``set_gradient_compression(GradCompression())``: int8 rows with an fp32 scale per
  256 elements, error feedback;
- ``int8-noef``: the same without error feedback;
- ``bf16``: bfloat16 rows with error feedback.

Reports the reduce-scatter bytes each rank sends per step (every group reduces once), the
median step time (and its ratio to FSDP2), and the loss curve with its largest distance from
the exact one::

    python benchmarks/bench_compression.py [--steps 60] [--model small]
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from functional_fsdp.testing.models import GPT, GPTConfig, pattern_batch

MODELS = {
    "gpt13m": GPTConfig(),
    "small": GPTConfig(vocab=256, dim=64, n_layers=2, n_heads=4, seq=32),
}
VARIANTS = ("fsdp2", "ours", "int8", "int8-noef", "bf16")


def _policy(variant: str):
    from functional_fsdp import GradCompression

    return {
        "int8": GradCompression(),
        "int8-noef": GradCompression(error_feedback=False),
        "bf16": GradCompression(dtype=torch.bfloat16),
    }.get(variant)


def _build(variant: str, cfg: GPTConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    model = GPT(cfg)
    if variant == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from functional_fsdp import fully_shard
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    if variant not in ("fsdp2", "ours"):
        model.set_gradient_compression(_policy(variant))  # type: ignore[operator]
    return model


def _reduce_bytes(model: torch.nn.Module, variant: str) -> int:
    """Reduce-scatter bytes this rank sends per step (FSDP2: the same rows as ours, exact)."""
    from functional_fsdp import FSDPModule
    from functional_fsdp.core.compression import wire_bytes

    if variant == "fsdp2":
        return -1
    total = 0
    for m in model.modules():
        if isinstance(m, FSDPModule) and m._ffsdp_state.group is not None:  # type: ignore[attr-defined]
            total += wire_bytes(m._ffsdp_state.group.layout, _policy(variant))  # type: ignore[attr-defined]
    return total


def _worker(rank: int, port: int, variant: str, args: argparse.Namespace, q: object) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    cfg = MODELS[args.model]
    model = _build(variant, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    times, losses = [], []
    for step in range(args.steps):
        x, y = pattern_batch(cfg, args.batch, seed=1000 * step + rank)
        dist.barrier()
        t0 = time.perf_counter()
        loss = model.loss(x, y)  # type: ignore[operator]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / 2)
    q.put(  # type: ignore[attr-defined]
        {
            "rank": rank,
            "step_ms": 1e3 * statistics.median(times[3:]),
            "losses": losses,
            "bytes": _reduce_bytes(model, variant),
        }
    )
    dist.destroy_process_group()


def run(variant: str, args: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(r, port, variant, args, q)) for r in range(2)]
    for p in procs:
        p.start()
    res: list[dict] = []
    while len(res) < 2:  # a rank that dies fails the run instead of hanging it
        try:
            res.append(q.get(timeout=5))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"{variant}: a rank exited with {dead[0]}") from None
    for p in procs:
        p.join(timeout=60)
    return {
        "step_ms": max(r["step_ms"] for r in res),
        "losses": res[0]["losses"],
        "bytes": res[0]["bytes"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt13m")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    rows = {v: run(v, args) for v in args.variants.split(",")}
    exact = rows.get("ours", rows.get("fsdp2"))
    if "fsdp2" in rows and "ours" in rows:
        rows["fsdp2"]["bytes"] = rows["ours"]["bytes"]  # the same fp32 rows
    print(f"model {args.model}: {MODELS[args.model]}, batch {args.batch}/rank, {args.steps} steps")
    print(
        f"{'variant':10} {'RS KiB/step':>12} {'x fewer':>8} {'step ms':>8} {'x fsdp2':>8} "
        f"{'final loss':>10} {'max |dloss|':>11}"
    )
    base_bytes = rows["ours"]["bytes"] if "ours" in rows else None
    for v, r in rows.items():
        fewer = base_bytes / r["bytes"] if base_bytes and r["bytes"] > 0 else float("nan")
        vs = r["step_ms"] / rows["fsdp2"]["step_ms"] if "fsdp2" in rows else float("nan")
        dl = max(abs(a - b) for a, b in zip(r["losses"], exact["losses"])) if exact else 0.0
        print(
            f"{v:10} {r['bytes'] / 1024:12.1f} {fewer:8.2f} {r['step_ms']:8.1f} {vs:8.3f} "
            f"{r['losses'][-1]:10.4f} {dl:11.4f}"
        )
    every = max(1, args.steps // 12)
    print("loss curve (mean over ranks), every", every, "steps:")
    for v, r in rows.items():
        print(f"  {v:10} " + " ".join(f"{x:.3f}" for x in r["losses"][::every]))


if __name__ == "__main__":
    main()
