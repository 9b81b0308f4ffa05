"""The compiled step on the benchmark's models against the eager step and one process.

    python scripts/compiled_parity.py [--model deep|gpt13m] [--steps 3] [--backend aot_eager]

On 2 gloo ranks (spawned here), ``make_train_step(..., compile=BACKEND)`` trains the model
(``benchmarks/bench_step.py``'s ``MODELS``: the same configurations and batch sizes) for a few
AdamW steps, and so does the eager ``make_train_step`` from the same start. One process then
trains the plain model on the global batch (both ranks' batches) with ``torch.compile`` of its
loss (the same backend) and ``torch.optim.AdamW``. Printed: the largest difference between the
compiled and eager steps' parameters and losses (``aot_eager``: 0, the same ops), and the
largest relative difference (2-norm, per parameter) and loss difference against the one
process (float rounding: two ranks' gradient sums against one batch's). Compiling the deep
model takes about a minute a rank on a 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
)

from bench_step import MODELS

from functional_fsdp import fully_shard, run_local
from functional_fsdp.testing.models import GPT, synthetic_batch

LR, WD = 1e-3, 0.01


def _batch(args: argparse.Namespace, step: int, rank: int) -> Any:
    cfg, batch = MODELS[args.model]
    return synthetic_batch(cfg, batch, seed=1000 * step + rank)


def _sharded(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    model = GPT(MODELS[args.model][0])
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def _rank(args: argparse.Namespace) -> dict[str, Any]:
    from functional_fsdp.functional import adamw, init, make_train_step

    torch.set_num_threads(1)
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for compile in (False, args.backend):
        model = _sharded(args)
        opt = adamw(LR, weight_decay=WD)
        step = make_train_step(model, lambda m, b: m.loss(*b), opt, compile=compile)
        state = init(model, opt)
        losses = []
        for s in range(args.steps):
            state, metrics = step(state, _batch(args, s, rank))
            losses.append(metrics["loss"].item())
        params = {n: p.full_tensor() for n, p in state.params.items()}
        out[str(compile)] = (params, losses)
    return out


def _reference(args: argparse.Namespace) -> tuple[dict[str, torch.Tensor], list[float]]:
    torch.manual_seed(0)
    model = GPT(MODELS[args.model][0])
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    loss_of = torch.compile(model.loss, backend=args.backend, fullgraph=True)
    losses = []
    for s in range(args.steps):
        (x0, y0), (x1, y1) = _batch(args, s, 0), _batch(args, s, 1)
        loss = loss_of(torch.cat([x0, x1]), torch.cat([y0, y1]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {n: p.detach() for n, p in model.named_parameters()}, losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt13m")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--backend", default="aot_eager")
    args = ap.parse_args()
    ranks = run_local(_rank, 2, args)
    (eager, eager_losses), (compiled, losses) = ranks[0]["False"], ranks[0][args.backend]
    torch.set_num_threads(2)
    ref, ref_losses = _reference(args)
    print(f"{args.model}, {args.steps} AdamW steps, compile={args.backend!r}, 2 gloo ranks")
    step_diff = max((compiled[n] - eager[n]).abs().max().item() for n in eager)
    loss_diff = max(abs(a - b) for a, b in zip(losses, eager_losses))
    print(f"compiled vs eager step: parameters max |diff| {step_diff:.3g}, losses {loss_diff:.3g}")
    rel = max(((compiled[n] - p).norm() / p.norm()).item() for n, p in ref.items())
    ref_loss = max(abs(a - b) for a, b in zip(losses, ref_losses))
    print(
        f"compiled vs one process (compiled loss, torch AdamW, global batch): parameters max "
        f"relative 2-norm {rel:.3g}, losses max |diff| {ref_loss:.3g}"
    )


if __name__ == "__main__":
    main()
