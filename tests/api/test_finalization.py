"""FSDP2 2.15's manual backward finalization on our modules, and the FSDP2 state that torch's
own code reads through ``torch.distributed.fsdp.fully_shard.state(module)``.

Manual finalization is compared with FSDP2 (torch 2.13, which lacks it) doing the same
accumulation the usual way: no-sync backwards, then a synced last backward.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _dist import World
from _llama import Llama, LlamaConfig, loss_fn, tokens

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

CFG = LlamaConfig(n_layers=2)
MICRO = 3


def _model(which: str) -> Llama:
    if which == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from functional_fsdp import fully_shard
    torch.manual_seed(0)
    model = Llama(CFG)
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    return model


def _step_manual(model: Llama, step: int, async_op: bool) -> list[float]:
    """As torch 2.15's pipeline stage drives a stage: manual mode, no-sync backwards that
    keep the parameters unsharded, then one finalization."""
    model.set_manual_backward_finalization(True)
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(False)
    losses = []
    for mb in range(MICRO):
        x, y = tokens(CFG, 2, seed=1000 * step + 10 * mb + dist.get_rank())
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(loss.item())
    model.set_requires_gradient_sync(True)
    model.set_reshard_after_backward(True)
    handle = model.finalize_backward(async_op=async_op)
    if async_op:
        handle.wait()
    else:
        assert handle is None
    model.set_manual_backward_finalization(False)
    return losses


def _step_usual(model: Llama, step: int) -> list[float]:
    losses = []
    for mb in range(MICRO):
        model.set_requires_gradient_sync(mb == MICRO - 1)
        x, y = tokens(CFG, 2, seed=1000 * step + 10 * mb + dist.get_rank())
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(loss.item())
    return losses


def _train(model: Llama, step_fn) -> tuple[list[float], dict[str, torch.Tensor]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(2):
        losses += step_fn(model, step)
        opt.step()
        opt.zero_grad()
    return losses, {n: p.full_tensor().detach() for n, p in model.named_parameters()}


def case_manual_finalization() -> dict[str, object]:
    """FSDP2's usual accumulation; ours finalized manually, synchronously and asynchronously."""
    return {
        "torch": _train(_model("torch"), _step_usual),
        "sync": _train(_model("ours"), lambda m, s: _step_manual(m, s, async_op=False)),
        "async": _train(_model("ours"), lambda m, s: _step_manual(m, s, async_op=True)),
    }


def test_manual_finalization_matches_fsdp2_accumulation(world2: World) -> None:
    """set_manual_backward_finalization + finalize_backward (both async_op values): FSDP2's
    losses and parameters, bit for bit."""
    for res in world2.run(case_manual_finalization):
        t_losses, t_params = res["torch"]
        for key in ("sync", "async"):
            losses, params = res[key]
            assert losses == t_losses, key
            assert all(torch.equal(params[k], t_params[k]) for k in t_params), key


def case_finalization_errors() -> dict[str, str]:
    """Each misuse FSDP2 2.15 refuses, refused here (before any collective)."""
    from functional_fsdp import fully_shard

    out: dict[str, str] = {}
    model = _model("ours")
    block = model.layers["0"]
    assert model.finalize_backward() is None  # before the first forward: a no-op
    model.finalize_backward(async_op=True).wait()
    x, y = tokens(CFG, 2, seed=dist.get_rank())
    loss_fn(model(x), y).backward()
    for name, call in {
        "not_manual": lambda: model.finalize_backward(),
        "non_root": lambda: block.set_manual_backward_finalization(True),
        "finalize_non_root": lambda: block.finalize_backward(),
    }.items():
        try:
            call()
            out[name] = "no error"
        except RuntimeError as e:
            out[name] = type(e).__name__
    model.set_manual_backward_finalization(True)
    loss_fn(model(x), y).backward()
    handle = model.finalize_backward(async_op=True)
    try:
        model.finalize_backward(async_op=True)
        out["twice"] = "no error"
    except RuntimeError as e:
        out["twice"] = type(e).__name__
    handle.wait()
    loss_fn(model(x), y).backward()
    handle = model.finalize_backward(async_op=True)
    handle.wait()  # reductions land before a reset can drop them
    model.reset_iter_state()
    model.set_manual_backward_finalization(False)
    model.set_keep_unsharded_storage(True)  # accepted (no effect here)
    model.set_keep_unsharded_storage(False, recurse=False)

    # torch's own fully_shard.state finds our modules' state; torch's fully_shard refuses them
    state = torch.distributed.fsdp.fully_shard.state(model)
    out["state_groups"] = str(
        [len(s._fsdp_param_groups) for s in state._state_ctx.all_states]  # type: ignore[union-attr]
    )
    try:
        torch.distributed.fsdp.fully_shard(block)
        out["torch_twice"] = "no error"
    except AssertionError:
        out["torch_twice"] = "AssertionError"
    copied = copy.deepcopy(model)
    out["copy_state_is_own"] = str(
        torch.distributed.fsdp.fully_shard.state(copied)._module is copied  # type: ignore[union-attr]
    )
    list_model = Llama(CFG)
    fully_shard([list_model.norm, list_model.output])
    fully_shard(list_model)
    loss_fn(list_model(x), y).backward()
    state = torch.distributed.fsdp.fully_shard.state(list_model)
    out["list_groups"] = str(
        [len(s._fsdp_param_groups) for s in state._state_ctx.all_states]  # type: ignore[union-attr]
    )
    return out


def test_finalization_misuse_and_torch_state(world2: World) -> None:
    """Manual finalization's errors are RuntimeErrors as FSDP2 2.15's; torch's
    ``fully_shard.state`` lists each group once (a list-form group under its first module)."""
    for out in world2.run(case_finalization_errors):
        assert out["not_manual"] == "StateError"
        assert out["non_root"] == "StateError"
        assert out["finalize_non_root"] == "StateError"
        assert out["twice"] == "StateError"
        assert out["state_groups"] == "[1, 1, 1]"  # root, two blocks
        assert out["torch_twice"] == "AssertionError"
        assert out["copy_state_is_own"] == "True"
        assert out["list_groups"] == "[1, 1, 0]"  # root, [norm, output] once
