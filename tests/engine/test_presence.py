"""A parameter some ranks never use in a backward (a routed expert, a branch taken on some
ranks' data) still lands the sum of the other ranks' gradients on every rank: the reduction
carries one presence flag per parameter (``core.reduction.agreed_present``). A parameter no
rank used lands nothing, as in a single process (no gradient, no optimizer state).

Before the flags, each rank landed only the gradients it had itself, so the rank that never
used the parameter kept its shard without a gradient (and without optimizer state) and the
model silently drifted from the single-process one. FSDP2 fails loudly there (gloo: the ranks'
reduce-scatter sizes differ) unless ``set_reduce_scatter_unused_params(True)``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dist import World, shared_mesh
from _helpers import Routed

pytestmark = pytest.mark.multiprocess

STEPS = 3


def _uses(who: str, rank: int, ws: int, step: int, micro: int) -> bool:
    """Whether ``rank`` (of ``ws``) runs ``extra`` in micro-batch ``micro`` of ``step``."""
    if who == "nobody":
        return False
    if who == "one rank":  # the last rank only, every step
        return rank == ws - 1
    if who == "held":  # the last rank's first micro-batch only (gradient sync off for it)
        return rank == ws - 1 and micro == 0
    return (rank + step + micro) % 2 == 1  # "alternating": changes with the step


def _data(step: int, rank: int, micro: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(4, d, generator=g), torch.randn(4, d, generator=g)


def _reference(d: int, ws: int, who: str, micro: int) -> dict[str, Any]:
    """The single-process run: every rank's micro-batches, the loss averaged over the ranks."""
    torch.manual_seed(0)
    model = Routed(d)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        for m in range(micro):
            for r in range(ws):
                model.use_extra = _uses(who, r, ws, step, m)
                x, y = _data(step, r, m, d)
                (torch.nn.functional.mse_loss(model(x), y) / ws).backward()
        opt.step()
        opt.zero_grad()
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "stateless": sorted(n for n, p in model.named_parameters() if p not in opt.state),
    }


def case_routed(variant: str, who: str, d: int = 8, micro: int = 1) -> dict[str, Any]:
    """``STEPS`` AdamW steps of ``micro`` micro-batches per rank; ``extra`` runs where ``who``
    says. ``variant``: how the model is sharded and reduced."""
    import torch.distributed as dist

    from functional_fsdp import MixedPrecisionPolicy, fully_shard

    rank, ws = dist.get_rank(), dist.get_world_size()
    mesh = shared_mesh((2, 2), ("replicate", "shard")) if variant == "hsdp" else shared_mesh((ws,))
    kw: dict[str, Any] = {"mesh": mesh}
    if variant == "alone":
        kw["bucket_bytes"] = 0
    if variant == "bf16 reduce":
        kw["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    torch.manual_seed(0)
    model = Routed(d)
    fully_shard(model.blocks[1], **kw)
    fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        for m in range(micro):
            model.set_requires_gradient_sync(m == micro - 1)
            model.use_extra = _uses(who, rank, ws, step, m)
            x, y = _data(step, rank, m, d)
            torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {
        "params": {n: p.detach().full_tensor() for n, p in model.named_parameters()},
        "stateless": sorted(n for n, p in model.named_parameters() if p not in opt.state),
        "reference": _reference(d, ws, who, micro) if rank == 0 else None,
    }


def case_routed_functional(who: str, d: int = 8) -> dict[str, Any]:
    """:func:`case_routed` through the functional training step (``torch.autograd.grad``
    returns the reduced shards; its reductions are deferred unless a trainable parameter
    has no gradient here)."""
    import torch.distributed as dist

    from functional_fsdp import fully_shard
    from functional_fsdp.functional import adamw, init, make_train_step

    rank, ws = dist.get_rank(), dist.get_world_size()
    mesh = shared_mesh((ws,))
    torch.manual_seed(0)
    model = Routed(d)
    fully_shard(model.blocks[1], mesh=mesh)
    fully_shard(model, mesh=mesh)

    def loss_fn(module: torch.nn.Module, batch: tuple) -> torch.Tensor:
        x, y, use = batch
        module.use_extra = bool(use.item())
        return torch.nn.functional.mse_loss(module(x), y)

    opt = adamw(1e-2)
    step, state = make_train_step(model, loss_fn, opt), init(model, opt)
    for k in range(STEPS):
        x, y = _data(k, rank, 0, d)
        state, _ = step(state, (x, y, torch.tensor(_uses(who, rank, ws, k, 0))))
    return {
        "params": {n: p.full_tensor() for n, p in state.params.items()},
        "stateless": [],
        "reference": _reference(d, ws, who, 1) if rank == 0 else None,
    }


def _check(results: list[dict[str, Any]], atol: float) -> None:
    ref = results[0]["reference"]
    for res in results:
        assert res["stateless"] == ref["stateless"], (res["stateless"], ref["stateless"])
        for n, want in ref["params"].items():
            got = res["params"][n]
            assert torch.allclose(got, want, atol=atol, rtol=0), (n, (got - want).abs().max())


@pytest.mark.parametrize(
    "variant, who, d, micro",
    [
        ("bucketed", "alternating", 8, 1),
        ("bucketed", "nobody", 8, 1),
        ("alone", "alternating", 8, 1),
        ("bucketed", "held", 8, 2),  # sync off for the first micro-batch
        ("bf16 reduce", "alternating", 8, 1),
        ("pieces", "one rank", 512, 1),  # a 1 MiB group: gloo's point-to-point pieces
    ],
)
def test_a_parameter_some_ranks_never_use_lands_on_every_rank(
    world2: World, variant: str, who: str, d: int, micro: int
) -> None:
    """Against the single-process run: the same parameters and the same parameters without
    optimizer state (none, or ``extra`` where no rank ever used it)."""
    atol = 2e-2 if variant == "bf16 reduce" else 1e-5
    _check(world2.run(case_routed, variant, who, d, micro), atol)


def test_a_parameter_one_rank_of_an_hsdp_mesh_uses_lands_on_every_rank(world4: World) -> None:
    """HSDP (2 replicas x 2 shards): only rank 3 runs ``extra``. Its flag is summed over its
    shard group (ranks 2, 3), then over the replicas (the all-reduce): rank 0, whose shard
    group had none, lands it too."""
    _check(world4.run(case_routed, "hsdp", "one rank"), 1e-5)


def test_the_functional_step_lands_a_parameter_some_ranks_never_use(world2: World) -> None:
    """The functional training step, against the same single-process run."""
    _check(world2.run(case_routed_functional, "alternating"), 1e-5)
