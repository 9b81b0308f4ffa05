"""torch.func over sharded modules (2 gloo ranks): grad/vjp equal backward, substituted
parameters are used (FSDP2 ignores them), and the support table of docs/functional.md, one test
per row."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from _dist import World, shared_mesh
from _functional_helpers import (
    TOL,
    _batch,
    _build,
    _rank,
    _rel,
)

pytestmark = pytest.mark.multiprocess


@pytest.fixture
def world(world2: World) -> World:
    return world2


def _case_func_grad_equals_backward() -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    model = _build()
    x, y = _batch(0, _rank())
    model.loss(x, y).backward()
    want = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    placements = {n: p.placements for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    params = {n: p.detach() for n, p in model.named_parameters()}

    def f(ps: dict[str, Any]) -> torch.Tensor:
        logits = torch.func.functional_call(model, ps, (x,))
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
        )

    grads = torch.func.grad(f)(params)
    _, vjp_fn = torch.func.vjp(f, params)
    (vjp_grads,) = vjp_fn(torch.ones(()))
    leaves = {n: p.detach().requires_grad_() for n, p in params.items()}
    ag = dict(zip(leaves, torch.autograd.grad(f(leaves), list(leaves.values()))))
    # functional_call with the module's own parameters and .backward(): the shell's own path.
    torch.func.functional_call(model, dict(model.named_parameters()), (x,))
    own = f(dict(model.named_parameters()))
    own.backward()
    own_grads = {n: p.grad for n, p in model.named_parameters()}
    return {
        "grad": max(_rel(grads[n].full_tensor(), want[n]) for n in want),
        "vjp": max(_rel(vjp_grads[n].full_tensor(), want[n]) for n in want),
        "autograd": max(_rel(ag[n].full_tensor(), want[n]) for n in want),
        "own": max(_rel(own_grads[n].full_tensor(), want[n]) for n in want),
        "sharded": all(
            isinstance(g, DTensor) and g.placements == placements[n] for n, g in grads.items()
        ),
    }


def test_func_grad_and_vjp_equal_backward_for_every_parameter(world: World) -> None:
    for r in world.run(_case_func_grad_equals_backward):
        assert r["sharded"]
        assert r["grad"] == 0.0 and r["vjp"] == 0.0 and r["autograd"] == 0.0 and r["own"] == 0.0


def _case_substituted_params_are_used() -> dict[str, float]:
    model = _build()
    ref = _build(shard=False)
    x, _ = _batch(0, _rank())
    before = model(x).detach()
    model.reshard()  # the root kept its full parameters registered (FSDP2's contract)
    zeros = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    out_zero = torch.func.functional_call(model, zeros, (x,))
    with torch.no_grad():
        for p in ref.parameters():
            p.zero_()
    want_zero = ref(x)
    doubled = {n: p.detach() * 2 for n, p in model.named_parameters()}
    out_doubled = torch.func.functional_call(model, doubled, (x,))
    ref2 = _build(shard=False)
    with torch.no_grad():
        for p in ref2.parameters():
            p.mul_(2)
    after = model(x).detach()
    return {
        "zero": (out_zero - want_zero).abs().max().item(),
        "zero_abs": want_zero.abs().max().item(),
        "doubled": _rel(out_doubled, ref2(x)),
        "module_unchanged": (after - before).abs().max().item(),
        "changed": (out_doubled - before).abs().max().item(),
    }


def test_all_zero_substituted_params_give_the_all_zero_param_output(world: World) -> None:
    for r in world.run(_case_substituted_params_are_used):
        assert r["zero"] == 0.0 and r["zero_abs"] == 0.0
        assert r["doubled"] <= TOL and r["changed"] > 0.1
        assert r["module_unchanged"] == 0.0


def _mlp(sharded: bool) -> nn.Module:
    from functional_fsdp import fully_shard

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    if sharded:
        fully_shard(mlp[0])
        fully_shard(mlp[2])
        fully_shard(mlp)
    return mlp


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters()}


def _case_transform(name: str) -> Any:
    """Run one torch.func claim; return a number to compare (0 = equal to the plain model)."""
    from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

    mlp, ref = _mlp(True), _mlp(False)
    ps, rps = _params(mlp), _params(ref)
    torch.manual_seed(1 + _rank())
    x = torch.randn(5, 4)

    def f(p: Any, xx: Any = x, m: nn.Module = mlp) -> torch.Tensor:
        return functional_call(m, p, (xx,))

    if name == "grad_inputs":
        got = grad(lambda xx: f(ps, xx).sum())(x)
        return _rel(got, grad(lambda xx: f(rps, xx, ref).sum())(x))
    if name == "vmap_inputs":
        xs = torch.randn(3, 5, 4)
        return _rel(vmap(lambda xx: f(ps, xx))(xs), vmap(lambda xx: f(rps, xx, ref))(xs))
    if name == "jvp_inputs":
        t = torch.ones_like(x)
        return _rel(
            jvp(lambda xx: f(ps, xx), (x,), (t,))[1], jvp(lambda xx: f(rps, xx, ref), (x,), (t,))[1]
        )
    if name == "jvp_params":
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            jvp(f, (ps,), ({n: torch.ones_like(p) for n, p in ps.items()},))
    elif name == "jacfwd_params":
        with pytest.raises(NotImplementedError, match="does not have a sharding strategy"):
            jacfwd(lambda p: f(p).sum())(ps)
    elif name == "hessian_params":
        with pytest.raises(NotImplementedError, match="does not have a sharding strategy"):
            hessian(lambda p: f(p).sum())(ps)
    elif name == "vmap_params":
        with pytest.raises(NotImplementedError, match="vmap over the parameters"):
            vmap(f)({n: torch.stack([p, p]) for n, p in ps.items()})
        mlp.reset_iter_state()  # refused mid-forward: recover as after any exception there
    elif name == "jacrev_params":
        with pytest.raises(NotImplementedError, match="batched gradients"):
            jacrev(lambda p: f(p).sum(0))(ps)
    elif name == "per_sample_grads":
        with pytest.raises(NotImplementedError, match="batched gradients"):
            vmap(grad(lambda p, xx: f(p, xx[None]).sum()), in_dims=(None, 0))(ps, x)
    elif name == "grad_of_grad":
        with pytest.raises(NotImplementedError, match="higher-order"):
            grad(lambda p: grad(lambda q: f(q).sum())(p)["0.weight"].sum())(ps)
    else:
        raise AssertionError(name)
    # After a refused transform the module still works (nothing left half-done).
    out, vjp_fn = vjp(f, ps)
    (grads,) = vjp_fn(torch.ones_like(out))
    assert all(torch.isfinite(g.full_tensor()).all() for g in grads.values())
    return _rel(out, f(rps, x, ref))


WORKS = ["grad_inputs", "vmap_inputs", "jvp_inputs"]
REFUSED = [
    "jvp_params",
    "jacfwd_params",
    "hessian_params",
    "vmap_params",
    "jacrev_params",
    "per_sample_grads",
    "grad_of_grad",
]


@pytest.mark.parametrize("name", WORKS + REFUSED)
def test_torch_func_support_table(world: World, name: str) -> None:
    for r in world.run(_case_transform, name):
        assert r <= 1e-6


def _case_torch_fsdp2_ignores_substitutes() -> dict[str, float]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    torch_fully_shard(mlp[0])
    torch_fully_shard(mlp[2])
    torch_fully_shard(mlp)
    x = torch.randn(5, 4)
    base = mlp(x).detach()
    ps = _params(mlp)
    out = torch.func.functional_call(mlp, {n: torch.zeros_like(p) for n, p in ps.items()}, (x,))
    grads = torch.func.grad(lambda p: torch.func.functional_call(mlp, p, (x,)).sum())(ps)
    return {
        "out_vs_base": (out - base).abs().max().item(),
        "base": base.abs().max().item(),
        "grads": max(g.full_tensor().abs().max().item() for g in grads.values()),
    }


def test_torch_fsdp2_ignores_substituted_params(world: World) -> None:
    # The behaviour this library fixes: FSDP2 computes with its own parameters and returns zeros.
    for r in world.run(_case_torch_fsdp2_ignores_substitutes):
        assert r["out_vs_base"] == 0.0 and r["base"] > 0
        assert r["grads"] == 0.0


def _case_bad_substitute() -> str:
    model = _mlp(True)
    x = torch.randn(5, 4)
    ps = _params(model)
    ps["0.weight"] = ps["0.weight"].full_tensor()
    with pytest.raises(TypeError, match=r"'weight' of Linear is a Tensor; pass a DTensor"):
        torch.func.functional_call(model, ps, (x,))
    model.reset_iter_state()
    ps["0.weight"] = torch.zeros(6, 4)  # right global shape, but not sharded
    with pytest.raises(TypeError, match=r"'weight' of Linear"):
        torch.func.functional_call(model, ps, (x,))
    model.reset_iter_state()
    ps["0.weight"] = torch.zeros(3, 4)
    with pytest.raises(
        ValueError, match=r"shape \(3, 4\), the parameter's global shape is \(6, 4\)"
    ):
        torch.func.functional_call(model, ps, (x,))
    model.reset_iter_state()
    return "ok" if torch.isfinite(model(x)).all() else "broken"


def test_plain_tensor_substitute_is_a_clear_error(world: World) -> None:
    assert world.run(_case_bad_substitute) == ["ok", "ok"]


# ------------------------------------------------------------------- interop and checkpoints


def _case_functional_grads_leave_a_kept_partial_sum_alone(interleave: bool) -> dict[str, Any]:
    """HSDP (2 replicas): a module backward with ``set_requires_all_reduce(False)`` keeps a
    partial sum for the next one; ``torch.func.grad`` calls in between (``interleave``) neither
    add it to their gradients nor consume it."""
    from functional_fsdp import fully_shard

    torch.manual_seed(0)
    mesh = shared_mesh((2, 1), ("replicate", "shard"))
    mlp = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    fully_shard(mlp[0], mesh=mesh)
    fully_shard(mlp, mesh=mesh)
    gen = torch.Generator().manual_seed(_rank())
    xs = [torch.randn(5, 4, generator=gen) for _ in range(3)]
    mlp.set_requires_all_reduce(False)
    mlp(xs[0]).square().sum().backward()
    mlp.set_requires_all_reduce(True)
    params = _params(mlp)

    def f(ps: dict[str, Any]) -> torch.Tensor:
        return torch.func.functional_call(mlp, ps, (xs[2],)).square().sum()

    spread = 0.0
    if interleave:
        first, second = torch.func.grad(f)(params), torch.func.grad(f)(params)
        spread = max((first[n] - second[n]).abs().max().item() for n in first)
    mlp(xs[1]).square().sum().backward()
    return {"spread": spread, "grads": {n: p.grad.full_tensor() for n, p in mlp.named_parameters()}}


def test_functional_grads_leave_the_module_partial_sum_alone(world: World) -> None:
    plain = world.run(_case_functional_grads_leave_a_kept_partial_sum_alone, False)
    mixed = world.run(_case_functional_grads_leave_a_kept_partial_sum_alone, True)
    for p, m in zip(plain, mixed):
        assert m["spread"] == 0.0  # the two functional gradients are alike
        for n, g in p["grads"].items():  # and the module's two backwards add as without them
            assert torch.equal(m["grads"][n], g), n
