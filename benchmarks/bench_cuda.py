"""The CUDA path on one GPU: functional_fsdp vs torch FSDP2, DDP and the model without FSDP.

World size 1 on NCCL in one process (a ``HashStore``), so every variant runs on the same GPU in
the same run. Each variant builds the model from the same seed, wraps it FSDP2's way (each block,
then the root), trains ``--steps`` AdamW steps on the same batches, and reports:

- ``step_ms``: the median step with a ``torch.cuda.synchronize()`` after each step;
- ``issue_ms``: the median host time until the step's last call returns, before that
  synchronize (how long the CPU takes to issue the step: the per-group overhead on a GPU);
- ``pipelined_ms``: the mean step over the timed steps with one synchronize at the end (the
  host runs ahead of the GPU as a training loop does);
- ``peak_mib``: ``torch.cuda.max_memory_allocated`` over the run;
- ``same_bits_as``: whether the final parameters are ``torch.equal`` to FSDP2's (and to the
  model without FSDP) under ``torch.use_deterministic_algorithms``.

Recipes (``--recipes``): ``fp32``; ``bf16`` (``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``); ``offload`` (``CPUOffloadPolicy()``: pinned host shards, the optimizer
on the CPU; no DDP or plain variant). Models (``--models``): ``gpt13m`` and ``deep`` from
``bench_step.py`` (CPU-bound on a GPU: the step is the host's issue time) and ``gpt350m``
(d=1024, 24 blocks, vocab 32768, seq 1024, batch 8: GPU-bound).

    python benchmarks/bench_cuda.py [--models gpt13m,deep,gpt350m] [--recipes fp32,bf16,offload]
        [--variants plain,ddp,fsdp2,ours,ours:0] [--steps 12] [--json FILE] [--tree DIR]
        [--profile N]

``ours:B`` sets the bucket size (``ours:0``: one collective per group, as FSDP2). ``--tree DIR``
imports functional_fsdp from ``DIR`` (a copy of another commit: an A/B on the same machine,
run as a second invocation). ``--profile N``: a ``cProfile`` of the deep model's steps under
FSDP2 and ours, the top ``N`` functions by own time (where the host's time per group goes).
For ours the CUDA runtime's free counts are reported too (``frees``: at once, later by the
stream clocks, later by polling the events).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import statistics
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist


def _tree() -> str:
    """``--tree DIR`` (read before functional_fsdp is imported), else this checkout."""
    if "--tree" in sys.argv:
        return os.path.abspath(sys.argv[sys.argv.index("--tree") + 1])
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


sys.path.insert(0, _tree())

from functional_fsdp.testing.models import GPT, GPTConfig, GPTLoss, synthetic_batch  # noqa: E402

# Without a GPU (a smoke test of this script) the same runs go to the CPU on gloo.
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


MODELS = {
    "gpt13m": (GPTConfig(), 4),
    "deep": (GPTConfig(vocab=1024, dim=128, n_layers=32, n_heads=4, seq=64), 2),
    "gpt350m": (GPTConfig(vocab=32768, dim=1024, n_layers=24, n_heads=16, seq=1024), 8),
}


def _policies(recipe: str, variant: str) -> dict[str, Any]:
    if recipe == "fp32":
        return {}
    if variant == "fsdp2":
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
    else:
        from functional_fsdp import CPUOffloadPolicy, MixedPrecisionPolicy  # type: ignore[no-redef]
    if recipe == "bf16":
        return {
            "mp_policy": MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
        }
    return {"offload_policy": CPUOffloadPolicy()}


def _build(variant: str, recipe: str, cfg: GPTConfig) -> tuple[torch.nn.Module, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    base, _, bucket = variant.partition(":")
    torch.manual_seed(0)
    gpt = GPT(cfg)
    if base == "plain":
        model: torch.nn.Module = gpt.to(DEV)
    elif base == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(GPTLoss(gpt.to(DEV)))
    else:
        if base == "fsdp2":
            from torch.distributed.fsdp import fully_shard
        else:
            from functional_fsdp import fully_shard  # type: ignore[no-redef]
        mesh = init_device_mesh(DEV, (1,))
        kw = _policies(recipe, base)
        if recipe != "offload":
            gpt = gpt.to(DEV)
        for b in gpt.blocks:
            fully_shard(b, mesh=mesh, **kw)
        if bucket:
            kw["bucket_bytes"] = int(bucket)
        fully_shard(gpt, mesh=mesh, **kw)
        model = gpt
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=recipe != "offload" or None)
    return model, opt


def _full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[n.removeprefix("module.").removeprefix("gpt.")] = t.detach().float().cpu()
    return out


def run_variant(variant: str, recipe: str, model_name: str, steps: int) -> dict[str, Any]:
    cfg, batch = MODELS[model_name]
    model, opt = _build(variant, recipe, cfg)
    loss_of: Any = model if variant == "ddp" else model.loss
    batches = [tuple(t.to(DEV) for t in synthetic_batch(cfg, batch, seed=s)) for s in range(steps)]
    _sync()
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step_ms, issue_ms, losses = [], [], []

    def step(s: int) -> torch.Tensor:
        loss = loss_of(*batches[s])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    warm = 3
    for s in range(warm):
        losses.append(step(s))
    _sync()
    for s in range(warm, steps):
        t0 = time.perf_counter()
        losses.append(step(s))
        t1 = time.perf_counter()
        _sync()
        t2 = time.perf_counter()
        issue_ms.append(1e3 * (t1 - t0))
        step_ms.append(1e3 * (t2 - t0))
    # pipelined: the same number of steps again, one synchronize at the end (the host runs ahead)
    t0 = time.perf_counter()
    for s in range(warm, steps):
        step(s)
    _sync()
    pipelined = 1e3 * (time.perf_counter() - t0) / (steps - warm)
    peak = torch.cuda.max_memory_allocated() / 2**20 if DEV == "cuda" else 0.0
    phases = _phase_peaks(model, loss_of, opt, batches[warm]) if DEV == "cuda" else {}
    frees = None
    if variant.startswith("ours"):
        from functional_fsdp.testing.streams import runtime_of

        frees = dict(getattr(runtime_of(model), "frees", {}))
    result = {
        "variant": variant,
        "frees": frees,
        "phase_peaks_mib": phases,
        "recipe": recipe,
        "model": model_name,
        "step_ms": statistics.median(step_ms),
        "issue_ms": statistics.median(issue_ms),
        "pipelined_ms": pipelined,
        "peak_mib": peak,
        "losses": [float(x) for x in losses],
        "params": _full_params(model),
    }
    return result


def _phase_peaks(model: Any, loss_of: Any, opt: Any, batch: Any) -> dict[str, float]:
    """One more step, the peak allocated memory of each phase (MiB): forward, backward (and
    what stays allocated after it, before and after ``gc.collect()``), the optimizer step."""
    del model
    out = {}
    mib = 2**20

    def phase(name: str) -> None:
        torch.cuda.synchronize()
        out[name] = torch.cuda.max_memory_allocated() / mib
        torch.cuda.reset_peak_memory_stats()

    phase("before")
    loss = loss_of(*batch)
    phase("forward")
    loss.backward()
    phase("backward")
    out["after_backward"] = torch.cuda.memory_allocated() / mib
    # The two readings differ when cyclic garbage holds GPU memory (a previous variant's model
    # did, until main() collected between variants; H100, 2026-11-26).
    gc.collect()
    out["after_backward_gc"] = torch.cuda.memory_allocated() / mib
    opt.step()
    opt.zero_grad()
    phase("optimizer")
    return {k: round(v, 1) for k, v in out.items()}


def _compare(results: list[dict[str, Any]]) -> None:
    by = {r["variant"]: r for r in results}
    for r in results:
        r["same_bits_as"] = {}
        for ref in ("fsdp2", "plain"):
            if ref in by and ref != r["variant"]:
                theirs = by[ref]["params"]
                equal = all(torch.equal(r["params"][k], theirs[k]) for k in theirs)
                diff = max((r["params"][k] - theirs[k]).abs().max().item() for k in theirs)
                r["same_bits_as"][ref] = equal if equal else f"no (max |diff| {diff:.3g})"


def _profile(variant: str, top: int) -> None:
    """The host's own time per function over 5 deep-model steps (after 3 warm-up steps)."""
    cfg, batch = MODELS["deep"]
    model, opt = _build(variant, "fp32", cfg)
    x, y = (t.to(DEV) for t in synthetic_batch(cfg, batch, seed=0))

    def steps(n: int) -> None:
        for _ in range(n):
            model.loss(x, y).backward()  # type: ignore[operator]
            opt.step()
            opt.zero_grad()
        _sync()

    steps(3)
    prof = cProfile.Profile()
    prof.enable()
    steps(5)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    print(f"# profile: deep, {variant}, 5 steps\n" + out.getvalue()[-6000:])


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", default="gpt13m,deep,gpt350m")
    ap.add_argument("--recipes", default="fp32,bf16,offload")
    ap.add_argument("--variants", default="plain,ddp,fsdp2,ours,ours:0")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--json", default=None)
    ap.add_argument("--tree", default=None)
    ap.add_argument("--profile", type=int, default=0)
    args = ap.parse_args()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    # (Deterministic mode would also fill every new buffer with NaN: a kernel per allocation
    # that is not part of training, and FSDP allocates more than the plain model.)
    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    if DEV == "cuda":
        torch.cuda.set_device(0)  # before the mesh: NCCL's communicator binds to it
    backend = "nccl" if DEV == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1, store=dist.HashStore())
    name = torch.cuda.get_device_name(0) if DEV == "cuda" else "CPU (smoke test)"
    print(f"# {name}, torch {torch.__version__}, world size 1 on {backend}, tree {_tree()}")
    rows = []
    try:
        for model_name in args.models.split(","):
            for recipe in args.recipes.split(","):
                results = []
                for variant in args.variants.split(","):
                    if recipe == "offload" and variant.partition(":")[0] in ("plain", "ddp"):
                        continue
                    if recipe == "bf16" and variant in ("plain", "ddp"):
                        continue
                    try:
                        results.append(run_variant(variant, recipe, model_name, args.steps))
                        # FSDP modules are cyclic (module, state, hooks): without a collection
                        # here the last variant's model stays allocated in the next one's
                        # numbers (a model's worth on the next variant's peak, H100 2026-11-26).
                        gc.collect()
                        if DEV == "cuda":
                            torch.cuda.empty_cache()
                    except Exception:  # report and go on: one run gives every other variant
                        print(f"{model_name} {recipe} {variant} FAILED:", file=sys.stderr)
                        traceback.print_exc()
                _compare(results)
                ref = next((r for r in results if r["variant"] == "fsdp2"), None)
                for r in results:
                    r.pop("params")
                    if ref is not None:
                        r["x_fsdp2_step"] = r["step_ms"] / ref["step_ms"]
                        r["x_fsdp2_issue"] = r["issue_ms"] / ref["issue_ms"]
                    print(
                        f"{model_name:8} {recipe:7} {r['variant']:7} step {r['step_ms']:8.2f} ms"
                        f"  issue {r['issue_ms']:8.2f} ms  pipelined {r['pipelined_ms']:8.2f} ms"
                        f"  peak {r['peak_mib']:9.1f} MiB  x fsdp2 {r.get('x_fsdp2_step', 1):.3f}"
                        f"  bits {r['same_bits_as']}"
                        + (f"  frees {r['frees']}" if r["frees"] else "")
                        + (f"\n    phases {r['phase_peaks_mib']}" if r["phase_peaks_mib"] else ""),
                        flush=True,
                    )
                    rows.append(r)
        if args.profile:
            for variant in ("fsdp2", "ours"):
                _profile(variant, args.profile)
    finally:
        dist.destroy_process_group()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
