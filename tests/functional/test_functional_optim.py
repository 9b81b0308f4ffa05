"""functional_fsdp.functional.optim: AdamW and SGD equal torch's optimizers, step after step.

In one process on plain tensors. The functional optimizers use the same ``torch._foreach_*``
kernels in the same order as torch's ``foreach`` implementation, so they agree with
``torch.optim.*(foreach=True)`` bit for bit; torch's default on CPU is the single-tensor loop,
which runs the same per-tensor ops and agrees too.
"""

from __future__ import annotations

from typing import Any

import optree
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from functional_fsdp.core._tree import NAMESPACE, tree_leaves
from functional_fsdp.functional import AdamWState, Optimizer, SGDState, adamw, sgd

SHAPES = [(5, 3), (7,), (0, 4), (2, 3, 2)]


def _params(dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"p{i}": torch.randn(s, generator=gen).to(dtype) for i, s in enumerate(SHAPES)}


def _grads(
    params: dict[str, torch.Tensor], step: int, scale: float = 1.0
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return {k: (torch.randn(v.shape, generator=gen) * scale).to(v.dtype) for k, v in params.items()}


def _run_torch(
    make: Any, params: dict[str, torch.Tensor], steps: int, **kw: Any
) -> dict[str, torch.Tensor]:
    ps = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = make(list(ps.values()), **kw)
    for s in range(steps):
        for k, g in _grads(params, s).items():
            ps[k].grad = g
        opt.step()
    return {k: v.detach() for k, v in ps.items()}


def _run_functional(
    opt: Optimizer, params: dict[str, torch.Tensor], steps: int, *, donate: bool = False
) -> Any:
    state = opt.init(params)
    ps = params if not donate else {k: v.clone() for k, v in params.items()}
    for s in range(steps):
        ps, state = opt.update(_grads(params, s), state, ps, donate=donate)
    return ps, state


def _assert_same(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *, exact: bool
) -> None:
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape
        if exact:
            assert torch.equal(got[k], want[k]), k
        else:
            torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7)


lrs = st.sampled_from([1e-4, 1e-3, 3e-2, 0.1])
betas = st.tuples(st.sampled_from([0.0, 0.5, 0.9]), st.sampled_from([0.9, 0.99, 0.999]))
decays = st.sampled_from([0.0, 1e-2, 0.1])


# ---------------------------------------------------------------------------------- AdamW


@given(
    lr=lrs,
    betas=betas,
    eps=st.sampled_from([1e-8, 1e-6]),
    weight_decay=decays,
    steps=st.integers(1, 12),
)
def test_adamw_matches_torch(
    lr: float, betas: tuple[float, float], eps: float, weight_decay: float, steps: int
) -> None:
    params = _params()
    got, state = _run_functional(adamw(lr, betas, eps, weight_decay), params, steps)
    kw = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    _assert_same(got, _run_torch(torch.optim.AdamW, params, steps, foreach=True, **kw), exact=True)
    _assert_same(got, _run_torch(torch.optim.AdamW, params, steps, foreach=False, **kw), exact=True)
    assert state.count.item() == steps


def test_adamw_many_steps_matches_torch_default() -> None:
    params = _params(seed=3)
    got, _ = _run_functional(adamw(1e-3), params, 60)
    _assert_same(got, _run_torch(torch.optim.AdamW, params, 60, lr=1e-3), exact=True)


def test_adamw_moments_match_torch_state() -> None:
    params = _params(seed=4)
    _, state = _run_functional(adamw(1e-2, weight_decay=0.05), params, 5)
    ps = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = torch.optim.AdamW(list(ps.values()), lr=1e-2, weight_decay=0.05)
    for s in range(5):
        for k, g in _grads(params, s).items():
            ps[k].grad = g
        opt.step()
    for k, p in ps.items():
        st_ = opt.state[p]
        assert torch.equal(state.mu[k], st_["exp_avg"]) and torch.equal(
            state.nu[k], st_["exp_avg_sq"]
        )
        assert state.count.item() == st_["step"].item()


# ------------------------------------------------------------------------------------ SGD


@st.composite
def sgd_settings(draw: st.DrawFn) -> dict[str, Any]:
    momentum = draw(st.sampled_from([0.0, 0.5, 0.9]))
    nesterov = momentum > 0 and draw(st.booleans())
    dampening = 0.0 if nesterov else draw(st.sampled_from([0.0, 0.1, 0.5]))
    return dict(
        lr=draw(lrs),
        momentum=momentum,
        dampening=dampening,
        weight_decay=draw(decays),
        nesterov=nesterov,
    )


@given(kw=sgd_settings(), steps=st.integers(1, 12))
def test_sgd_matches_torch(kw: dict[str, Any], steps: int) -> None:
    params = _params()
    got, state = _run_functional(sgd(**kw), params, steps)
    _assert_same(got, _run_torch(torch.optim.SGD, params, steps, foreach=True, **kw), exact=True)
    _assert_same(got, _run_torch(torch.optim.SGD, params, steps, foreach=False, **kw), exact=True)
    assert (state.momentum is None) == (kw["momentum"] == 0)


