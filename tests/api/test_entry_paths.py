"""Every entry path against the truth: a single-process reference on the same seed and data.

Each rank runs half of a global batch; the reference runs the whole batch in one process with
the unsharded model (a mean loss, so FSDP's gradient averaging equals the reference's gradient).
The paths: ``loss.backward()``, ``torch.func.functional_call`` with the module's own parameters
(taken fresh, after a training step, after an evaluation forward, after a training forward) and
with substituted ones, ``torch.func.grad``, ``torch.autograd.grad`` over ``model.parameters()``
taken after the forward, and the functional step. Then the legal programs that gave wrong numbers
or a broken state without an error: an evaluation forward before the optimizer is
built or between ``backward()`` and ``step()``, the EMA recipe, a parameter with fewer rows than
ranks beside an empty one, and training on after a forward that raised. Where torch FSDP2 is
wrong on the same program the test says so by running it too (docs/fsdp2_mapping.md).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
from _dist import World

pytestmark = pytest.mark.multiprocess

WS = 2
LR = 0.1
TOL = 1e-6  # fp32: the reference sums the batch in one order, the ranks in two halves


class Block(nn.Module):
    def __init__(self, odd: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        # odd=True: a parameter with fewer dim-0 rows than ranks beside an empty one (both in
        # this block's group; the empty one is the first trainable parameter of the group).
        self.empty = nn.Parameter(torch.randn(0, 8)) if odd else None
        self.one = nn.Parameter(torch.randn(1, 8)) if odd else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.lin(x))
        if self.one is not None and self.empty is not None:
            y = y + self.one + self.empty.sum(0)
        return y


class Net(nn.Module):
    """Blocks sharded first, then the root, whose own group holds emb, head.weight, head.bias."""

    def __init__(self, odd: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.blocks = nn.ModuleList([Block(odd), Block()])
        self.head = nn.Linear(8, 11)

    def generate(self, idx: torch.Tensor, fail: bool = False) -> torch.Tensor:
        """A forward method other than ``forward`` (registered with
        ``register_fsdp_forward_method``) that calls the blocks directly."""
        x = self.emb(idx)
        if fail:
            raise RuntimeError("user error in generate")
        for b in self.blocks:
            x = b(x)
        return self.head(x)

    def forward(self, idx: torch.Tensor, fail: bool = False) -> torch.Tensor:
        x = self.emb(idx)
        for i, b in enumerate(self.blocks):
            x = b(x)
            if fail and i == 0:
                raise RuntimeError("user error in forward")
        return self.head(x)


def _build(which: str, odd: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = Net(odd)
    if which == "ref":
        return model
    if which == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from functional_fsdp import fully_shard
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    return model


def _rank(which: str) -> int | None:
    import torch.distributed as dist

    return None if which == "ref" else dist.get_rank()


def _data(which: str, seed: int) -> torch.Tensor:
    """The global batch (reference) or this rank's half of it."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 11, (2 * WS, 5), generator=g)
    r = _rank(which)
    return x if r is None else x[2 * r : 2 * r + 2]


def _loss(out: torch.Tensor) -> torch.Tensor:
    return (out.float() ** 2).mean()


def _full(t: Any) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: _full(p) for n, p in model.named_parameters()}


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else _full(p.grad) for n, p in model.named_parameters()}


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR)


# ------------------------------------------------------------------ every entry path


