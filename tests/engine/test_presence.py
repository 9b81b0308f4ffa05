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

STEPS = 2


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
    shapes = {"hsdp": (2, 2), "hsdp 1x2, setting changed": (1, 2)}
    mesh = shared_mesh(shapes[variant], ("replicate", "shard")) if variant in shapes else None
    kw: dict[str, Any] = {"mesh": mesh if mesh is not None else shared_mesh((ws,))}
    if variant == "alone":
        kw["bucket_bytes"] = 0
    if variant == "bf16 reduce":
        kw["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    torch.manual_seed(0)
    model = Routed(d)
    fully_shard(model.blocks[1], **kw)
    fully_shard(model, **kw)
    if variant == "custom reduce-scatter":
        for mod in (model, model.blocks[1]):
            mod.set_custom_reduce_scatter(_PlainReduceScatter())  # type: ignore[operator]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        for m in range(micro):
            if variant == "hsdp 1x2, setting changed":
                # HSDP keeps the first micro-batch's partial sum (no all-reduce); a setting
                # that changes the reduction's row width comes between the two.
                model.set_requires_all_reduce(m == micro - 1)
                model.set_reduce_scatter_unused_params(m == micro - 1)
            else:
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


class _PlainReduceScatter:
    """FSDP2's ``ReduceScatter`` protocol over torch's own reduce-scatter."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        import torch.distributed as dist

        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def case_routed_functional(who: str, mesh_shape: tuple[int, int] | None = None) -> dict[str, Any]:
    """:func:`case_routed` through the functional training step (``torch.autograd.grad``
    returns the reduced shards; its reductions are deferred unless a trainable parameter
    has no gradient here)."""
    import torch.distributed as dist

    from functional_fsdp import fully_shard
    from functional_fsdp.functional import adamw, init, make_train_step

    d = 8
    rank, ws = dist.get_rank(), dist.get_world_size()
    mesh = shared_mesh((ws,)) if mesh_shape is None else shared_mesh(mesh_shape, ("r", "s"))
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
        ("custom reduce-scatter", "one rank", 8, 1),  # no flags: every trainable one lands
        ("hsdp 1x2, setting changed", "alternating", 8, 2),
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


@pytest.mark.parametrize("mesh_shape", [None, (2, 1)])
def test_the_functional_step_lands_a_parameter_some_ranks_never_use(
    world2: World, mesh_shape: tuple[int, int] | None
) -> None:
    """The functional training step, against the same single-process run; on a (2, 1) HSDP
    mesh too, where a rank that lacked the gradient once reduced at once and the other
    deferred, so their replica all-reduces ran in different orders (gloo aborted)."""
    _check(world2.run(case_routed_functional, "alternating", mesh_shape), 1e-5)
