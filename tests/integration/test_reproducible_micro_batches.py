"""``ReproduciblePolicy`` counts a step's micro-batch backwards per rank: exactly ``V/N``.

Too few is refused at the optimizer step; one too many, and so also twice ``V/N``, is refused at
the backward that is one too many (its gradients would otherwise start a second step's
reduction and add to ``.grad`` silently); after an optimizer step or ``reset_iter_state()`` the
next step counts from zero. On 2 gloo ranks with ``V = 4`` (2 micro-batches per rank).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.multiprocess

V = 4


def _model() -> nn.Module:
    from functional_fsdp import ReproduciblePolicy, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    policy = ReproduciblePolicy(virtual_world_size=V)
    for i in (0, 2):
        fully_shard(model[i], reproducible=policy)
    fully_shard(model, reproducible=policy)
    return model


def _backward(model: nn.Module, k: int) -> None:
    g = torch.Generator().manual_seed(k)
    x = torch.randn(4, 8, generator=g)
    (model(x).pow(2).mean() / (V // 2)).backward()


def case_counting() -> list[str]:
    """What each misuse raises (the error's first words), in order."""
    from functional_fsdp import ReproducibilityError

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []

    def attempt(what: str, fn: Any) -> None:
        try:
            fn()
            seen.append(f"{what}: ok")
        except ReproducibilityError as e:
            text = str(e)
            seen.append(f"{what}: {text[text.index(':') + 2 : text.index(',')]}")

    # A complete step, then one backward too many: refused at that backward.
    _backward(model, 0)
    _backward(model, 1)
    attempt("third backward", lambda: _backward(model, 2))
    model.reset_iter_state()
    # Twice V/N backwards without a step: the third is refused, the fourth never runs.
    _backward(model, 0)
    _backward(model, 1)
    attempt("third of four", lambda: _backward(model, 2))
    model.reset_iter_state()
    # Too few: refused at the optimizer step.
    _backward(model, 0)
    attempt("step after one", opt.step)
    model.reset_iter_state()
    opt.zero_grad()
    # The usual loop goes on working: two steps of two backwards.
    for step in range(2):
        _backward(model, 2 * step)
        _backward(model, 2 * step + 1)
        attempt(f"step {step}", opt.step)
        opt.zero_grad()
    return seen


def test_micro_batch_backwards_are_counted_where_the_docs_say(world2) -> None:
    for seen in world2.run(case_counting):
        assert seen == [
            "third backward: a micro-batch backward after the step's 2 were reduced",
            "third of four: a micro-batch backward after the step's 2 were reduced",
            "step after one: 1 micro-batch backward(s) this step under ReproduciblePolicy",
            "step 0: ok",
            "step 1: ok",
        ], seen


def case_deep_copy_keeps_the_policy() -> list[str]:
    """``copy.deepcopy`` of a model under the policy counts micro-batches as the original."""
    import copy

    from functional_fsdp import ReproducibilityError

    model = copy.deepcopy(_model())
    _backward(model, 0)
    _backward(model, 1)
    try:
        _backward(model, 2)
        seen = ["third backward: ok"]
    except ReproducibilityError:
        seen = ["third backward: refused"]
    model.reset_iter_state()
    return seen


def test_a_deep_copy_keeps_the_policy(world2) -> None:
    for seen in world2.run(case_deep_copy_keeps_the_policy):
        assert seen == ["third backward: refused"], seen
