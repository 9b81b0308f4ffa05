"""A custom trainer on the functional API: schedule, accumulation, EMA, eval, checkpoint/resume.

One command, 2 CPU ranks (it spawns its own gloo ranks; under torchrun it uses those)::

    python examples/05_custom_trainer.py                 # 40 steps
    python examples/05_custom_trainer.py --steps 8 --eval-every 4
    torchrun --nproc-per-node 2 examples/05_custom_trainer.py --ckpt-dir /tmp/ckpt05

What it shows, all with pure functions over an immutable ``TrainState``:

- an optax-style optimizer: ``chain(clip_by_global_norm(1.0), adamw(schedule))`` with a
  warmup + cosine learning-rate schedule;
- gradient accumulation (``grad_accum``) and an auxiliary output (``has_aux=True``: the token
  accuracy of each micro-batch);
- an exponential moving average of the parameters, kept as a plain dict of ``DTensor`` s
  (the state is a value, so the EMA is one ``tree_map`` per step and never aliases it);
- evaluation of the EMA weights with the module API (``apply_to_module``);
- a ``torch.distributed.checkpoint`` checkpoint of state + EMA halfway, and a resume from it
  that replays the second half and checks that it ends bit for bit where training ended;
- per-step metrics: global mean loss, learning rate, gradient norm, accuracy, step time.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import optree
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F

from functional_fsdp import fully_shard, run_local
from functional_fsdp.functional import (
    adamw,
    apply_to_module,
    chain,
    clip_by_global_norm,
    from_state_dict,
    init,
    make_train_step,
    to_state_dict,
    with_params,
)
from functional_fsdp.functional.schedules import warmup_cosine_decay_schedule
from functional_fsdp.testing.models import GPT, GPTConfig, pattern_batch

CFG = GPTConfig(vocab=256, dim=64, n_layers=2, n_heads=4, seq=32)
EMA_DECAY = 0.9


def loss_and_accuracy(model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """Next-token cross-entropy, and the token accuracy as an auxiliary output."""
    x, y = batch
    logits = model(x)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
    return loss, {"accuracy": (logits.argmax(-1) == y).float().mean()}


def _batch(i: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    return pattern_batch(CFG, args.batch, seed=1000 * i + dist.get_rank())


def _mean(x: torch.Tensor) -> float:
    x = x.detach().clone()
    dist.all_reduce(x)
    return x.item() / dist.get_world_size()


def evaluate(state: Any, ema: dict[str, Any], model: nn.Module) -> float:
    """Global mean loss of the EMA weights on held-out batches (the module API, no grads)."""
    apply_to_module(with_params(state, ema), model)
    with torch.no_grad():
        losses = [loss_and_accuracy(model, _held_out(k))[0] for k in range(2)]
    return _mean(torch.stack(losses).mean())


def _held_out(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return pattern_batch(CFG, 4, seed=10_000_000 + 100 * k + dist.get_rank())


def _save(path: str, state: Any, ema: dict[str, Any]) -> None:
    sd = {"train/" + k: v for k, v in to_state_dict(state).items()}
    sd.update({"ema/" + k: v for k, v in ema.items()})
    dcp.save(sd, checkpoint_id=path)


def _load(path: str, model: nn.Module, opt: Any) -> tuple[Any, dict[str, Any]]:
    template = init(model, opt)  # the structure, and fresh tensors to load into
    sd = {"train/" + k: v for k, v in to_state_dict(template).items()}
    ema = {n: t.detach().clone() for n, t in template.params.items()}
    sd.update({"ema/" + k: v for k, v in ema.items()})
    dcp.load(sd, checkpoint_id=path)
    train = {k.removeprefix("train/"): v for k, v in sd.items() if k.startswith("train/")}
    return from_state_dict(template, train), {n: sd["ema/" + n] for n in ema}


def _update_ema(ema: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    return optree.tree_map(lambda e, p: torch.lerp(e, p, 1 - EMA_DECAY), ema, params)


def train(args: argparse.Namespace) -> dict[str, Any]:
    """The whole program of one rank; returns its summary."""
    torch.manual_seed(0)  # same initial weights on every rank
    model = GPT(CFG)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    schedule = warmup_cosine_decay_schedule(
        0.0, args.lr, warmup_steps=max(1, args.steps // 10), decay_steps=args.steps
    )
    opt = chain(clip_by_global_norm(1.0), adamw(schedule, weight_decay=0.01))
    step = make_train_step(model, loss_and_accuracy, opt, grad_accum=args.accum, has_aux=True)
    state = init(model, opt)
    ema = {n: t.detach().clone() for n, t in state.params.items()}
    save_at = args.steps // 2
    path = os.path.join(args.ckpt_dir, f"step{save_at}")
    rank0 = dist.get_rank() == 0
    losses, evals = [], []
    for i in range(args.steps):
        if i == save_at:
            _save(path, state, ema)
        t0 = time.perf_counter()
        state, metrics = step(state, _batch(i, args))
        ema = _update_ema(ema, state.params)
        ms = 1e3 * (time.perf_counter() - t0)
        losses.append(metrics["loss"].item())  # already the mean over ranks
        accuracy = sum(a["accuracy"].item() for a in metrics["aux"]) / args.accum
        if rank0:
            print(
                f"step {int(state.step):3d}  loss {losses[-1]:.4f}  lr {metrics['lr']:.2e}  "
                f"grad norm {metrics['grad_norm'].item():.3f}  acc {accuracy:.3f}  {ms:6.1f} ms",
                flush=True,
            )
        if (i + 1) % args.eval_every == 0 or i + 1 == args.steps:
            evals.append(evaluate(state, ema, model))
            if rank0:
                print(f"           eval (EMA weights) loss {evals[-1]:.4f}", flush=True)

    # Resume from the halfway checkpoint and replay the second half: bit for bit the same end.
    resumed, resumed_ema = _load(path, model, opt)
    for i in range(save_at, args.steps):
        resumed, _ = step(resumed, _batch(i, args))
        resumed_ema = _update_ema(resumed_ema, resumed.params)
    same = all(
        torch.equal(a.to_local(), b.to_local())
        for a, b in zip(
            [*state.params.values(), *ema.values()],
            [*resumed.params.values(), *resumed_ema.values()],
        )
    )
    if rank0:
        print(f"resumed from step {save_at}: final state identical = {same}", flush=True)
    return {"losses": losses, "evals": evals, "resumed_identical": same}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse arguments and run on torchrun's ranks or on ``--world-size`` local ones."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=8, help="per-rank batch (split by --accum)")
    ap.add_argument("--accum", type=int, default=2, help="gradient accumulation micro-batches")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--ckpt-dir", default=None, help="default: a new temporary directory")
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the checkpoint is taken halfway)")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        if args.ckpt_dir is None:
            ap.error("under torchrun pass --ckpt-dir (a directory every rank can reach)")
        dist.init_process_group("gloo")
        try:
            return train(args)
        finally:
            dist.destroy_process_group()
    with tempfile.TemporaryDirectory() as tmp:
        args.ckpt_dir = args.ckpt_dir or tmp
        summary = run_local(_rank, args.world_size, args)[0]
    losses = summary["losses"]
    print(
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; resumed identical: {summary['resumed_identical']}"
    )
    return summary


def _rank(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    return train(args)


if __name__ == "__main__":
    main()
