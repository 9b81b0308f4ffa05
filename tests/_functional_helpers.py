"""Helpers shared by the functional-API test modules (a small GPT sharded FSDP2-style, batches,
comparisons, the shell and functional training loops)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from _full import full_tensors

TOL = 1e-5


def _cfg() -> Any:
    from functional_fsdp.testing.models import GPTConfig

    return GPTConfig(vocab=101, dim=32, n_layers=4, n_heads=2, seq=8)


def _build(*, shard: bool = True, seed: int = 0, **kw: Any) -> nn.Module:
    from functional_fsdp import fully_shard
    from functional_fsdp.testing.models import GPT

    torch.manual_seed(seed)
    model = GPT(_cfg())
    if shard:
        for block in model.blocks:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
    return model


def _batch(step: int, rank: int, n: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    from functional_fsdp.testing.models import synthetic_batch

    return synthetic_batch(_cfg(), n, seed=100 * step + rank)


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return model.loss(*batch)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _full(t: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _max_rel(got: dict[str, Any], want: dict[str, Any]) -> float:
    assert set(got) == set(want)
    got, want = full_tensors(got), full_tensors(want)
    return max(_rel(got[k].detach(), want[k].detach()) for k in want)


def _max_norm_rel(got: dict[str, Any], want: dict[str, Any]) -> float:
    """Largest ``|a - b| / |b|`` in the 2-norm over the parameters."""
    got = full_tensors(got)
    return max(((got[k] - want[k]).norm() / want[k].norm()).item() for k in want)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _torch_opt(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)


def _functional_opt(name: str) -> Any:
    from functional_fsdp.functional import adamw, sgd

    if name == "adamw":
        return adamw(1e-2, weight_decay=0.01)
    return sgd(0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)


def _shell_train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: int,
    *,
    accum: int = 1,
    clip: float | None = None,
) -> tuple[list[float], list[float]]:
    rank, losses, norms = _rank(), [], []
    for s in range(steps):
        x, y = _batch(s, rank, n=2 * accum)
        total = 0.0
        for xm, ym in zip(x.chunk(accum), y.chunk(accum)):
            loss = model.loss(xm, ym)
            (loss / accum if accum > 1 else loss).backward()
            total += loss.item()
        if clip is not None:
            norms.append(_full(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)).item())
        opt.step()
        opt.zero_grad()
        losses.append(total / accum)
    return losses, norms


def _functional_train(
    model: nn.Module, opt: Any, steps: int, **kw: Any
) -> tuple[Any, list[float], list[float]]:
    from functional_fsdp.functional import init, make_train_step

    accum = kw.get("grad_accum", 1)
    rank = _rank()
    state = init(model, opt)
    step = make_train_step(model, _loss, opt, **kw)
    losses, norms = [], []
    for s in range(steps):
        state, metrics = step(state, _batch(s, rank, n=2 * accum))
        losses.append(metrics["local_loss"].item())
        norms.append(metrics["grad_norm"].item())
    return state, losses, norms


# ------------------------------------------------------------------ the step against FSDP2 / 1 proc
