"""Whole-matrix optimizers against single-process torch.optim.Muon / AdamW on the same data.

Bounds (measured, see docs/muon.md): given the same full gradients, the sharded Muon equals one
process bit for bit (the owner runs torch's Newton-Schulz on the same whole matrix; everything
else is element-wise), fp32 and bf16 parameters, world sizes 1, 2 and 4, uneven shards
included. Trained end to end through ``fully_shard``, the gradients differ from one process by
reduce-scatter rounding (~1e-7); Newton-Schulz in bfloat16 can turn that into a one-ulp flip of
an update entry, so the parameters are compared within ``E2E_TOL`` of the size of the update
(measured: exact in our runs), where torch.optim.Muon on the same shards is off by ~30%.

Each world runs all of its cases in one call (the worlds are spawned once per session).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

from functional_fsdp.core.errors import WholeMatrixError

# bf16 parameters given the same gradients, 3 steps, in units of |x| * eps (eps = 2**-7):
# measured 2.04 at world 2 and 4 (a last-bit flip or two per element), asserted <= 4.
BF16_ULPS = 4.0

# Parameters after training, |sharded - single| / |single update|; measured 0 (see module doc).
E2E_TOL = 1e-3

# (rows, cols) per matrix: even, uneven (5 rows on 4 ranks: 2, 2, 1, 0), tall, fewer rows
# than ranks (3 rows on 4 ranks), wide.
SHAPES = [(48, 64), (5, 7), (40, 12), (3, 8), (16, 48)]


class _Mats(nn.Module):
    """Matrices of SHAPES and one vector (AdamW's)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mats = nn.ParameterList(
            [nn.Parameter(torch.randn(s, dtype=dtype) * 0.1) for s in SHAPES]
        )
        self.bias = nn.Parameter(torch.randn(7, dtype=dtype) * 0.1)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 48, bias=False), nn.ReLU(), nn.Linear(48, 32, bias=False))


