"""fully_shard's API surface on real gloo ranks: peak unsharded memory, explicit prefetch order,
errors raised before any collective, reset after an exception, FSDPModule methods, and the
regressions found in review."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _dist import World, shared_mesh
from _fully_shard_helpers import (
    CFG,
    _all_equal,
    _build,
    _full_params,
    _max_rel,
    _optimizer,
    _train,
)

from functional_fsdp.testing.models import GPT, synthetic_batch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]


def case_peak_unsharded(recipe: str) -> dict:
    """Peak number (and bytes) of block groups whose unsharded buffer is allocated, over steps.

    A group's buffer storage only grows in ``GatherSlot.alloc`` (called by both the gather issue,
    prefetches included, and its wait), so reading the live set right after every allocation
    sees the true peak; freeing only lowers it.
    """
    model = _build("ours", recipe)
    # FSDP2's contract, one collective per group (coalesced buckets: tests/engine/test_coalesce.py).
    model.set_bucket_bytes(0)
    groups = [b._ffsdp_state.group for b in model.blocks]
    peak = {"groups": 0, "bytes": 0}

    def live() -> list[int]:
        return [
            g.buffer.untyped_storage().nbytes()
            for g in groups
            if g.buffer is not None and g.buffer.untyped_storage().nbytes() > 0
        ]

    from functional_fsdp.shell.engine.gather import GatherSlot

    slots = {id(g.slot) for g in groups}
    orig = GatherSlot.alloc

    def alloc(self):
        out = orig(self)
        if id(self) in slots:
            now = live()
            peak["groups"] = max(peak["groups"], len(now))
            peak["bytes"] = max(peak["bytes"], sum(now))
        return out

    GatherSlot.alloc = alloc
    try:
        _train(model, recipe, steps=2)
    finally:
        GatherSlot.alloc = orig
    sizes = sorted((g.buffer.numel() * g.buffer.element_size() for g in groups), reverse=True)
    return {**peak, "two_largest_bytes": sum(sizes[:2]), "all_bytes": sum(sizes)}


def case_explicit_prefetch(explicit: bool) -> dict:
    """The block gathers (and the forward/reduction marks between them) in issue order.

    With ``explicit``, block 0 prefetches blocks 1 and 2 in forward and block 2 prefetches
    blocks 1 and 0 in backward; every other list is empty. Without it, the implicit
    one-ahead prefetch runs (in the first step, before the forward order is recorded, none).
    """
    model = _build("ours", "default")
    # FSDP2's implicit one-ahead prefetch: one collective per group (explicit prefetch turns
    # coalesced all-gathers off anyway).
    model.set_bucket_bytes(0)
    blocks = list(model.blocks)
    if explicit:
        for b, fwd, bwd in zip(blocks, ([1, 2], [], []), ([], [], [1, 0])):
            b.set_modules_to_forward_prefetch([blocks[i] for i in fwd])
            b.set_modules_to_backward_prefetch([blocks[i] for i in bwd])
    log: list[str] = []

    def recording(i, g):
        orig_start, orig_post_backward = g.start_unshard, g.post_backward

        def start_unshard(*args):
            idle = g.pending is None and not g.is_unsharded
            orig_start(*args)
            if idle and g.pending is not None:
                log.append(f"gather{i}")

        def post_backward(grads):
            log.append(f"reduce{i}")
            orig_post_backward(grads)

        g.start_unshard, g.post_backward = start_unshard, post_backward

    for i, b in enumerate(blocks):
        recording(i, b._ffsdp_state.group)
        b.register_forward_hook(lambda m, a, o, i=i: log.append(f"forward{i}"))
    steps: list[list[str]] = []
    losses = []
    opt = _optimizer(model.parameters(), "adamw")
    for s in range(2):
        log.clear()
        x, y = synthetic_batch(CFG, 2, seed=1000 * s + dist.get_rank())
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        steps.append(list(log))
    return {"steps": steps, "losses": losses, "params": _full_params(model)}


def case_errors() -> list[str]:
    """Bad input raises named errors before any collective; the world keeps working after."""

    from functional_fsdp import MixedPrecisionPolicy, errors, fully_shard

    seen = []

    def expect(exc, fn):
        try:
            fn()
        except exc as e:
            seen.append(f"{exc.__name__}: {e}")
            return
        raise AssertionError(f"expected {exc.__name__}")

    expect(errors.IndivisibleError, lambda: fully_shard(nn.Linear(4, 4), reshard_after_forward=3))
    expect(errors.MeshError, lambda: fully_shard(nn.Linear(4, 4), mesh="not a mesh"))  # type: ignore[arg-type]
    mesh3 = shared_mesh((dist.get_world_size(), 1, 1))
    expect(errors.MeshError, lambda: fully_shard(nn.Linear(4, 4), mesh=mesh3))

    class Scalar(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.s = nn.Parameter(torch.tensor(1.0))

    expect(errors.ScalarParameterError, lambda: fully_shard(Scalar()))
    from torch.distributed.tensor import Shard

    expect(
        errors.IndivisibleError,
        lambda: fully_shard(nn.Linear(3, 3), shard_placement_fn=lambda p: Shard(1)),
    )

    # A parameter tied across two groups that compute in different dtypes (a tie across
    # groups is otherwise shared: tests/engine/test_tied_weights.py).
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    fully_shard(a)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    expect(errors.TiedParameterError, lambda: fully_shard(b, mp_policy=bf16))

    # Running a child before its root.
    torch.manual_seed(0)
    model = GPT(CFG)
    for blk in model.blocks:
        fully_shard(blk)
    fully_shard(model)
    model.blocks[0](torch.randn(2, CFG.seq, CFG.dim))
    expect(errors.StateError, lambda: model(torch.zeros(2, CFG.seq, dtype=torch.long)))
    # A collective still works on every rank: nobody hung or desynchronised.
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()
    return seen


def case_exception_then_reset() -> dict:
    """An exception mid-forward, reset_iter_state, then training equals an untouched run."""
    model = _build("ours", "default")

    def boom(module, args):
        raise RuntimeError("injected")

    h = model.blocks[1].register_forward_pre_hook(boom)
    x, y = synthetic_batch(CFG, 2, seed=7)
    try:
        model.loss(x, y)
    except RuntimeError as e:
        assert "injected" in str(e)
    h.remove()
    model.reset_iter_state()
    lo = _train(model, "default")
    ref = _build("ours", "default")
    lr = _train(ref, "default")
    return {"ours": lo, "ref": lr, "param_rel": _max_rel(_full_params(ref), _full_params(model))}


def case_api_surface() -> dict:
    """unshard(async_op) handles, explicit prefetch lists, forward methods, ignored params."""
    from functional_fsdp import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method

    torch.manual_seed(0)
    model = GPT(CFG)
    ignored = {model.pos.weight}
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model, ignored_params=ignored)
    assert all(isinstance(m, FSDPModule) for m in [model, *model.blocks])
    assert not hasattr(model.pos.weight, "placements"), "ignored params stay plain tensors"
    blocks = list(model.blocks)
    for i, b in enumerate(blocks[:-1]):
        b.set_modules_to_forward_prefetch([blocks[i + 1]])
    for i, b in enumerate(blocks[1:], start=1):
        b.set_modules_to_backward_prefetch([blocks[i - 1]])
    h = model.blocks[0].unshard(async_op=True)
    assert isinstance(h, UnshardHandle)
    h.wait()
    x, y = synthetic_batch(CFG, 2, seed=dist.get_rank())
    loss = model.loss(x, y)
    loss.backward()
    grads_ok = all(p.grad is not None for p in model.parameters())

    def generate(self, idx):
        return self(idx).argmax(-1)

    type(model).generate = generate
    register_fsdp_forward_method(model, "generate")
    with torch.no_grad():
        out = model.generate(x)
    return {"grads_ok": grads_ok, "gen_shape": tuple(out.shape), "loss": loss.item()}


def _check(res: dict, key: str, tol: float) -> None:
    a, b = torch.tensor(res[key]), torch.tensor(res["ours"])
    assert torch.allclose(a, b, rtol=tol, atol=tol), (res[key], res["ours"])
    assert res["param_rel"] <= tol, res["param_rel"]


def test_at_most_two_block_groups_unsharded(world2: World) -> None:
    for res in world2.run(case_peak_unsharded, "default"):
        # Exactly 2: the running block and the one prefetched (0 or 1 would mean no prefetch).
        assert res["groups"] == 2, res
        assert res["bytes"] <= res["two_largest_bytes"], res


def test_peak_measurement_catches_groups_left_unsharded(world2: World) -> None:
    """Negative control: reshard_after_forward=False keeps every block unsharded until its
    backward, and the same measurement reports it."""
    for res in world2.run(case_peak_unsharded, "raf_false"):
        assert res["groups"] == len(range(CFG.n_layers)), res
        assert res["bytes"] == res["all_bytes"] > res["two_largest_bytes"], res


def test_bad_input_raises_before_collectives(world2: World) -> None:
    msgs = world2.run(case_errors)
    assert len(msgs[0]) == 7
    assert any("common parent" in m for m in msgs[0])
    assert any("running forward through the root module first" in m for m in msgs[0])


def test_exception_mid_forward_then_reset(world2: World) -> None:
    for res in world2.run(case_exception_then_reset):
        _check(res, "ref", 0.0)


def test_api_surface(world2: World) -> None:
    for res in world2.run(case_api_surface):
        assert res["grads_ok"]
        assert res["gen_shape"] == (2, CFG.seq)


def test_explicit_prefetch_issues_gathers_in_the_set_order(world2: World) -> None:
    explicit = world2.run(case_explicit_prefetch, True)
    implicit = world2.run(case_explicit_prefetch, False)
    forward = ["gather0", "gather1", "gather2", "forward0", "forward1", "forward2"]
    backward = ["gather2", "gather1", "gather0", "reduce2", "reduce1", "reduce0"]
    for ex, im in zip(explicit, implicit):
        assert ex["steps"] == [forward + backward] * 2, ex["steps"]
        # The implicit schedule differs (so the lists above are what the setters changed):
        # one block ahead, and nothing ahead in the first forward (its order is not known yet).
        assert im["steps"][0][:6] == ["gather0", "forward0", "gather1", "forward1"] + [
            "gather2",
            "forward2",
        ], im["steps"]
        assert im["steps"][0][6:] == ["gather2", "gather1", "reduce2"] + [
            "gather0",
            "reduce1",
            "reduce0",
        ], im["steps"]
        # Prefetching changes when data moves, not the arithmetic.
        assert ex["losses"] == im["losses"]
        assert _all_equal(ex["params"], im["params"])


class _RankBranch(nn.Module):
    """A block whose second layer runs on rank 0 only (data-dependent unused parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        return y + self.b(x) if dist.get_rank() == 0 else y


def case_regressions() -> dict:
    """Bugs found in review: each check would fail (or crash the rank) before its fix."""
    from functional_fsdp import fully_shard

    out: dict = {}
    rank, ws = dist.get_rank(), dist.get_world_size()

    # Parameters unused on some ranks only: every rank must take the same reduction path.
    torch.manual_seed(0)
    m = nn.Sequential(_RankBranch(), nn.Linear(6, 3))
    fully_shard(m[0])
    fully_shard(m)
    m(torch.randn(4, 6)).sum().backward()
    out["rank_unused_ok"] = m[0].a.weight.grad is not None

    # The first forward under inference_mode allocates buffers; training afterwards works.
    model = _build("ours", "default")
    x, y = synthetic_batch(CFG, 2, seed=rank)
    with torch.inference_mode():
        model(x)
    model.loss(x, y).backward()
    out["inference_then_train_ok"] = all(p.grad is not None for p in model.parameters())

    # A submodule run on its own must not leave a stale prefetch for the next root forward.
    a, b = _build("ours", "default"), _build("ours", "default")
    for mm in (a, b):
        _train(mm, "default", steps=1)  # records the forward order
    h = torch.randn(2, CFG.seq, CFG.dim)
    with torch.no_grad():
        a.blocks[0](h)  # would prefetch blocks[1] before the fix
        for p in list(a.parameters()) + list(b.parameters()):
            p.add_(0.5)
    with torch.no_grad():
        out["no_stale_prefetch"] = torch.equal(a(x), b(x))

    # reset_iter_state() on a child (not the root) recovers after an exception.
    model = _build("ours", "default")

    def boom(module, args):
        raise RuntimeError("injected")

    hk = model.blocks[1].register_forward_pre_hook(boom)
    with contextlib.suppress(RuntimeError):
        model.loss(x, y)
    hk.remove()
    model.blocks[0].reset_iter_state()
    ref = _build("ours", "default")
    out["child_reset_ok"] = _train(model, "default") == _train(ref, "default")

    # unshard() puts the full parameters on the module; reshard() the sharded ones.
    model = _build("ours", "default")
    blk = model.blocks[0]
    blk.unshard()
    full_shape = tuple(blk.qkv.weight.shape)
    is_plain = not hasattr(blk.qkv.weight, "placements")
    blk.reshard()
    out["unshard_registers_full"] = full_shape == (3 * CFG.dim, CFG.dim) and is_plain
    out["reshard_registers_sharded"] = hasattr(blk.qkv.weight, "placements")
    del ws
    return out


def test_review_regressions(world2: World) -> None:
    for res in world2.run(case_regressions):
        assert all(res.values()), res
