"""Side-by-side step time, memory and traffic: functional_fsdp vs torch FSDP2, DDP, no-comm floor.

Runs every variant in one invocation on the same machine: world size 2 on gloo (one thread per
rank), FSDP2's recipe (each block, then the root), AdamW. The floor is one process, same per-rank
batch, no collectives. Each rank sets ``mallopt(M_MMAP_THRESHOLD, 64 KiB)`` so RSS follows live
tensors. Models (``--model``):

- ``gpt13m`` (default): the ~13M-parameter GPT (d=384, 4 blocks, vocab 8192, seq 128), batch 4
  per rank: compute-heavy, few groups.
- ``deep``: 32 small blocks (d=128, vocab 1024, seq 64), batch 2 per rank: 33 groups with little
  compute each, so per-group overhead (hooks, autograd Functions, messages) dominates.

    python benchmarks/bench_step.py [--model deep] [--steps 12] [--rounds 2]
        [--variants floor,fsdp2,ours,ddp,wire,repro] [--micro-batches 2] [--compile] [--device cuda]

``--device cuda``: the same comparison on ``--world-size`` GPUs of one machine, one per rank on
NCCL, each step synchronized, memory as each rank's ``torch.cuda.max_memory_allocated`` (the
floor on one GPU). Not yet run: no machine of several GPUs has been lent to this project.

``wire``: the plain model on every rank (no FSDP), plus ours' collectives of a step as bare
point-to-point messages, all posted when the step begins and waited for after the backward
(``_Wire``): the price of FSDP's bytes over gloo with perfect overlap, a floor for any FSDP here.
``repro``: ours with ``ReproduciblePolicy(virtual_world_size=world size x micro-batches)`` on
every group (the cost of bit-identical training at any world size: docs/reproducibility.md).
``copies``: ours with ``keep_neighbour_copies`` (every rank also receives its neighbour's
parameters and Adam state after each step: the cost of surviving a lost rank). ``ours:B`` (or
``repro:B``) sets the bucket size of the coalesced collectives
(``fully_shard(model, bucket_bytes=B)``: ``4M``, ``512K``, bytes; ``ours:0`` is one collective
per group, as FSDP2). ``--micro-batches K`` splits each rank's batch into ``K`` accumulated micro-batches, gradient sync
on the last only (DDP: ``no_sync``), as FSDP2's accumulation recipe does.
``step``: ours' functional step (``make_train_step``, the functional AdamW) on the same sharded
model; ``compiled`` (``compiled:BACKEND``, default ``aot_eager``; ``compiled:inductor``): the same
step with ``compile=BACKEND``, every group's all-gather and reduce-scatter inside the traced
graphs (docs/compiled_step.md); its compile time (the first step's extra time) is printed.
``compiled-serial[:BACKEND]``: the same with ``compile_overlap=False`` (each collective waited
for where traced, none issued ahead).
``fsdp2c``: FSDP2 with each block's forward compiled by inductor (its hooks stay eager), as
torchtitan compiles per block; the warmup absorbs the compilation.
``FFSDP_BENCH_MALLOC=default`` leaves glibc's malloc thresholds as they are for every variant
(RSS then also counts freed memory glibc keeps; fresh buffers fault less).
``FFSDP_HOST_POOL_BYTES=N`` in the environment sizes ours' host buffer pool for every variant of
the run (0: off; ``set_host_buffer_pool_bytes``). DDP runs its loss through its own forward, and
the run fails unless its ranks end with equal parameters (proof that it all-reduced).

For ours the run also prints the time each step blocked in waits for collectives (the slower
rank's, ``ProcessGroupComm.wait_stats``): on gloo a wait is where the peer's bytes are
received, so this is the transfer cost the compute did not hide.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import json
import os
import queue
import resource
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from functional_fsdp.core.coalesce import plan_buckets
from functional_fsdp.shell.api.buckets import DEFAULT_BUCKET_BYTES
from functional_fsdp.testing.models import GPT, GPTConfig, GPTLoss, synthetic_batch

_COMPILED = ("compiled", "compiled-serial")


def _mallopt() -> None:
    if os.environ.get("FFSDP_BENCH_MALLOC") == "default":  # glibc's own thresholds (see above)
        return
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


MODELS = {
    "gpt13m": (GPTConfig(), 4),
    "deep": (GPTConfig(vocab=1024, dim=128, n_layers=32, n_heads=4, seq=64), 2),
}


def _use_tree(variant: str) -> str:
    """``ours@DIR``: run functional_fsdp from the copy in ``DIR`` (a prototype beside main)."""
    base, _, tree = variant.partition("@")
    if tree:
        for name in [m for m in sys.modules if m.split(".")[0] == "functional_fsdp"]:
            del sys.modules[name]
        sys.path.insert(0, os.path.abspath(tree))
        import functional_fsdp

        assert functional_fsdp.__file__.startswith(os.path.abspath(tree)), functional_fsdp.__file__
    return base


def _label(variant: str) -> str:
    base, _, tree = variant.partition("@")
    return f"{base}@{os.path.basename(tree.rstrip('/'))}" if tree else base


def _bucket(variant: str) -> int | None:
    """``ours:B`` / ``repro:B``: the bucket size (``fully_shard(bucket_bytes=B)``; ``4M``,
    ``512K`` or bytes; ``0`` turns coalescing off). ``None``: the default."""
    base, _, size = variant.partition("@")[0].partition(":")
    if not size or base in ("step", *_COMPILED):  # compiled:BACKEND names a backend
        return None
    scale = {"K": 1 << 10, "M": 1 << 20}.get(size[-1], 1)
    return int(size.rstrip("KM")) * scale


def _build(
    variant: str,
    cfg: GPTConfig,
    raf: bool | None,
    micro_batches: int = 1,
    device: torch.device | str = "cpu",
) -> torch.nn.Module:
    bucket = _bucket(variant)
    variant = _use_tree(variant).partition(":")[0]
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    if variant in ("ours", "fsdp2", "fsdp2c", "repro", "copies", "step", *_COMPILED):
        kw: dict = {}
        if variant in ("fsdp2", "fsdp2c"):
            from torch.distributed.fsdp import fully_shard
        else:
            from functional_fsdp import fully_shard

            if variant == "repro":  # V = world size x micro-batches per rank
                from functional_fsdp import ReproduciblePolicy

                ws = dist.get_world_size() if dist.is_initialized() else 1
                kw["reproducible"] = ReproduciblePolicy(virtual_world_size=ws * micro_batches)
        for b in model.blocks:
            fully_shard(b, reshard_after_forward=raf, **kw)
        if bucket is not None:
            kw["bucket_bytes"] = bucket
        fully_shard(model, reshard_after_forward=raf, **kw)
    elif variant == "ddp":
        # DDP all-reduces gradients only for what runs through its own forward: wrap the loss
        # (calling the wrapped module's ``loss`` directly would skip every all-reduce).
        model = torch.nn.parallel.DistributedDataParallel(GPTLoss(model))
    return model


def _replicas_equal(model: torch.nn.Module) -> bool:
    """Whether every rank holds the same parameters (DDP: the gradients were all-reduced)."""
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return bool(torch.equal(hi, lo))


@functools.cache
def _shards(cfg: GPTConfig, ws: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each group's (shard elements, unsharded bytes), in forward order (the root first). A
    parameter is sharded on dim 0 and padded to ``ceil(dim0 / ws)`` rows (FSDP2's rule).
    Cached: the byte count and the message list both read it, and each builds the model."""
    model = GPT(cfg)
    root = [p for n, p in model.named_parameters() if not n.startswith("blocks.")]
    groups = [root] + [list(b.parameters()) for b in model.blocks]
    shard = tuple(
        sum(-(-p.shape[0] // ws) * (p[0].numel() if p.dim() > 1 else 1) for p in ps)
        for ps in groups
    )
    return shard, tuple(4 * sum(p.numel() for p in ps) for ps in groups)


def _messages(
    cfg: GPTConfig, ws: int, raf: bool, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> list[int]:
    """Ours' collectives in a step, as the elements each rank sends to each peer, in the order
    they are issued: the forward all-gathers (one per bucket), the backward re-gathers when
    resharding (every bucket's blocks, never the root; not the last forward bucket, which ours
    keeps for the backward when within the bucket size), then the reduce-scatters."""
    shard, full = _shards(cfg, ws)
    cut = plan_buckets([str(i) for i in range(len(full))], full, [True] * len(full), bucket_bytes)
    per_bucket = [sum(shard[int(n)] for n in b.groups) for b in cut]
    kept = cut[-1].unsharded_bytes <= bucket_bytes
    regather = [
        sum(shard[int(n)] for n in b.groups if n != "0")
        for i, b in enumerate(cut)
        if raf and not (kept and i == len(cut) - 1)
    ]
    return per_bucket + [n for n in reversed(regather) if n] + per_bucket[::-1]


def _collective_bytes(
    cfg: GPTConfig, ws: int, raf: bool, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> tuple[int, int]:
    """Bytes each rank sends per step: (ours with buckets of ``bucket_bytes``, FSDP2 on gloo).

    Ours: :func:`_messages`, to each of ``ws - 1`` peers. FSDP2 gathers every block again in
    backward when resharding (never the root), and gloo's ``reduce_scatter_tensor``, which
    FSDP2 calls, is an all-reduce inside gloo and sends twice ours (ring all-reduce).
    """
    shard, _ = _shards(cfg, ws)
    ours = (ws - 1) * sum(_messages(cfg, ws, raf, bucket_bytes))
    fsdp2 = (ws - 1) * (sum(shard) + (sum(shard[1:]) if raf else 0) + 2 * sum(shard))
    return 4 * ours, 4 * fsdp2


def _worker(
    rank: int, ws: int, port: int, variant: str, args: argparse.Namespace, out: object
) -> None:
    _mallopt()
    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)  # one GPU per rank, before the mesh
    if ws > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=ws)
    cfg = MODELS[args.model][0]
    model = _build(variant, cfg, None, args.micro_batches, device)
    base = variant.partition("@")[0].partition(":")[0]
    if base in ("step", *_COMPILED):
        out.put(_functional(model, variant, args, cfg, rank, device))  # type: ignore[attr-defined]
        if ws > 1:
            dist.destroy_process_group()
        return
    if args.compile or base == "fsdp2c":
        # Each block's forward compiled with inductor (FSDP's hooks stay eager); warmup steps
        # absorb the compilation.
        blocks = model.module.gpt.blocks if variant == "ddp" else model.blocks  # type: ignore[union-attr]
        for b in blocks:
            b.compile(backend="inductor")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if variant.partition("@")[0].partition(":")[0] == "copies":
        from functional_fsdp import keep_neighbour_copies

        keep_neighbour_copies(model, opt)  # the neighbour's state after every step
    loss_fn = model if variant == "ddp" else model.loss  # type: ignore[union-attr]
    wire = _Wire(cfg, ws, device) if variant == "wire" else None
    times, losses = [], []
    waits0 = _wait_stats()
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            waits0 = _wait_stats()
            faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x, y = (t.to(device) for t in synthetic_batch(cfg, args.batch, seed=1000 * step + rank))
        if ws > 1:
            dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        k = args.micro_batches
        for m in range(k):  # the usual accumulation loop; one micro-batch: a plain step
            last = m == k - 1
            if k > 1:
                _set_sync(model, variant, last)
            with contextlib.nullcontext() if last or variant != "ddp" else model.no_sync():  # type: ignore[operator]
                sent = wire.post() if wire is not None and last else []
                loss = loss_fn(x[m::k], y[m::k]) / k
                loss.backward()
                for w in sent:
                    w.wait()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    waits = [b - a for a, b in zip(waits0, _wait_stats())]
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    local_numel = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters()
    )
    res = _row(
        variant,
        rank,
        times,
        losses,
        args,
        peak_gpu_mib=torch.cuda.max_memory_allocated(device) / 2**20 if cuda else 0.0,
        local_param_numel=local_numel,
        replicas_equal=_replicas_equal(model) if variant == "ddp" else True,
        waits=[w / args.steps for w in waits],
        faults=faults / args.steps,
    )
    out.put(res)  # type: ignore[attr-defined]
    if ws > 1:
        dist.destroy_process_group()


def _functional(
    model: torch.nn.Module,
    variant: str,
    args: argparse.Namespace,
    cfg: GPTConfig,
    rank: int,
    device: torch.device,
) -> dict:
    """The ``step`` and ``compiled`` variants: ours' functional step (AdamW, lr 1e-4 as the
    others), ``grad_accum`` micro-batches, timed as the module-API variants are."""
    from functional_fsdp.functional import adamw, init, make_train_step

    base, _, backend = variant.partition("@")[0].partition(":")
    opt = adamw(1e-4)
    step = make_train_step(
        model,
        lambda m, b: m.loss(*b),
        opt,
        grad_accum=args.micro_batches,
        compile=(backend or "aot_eager") if base in _COMPILED else False,
        compile_overlap=base != "compiled-serial",
    )
    state = init(model, opt)
    times, losses = [], []
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x, y = (t.to(device) for t in synthetic_batch(cfg, args.batch, seed=1000 * i + rank))
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        state, metrics = step(state, (x, y))
        times.append(time.perf_counter() - t0)
        losses.append(metrics["local_loss"].item())
    report = step.compile_report() if base in _COMPILED else None  # type: ignore[attr-defined]
    return _row(
        variant,
        rank,
        times,
        losses,
        args,
        local_param_numel=sum(p._local_tensor.numel() for p in state.params.values()),
        faults=(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0) / args.steps,
        compile_s=0.0 if report is None else report.compile_seconds,
        graphs=0 if report is None else report.graphs,
    )


def _row(
    variant: str,
    rank: int,
    times: list[float],
    losses: list[float],
    args: argparse.Namespace,
    **measured: object,
) -> dict:
    """One rank's result: the timed steps' median and mean, peak RSS and the last loss, then
    what the variant measured (defaults: no GPU, replicas not checked, no waits)."""
    return {
        "variant": variant,
        "rank": rank,
        "step_ms": 1e3 * statistics.median(times[args.warmup :]),
        "mean_ms": 1e3 * statistics.mean(times[args.warmup :]),
        "peak_rss_mib": _peak_rss_mib(),
        "final_loss": losses[-1],
        "losses": losses,
        "peak_gpu_mib": 0.0,
        "replicas_equal": True,
        "waits": [0.0, 0.0],
        **measured,
    }


class _Wire:
    """The ``wire`` variant's traffic: ours' messages of a step (:func:`_messages`, the same
    elements to and from every peer, point to point as ours sends them on gloo), all posted
    when the step begins and waited for after the backward, around the plain model's step.
    Nothing waits on a message earlier, so this is the least any FSDP that moves these bytes
    over gloo can add to the step: the price of the bytes alone, with perfect overlap."""

    def __init__(self, cfg: GPTConfig, ws: int, device: torch.device) -> None:
        self.rank, self.ws = dist.get_rank(), ws
        self.sizes = _messages(cfg, ws, raf=True)
        self.out = torch.randn(max(self.sizes), device=device)
        self.into = [torch.empty(n, device=device) for n in self.sizes for _ in range(ws - 1)]

    def post(self) -> list:
        works, recv = [], iter(self.into)
        for tag, n in enumerate(self.sizes):
            for peer in (p for p in range(self.ws) if p != self.rank):
                works.append(dist.isend(self.out[:n], peer, tag=tag))
                works.append(dist.irecv(next(recv), peer, tag=tag))
        return works


def _wait_stats() -> tuple[float, float]:
    """Ours' host waits for collectives so far, over every communicator of the process:
    ``(waits, seconds blocked)`` (``ProcessGroupComm.wait_stats``; zeros for the other
    variants, and for a tree from before the counters)."""
    mod = sys.modules.get("functional_fsdp.shell.comm.process_group")
    if mod is None:
        return 0.0, 0.0
    stats = [getattr(c, "wait_stats", (0, 0.0)) for c in list(mod.LIVE)]
    return float(sum(x[0] for x in stats)), float(sum(x[-1] for x in stats))


def _set_sync(model: torch.nn.Module, variant: str, on: bool) -> None:
    """Gradient sync on the last micro-batch only (FSDP2's ``set_requires_gradient_sync``)."""
    if variant.partition("@")[0].partition(":")[0] in (
        "ours",
        "fsdp2",
        "fsdp2c",
        "repro",
        "copies",
    ):
        model.set_requires_gradient_sync(on)  # type: ignore[operator]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_variant(variant: str, args: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ws = 1 if variant == "floor" else args.world_size  # ours@DIR: see _use_tree
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, ws, port, variant, args, q)) for r in range(ws)]
    for p in procs:
        p.start()
    results = []
    deadline = time.monotonic() + 900
    while len(results) < ws:
        try:
            results.append(q.get(timeout=5))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(
                    f"variant {variant}: a rank failed (exit codes {dead})"
                ) from None
    for p in procs:
        p.join(timeout=60)
    if not all(r["replicas_equal"] for r in results):
        raise RuntimeError(f"variant {variant}: the ranks' parameters differ after training")
    step = max(r["step_ms"] for r in results)
    return {
        "variant": variant,
        "step_ms": step,
        "peak_rss_mib": max(r["peak_rss_mib"] for r in results),
        "peak_gpu_mib": max(r["peak_gpu_mib"] for r in results),
        "waits": max((r["waits"] for r in results), key=lambda w: w[-1]),
        "faults": max(r["faults"] for r in results),
        "final_loss": results[0]["final_loss"],
        "losses": min(results, key=lambda r: r["rank"])["losses"],
        "local_param_numel": results[0]["local_param_numel"],
        "compile_s": max(r.get("compile_s", 0.0) for r in results),
        "graphs": max(r.get("graphs", 0) for r in results),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument(
        "--rounds", type=int, default=2, help="repeat all variants, keep each one's best"
    )
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt13m")
    ap.add_argument("--batch", type=int, default=None, help="per rank (default: the model's)")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument(
        "--variants", default="floor,fsdp2,ours,ddp", help="ours@DIR: functional_fsdp from DIR"
    )
    ap.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        help="split each rank's batch into this many accumulated micro-batches (sync on the last)",
    )
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: one GPU per rank on NCCL (needs --world-size GPUs); memory as GPU peak",
    )
    ap.add_argument(
        "--compile", action="store_true", help="torch.compile each block (inductor) first"
    )
    args = ap.parse_args()
    if args.batch is None:
        args.batch = MODELS[args.model][1]
    variants = args.variants.split(",")
    rows: dict[str, dict] = {}
    every: dict[str, list[float]] = {v: [] for v in variants}
    # Variants alternate round by round, so a burst of load on the machine hits all of them.
    for _ in range(args.rounds):
        for v in variants:
            r = run_variant(v, args)
            every[v].append(r["step_ms"])
            best = rows.get(v)
            if best is None or r["step_ms"] < best["step_ms"]:
                rows[v] = r
    cfg = MODELS[args.model][0]
    print(
        f"model {args.model}: {cfg}, batch {args.batch} per rank in {args.micro_batches} "
        f"micro-batch(es), {args.rounds} rounds"
    )
    mem = "peak_gpu_mib" if args.device == "cuda" else "peak_rss_mib"
    print(
        f"{'variant':8} {'step ms':>9} {'x floor':>8} {'x fsdp2':>8} "
        f"{'peak GPU MiB' if args.device == 'cuda' else 'peak RSS MiB':>13} {'local params':>13}"
    )
    for v, r in rows.items():
        fl = r["step_ms"] / rows["floor"]["step_ms"] if "floor" in rows else float("nan")
        fs = r["step_ms"] / rows["fsdp2"]["step_ms"] if "fsdp2" in rows else float("nan")
        print(
            f"{_label(v):8} {r['step_ms']:9.1f} {fl:8.3f} {fs:8.3f} {r[mem]:13.1f} {r['local_param_numel']:13d}"
        )
    print(
        "per round (step ms): "
        + "; ".join(f"{_label(v)} {' '.join(f'{t:.1f}' for t in ts)}" for v, ts in every.items())
    )
    if "ours" in every and "fsdp2" in every:
        per = [o / f for o, f in zip(every["ours"], every["fsdp2"])]
        print("ours / fsdp2 per round: " + " ".join(f"{x:.3f}" for x in per))
    if "floor" in rows and "ddp" in rows:
        # The yardstick: what each variant adds to the floor, against what DDP adds.
        floor, ddp = rows["floor"]["step_ms"], rows["ddp"]["step_ms"] - rows["floor"]["step_ms"]
        print(
            "time above the floor (x DDP's): "
            + "; ".join(
                f"{_label(v)} {r['step_ms'] - floor:.1f} ms ({(r['step_ms'] - floor) / ddp:.2f})"
                for v, r in rows.items()
                if v != "floor"
            )
        )
    compiled = {v: r for v, r in rows.items() if r.get("graphs")}
    if compiled:
        print(
            "compiled step: "
            + "; ".join(
                f"{_label(v)} compiled {r['graphs']} graph(s) in {r['compile_s']:.1f} s"
                for v, r in compiled.items()
            )
        )
    if compiled and "step" in rows:
        # The same functional step, data and start: aot_eager runs the eager step's ops (its
        # losses are equal); inductor's fused kernels round differently.
        print(
            "losses (rank 0, every step) against the eager step's, max |difference|: "
            + "; ".join(
                f"{_label(v)} {max(abs(a - b) for a, b in zip(r['losses'], rows['step']['losses'])):.3g}"
                for v, r in compiled.items()
            )
        )
    blocked = {v: r["waits"] for v, r in rows.items() if r["waits"][0] > 0}
    if blocked:
        # Where ours' step goes on gloo: a wait blocks until the peer's bytes are in
        # (receiving them is the wait's work on a busy core).
        print(
            "blocked in collectives per step (the slower rank): "
            + "; ".join(
                f"{_label(v)} {w[-1] * 1e3:.1f} ms in {w[0]:.0f} waits" for v, w in blocked.items()
            )
        )
    if args.device == "cpu":
        # Each fresh 4 KiB page of host memory costs a fault and its zeroing on first touch
        # (freed buffers return to the kernel: see _mallopt); the host buffer pool trades
        # resident memory for fewer of them.
        print(
            "minor page faults per step (the rank with more): "
            + "; ".join(f"{_label(v)} {r['faults']:.0f}" for v, r in rows.items())
        )
    ours_b, fsdp2_b = _collective_bytes(cfg, args.world_size, raf=True)
    print(
        f"bytes sent per rank per step: ours {ours_b / 2**20:.1f} MiB, FSDP2 {fsdp2_b / 2**20:.1f} MiB "
        f"(ratio {ours_b / fsdp2_b:.3f})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"rows": rows, "rounds": every, "bytes_ours": ours_b, "bytes_fsdp2": fsdp2_b},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
