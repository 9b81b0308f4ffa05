"""Double backward and Hessian-vector products through sharded modules, and honest errors for
what torch.func cannot do through them (2 gloo ranks, against a single-process reference)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _dist import World

pytestmark = pytest.mark.multiprocess

WS = 2


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.layers = nn.ModuleList(nn.Linear(7, 7) for _ in range(2))
        self.out = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.out(x)


def _setup(raf: Any) -> tuple[nn.Module, nn.Module, list[torch.Tensor]]:
    from functional_fsdp import fully_shard

    torch.manual_seed(0)
    ref = _MLP().double()
    model = copy.deepcopy(ref)
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=raf)
    fully_shard(model, reshard_after_forward=raf)
    xs = [
        torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(r))
        for r in range(WS)
    ]
    return model, ref, xs


def _ref_hvp(ref: nn.Module, xs: list[torch.Tensor], vs: list[torch.Tensor]) -> list[torch.Tensor]:
    params = list(ref.parameters())
    loss = sum(ref(x).square().mean() for x in xs) / len(xs)
    g = torch.autograd.grad(loss, params, create_graph=True)
    return list(torch.autograd.grad(g, params, grad_outputs=vs))


def _hvp_case(path: str, raf: Any) -> float:
    """Largest |ours - reference| over the HVP entries (full tensors)."""
    from torch.distributed.tensor import distribute_tensor

    model, ref, xs = _setup(raf)
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(7)
    full_vs = [torch.randn(p.shape, dtype=p.dtype, generator=gen) for p in ref.parameters()]
    params = list(model.parameters())
    vs = [distribute_tensor(v, p.device_mesh, p.placements) for v, p in zip(full_vs, params)]
    if path == "module":
        loss = model(xs[rank]).square().mean()
        inputs = params
    else:
        subs = {n: p.detach().requires_grad_() for n, p in model.named_parameters()}
        inputs = list(subs.values())
        loss = torch.func.functional_call(model, subs, (xs[rank],)).square().mean()
    g = torch.autograd.grad(loss, inputs, create_graph=True)
    hv = torch.autograd.grad(g, inputs, grad_outputs=vs)
    want = _ref_hvp(ref, xs, full_vs)
    # The first-order gradients are the data-parallel mean too.
    g_ref = torch.autograd.grad(
        sum(ref(x).square().mean() for x in xs) / WS, list(ref.parameters())
    )
    err = max((a.full_tensor() - b).abs().max().item() for a, b in zip(hv, want))
    err_g = max((a.full_tensor() - b).abs().max().item() for a, b in zip(g, g_ref))
    # The module keeps working afterwards: an ordinary step gives ordinary gradients.
    model(xs[rank]).square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    return max(err, err_g)


@pytest.mark.parametrize("path", ["module", "functional_call"])
@pytest.mark.parametrize("raf", [True, False])
def test_hessian_vector_product_matches_single_process(world2: World, path: str, raf: bool) -> None:
    for err in world2.run(_hvp_case, path, raf):
        assert err < 1e-12


def _autograd_grad_first_order() -> float:
    model, ref, xs = _setup(True)
    rank = dist.get_rank()
    params = list(model.parameters())
    g = torch.autograd.grad(model(xs[rank]).square().mean(), params)
    g_ref = torch.autograd.grad(
        sum(ref(x).square().mean() for x in xs) / WS, list(ref.parameters())
    )
    assert all(p.grad is None for p in params)  # autograd.grad never touches .grad
    return max((a.full_tensor() - b).abs().max().item() for a, b in zip(g, g_ref))


def test_autograd_grad_on_the_module_returns_reduced_gradients(world2: World) -> None:
    for err in world2.run(_autograd_grad_first_order):
        assert err < 1e-12


def _transform_messages() -> dict[str, str]:
    model, _, xs = _setup(True)
    x = xs[dist.get_rank()]
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor], inp: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, p, (inp,)).square().mean()

    out = {}
    tangents = {n: torch.zeros_like(p) for n, p in params.items()}
    cases = {
        "per_example": lambda: torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(
            params, x.unsqueeze(1)
        ),
        "jvp_grad": lambda: torch.func.jvp(
            lambda p: torch.func.grad(loss)(p, x), (params,), (tangents,)
        ),
    }
    for name, fn in cases.items():
        try:
            fn()
            out[name] = "no error"
        except NotImplementedError as e:
            out[name] = str(e)
        except Exception as e:  # a foreign error is what this test guards against
            out[name] = f"{type(e).__name__}: {e}"
    return out


def test_unsupported_transforms_say_what_the_result_would_be(world2: World) -> None:
    for msgs in world2.run(_transform_messages):
        assert "averaged over the data-parallel ranks" in msgs["per_example"], msgs
        assert "forward-mode AD" in msgs["jvp_grad"], msgs
        assert "reverse over reverse" in msgs["jvp_grad"], msgs