def test_sgd_many_steps_nesterov() -> None:
    params = _params(seed=5)
    kw = dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3)
    got, _ = _run_functional(sgd(**kw), params, 50)
    _assert_same(got, _run_torch(torch.optim.SGD, params, 50, **kw), exact=True)


# ---------------------------------------------------------------- conformance (every optimizer)


OPTIMIZERS = {
    "adamw": lambda: adamw(1e-2, weight_decay=0.1),
    "adamw_no_decay": lambda: adamw(1e-2, weight_decay=0.0),
    "sgd": lambda: sgd(1e-2),
    "sgd_momentum": lambda: sgd(1e-2, momentum=0.9, dampening=0.1, weight_decay=1e-2),
    "sgd_nesterov": lambda: sgd(1e-2, momentum=0.9, nesterov=True),
}


@pytest.fixture(params=sorted(OPTIMIZERS))
def opt(request: pytest.FixtureRequest) -> Optimizer:
    return OPTIMIZERS[request.param]()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_dtype_and_structure_are_kept(opt: Optimizer, dtype: torch.dtype) -> None:
    params = _params(dtype)
    state = opt.init(params)
    spec0 = optree.tree_structure(state, namespace=NAMESPACE)
    for s in range(3):
        params, state = opt.update(_grads(params, s), state, params)
        assert optree.tree_structure(state, namespace=NAMESPACE) == spec0
        assert all(
            params[k].dtype == dtype and params[k].shape == torch.Size(sh)
            for k, sh in zip(params, SHAPES)
        )
        assert all(t.dtype in (dtype, torch.float32) for t in tree_leaves(state))


def test_update_does_not_modify_its_inputs(opt: Optimizer) -> None:
    params = _params()
    state = opt.init(params)
    params, state = opt.update(_grads(params, 0), state, params)  # non-trivial state
    grads = _grads(params, 1)
    before = [t.clone() for t in tree_leaves([params, state, grads])]
    new_params, new_state = opt.update(grads, state, params)
    after = tree_leaves([params, state, grads])
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    assert all(a is not b for a, b in zip(tree_leaves(new_params), tree_leaves(params)))
    assert not any(a is b for a, b in zip(tree_leaves(new_state), tree_leaves(state)))


def test_donate_updates_in_place_with_the_same_numbers(opt: Optimizer) -> None:
    params = _params()
    want, want_state = _run_functional(opt, params, 4)
    got, got_state = _run_functional(opt, params, 4, donate=True)
    _assert_same(got, want, exact=True)
    for a, b in zip(tree_leaves(got_state), tree_leaves(want_state)):
        assert torch.equal(a, b)
    # Donation reuses the buffers: the parameters come back as the very tensors passed in.
    ps = {k: v.clone() for k, v in params.items()}
    state = opt.init(ps)
    new_ps, new_state = opt.update(_grads(ps, 0), state, ps, donate=True)
    assert all(new_ps[k] is ps[k] for k in ps)
    assert new_state.count is state.count


def test_empty_tree_is_a_no_op(opt: Optimizer) -> None:
    state = opt.init({})
    params, state = opt.update({}, state, {})
    assert params == {} and state.count.item() == 1


def test_structure_mismatch_is_an_error(opt: Optimizer) -> None:
    params = _params()
    state = opt.init(params)
    with pytest.raises(ValueError, match="structure"):
        opt.update({"p0": params["p0"]}, state, params)


def test_learning_rate_schedule_gets_the_step_count() -> None:
    params = _params()
    seen: list[int] = []

    def schedule(count: int) -> float:
        seen.append(count)
        return 1e-2 * 0.5**count

    got, _ = _run_functional(adamw(schedule), params, 4)
    assert seen == [0, 1, 2, 3]
    ps = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = torch.optim.AdamW(list(ps.values()), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda c: 0.5**c)
    for s in range(4):
        for k, g in _grads(params, s).items():
            ps[k].grad = g
        opt.step()
        sched.step()
    _assert_same(got, {k: v.detach() for k, v in ps.items()}, exact=True)


def test_states_are_frozen_pytrees() -> None:
    params = _params()
    for state in (adamw(1e-3).init(params), sgd(1e-3, momentum=0.9).init(params)):
        assert isinstance(state, (AdamWState, SGDState))
        with pytest.raises(AttributeError):
            state.count = torch.ones(())  # type: ignore[misc]
        assert len(tree_leaves(state)) == 1 + len(params) * (
            2 if isinstance(state, AdamWState) else 1
        )


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: adamw(-1.0), "lr"),
        (lambda: adamw(1e-3, betas=(1.0, 0.9)), "betas"),
        (lambda: adamw(1e-3, eps=-1.0), "eps"),
        (lambda: adamw(1e-3, weight_decay=-0.1), "weight_decay"),
        (lambda: sgd(1e-3, momentum=-0.5), "momentum"),
        (lambda: sgd(1e-3, nesterov=True), "Nesterov"),
        (lambda: sgd(1e-3, momentum=0.9, dampening=0.1, nesterov=True), "Nesterov"),
        (lambda: sgd(1e-3, weight_decay=-1.0), "weight_decay"),
    ],
)
def test_bad_hyper_parameters_raise(make: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()