def _entry_paths(which: str) -> dict[str, Any]:
    from torch.func import functional_call

    out: dict[str, Any] = {}
    x = _data(which, 1)

    model = _build(which)
    _loss(model(x)).backward()
    out["backward"] = _grads(model)

    # functional_call with the module's own parameters, taken at four points.
    for when in ("fresh", "after_step", "after_eval", "after_train_forward"):
        model = _build(which)
        if when == "after_step":
            _loss(model(_data(which, 0))).backward()
            _sgd(model).step()
            model.zero_grad()
        elif when == "after_eval":
            with torch.no_grad():
                model(_data(which, 0))
        elif when == "after_train_forward":
            loss = _loss(model(_data(which, 0)))
        params = dict(model.named_parameters())
        if when == "after_train_forward":
            loss.backward()
            model.zero_grad()
        _loss(functional_call(model, params, (x,))).backward()
        out[f"functional_call_own_{when}"] = _grads(model)
        # A second call with the own parameters after one with substituted tensors.
        subs = {k: v.detach().clone() for k, v in model.named_parameters()}
        with torch.no_grad():
            functional_call(model, subs, (x,))
        model.zero_grad()
        _loss(functional_call(model, params, (x,))).backward()
        out[f"functional_call_own_again_{when}"] = _grads(model)

    model = _build(which)
    subs = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    names = list(subs)
    gs = torch.autograd.grad(_loss(functional_call(model, subs, (x,))), list(subs.values()))
    out["functional_call_substituted"] = {n: _full(g) for n, g in zip(names, gs)}

    model = _build(which)
    params = {k: v.detach() for k, v in model.named_parameters()}
    gs = torch.func.grad(lambda p: _loss(functional_call(model, p, (x,))))(params)
    out["torch_func_grad"] = {n: _full(g) for n, g in gs.items()}

    model = _build(which)
    loss = _loss(model(x))
    named = list(model.named_parameters())  # taken after the forward
    gs = torch.autograd.grad(loss, [p for _, p in named])
    out["autograd_grad_params_after_forward"] = {n: _full(g) for (n, _), g in zip(named, gs)}
    return out


def _functional_step() -> dict[str, torch.Tensor]:
    from functional_fsdp.functional import init, make_train_step, sgd

    model = _build("ours")
    opt = sgd(LR)
    state = init(model, opt)
    step = make_train_step(model, lambda m, b: _loss(m(b)), opt)
    state, _ = step(state, _data("ours", 1))
    return {n: _full(p) for n, p in state.params.items()}