def _full(t: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _torch_pair(model: nn.Module, **kw: Any) -> list[torch.optim.Optimizer]:
    mats = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    out: list[torch.optim.Optimizer] = [torch.optim.Muon(mats, **kw)]
    if rest:
        out.append(torch.optim.AdamW(rest, lr=1e-3))
    return out


def _same_grads_case(dtype: torch.dtype, nesterov: bool, mesh: Any = None) -> float:
    """Sharded functional_fsdp.optim.Muon vs one-process torch (Muon + AdamW), given the same
    full gradients for 3 steps: the largest difference in ulps."""
    from functional_fsdp import fully_shard
    from functional_fsdp.optim import Muon

    ref, sharded = _Mats(dtype), _Mats(dtype)
    fully_shard(sharded, mesh=mesh)
    kw = {"lr": 0.02, "nesterov": nesterov, "adjust_lr_fn": "match_rms_adamw"}
    refs = _torch_pair(ref, **kw)
    opt = Muon(sharded.parameters(), **kw)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for pr, ps in zip(ref.parameters(), sharded.parameters()):
            g = torch.randn(pr.shape, generator=gen).to(dtype)
            pr.grad = g
            ps.grad = _distribute(g, ps)
        for o in refs:
            o.step()
        opt.step()
    return max(_ulps(_full(b), a) for a, b in zip(ref.parameters(), sharded.parameters()))


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference in units of the last place of ``want``'s dtype (0: bit for bit)."""
    if torch.equal(got, want):
        return 0.0
    ulp = want.float().abs().clamp_min(1e-30) * torch.finfo(want.dtype).eps
    return ((got.float() - want.float()).abs() / ulp).max().item()


def _distribute(g: torch.Tensor, like: Any) -> Any:
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(g, like.device_mesh, like.placements)


def _train_mlp(make_opt: Any, steps: int = 2) -> tuple[float, float]:
    """The issue's measurement: a 64->48->32 MLP, lr 0.02, same data on every rank; returns
    (max |sharded - single|, max |single update|) of the parameters."""
    from functional_fsdp import fully_shard

    torch.manual_seed(1)
    x, y = torch.randn(8, 64), torch.randn(8, 32)
    ref, model = _mlp(), _mlp()
    start = [p.detach().clone() for p in ref.parameters()]
    fully_shard(model)
    refs, opt = _torch_pair(ref, lr=0.02), make_opt(model.parameters())
    for _ in range(steps):
        for mod, opts in ((ref, refs), (model, [opt])):
            for o in opts:
                o.zero_grad()
            ((mod(x) - y) ** 2).mean().backward()
            for o in opts:
                o.step()
    diff = max(
        (a - _full(b)).abs().max().item() for a, b in zip(ref.parameters(), model.parameters())
    )
    update = max((a - s).abs().max().item() for a, s in zip(ref.parameters(), start))
    return diff, update


def _torch_muon_refused() -> tuple[bool, bool]:
    from functional_fsdp import fully_shard

    model = _mlp()
    fully_shard(model)
    before = [_full(p).clone() for p in model.parameters()]
    opt = torch.optim.Muon(model.parameters(), lr=0.02)
    model(torch.randn(4, 64)).sum().backward()
    try:
        opt.step()
    except WholeMatrixError as e:
        refused = "functional_fsdp.optim.Muon" in str(e)
    else:
        refused = False
    unchanged = all(torch.equal(a, _full(b)) for a, b in zip(before, model.parameters()))
    return refused, unchanged


def _exchange_stats() -> dict[str, Any]:
    """Bytes and owners of one step over the _Mats matrices (fp32)."""
    import torch.distributed as dist

    from functional_fsdp import fully_shard
    from functional_fsdp.optim import Muon

    model = _Mats(torch.float32)
    fully_shard(model)
    opt = Muon(model.parameters(), lr=0.02)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    sent = torch.tensor([float(opt.last_exchange.bytes_sent)])
    dist.all_reduce(sent)
    return {"sent": sent.item(), "computed": opt.last_exchange.computed}


def _functional_case() -> dict[str, float]:
    """functional.muon in make_train_step (and whole_matrix with a spectral normalization)
    against one process."""
    from functional_fsdp import fully_shard
    from functional_fsdp.functional import (
        chain,
        clip_by_global_norm,
        init,
        make_train_step,
        muon,
        scale_by_learning_rate,
        whole_matrix,
    )

    torch.manual_seed(1)
    x, y = torch.randn(8, 64), torch.randn(8, 32)

    def loss_fn(m: nn.Module, b: Any) -> torch.Tensor:
        return ((m(b[0]) - b[1]) ** 2).mean()

    out = {}
    spectral = whole_matrix(lambda g: g / torch.linalg.matrix_norm(g, ord=2))
    rules = {
        "muon": (chain(clip_by_global_norm(1.0), muon(0.02)), "muon"),
        "spectral": (chain(spectral, scale_by_learning_rate(0.05)), "spectral"),
    }
    for name, (opt, kind) in rules.items():
        ref, model = _mlp(), _mlp()
        start = [p.detach().clone() for p in ref.parameters()]
        fully_shard(model)
        state = init(model, opt)
        step = make_train_step(model, loss_fn, opt)
        refs = _torch_pair(ref, lr=0.02) if kind == "muon" else []
        for _ in range(2):
            state, _ = step(state, (x, y))
            ref.zero_grad()
            loss_fn(ref, (x, y)).backward()
            with torch.no_grad():
                if kind == "muon":
                    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
                    for o in refs:
                        o.step()
                else:
                    for p in ref.parameters():
                        p -= 0.05 * p.grad / torch.linalg.matrix_norm(p.grad, ord=2)
        names = [n for n, _ in ref.named_parameters()]
        diff = max(
            (p - _full(state.params[n])).abs().max().item() for n, p in zip(names, ref.parameters())
        )
        update = max((p - s).abs().max().item() for p, s in zip(ref.parameters(), start))
        out[name] = diff / update
    return out


def _case_all(world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from functional_fsdp.optim import Muon

    res: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        res[f"same_grads_{dtype}"] = _same_grads_case(dtype, nesterov=True)
    res["same_grads_no_nesterov"] = _same_grads_case(torch.float32, nesterov=False)
    if world_size == 4:
        # HSDP: replicate over 2, shard over 2.
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        res["same_grads_hsdp"] = _same_grads_case(torch.float32, True, mesh)
        # 2-D FSDP + TP placements are refused at construction, by name.
        from torch.distributed.tensor import Shard, distribute_tensor

        w = distribute_tensor(torch.randn(8, 8), mesh, [Shard(0), Shard(1)])
        try:
            Muon([nn.Parameter(w)], lr=0.02)
            res["tp_refused"] = False
        except WholeMatrixError:
            res["tp_refused"] = True
    ours = _train_mlp(lambda ps: Muon(ps, lr=0.02))
    res["e2e_rel"] = ours[0] / ours[1]
    res["refused"] = _torch_muon_refused()
    res["stats"] = _exchange_stats()
    res["functional"] = _functional_case()
    return res


def _check(results: list[dict[str, Any]], world_size: int) -> None:
    r = results[0]
    for key, value in r.items():
        if key.startswith("same_grads"):
            # fp32: bit for bit. bf16: CPU kernels round a vector's tail elements differently
            # from its body, so an element's last bit depends on where the shard starts (as for
            # torch.optim.AdamW under FSDP2): at most one ulp per step (3 steps).
            limit = BF16_ULPS if "bfloat16" in key else 0.0
            assert value <= limit, f"{key} at world {world_size}: {value} ulps"
    if world_size == 4:
        assert r["tp_refused"] is True
    assert r["e2e_rel"] <= E2E_TOL, r["e2e_rel"]
    for name, rel in r["functional"].items():
        assert rel <= E2E_TOL, (name, rel)
    assert r["refused"] == (True, True)
    # At most twice the Muon matrices' gradient bytes (fp32); bf16 on the wire: below 1x.
    grad_bytes = sum(a * b for a, b in SHAPES) * 4
    assert r["stats"]["sent"] <= grad_bytes, (r["stats"]["sent"], grad_bytes)
    computed = [x["stats"]["computed"] for x in results]
    assert max(computed) - min(computed) <= 1, computed  # round-robin owners


def test_world1_equals_torch_bit_for_bit() -> None:
    """One process, plain tensors: our Muon + AdamW routing is torch.optim.Muon + AdamW."""
    from functional_fsdp.optim import Muon

    for dtype in (torch.float32, torch.bfloat16):
        ref, ours = _Mats(dtype), _Mats(dtype)
        refs = _torch_pair(ref, lr=0.02, weight_decay=0.05)
        opt = Muon(ours.parameters(), lr=0.02, weight_decay=0.05)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            for a, b in zip(ref.parameters(), ours.parameters()):
                a.grad = torch.randn(a.shape, generator=gen).to(dtype)
                b.grad = a.grad.clone()
            for o in refs:
                o.step()
            opt.step()
        for a, b in zip(ref.parameters(), ours.parameters()):
            assert torch.equal(a, b), dtype


def test_functional_world1_equals_torch() -> None:
    from functional_fsdp.functional import muon

    ref, ours = _Mats(torch.float32), _Mats(torch.float32)
    refs = _torch_pair(ref, lr=0.02)
    opt = muon(0.02)
    params = {n: p.detach().clone() for n, p in ours.named_parameters()}
    state = opt.init(params)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = {}
        for (n, _), a in zip(ours.named_parameters(), ref.parameters()):
            a.grad = torch.randn(a.shape, generator=gen)
            grads[n] = a.grad.clone()
        for o in refs:
            o.step()
        params, state = opt.update(grads, state, params)
    for (n, _), a in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(params[n], a), n


def test_adamw_routing_equals_torch_adamw() -> None:
    """1-D parameters (use_muon unset) and a use_muon=False group step as torch.optim.AdamW."""
    from functional_fsdp.optim import Muon

    torch.manual_seed(0)
    vecs = [torch.randn(9), torch.randn(3, 4)]
    ref = [nn.Parameter(v.clone()) for v in vecs]
    ours = [nn.Parameter(v.clone()) for v in vecs]
    kw = {"betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.2, "lr": 3e-3}
    torch_opt = torch.optim.AdamW(ref, **kw)
    opt = Muon(
        [{"params": ours[:1]}, {"params": ours[1:], "use_muon": False}],
        lr=0.02,
        adamw_lr=3e-3,
        adamw_betas=(0.8, 0.99),
        adamw_eps=1e-6,
        adamw_weight_decay=0.2,
    )
    for _ in range(4):
        for a, b in zip(ref, ours):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        torch_opt.step()
        opt.step()
    for a, b in zip(ref, ours):
        assert torch.equal(a, b)
        assert torch.equal(torch_opt.state[a]["exp_avg_sq"], opt.state[b]["exp_avg_sq"])


def test_use_muon_true_on_a_vector_is_a_named_error() -> None:
    from functional_fsdp.functional import muon
    from functional_fsdp.optim import Muon

    with pytest.raises(WholeMatrixError, match="use_muon=True"):
        Muon([{"params": [nn.Parameter(torch.ones(3))], "use_muon": True}])
    with pytest.raises(WholeMatrixError, match="2-D"):
        muon(0.02, use_muon=lambda p: True).init({"b": torch.ones(3)})
    assert issubclass(WholeMatrixError, ValueError)


def test_whole_matrix_refuses_a_shard_for_a_whole_state() -> None:
    """A state built from whole plain matrices never computes on a shard of one."""
    from functional_fsdp.functional import whole_matrix

    tx = whole_matrix(lambda g: g)
    state = tx.init({"w": torch.ones(4, 3)})
    with pytest.raises(WholeMatrixError, match="whole"):
        tx.update({"w": torch.ones(2, 3)}, state)


def test_owner_plan_is_round_robin_largest_first() -> None:
    from functional_fsdp.optim import assign_owners

    assert assign_owners([10, 40, 30, 20], 2) == (1, 0, 1, 0)
    assert assign_owners([5, 5, 5], 4) == (0, 1, 2)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", ["world2", "world4"])
def test_sharded_muon_matches_one_process(world: str, request: pytest.FixtureRequest) -> None:
    w = request.getfixturevalue(world)
    _check(w.run(_case_all, w.world_size), w.world_size)
