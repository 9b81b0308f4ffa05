"""Step time and traffic of ``functional_fsdp.optim.Muon`` against AdamW on the benchmark GPT.

World size 2 on gloo (``run_local``: one thread per rank on 2 cores), ``GPTConfig()`` defaults
(~13M parameters), batch 4 per rank, FSDP2's recipe (each block, then the root). Muon gets the
blocks' 2-D weights (16 matrices); embeddings, head, norms and biases go to AdamW (the usual
recipe, ``use_muon=False`` / automatic routing). Both optimizers live in the same processes
(each on its own model) and their steps alternate, so machine noise hits both alike; medians
over the timed steps, rank 0's clock after a barrier. Reports:

- step time (forward + backward + optimizer) with Muon and with AdamW, and the optimizer step
  alone;
- bytes the optimizer sent per step (both ranks), against the fp32 gradient bytes of the Muon
  matrices (target: at most 2x);
- each rank's share of the Newton-Schulz work (``rows * cols * min(rows, cols)`` per matrix).

    python benchmarks/bench_muon.py [--steps 8] [--warmup 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from functional_fsdp import fully_shard
from functional_fsdp.optim import Muon, newton_schulz
from functional_fsdp.shell.launch import run_local
from functional_fsdp.testing.models import GPT, GPTConfig, synthetic_batch


def _build(cfg: GPTConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _muon(model: torch.nn.Module) -> Muon:
    blocks = [p for n, p in model.named_parameters() if n.startswith("blocks.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("blocks.")]
    return Muon([{"params": blocks}, {"params": rest, "use_muon": False}], lr=0.02, adamw_lr=3e-4)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: Any) -> tuple[float, float]:
    dist.barrier()
    t0 = time.perf_counter()
    model.loss(*batch).backward()  # type: ignore[operator]
    dist.barrier()
    t1 = time.perf_counter()
    opt.step()
    opt.zero_grad()
    dist.barrier()
    t2 = time.perf_counter()
    return t2 - t0, t2 - t1


def bench(steps: int, warmup: int) -> dict[str, Any]:
    """One rank's measurements (run under ``run_local``)."""
    cfg = GPTConfig()
    rank = dist.get_rank()
    m_muon, m_adamw = _build(cfg), _build(cfg)
    opt_muon = _muon(m_muon)
    opt_adamw = torch.optim.AdamW(m_adamw.parameters(), lr=3e-4)
    times: dict[str, list[tuple[float, float]]] = {"muon": [], "adamw": []}
    for i in range(warmup + steps):
        batch = synthetic_batch(cfg, 4, seed=1000 * i + rank)
        for name, model, opt in (("muon", m_muon, opt_muon), ("adamw", m_adamw, opt_adamw)):
            t = _step(model, opt, batch)
            if i >= warmup:
                times[name].append(t)
    stats = opt_muon.last_exchange
    matrices = [
        p
        for g in opt_muon.param_groups
        if g["use_muon"] is not False
        for p in g["params"]
        if p.ndim == 2
    ]
    # The floor without sharding: torch's Newton-Schulz on every matrix in one process.
    ns_one = 0.0
    if rank == 0:
        for p in matrices:
            g = torch.randn(tuple(p.shape))
            t = time.perf_counter()
            newton_schulz(g)
            ns_one += time.perf_counter() - t
    dist.barrier()
    grad_bytes = sum(p.numel() * 4 for p in matrices)
    return {
        "step_muon": statistics.median(t[0] for t in times["muon"]),
        "step_adamw": statistics.median(t[0] for t in times["adamw"]),
        "opt_muon": statistics.median(t[1] for t in times["muon"]),
        "opt_adamw": statistics.median(t[1] for t in times["adamw"]),
        "bytes_sent": stats.bytes_sent,
        "flops": stats.computed_flops,
        "computed": stats.computed,
        "matrices": len(matrices),
        "grad_bytes": grad_bytes,
        "ns_one_process": ns_one,
    }


def main() -> None:
    """Run the benchmark on 2 local gloo ranks and print the numbers."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    res = run_local(bench, 2, args.steps, args.warmup)
    r0 = res[0]
    sent = sum(r["bytes_sent"] for r in res)
    flops = [r["flops"] for r in res]
    print(f"step time  Muon {r0['step_muon'] * 1e3:.1f} ms   AdamW {r0['step_adamw'] * 1e3:.1f} ms")
    print(f"Newton-Schulz of all matrices in one process: {r0['ns_one_process'] * 1e3:.1f} ms")
    print(f"optimizer  Muon {r0['opt_muon'] * 1e3:.1f} ms   AdamW {r0['opt_adamw'] * 1e3:.1f} ms")
    print(
        f"Muon matrices: {r0['matrices']}, fp32 gradient bytes {r0['grad_bytes']:,}; optimizer "
        f"sent {sent:,} bytes per step (both ranks) = {sent / r0['grad_bytes']:.2f}x"
    )
    print(
        "Newton-Schulz share per rank: "
        + ", ".join(
            f"rank {i}: {f / sum(flops):.1%} ({r['computed']} matrices)"
            for i, (f, r) in enumerate(zip(flops, res))
        )
    )


if __name__ == "__main__":
    main()
