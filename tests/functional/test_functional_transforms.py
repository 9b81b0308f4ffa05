"""Composable transformations, schedules, inject_hyperparams and pytrees (one process).

The bit-exact claims are against ``torch.optim`` on plain tensors; the same chains on the sharded
model over 2 ranks are in ``tests/functional/test_functional_api.py``.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import optree
import pytest
import torch
import torch.utils._pytree as torch_pytree

from functional_fsdp.core._tree import NAMESPACE, tree_leaves
from functional_fsdp.functional import (
    AdamWState,
    GradientTransformation,
    InjectHyperparamsState,
    Optimizer,
    TrainState,
    adamw,
    add_decayed_weights,
    apply_updates,
    as_optimizer,
    chain,
    clip_by_global_norm,
    global_norm,
    identity,
    inject_hyperparams,
    scale,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_schedule,
    schedules,
    set_hyperparams,
    sgd,
)

SHAPES = [(5, 3), (7,), (0, 4), (2, 3, 2)]


def _params(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"p{i}": torch.randn(s, generator=gen) for i, s in enumerate(SHAPES)}


def _grads(step: int, scale_: float = 1.0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return {f"p{i}": torch.randn(s, generator=gen) * scale_ for i, s in enumerate(SHAPES)}


def _torch_run(
    params: dict[str, torch.Tensor], steps: int, *, clip: float | None = None, lrs: Any = None
) -> dict[str, torch.Tensor]:
    ps = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = torch.optim.AdamW(list(ps.values()), lr=1e-2, weight_decay=0.1)
    for s in range(steps):
        if lrs is not None:
            opt.param_groups[0]["lr"] = lrs[s]
        for k, g in _grads(s, 3.0).items():
            ps[k].grad = g
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(list(ps.values()), clip)
        opt.step()
    return {k: v.detach() for k, v in ps.items()}


def _run(opt: Any, params: dict[str, torch.Tensor], steps: int, **kw: Any) -> Any:
    opt = as_optimizer(opt)
    state = opt.init(params)
    for s in range(steps):
        params, state = opt.update(_grads(s, 3.0), state, params, **kw)
    return params, state


# ---------------------------------------------------------------- bit-exact against torch


@pytest.mark.parametrize("clip", [0.5, 1e6])
def test_chain_clip_then_adamw_is_bit_exact_with_clip_grad_norm_and_adamw(clip: float) -> None:
    params = _params()
    got, _ = _run(chain(clip_by_global_norm(clip), adamw(1e-2, weight_decay=0.1)), params, 6)
    want = _torch_run(params, 6, clip=clip)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_inject_hyperparams_lr_change_is_bit_exact_with_param_group_lr() -> None:
    params = _params(1)
    lrs = [1e-2, 1e-2, 5e-3, 5e-3, 2e-3]
    opt = inject_hyperparams(adamw)(lr=1e-2, weight_decay=0.1)
    state = opt.init(params)
    ps = params
    for s, lr in enumerate(lrs):
        state = set_hyperparams(state, lr=lr)
        ps, state = opt.update(_grads(s, 3.0), state, ps)
        assert opt.learning_rate(state) == lr
    want = _torch_run(params, len(lrs), lrs=lrs)
    assert all(torch.equal(ps[k], want[k]) for k in want)
    assert isinstance(state, InjectHyperparamsState) and state.count.item() == len(lrs)


def test_schedule_as_lr_is_bit_exact_with_lambda_lr() -> None:
    params = _params(2)
    sched = schedules.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=2, decay_steps=6)
    got, state = _run(adamw(sched, weight_decay=0.1), params, 6)
    want = _torch_run(params, 6, lrs=[sched(i) for i in range(6)])
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert adamw(sched).learning_rate(state) == sched(5)  # type: ignore[misc]


def test_transformation_chain_matches_adamw_to_rounding() -> None:
    params = _params(3)
    tx = chain(scale_by_adam(), add_decayed_weights(0.1), scale_by_learning_rate(1e-2))
    assert isinstance(tx, GradientTransformation)
    got, _ = _run(tx, params, 8)
    want = _torch_run(params, 8)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_chain_of_clip_and_sgd_with_momentum_is_bit_exact() -> None:
    params = _params(4)
    got, _ = _run(chain(clip_by_global_norm(0.3), sgd(0.1, momentum=0.9)), params, 5)
    ps = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = torch.optim.SGD(list(ps.values()), lr=0.1, momentum=0.9)
    for s in range(5):
        for k, g in _grads(s, 3.0).items():
            ps[k].grad = g
        torch.nn.utils.clip_grad_norm_(list(ps.values()), 0.3)
        opt.step()
    assert all(torch.equal(got[k], ps[k].detach()) for k in ps)


# --------------------------------------------------------- conformance (every transformation)

TRANSFORMS = {
    "identity": identity,
    "scale": lambda: scale(-0.1),
    "scale_by_schedule": lambda: scale_by_schedule(lambda c: -0.1 / (1 + c)),
    "scale_by_adam": scale_by_adam,
    "add_decayed_weights": lambda: add_decayed_weights(0.1),
    "clip_by_global_norm": lambda: clip_by_global_norm(1.0),
    "scale_by_learning_rate": lambda: scale_by_learning_rate(schedules.constant_schedule(0.1)),
    "chain": lambda: chain(clip_by_global_norm(1.0), scale_by_adam(), scale(-1e-3)),
    "inject": lambda: inject_hyperparams(scale_by_adam)(b1=0.9, b2=0.99),
}


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_transformation_conformance(name: str, dtype: torch.dtype) -> None:
    tx = TRANSFORMS[name]()
    params = {k: v.to(dtype) for k, v in _params().items()}
    state = tx.init(params)
    spec = optree.tree_structure(state, namespace=NAMESPACE)
    for s in range(3):
        grads = {k: v.to(dtype) for k, v in _grads(s).items()}
        before = [t.clone() for t in tree_leaves([grads, state, params])]
        updates, new_state = tx.update(grads, state, params)
        after = tree_leaves([grads, state, params])
        assert all(torch.equal(a, b) for a, b in zip(after, before)), "inputs changed"
        assert optree.tree_structure(new_state, namespace=NAMESPACE) == spec
        assert all(
            updates[k].dtype == dtype and updates[k].shape == params[k].shape for k in params
        )
        params, state = apply_updates(params, updates), new_state


def test_an_optimizer_must_be_last_in_a_chain_and_torch_optimizers_are_refused() -> None:
    with pytest.raises(TypeError, match="last element"):
        chain(adamw(1e-3), scale(1.0))
    p = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(TypeError, match=r"torch optimizer \(AdamW\).*adamw\(lr"):
        chain(clip_by_global_norm(1.0), torch.optim.AdamW([p]))
    assert isinstance(chain(clip_by_global_norm(1.0), adamw(1e-3)), Optimizer)


def test_list_of_grads_for_a_dict_of_params_is_a_clear_error() -> None:
    params = _params()
    opt = adamw(1e-3)
    state = opt.init(params)
    with pytest.raises(ValueError, match="parameters are a dict, so pass grads as a dict"):
        opt.update(list(_grads(0).values()), state, params)
    with pytest.raises(ValueError, match="pass updates as a dict"):
        apply_updates(params, list(params.values()))


def test_global_norm_of_plain_tensors() -> None:
    g = _grads(0)
    want = torch.cat([t.reshape(-1) for t in g.values()]).norm()
    torch.testing.assert_close(global_norm(g), want)


# ------------------------------------------------------------------------------- schedules


def test_schedules() -> None:
    lin = schedules.linear_schedule(1.0, 0.0, 4, transition_begin=2)
    assert [lin(i) for i in range(8)] == [1.0, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    cos = schedules.cosine_decay_schedule(2.0, 10, alpha=0.1)
    assert cos(0) == 2.0 and math.isclose(cos(10), 0.2) and math.isclose(cos(20), 0.2)
    assert math.isclose(cos(5), 2.0 * (0.9 * 0.5 + 0.1))
    w = schedules.warmup_cosine_decay_schedule(0.0, 1.0, 4, 14, end_value=0.1)
    assert [w(i) for i in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert math.isclose(w(14), 0.1) and w(9) < w(5)
    exp = schedules.exponential_decay(1.0, 2, 0.5, staircase=True, end_value=0.2)
    assert [exp(i) for i in range(7)] == [1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 0.2]
    with pytest.raises(ValueError, match="decay_steps"):
        schedules.warmup_cosine_decay_schedule(0.0, 1.0, 5, 5)


# --------------------------------------------------------------------------------- pytrees


def test_records_are_pytrees_in_optree_default_namespace_and_torch() -> None:
    params = _params()
    opt = inject_hyperparams(adamw)(lr=1e-3)
    ts = TrainState(params, chain(clip_by_global_norm(1.0), opt).init(params), torch.zeros(()))
    n = len(tree_leaves(ts))
    assert n == len(optree.tree_leaves(ts)) == len(torch_pytree.tree_leaves(ts))
    doubled = torch_pytree.tree_map(lambda t: t * 2, ts)
    assert isinstance(doubled, TrainState) and torch.equal(doubled.params["p0"], params["p0"] * 2)
    assert isinstance(optree.tree_map(lambda t: t, ts), TrainState)
    inner = ts.opt_state[1]
    assert isinstance(inner, InjectHyperparamsState) and isinstance(inner.inner_state, AdamWState)
    moved = set_hyperparams(ts, lr=0.5)  # finds the state inside a TrainState's chain
    assert moved.opt_state[1].hyperparams["lr"].item() == 0.5
    assert ts.opt_state[1].hyperparams["lr"].item() == 1e-3
    edited = attrs.evolve(ts, step=torch.ones(()))
    assert edited.step.item() == 1 and ts.step.item() == 0
    with pytest.raises(KeyError, match="momentum"):
        set_hyperparams(ts, momentum=0.1)


def test_sharded_state_local_and_local_grad_by_name() -> None:
    from functional_fsdp import reduce_grad, shard
    from functional_fsdp.testing import SimulatedWorld

    full = {"w": torch.randn(5, 3), "b": torch.randn(5)}
    s = shard(full, world_size=2, rank=1)
    assert torch.equal(s.local("w"), s.local(1)) and torch.equal(s.local("b"), s.local(0))
    with pytest.raises(KeyError, match=r"no parameter named 'x'.*\['b', 'w'\]"):
        s.local("x")
    world = SimulatedWorld(2)

    def per_rank(comm: Any) -> bool:
        st = shard(full, world_size=2, rank=comm.rank)
        g = reduce_grad({"w": torch.ones(5, 3), "b": torch.ones(5)}, st, comm)
        return torch.equal(g.local_grad("w"), g.local_grad(1)) and g.local_grad("b") is not None

    assert world.run(per_rank) == [True, True]
