"""No silent wrong results: stale unsharded caches and FSDP2's observable state contracts.

Every case runs on a real 2-rank gloo world and compares against torch's own FSDP2 doing the
same, or against a plain unsharded model that went through the same sequence of operations.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import World
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.multiprocess

_CFG = dict(vocab=64, dim=32, n_layers=2, n_heads=2, seq=16)


def _models(use_torch: bool = False, *, root_raf: Any = None, block_raf: Any = None) -> Any:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from functional_fsdp import fully_shard
    from functional_fsdp.testing.models import GPT, GPTConfig

    fs = torch_fully_shard if use_torch else fully_shard
    torch.manual_seed(0)
    cfg = GPTConfig(**_CFG)
    model, other = GPT(cfg), GPT(cfg)
    ref, ref_other = copy.deepcopy(model), copy.deepcopy(other)
    for m in (model, other):
        for b in m.blocks:
            fs(b, reshard_after_forward=block_raf)
        fs(m, reshard_after_forward=root_raf)
    return cfg, model, other, ref, ref_other


def _batch(cfg: Any, rank: int, step: int = 0) -> Any:
    from functional_fsdp.testing.models import synthetic_batch

    return synthetic_batch(cfg, 2, seed=100 * step + rank)


# ----------------------------------------------------------------------- stale caches


def _stale_after(kind: str, use_torch: bool) -> tuple[float, float]:
    """A no-grad forward (the root keeps its full parameters), then a write to the sharded
    parameters by ``kind``, then a forward: returns (loss, plain reference loss)."""
    from functional_fsdp import summon_full_params
    from functional_fsdp.functional import apply_to_module, init, sgd

    cfg, model, other, ref, ref_other = _models(use_torch)
    sharded = list(model.parameters())
    x, y = _batch(cfg, dist.get_rank())
    with torch.no_grad():
        model.loss(x, y)
        if kind == "load_state_dict":
            model.load_state_dict(other.state_dict())
            ref.load_state_dict(ref_other.state_dict())
        elif kind == "apply_to_module":
            apply_to_module(init(other, sgd(0.1)), model)
            ref.load_state_dict(ref_other.state_dict())
        elif kind == "copy_":
            for p, o in zip(sharded, other.parameters()):
                p.copy_(o)
            ref.load_state_dict(ref_other.state_dict())
        elif kind == "optimizer":
            for p in sharded:
                p.grad = torch.ones_like(p)
            torch.optim.SGD(sharded, lr=0.1).step()
            for p in ref.parameters():
                p.sub_(0.1)
        elif kind == "summon":
            with summon_full_params(model):
                for p in model.parameters():
                    p.mul_(0.5)
            for p in ref.parameters():
                p.mul_(0.5)
        return model.loss(x, y).item(), ref.loss(x, y).item()


_KINDS = ["load_state_dict", "apply_to_module", "copy_", "optimizer", "summon"]


def _all_stale_cases() -> dict[str, tuple[float, float]]:
    return {k: _stale_after(k, False) for k in _KINDS}


def test_writes_to_sharded_params_invalidate_the_unsharded_cache(world2: World) -> None:
    for rank_out in world2.run(_all_stale_cases):
        for kind, (got, want) in rank_out.items():
            assert got == pytest.approx(want, abs=1e-5), kind


def _torch_load_case() -> tuple[float, float]:
    return _stale_after("load_state_dict", True)


def test_load_state_dict_after_no_grad_forward_matches_fsdp2(world2: World) -> None:
    ours = world2.run(_stale_after, "load_state_dict", False)
    theirs = world2.run(_torch_load_case)
    for (o, want), (t, _) in zip(ours, theirs):
        assert o == t
        assert o == pytest.approx(want, abs=1e-5)


# ---------------------------------------------------- property: any sequence of operations

_OPS = ["fwd_nograd", "fwd_bwd", "step", "load", "apply", "summon", "reshard", "copy"]


def _run_sequence(ops: list[str], root_raf: Any, block_raf: Any) -> list[tuple[float, float]]:
    """Apply ``ops`` to a sharded model and a plain one; return (sharded, plain) losses of
    every forward and of a final no-grad forward."""
    from functional_fsdp import summon_full_params
    from functional_fsdp.functional import apply_to_module, init, sgd

    cfg, model, other, ref, ref_other = _models(root_raf=root_raf, block_raf=block_raf)
    rank, ws = dist.get_rank(), dist.get_world_size()
    sharded = list(model.parameters())
    opt = torch.optim.SGD(sharded, lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    out = []
    for i, op in enumerate([*ops, "fwd_nograd"]):
        x, y = _batch(cfg, rank, i)
        if op == "fwd_nograd":
            with torch.no_grad():
                out.append((model.loss(x, y).item(), ref.loss(x, y).item()))
        elif op == "fwd_bwd":
            loss = model.loss(x, y)
            loss.backward()
            total = sum(ref.loss(*_batch(cfg, r, i)) for r in range(ws)) / ws
            total.backward()  # type: ignore[union-attr]
            out.append((loss.item(), ref.loss(x, y).item()))
        elif op == "step":
            opt.step()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
        elif op in ("load", "apply"):
            with torch.no_grad():
                for p in other.parameters():
                    p.mul_(0.9)
                for p in ref_other.parameters():
                    p.mul_(0.9)
            if op == "load":
                model.load_state_dict(other.state_dict())
            else:
                apply_to_module(init(other, sgd(0.1)), model)
            ref.load_state_dict(ref_other.state_dict())
        elif op == "summon":
            with summon_full_params(model), torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01)
            with torch.no_grad():
                for p in ref.parameters():
                    p.add_(0.01)
        elif op == "reshard":
            model.reshard()
        elif op == "copy":
            with torch.no_grad():
                for p in sharded:
                    p.mul_(1.1)
                for p in ref.parameters():
                    p.mul_(1.1)
    return out


# No-grad forwards (which leave the root unsharded) are drawn half the time: the stale cases
# need one before a write.
_op = st.one_of(st.just("fwd_nograd"), st.sampled_from(_OPS))


@settings(max_examples=25, deadline=None)
@given(
    ops=st.lists(_op, min_size=1, max_size=6),
    root_raf=st.sampled_from([None, True, False]),
    block_raf=st.sampled_from([None, False]),
)
def test_next_forward_equals_a_plain_model_after_any_sequence(
    world2: World, ops: list[str], root_raf: Any, block_raf: Any
) -> None:
    for rank_out in world2.run(_run_sequence, ops, root_raf, block_raf):
        for j, (got, want) in enumerate(rank_out):
            assert got == pytest.approx(want, abs=2e-5), (ops, j)


# ------------------------------------------------------------------ FSDP2 state contracts


def _registered_kinds(use_torch: bool) -> dict[str, Any]:
    """Which parameters are on the modules (DTensor or plain, and their shapes) at each point."""
    from torch.distributed.tensor import DTensor

    cfg, model, *_ = _models(use_torch)

    def kinds() -> list[tuple[str, bool, tuple[int, ...]]]:
        return [(n, isinstance(p, DTensor), tuple(p.shape)) for n, p in model.named_parameters()]

    x, y = _batch(cfg, dist.get_rank())
    out: dict[str, Any] = {"init": kinds()}
    with torch.no_grad():
        model.loss(x, y)
    out["after_no_grad_forward"] = kinds()
    model.reshard()
    out["after_reshard"] = kinds()
    model.unshard()
    out["after_unshard"] = kinds()
    model.reshard()
    loss = model.loss(x, y)
    out["after_forward"] = kinds()
    loss.backward()
    out["after_backward"] = kinds()
    sd = model.state_dict()
    out["state_dict"] = [(k, isinstance(v, DTensor)) for k, v in sd.items()]
    return out


def test_registered_parameters_follow_fsdp2_except_after_forward(world2: World) -> None:
    ours = world2.run(_registered_kinds, False)
    theirs = world2.run(_registered_kinds, True)
    # After a forward we register the sharded DTensors on every module, the root included
    # (FSDP2 leaves the root's unsharded tensors there, and an optimizer, clipping, an EMA or
    # autograd.grad then silently works on throwaway copies: docs/fsdp2_mapping.md).
    after_forward = ("after_no_grad_forward", "after_forward")
    for o, t in zip(ours, theirs):
        assert {k: v for k, v in o.items() if k not in after_forward} == {
            k: v for k, v in t.items() if k not in after_forward
        }
        for point in after_forward:
            assert all(is_dt for _, is_dt, _ in o[point]), point
            fsdp2 = dict((n, is_dt) for n, is_dt, _ in t[point])
            assert fsdp2["tok.weight"] is False and fsdp2["blocks.0.fc.weight"] is True
    # After the root's unshard() its full tensors are registered, as in FSDP2.
    assert dict((n, is_dt) for n, is_dt, _ in ours[0]["after_unshard"])["tok.weight"] is False


def _float64_training(use_torch: bool) -> list[float]:
    cfg, model, *_ = _models(use_torch)
    model.to(torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        x, y = _batch(cfg, dist.get_rank(), step)
        logits = model(x)
        assert logits.dtype == torch.float64
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(p.dtype == torch.float64 for p in model.parameters())
    return losses


def test_module_to_dtype_after_fully_shard_trains_in_that_dtype(world2: World) -> None:
    ours = world2.run(_float64_training, False)
    theirs = world2.run(_float64_training, True)
    assert ours == theirs


def _isinstance_torch_fsdp_module() -> list[bool]:
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    import functional_fsdp

    _, model, *_ = _models(False)
    mods = [model, *model.blocks]
    copy_ok = isinstance(copy.deepcopy(model), TorchFSDPModule)
    sliced = type(model.blocks[:1]).__name__ == "ModuleList"
    return [
        all(isinstance(m, TorchFSDPModule) for m in mods),
        all(isinstance(m, functional_fsdp.FSDPModule) for m in mods),
        copy_ok,
        sliced,
    ]


def test_sharded_modules_are_torch_fsdp_modules(world2: World) -> None:
    assert world2.run(_isinstance_torch_fsdp_module) == [[True] * 4] * 2


def _unsupported_method_is_clear() -> str:
    _, model, *_ = _models(False)
    try:
        model.set_symm_mem_for_comm()
    except NotImplementedError as e:
        return str(e)
    return "no error"


def test_torch_only_methods_raise_clearly(world2: World) -> None:
    for msg in world2.run(_unsupported_method_is_clear):
        assert "set_symm_mem_for_comm" in msg and "not supported" in msg


def _last_backward_flag(use_torch: bool, use_flag: bool, between: str = "") -> dict[str, Any]:
    """Two micro-batches with gradient sync on; ``set_is_last_backward(False)`` on the first;
    ``between`` them: nothing, ``zero_grad`` (drops the first) or ``step`` (an SGD step on the
    first micro-batch's gradients, then ``zero_grad``). The gradients after each backward
    and the parameters at the end."""
    from torch.distributed.tensor import DTensor

    cfg, model, *_ = _models(use_torch)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = dist.get_rank()
    in_flight = None
    grads = []
    for i in range(2):
        if use_flag:
            model.set_is_last_backward(i == 1)
        model.loss(*_batch(cfg, rank, i)).backward()
        if i == 0 and not use_torch:
            in_flight = any(
                m._ffsdp_state.group is not None and m._ffsdp_state.group.pending_reduce is not None
                for m in [model, *model.blocks]
            )
        grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
        if i == 0 and between == "step":
            opt.step()
        if i == 0 and between:
            opt.zero_grad()
    assert all(isinstance(p, DTensor) for p in model.parameters())
    params = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    return {"grads": grads, "params": params, "in_flight": in_flight}


@pytest.mark.parametrize("between", ["", "zero_grad", "step"])
def test_set_is_last_backward_lands_every_reduction_and_matches_fsdp2(
    world2: World, between: str
) -> None:
    """A backward with ``set_is_last_backward(False)`` ends with every reduction landed, as
    FSDP2 assigns ``.grad`` in each group's post-backward: a ``zero_grad()`` after it drops
    that micro-batch, and an optimizer step after it steps on its gradients. (The last
    reduction once stayed in flight and landed later into whatever ``.grad`` had become: the
    dropped micro-batch came back, 0.30 off; the step ran on incomplete gradients.)"""
    flagged = world2.run(_last_backward_flag, False, True, between)
    plain = world2.run(_last_backward_flag, False, False, between)
    theirs = world2.run(_last_backward_flag, True, True, between)
    for f, p, t in zip(flagged, plain, theirs):
        assert f["in_flight"] is False and p["in_flight"] is False
        for k in range(2):
            for n in f["grads"][k]:
                assert torch.equal(f["grads"][k][n], p["grads"][k][n]), (k, n)
                assert torch.equal(f["grads"][k][n], t["grads"][k][n]), (k, n)
        for n in f["params"]:
            assert torch.equal(f["params"][n], t["params"][n]), n


def _no_sync_while_a_reduction_is_in_flight(use_torch: bool, buckets: bool) -> dict[str, Any]:
    """Three micro-batches: sync on with ``set_is_last_backward(False)`` (its reductions stay
    in flight past the backward), sync off (its gradients are held), sync on and last.
    Without buckets each group's reduction is finished by the next group's (hand-over)."""
    cfg, model, *_ = _models(use_torch)
    if not buckets and not use_torch:
        model.set_bucket_bytes(0)
    rank = dist.get_rank()
    for i, (sync, last) in enumerate([(True, False), (False, False), (True, True)]):
        model.set_requires_gradient_sync(sync)
        model.set_is_last_backward(last)
        model.loss(*_batch(cfg, rank, i)).backward()
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def test_gradients_held_without_sync_survive_a_reduction_in_flight(world2: World) -> None:
    """The held (no-sync) gradients live beside the reduction's state; finishing a reduction
    that began before them must not drop them (it once replaced the whole state)."""
    theirs = world2.run(_no_sync_while_a_reduction_is_in_flight, True, True)
    for buckets in (False, True):
        ours = world2.run(_no_sync_while_a_reduction_is_in_flight, False, buckets)
        for o, t in zip(ours, theirs):
            for n in o:
                torch.testing.assert_close(o[n], t[n], rtol=1e-6, atol=1e-6, msg=f"{n} {buckets}")
