"""Python-side overhead per FSDP group per step: functional_fsdp vs torch FSDP2.

Runs the deep model's structure (32 blocks, one ``fully_shard`` per block then the root: 33
groups) shrunk until compute and collectives are negligible (``--model tiny``: d=16, vocab 32,
seq 8, batch 1), so what remains of the step is the per-group machinery: hooks, autograd
Functions, records, tags, messages. Variants alternate by round: ``plain`` (the same model, no
FSDP, in as many processes), ``fsdp2`` and ``ours``, at world sizes 1 and 2 (gloo, one thread per
rank). Overhead per group = (variant - plain) / groups, per phase (forward, backward, optimizer).

``--profile`` then runs one more round per world size > 1 under ``cProfile`` on rank 0 and prints
the hot spots (cumulative time per step, under the profiler, which inflates Python-heavy code).

    python benchmarks/bench_overhead.py [--model tiny|deep] [--rounds 5] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_step import MODELS, _build, _free_port, _mallopt

from functional_fsdp.testing.models import GPTConfig, synthetic_batch

CONFIGS = {
    "tiny": (GPTConfig(vocab=32, dim=16, n_layers=32, n_heads=2, seq=8), 1),
    "deep": MODELS["deep"],
}
PHASES = ("fwd", "bwd", "opt", "step")
WATCH = (
    "functional_fsdp",
    "torch/distributed/fsdp",
    "torch/distributed/tensor",
    "torch/autograd",
    "torch/distributed/distributed_c10d",
    "torch/nn/modules/module.py",
    "torch/optim",
)


def _worker(rank: int, ws: int, port: int, variant: str, args: argparse.Namespace, q: object):
    _mallopt()
    torch.set_num_threads(1)
    if ws > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=ws)
    elif variant != "plain":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=0, world_size=1)
    cfg, batch = CONFIGS[args.model]
    model = _build("floor" if variant == "plain" else variant, cfg, None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    prof = cProfile.Profile() if (args.profiling and rank == 0) else None
    times: dict[str, list[float]] = {k: [] for k in PHASES}
    for step in range(args.warmup + args.steps):
        x, y = synthetic_batch(cfg, batch, seed=1000 * step + rank)
        if ws > 1:
            dist.barrier()
        measured = step >= args.warmup
        if prof is not None and measured:
            prof.enable()
        t0 = time.perf_counter()
        loss = model.loss(x, y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if prof is not None and measured:
            prof.disable()
        if measured:
            for k, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                times[k].append(dt)
    res: dict = {k: 1e6 * statistics.median(v) for k, v in times.items()}
    if prof is not None:
        res["stats"] = _hot_spots(prof, args.steps)
    q.put(res)  # type: ignore[attr-defined]
    if dist.is_initialized():
        dist.destroy_process_group()


def _hot_spots(prof: cProfile.Profile, steps: int) -> list[tuple[str, int, float, float]]:
    """``(function, calls per step, cumulative us per step, own us per step)``, all functions."""
    st = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        short = file
        for w in WATCH:
            i = file.find(w)
            if i >= 0:
                short = file[i:]
                break
        else:
            short = os.path.basename(file)
        rows.append((f"{short}:{line}({fn})", nc // steps, 1e6 * ct / steps, 1e6 * tt / steps))
    return rows


def run(variant: str, ws: int, args: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, ws, port, variant, args, q)) for r in range(ws)]
    for p in procs:
        p.start()
    results = [q.get(timeout=900) for _ in range(ws)]
    for p in procs:
        p.join(timeout=60)
    out = {k: max(r[k] for r in results) for k in PHASES}
    out["stats"] = next((r["stats"] for r in results if "stats" in r), None)
    return out


def _print_hot(title: str, rows: list, key: int, n: int, only: str | None) -> None:
    print(f"\n{title}")
    print(f"{'us/step':>9} {'own us':>8} {'calls':>6}  function")
    sel = [r for r in rows if only is None or only in r[0]]
    for name, calls, cum, own in sorted(sel, key=lambda r: -r[key])[:n]:
        print(f"{cum:9.0f} {own:8.0f} {calls:6d}  {name}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", choices=sorted(CONFIGS), default="tiny")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--world-sizes", default="1,2")
    ap.add_argument("--variants", default="plain,fsdp2,ours")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top", type=int, default=10)
    args = ap.parse_args()
    args.profiling = False
    cfg = CONFIGS[args.model][0]
    groups = cfg.n_layers + 1
    variants = args.variants.split(",")
    sizes = [int(w) for w in args.world_sizes.split(",")]
    res: dict[tuple[int, str], list[dict]] = {(w, v): [] for w in sizes for v in variants}
    for _ in range(args.rounds):
        for w in sizes:
            for v in variants:
                res[(w, v)].append(run(v, w, args))
    print(f"model {args.model}: {cfg}, {groups} groups, {args.rounds} rounds x {args.steps} steps")
    print("medians over rounds of per-round median us (min-max); overhead = (v - plain) / groups")
    for w in sizes:
        print(f"\nworld size {w}")
        print(f"{'variant':8}" + "".join(f" {k + ' us':>22}" for k in PHASES) + "  us/group/step")
        base = {k: statistics.median(r[k] for r in res[(w, "plain")]) for k in PHASES}
        for v in variants:
            rs = res[(w, v)]
            cells = []
            for k in PHASES:
                xs = [r[k] for r in rs]
                cells.append(f"{statistics.median(xs):8.0f} ({min(xs):5.0f}-{max(xs):5.0f})")
            med = {k: statistics.median(r[k] for r in rs) for k in PHASES}
            per = "  ".join(f"{k} {(med[k] - base[k]) / groups:5.0f}" for k in PHASES)
            print(f"{v:8}" + "".join(f" {c:>22}" for c in cells) + "  " + per)
    if args.profile:
        args.profiling = True
        for w in [w for w in sizes if w > 1] or sizes:
            for v in [v for v in variants if v != "plain"]:
                r = run(v, w, args)
                rows = r["stats"]
                tag = f"{v}, world size {w}, under cProfile: step {r['step']:.0f} us"
                only = "functional_fsdp/shell" if v.startswith("ours") else "torch/distributed/fsdp"
                if v.startswith("ours"):
                    rows = [r for r in rows if "functional_fsdp/testing" not in r[0]]
                _print_hot(f"{tag}; own package by cumulative", rows, 2, args.top, only)
                _print_hot(f"{tag}; all by own time", rows, 3, args.top, None)


if __name__ == "__main__":
    main()