def _close(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert set(got) == set(want), what
    for n in want:
        assert got[n] is not None, f"{what}: {n} has no gradient"
        assert torch.allclose(got[n], want[n], atol=TOL, rtol=0), (
            what,
            n,
            (got[n] - want[n]).abs().max().item(),
        )


class TestEveryEntryPath:
    """Every parameter's gradient, the root's included, equals the single-process reference."""

    def test_gradients_equal_the_reference(self, world2: World) -> None:
        ref = _entry_paths("ref")  # the same programs, unsharded, on the whole batch
        for rank_out in world2.run(_entry_paths, "ours"):
            assert set(rank_out) == set(ref)
            for what, grads in rank_out.items():
                _close(grads, ref[what], what)

    def test_functional_step_equals_one_sgd_step_of_the_reference(self, world2: World) -> None:
        model = _build("ref")
        _loss(model(_data("ref", 1))).backward()
        _sgd(model).step()
        want = _params(model)
        for got in world2.run(_functional_step):
            _close(got, want, "functional step")


# ------------------------------------------------------------------ evaluation forwards


def _eval_then_build_optimizer(which: str) -> dict[str, torch.Tensor]:
    """Item 2: an evaluation forward, then the optimizer is built, then two SGD steps."""
    model = _build(which)
    with torch.no_grad():
        model(_data(which, 2))
    if which == "ours":
        from torch.distributed.tensor import DTensor

        assert all(isinstance(p, DTensor) for p in model.parameters())
    opt = _sgd(model)
    for s in range(2):
        _loss(model(_data(which, 3 + s))).backward()
        opt.step()
        opt.zero_grad()
    return _params(model)


def _eval_between_backward_and_step(which: str) -> dict[str, torch.Tensor]:
    """Item 3: an evaluation loss logged between backward() and step(); optimizer rebuilt."""
    model = _build(which)
    for s in range(3):
        opt = _sgd(model)
        _loss(model(_data(which, 3 + s))).backward()
        with torch.no_grad():
            model(_data(which, 9))
        opt.step()
        opt.zero_grad()
    return _params(model)


def _max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max((got[n] - want[n]).abs().max().item() for n in want)


@pytest.mark.parametrize("program", [_eval_then_build_optimizer, _eval_between_backward_and_step])
def test_evaluation_forwards_leave_every_group_sharded(world2: World, program: Any) -> None:
    want = program("ref")
    for got in world2.run(program, "ours"):
        _close(got, want, program.__name__)
    # torch FSDP2 trains the root's throwaway unsharded tensors here (documented difference).
    theirs = world2.run(program, "torch")
    assert _max_diff(theirs[0], want) > 1e-3


def _ema_recipe() -> list[float]:
    """Item 10: docs/summon_and_checkpoints.md's EMA recipe, with the EMA evaluated first."""
    model = _build("ours")
    ema = copy.deepcopy(model)
    x = _data("ours", 5)
    with torch.no_grad():
        ema(x)  # evaluate the EMA
        for pe, p in zip(ema.parameters(), model.parameters()):
            pe.lerp_(p, 1 - 0.9)
    _loss(model(x)).backward()
    _sgd(model).step()
    with torch.no_grad():
        for pe, p in zip(ema.parameters(), model.parameters()):
            pe.lerp_(p, 1 - 0.9)
        return [_full(p).sum().item() for p in ema.parameters()]


def test_the_ema_recipe_works_after_evaluating_the_ema(world2: World) -> None:
    model = _build("ref")
    ema = copy.deepcopy(model)
    x = _data("ref", 5)
    _loss(model(x)).backward()
    _sgd(model).step()
    with torch.no_grad():
        for pe, p in zip(ema.parameters(), model.parameters()):
            pe.lerp_(p, 1 - 0.9)
    want = [p.sum().item() for p in ema.parameters()]
    for got in world2.run(_ema_recipe):
        assert got == pytest.approx(want, abs=1e-5)


# ------------------------------------------------------------------ legal shapes, faults


def _odd_shapes(which: str) -> dict[str, torch.Tensor]:
    """Item 6: one row on two ranks beside an empty parameter in one group, trained."""
    model = _build(which, odd=True)
    opt = _sgd(model)
    for s in range(2):
        _loss(model(_data(which, s))).backward()
        opt.step()
        opt.zero_grad()
    return _params(model)


def test_fewer_rows_than_ranks_beside_an_empty_parameter_trains(world2: World) -> None:
    want = _odd_shapes("ref")
    for got in world2.run(_odd_shapes, "ours"):
        _close(got, want, "odd shapes")


def _train_on_after_a_failed_forward(
    which: str, method: str = "forward"
) -> dict[str, torch.Tensor]:
    """Item 7: a forward (or a registered forward method) raises on every rank; training goes
    on without reset_iter_state()."""
    model = _build(which)
    if which == "ours" and method == "generate":
        from functional_fsdp import register_fsdp_forward_method

        register_fsdp_forward_method(model, "generate")
    opt = _sgd(model)
    for s in range(3):
        if s == 1 and which != "ref":
            with pytest.raises(RuntimeError, match="user error"):
                run = model if method == "forward" else model.generate
                run(_data(which, s), fail=True)
        _loss(model(_data(which, s))).backward()
        opt.step()
        opt.zero_grad()
    return _params(model)


@pytest.mark.parametrize("method", ["forward", "generate"])
def test_training_goes_on_after_a_forward_that_raised(world2: World, method: str) -> None:
    want = _train_on_after_a_failed_forward("ref")
    for got in world2.run(_train_on_after_a_failed_forward, "ours", method):
        _close(got, want, f"after a failed {method}")


def _train_on_after_a_failed_backward(which: str) -> dict[str, torch.Tensor]:
    """A backward raises on every rank (a user hook); the user drops the step's gradients
    with zero_grad() and trains on without reset_iter_state()."""
    model = _build(which)
    opt = _sgd(model)
    for s in range(3):
        if s == 1 and which != "ref":
            out = model(_data(which, s))

            def fail(grad: torch.Tensor) -> torch.Tensor:
                raise RuntimeError("user error in backward")

            out.register_hook(fail)
            with pytest.raises(RuntimeError, match="user error in backward"):
                _loss(out).backward()
            opt.zero_grad()
        _loss(model(_data(which, s))).backward()
        opt.step()
        opt.zero_grad()
    return _params(model)


def test_training_goes_on_after_a_backward_that_raised(world2: World) -> None:
    want = _train_on_after_a_failed_backward("ref")
    for got in world2.run(_train_on_after_a_failed_backward, "ours"):
        _close(got, want, "after a failed backward")
