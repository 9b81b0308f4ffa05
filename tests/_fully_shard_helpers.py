"""Helpers shared by the fully_shard test modules: the small GPT built under torch's
``fully_shard`` or ours for a recipe, training, and comparisons of full parameters."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from _dist import shared_mesh
from _full import full_parameters

from functional_fsdp.testing.models import GPT, GPTConfig, synthetic_batch

CFG = GPTConfig(vocab=101, dim=30, n_layers=3, n_heads=2, seq=8)
STEPS = 3


def _impl(which: str):
    if which == "torch":
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    else:
        from functional_fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy


def _mesh(recipe: str):
    if recipe == "hsdp":
        return shared_mesh((2, dist.get_world_size() // 2), ("replicate", "shard"))
    return None


def _full_init(cfg: GPTConfig) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.detach().clone() for k, v in GPT(cfg).state_dict().items()}


def _build(which: str, recipe: str, cfg: GPTConfig = CFG) -> nn.Module:
    fully_shard, MP, Offload = _impl(which)
    kw: dict = {}
    if recipe == "mp":
        kw["mp_policy"] = MP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if recipe == "offload":
        kw["offload_policy"] = Offload(pin_memory=False)
    if recipe == "raf_false":
        kw["reshard_after_forward"] = False
    if recipe == "raf_int":
        kw["reshard_after_forward"] = 2
    if recipe == "shard1":
        from torch.distributed.tensor import Shard

        kw["shard_placement_fn"] = lambda p: (
            Shard(1) if p.ndim == 2 and p.shape[1] % dist.get_world_size() == 0 else None
        )
    mesh = _mesh(recipe)
    if mesh is not None:
        kw["mesh"] = mesh
    init = _full_init(cfg)
    if recipe == "meta":
        with torch.device("meta"):
            model = GPT(cfg)
    else:
        torch.manual_seed(0)
        model = GPT(cfg)
    if recipe == "ckpt":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        model.blocks = nn.ModuleList(checkpoint_wrapper(b) for b in model.blocks)
    if recipe == "list":
        # fully_shard([m1, m2]): two blocks share one group (one gather, one reduction).
        fully_shard([model.blocks[0], model.blocks[1]], **kw)
        for b in model.blocks[2:]:
            fully_shard(b, **kw)
    else:
        for b in model.blocks:
            fully_shard(b, **kw)
    fully_shard(model, **kw)
    if recipe == "meta":
        model.to_empty(device="cpu")
        from torch.distributed.tensor import distribute_tensor

        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(distribute_tensor(init[n], p.device_mesh, p.placements))
    return model


def _optimizer(params, kind: str) -> torch.optim.Optimizer:
    # Adam divides by sqrt(v): float reordering in near-zero gradients can flip an update's sign,
    # so comparisons against a differently-reduced reference use SGD (linear in the gradients).
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _train(
    model: nn.Module,
    recipe: str,
    steps: int = STEPS,
    rank: int | None = None,
    opt_kind: str = "adamw",
) -> list[float]:
    rank = dist.get_rank() if rank is None else rank
    opt = _optimizer(model.parameters(), opt_kind)
    losses = []
    micro = 3 if recipe == "accum" else 1
    for s in range(steps):
        total = 0.0
        for mb in range(micro):
            if micro > 1:
                model.set_requires_gradient_sync(mb == micro - 1)
            x, y = synthetic_batch(CFG, 2, seed=1000 * s + 10 * mb + rank)
            loss = model.loss(x, y) / micro
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    full = full_parameters(model)
    return {n.replace("._checkpoint_wrapped_module", ""): p.detach() for n, p in full.items()}


def _max_abs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _all_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    assert a.keys() == b.keys()
    return all(torch.equal(a[k], b[k]) for k in a)


def _max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(
        (
            (a[k].float() - b[k].float()).abs().max() / a[k].float().abs().max().clamp_min(1e-12)
        ).item()
        for k in a
    )
