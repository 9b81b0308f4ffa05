"""Reproducible at any scale, end to end on gloo: with ``ReproduciblePolicy`` a small GPT trained
with AdamW and clipping has the same parameters, gradients' norms and optimizer state, bit for
bit, on 1, 2 and 4 ranks, in 1-D and HSDP, in fp32 and bf16 mixed precision, with and without
no-sync accumulation, and after resuming a checkpoint at another world size.

The session's 2-rank world runs the 1- and 2-rank runs (``N = 1`` as two one-rank worlds), its
4-rank world the 4-rank runs, HSDP 2x2, 2-D with tensor parallelism, and the checkpoint resumed
at another world size (there ``N = 2`` runs as two independent 2-rank worlds, ranks {0, 1} and
{2, 3}). On 4 processes of 2 cores each collective waits 4-6x longer than on 2."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dist import shared_mesh
from _full import full_parameters
from _helpers import Routed, full_named
from torch.nn.utils import clip_grad_norm_ as _EARLY_TORCH_CLIP

pytestmark = pytest.mark.multiprocess

V = 4  # virtual micro-batches per step; N = 1, 2, 4 divide it
STEPS = 3


def _cfg() -> Any:
    from functional_fsdp.testing.models import GPTConfig

    return GPTConfig(vocab=64, dim=32, n_layers=2, n_heads=2, seq=16)


def _mesh(n_dp: int, hsdp: bool) -> tuple[Any, int]:
    """This rank's data-parallel mesh of ``n_dp`` ranks and its data-parallel rank."""
    import torch.distributed as dist

    ws = dist.get_world_size()
    if hsdp:
        mesh = shared_mesh((2, ws // 2), ("replicate", "shard"))
        return mesh, dist.get_rank()  # dp rank = replica * shards + shard
    mesh = shared_mesh((ws // n_dp, n_dp), ("copies", "dp"))["dp"]
    return mesh, mesh.get_local_rank()


def _model(mesh: Any, bf16: bool, policy: Any) -> Any:
    from functional_fsdp import MixedPrecisionPolicy, fully_shard
    from functional_fsdp.testing.models import GPT

    torch.manual_seed(0)
    model = GPT(_cfg())
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh, mp_policy=mp, reproducible=policy)
    fully_shard(model, mesh=mesh, mp_policy=mp, reproducible=policy)
    return model


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: ``V`` micro-batches of 2 sequences."""
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, _cfg().vocab, (V, 2, _cfg().seq + 1), generator=g)
    return data[..., :-1], data[..., 1:]


def _steps(
    model: Any, opt: Any, policy: Any, dp_rank: int, n_dp: int, steps: range, no_sync: bool
) -> list[torch.Tensor]:
    from functional_fsdp import clip_grad_norm_

    norms = []
    mine = list(policy.micro_batches(dp_rank, n_dp))
    for step in steps:
        x, y = _batch(step)
        for j, k in enumerate(mine):
            if no_sync:
                model.set_requires_gradient_sync(j == len(mine) - 1)
            (model.loss(x[k], y[k]) / len(mine)).backward()
        norms.append(clip_grad_norm_(model.parameters(), 0.05))
        opt.step()
        opt.zero_grad()
    return norms


def _snapshot(model: Any, opt: Any, norms: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    named = {f"param/{n}": p for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            named[f"{key}/{names[id(p)]}"] = st[key]
    out = full_named(named)
    out.update({f"norm/{i}": n for i, n in enumerate(norms)})
    return out


def _train(n_dp: int, hsdp: bool, bf16: bool, no_sync: bool) -> dict[str, torch.Tensor]:
    from functional_fsdp import ReproduciblePolicy

    policy = ReproduciblePolicy(virtual_world_size=V)
    mesh, dp_rank = _mesh(n_dp, hsdp)
    model = _model(mesh, bf16, policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    norms = _steps(model, opt, policy, dp_rank, n_dp, range(STEPS), no_sync)
    return _snapshot(model, opt, norms)


def _train_resumed(n_first: int, n_then: int, path: str) -> dict[str, torch.Tensor]:
    """``STEPS - 1`` steps at ``n_first`` ranks, a checkpoint, the last step at ``n_then``."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from functional_fsdp import ReproduciblePolicy, load_checkpoint, save_checkpoint

    policy = ReproduciblePolicy(virtual_world_size=V)
    mesh, dp_rank = _mesh(n_first, False)
    model = _model(mesh, False, policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    norms = _steps(model, opt, policy, dp_rank, n_first, range(STEPS - 1), False)
    msd, osd = get_state_dict(model, opt)
    # Each independent copy of the n_first-rank run saves its own checkpoint; all load copy 0's.
    copy = torch.distributed.get_rank() // n_first
    save_checkpoint({"model": msd, "optim": osd}, f"{path}/{copy}", process_group=mesh.get_group())
    torch.distributed.barrier()
    mesh, dp_rank = _mesh(n_then, False)
    model = _model(mesh, False, policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    load_checkpoint(state, f"{path}/0", process_group=mesh.get_group())
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    norms += _steps(model, opt, policy, dp_rank, n_then, range(STEPS - 1, STEPS), False)
    return _snapshot(model, opt, norms)


def _train_plain(n_dp: int) -> dict[str, torch.Tensor]:
    """The same run without the policy (what FSDP2 does)."""
    mesh, dp_rank = _mesh(n_dp, False)
    from functional_fsdp import fully_shard
    from functional_fsdp.testing.models import GPT

    torch.manual_seed(0)
    model = GPT(_cfg())
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    k = V // n_dp
    for step in range(STEPS):
        x, y = _batch(step)
        for j in range(dp_rank * k, (dp_rank + 1) * k):
            (model.loss(x[j], y[j]) / k).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
    return full_named({f"param/{n}": p for n, p in model.named_parameters()})


def _differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    assert a.keys() == b.keys()
    return {
        k: (a[k].double() - b[k].double()).abs().max().item()
        for k in a
        if not torch.equal(a[k], b[k])
    }


def _all_equal(results: list[dict[str, torch.Tensor]], reference: dict[str, torch.Tensor]) -> None:
    for r, res in enumerate(results):
        diff = _differences(res, reference)
        assert not diff, f"rank {r} differs from one rank: {diff}"


@pytest.mark.parametrize(("bf16", "no_sync"), [(False, False), (False, True), (True, False)])
def test_one_two_and_four_ranks_train_to_the_same_bits(
    world2: Any, world4: Any, bf16: bool, no_sync: bool
) -> None:
    one = world2.run(_train, 1, False, bf16, no_sync)
    _all_equal(one[1:], one[0])  # two independent one-rank runs agree (sanity)
    _all_equal(world2.run(_train, 2, False, bf16, no_sync), one[0])
    _all_equal(world4.run(_train, 4, False, bf16, no_sync), one[0])


def test_hsdp_two_by_two_trains_to_the_bits_of_one_rank(world2: Any, world4: Any) -> None:
    one = world2.run(_train, 1, False, False, True)[0]
    _all_equal(world4.run(_train, 4, True, False, True), one)


def test_resuming_at_another_world_size_continues_bit_identically(
    world2: Any, world4: Any, tmp_path: Any
) -> None:
    uninterrupted = world2.run(_train, 1, False, False, False)[0]
    _all_equal(world4.run(_train_resumed, 4, 2, str(tmp_path / "a")), uninterrupted)
    _all_equal(world4.run(_train_resumed, 2, 4, str(tmp_path / "b")), uninterrupted)


def test_without_the_policy_the_world_size_shows_in_the_bits(world2: Any) -> None:
    """What the policy fixes: the same run without it differs between 1 and 2 ranks (as torch
    FSDP2's does: the accumulation ((g0 + g1) + g2) + g3 on one rank against
    (g0 + g1) + (g2 + g3) on two), so the tests above are not vacuous."""
    one = world2.run(_train_plain, 1)[0]
    two = world2.run(_train_plain, 2)[0]
    assert _differences(two, one), "the plain run happened to be identical; pick other data"


def _train_functional(n_dp: int, clip: bool) -> dict[str, torch.Tensor]:
    """The functional step (make_train_step) under the policy: each rank's V/N micro-batches
    are its batch, grad_accum = V/N."""
    from functional_fsdp import ReproduciblePolicy
    from functional_fsdp.functional import adamw, chain, clip_by_global_norm, init, make_train_step

    policy = ReproduciblePolicy(virtual_world_size=V)
    mesh, dp_rank = _mesh(n_dp, False)
    model = _model(mesh, False, policy)
    opt = adamw(1e-2, weight_decay=0.1)
    if clip:
        opt = chain(clip_by_global_norm(0.05), opt)
    mine = list(policy.micro_batches(dp_rank, n_dp))
    step = make_train_step(model, lambda m, b: m.loss(*b), opt, grad_accum=len(mine))
    state = init(model, opt)
    norms = []
    for s in range(STEPS):
        x, y = _batch(s)
        batch = (x[mine].reshape(-1, x.shape[-1]), y[mine].reshape(-1, y.shape[-1]))
        state, metrics = step(state, batch)
        norms.append(metrics["grad_norm"])
    out = full_named({f"param/{n}": p for n, p in state.params.items()})
    out.update({f"norm/{i}": n for i, n in enumerate(norms)})
    return out


def _train_module_no_clip(n_dp: int) -> dict[str, torch.Tensor]:
    from functional_fsdp import ReproduciblePolicy

    policy = ReproduciblePolicy(virtual_world_size=V)
    mesh, dp_rank = _mesh(n_dp, False)
    model = _model(mesh, False, policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    mine = list(policy.micro_batches(dp_rank, n_dp))
    for step in range(STEPS):
        x, y = _batch(step)
        for k in mine:
            (model.loss(x[k], y[k]) / len(mine)).backward()
        opt.step()
        opt.zero_grad()
    return full_named({f"param/{n}": p for n, p in model.named_parameters()})


def test_the_functional_step_gives_the_same_bits_on_every_world_size(
    world2: Any, world4: Any
) -> None:
    one = world2.run(_train_functional, 1, True)[0]
    _all_equal(world2.run(_train_functional, 2, True), one)
    _all_equal(world4.run(_train_functional, 4, True), one)


def test_the_functional_step_gives_the_bits_of_the_module_path(world2: Any) -> None:
    """Without clipping (the functional clip_by_global_norm scales as optax does, torch's
    clip_grad_norm_ as torch does): make_train_step equals loss.backward() + torch AdamW."""
    functional = world2.run(_train_functional, 2, False)[0]
    module = world2.run(_train_module_no_clip, 2)[0]
    params = {k: v for k, v in functional.items() if k.startswith("param/")}
    assert not _differences(params, module)


def _tree_reduce_on_gloo(n: int, seed: int) -> list[torch.Tensor]:
    """The core's reproducible reduction over a real gloo group of ``n`` ranks."""
    from functional_fsdp.core.reduction import pack_grads
    from functional_fsdp.core.reproducible import tree_reduce
    from functional_fsdp.core.transitions import shard
    from functional_fsdp.shell import ProcessGroupComm

    mesh, rank = _mesh(n, False)
    comm = ProcessGroupComm(mesh.get_group())
    g = torch.Generator().manual_seed(seed + rank)
    grads = [torch.randn(7, 3, generator=g), torch.randn(5, generator=g)]
    state = shard([torch.zeros(7, 3), torch.zeros(5)], world_size=n, rank=comm.rank)
    new = tree_reduce(pack_grads(grads, state.layout), state, comm, present=[True, True])
    return [new.local_grad(i) for i in range(2)]


def test_the_simulated_world_replays_the_gloo_reduction_bit_for_bit(world4: Any) -> None:
    """A distributed reduction replayed in one process: SimulatedWorld(4) gives the bits of
    four gloo processes."""
    from functional_fsdp.testing import SimulatedWorld

    real = world4.run(_tree_reduce_on_gloo, 4, 11)
    world = SimulatedWorld(4)

    def body(comm: Any) -> list[torch.Tensor]:
        from functional_fsdp.core.reduction import pack_grads
        from functional_fsdp.core.reproducible import tree_reduce
        from functional_fsdp.core.transitions import shard

        g = torch.Generator().manual_seed(11 + comm.rank)
        grads = [torch.randn(7, 3, generator=g), torch.randn(5, generator=g)]
        state = shard([torch.zeros(7, 3), torch.zeros(5)], world_size=4, rank=comm.rank)
        new = tree_reduce(pack_grads(grads, state.layout), state, comm, present=[True, True])
        return [new.local_grad(i) for i in range(2)]

    simulated = world.run(body)
    for r in range(4):
        assert all(torch.equal(a, b) for a, b in zip(real[r], simulated[r]))


def _misuse() -> list[str]:
    """Every misuse of the policy raises ReproducibilityError, before any collective."""
    import torch.distributed as dist

    from functional_fsdp import ReproduciblePolicy, fully_shard
    from functional_fsdp.core.errors import ReproducibilityError

    seen = []
    mesh, rank = _mesh(dist.get_world_size(), False)
    policy = ReproduciblePolicy(virtual_world_size=8)  # 2 micro-batches per rank on 4
    try:
        fully_shard(torch.nn.Linear(4, 4), mesh=mesh, reproducible=ReproduciblePolicy(2))
    except ReproducibilityError as e:
        seen.append("fully_shard: " + str(e).split(":")[0])
    model = _model(mesh, False, policy)
    for setter, args in (
        ("set_gradient_divide_factor", (2.0,)),
        ("set_all_reduce_hook", (lambda t: None,)),
        ("set_force_sum_reduction_for_comms", (True,)),
    ):
        try:
            getattr(model, setter)(*args)
        except ReproducibilityError:
            seen.append(setter)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _batch(0)
    (model.loss(x[rank], y[rank]) / 2).backward()  # 1 of 2 micro-batches
    try:
        opt.step()
    except ReproducibilityError as e:
        seen.append("step after 1 of 2: " + ("exactly 2" in str(e)) * "named")
    (model.loss(x[(rank + 1) % V], y[(rank + 1) % V]) / 2).backward()
    opt.step()  # complete: fine
    opt.zero_grad()
    model.reset_iter_state()
    try:
        torch.autograd.grad(model.loss(x[0], y[0]), list(model.parameters()))
    except ReproducibilityError:
        seen.append("autograd.grad")
    model.reset_iter_state()
    return seen


def test_misuse_raises_named_errors_on_every_rank(world4: Any) -> None:
    for seen in world4.run(_misuse):
        assert seen == [
            "fully_shard: ReproduciblePolicy(virtual_world_size=2) on 4 data-parallel ranks",
            "set_gradient_divide_factor",
            "set_all_reduce_hook",
            "set_force_sum_reduction_for_comms",
            "step after 1 of 2: named",
            "autograd.grad",
        ], seen


def _train_2d(dp: int, reproducible: bool = True) -> dict[str, torch.Tensor]:
    """2-D FSDP x TP at a fixed TP degree of 2: ``dp`` data-parallel ranks (``4 // (2 * dp)``
    independent copies of the run), ``V = 4`` micro-batches per step, 2 AdamW steps."""
    import _tp_helpers as H
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import parallelize_module

    from functional_fsdp import ReproduciblePolicy, fully_shard

    copies = dist.get_world_size() // (2 * dp)
    world = shared_mesh((copies, dp, 2), ("copies", "dp", "tp"))
    policy = ReproduciblePolicy(virtual_world_size=4)
    model = H.reference_model()
    parallelize_module(model, world["tp"], H.tp_plan())
    kw = {"reproducible": policy} if reproducible else {}
    for b in model.blocks:
        fully_shard(b, mesh=world["dp"], **kw)
    fully_shard(model, mesh=world["dp"], **kw)
    opt = H.optimizer(model.parameters())
    mine = list(policy.micro_batches(world["dp"].get_local_rank(), dp))
    for step in range(2):
        for k in mine:
            x, y = H.batch(step, k)
            (model.loss(x, y) / len(mine)).backward()
        opt.step()
        opt.zero_grad()
    return full_parameters(model)


def test_2d_at_a_fixed_tp_degree_gives_the_same_bits_on_one_and_two_dp_ranks(
    world4: Any,
) -> None:
    one = world4.run(_train_2d, 1)[0]
    _all_equal(world4.run(_train_2d, 2), one)
    # Without the policy the same two runs differ (the test can fail).
    assert _differences(world4.run(_train_2d, 2, False)[0], world4.run(_train_2d, 1, False)[0])


# ------------------------------------------------------------------ a policy on some groups only


def _partial_policy() -> list[str]:
    """The policy on the blocks only, or another policy on the root: refused at the root's
    first forward, on every rank (before any collective), and again at the next forward."""
    import torch.distributed as dist

    from functional_fsdp import ReproducibilityError, ReproduciblePolicy, fully_shard
    from functional_fsdp.testing.models import GPT

    mesh, rank = _mesh(dist.get_world_size(), False)
    x, y = _batch(0)
    seen = []
    for root_policy in (None, ReproduciblePolicy(virtual_world_size=8)):
        torch.manual_seed(0)
        model = GPT(_cfg())
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh, reproducible=ReproduciblePolicy(virtual_world_size=V))
        fully_shard(model, mesh=mesh, reproducible=root_policy)
        for _ in range(2):
            try:
                model.loss(x[rank], y[rank])
            except ReproducibilityError as e:
                seen.append(str(e))
    return seen


def test_a_policy_on_some_groups_only_is_refused_at_the_first_forward(world4: Any) -> None:
    for seen in world4.run(_partial_policy):
        assert len(seen) == 4, seen
        without, other = seen[0], seen[2]
        assert seen[1] == without and seen[3] == other  # refused again, not half-initialised
        for text in (without, other):
            assert (
                "with ReproduciblePolicy(virtual_world_size=4, seed=0): blocks.0, blocks.1" in text
            )
            assert "pass the same policy to every fully_shard call" in text
        assert "without a ReproduciblePolicy: GPT (the root)" in without
        assert "with ReproduciblePolicy(virtual_world_size=8, seed=0): GPT (the root)" in other


def _torch_clip() -> list[str]:
    """torch.nn.utils.clip_grad_norm_ over the policy's parameters warns (once per calling
    line under the default filter, pointing at the caller), however it was imported; the
    library's clip_grad_norm_ and torch's over a model without the policy do not."""
    import warnings

    import torch.distributed as dist

    from functional_fsdp import ReproducibilityWarning, ReproduciblePolicy, clip_grad_norm_

    mesh, rank = _mesh(dist.get_world_size(), False)
    x, y = _batch(0)
    out = []
    for policy in (ReproduciblePolicy(virtual_world_size=V), None):
        model = _model(mesh, False, policy)
        model.loss(x[rank], y[rank]).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            clip_grad_norm_(model.parameters(), 1.0)
            for _ in range(2):  # one warning for this line
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            _EARLY_TORCH_CLIP(list(model.parameters()), 1.0)  # imported before any policy
        for w in caught:
            assert issubclass(w.category, ReproducibilityWarning), w
            assert w.filename == __file__, w.filename  # the caller's line
            out.append(str(w.message))
        out.append("--")
        model.zero_grad()
    return out


def test_torch_clip_grad_norm_over_the_policys_parameters_warns(world4: Any) -> None:
    for seen in world4.run(_torch_clip):
        assert len(seen) == 4 and seen[-1] == "--" and seen[2] == "--", seen
        for text in seen[:2]:
            assert "torch.nn.utils.clip_grad_norm_ was given parameters of groups" in text
            assert "Use functional_fsdp.clip_grad_norm_(parameters, max_norm)" in text


# ------------------------------------------------------------ data-dependent routing


def case_routed_parameter(n_dp: int, unused: bool) -> dict[str, Any]:
    """3 AdamW steps of 4 micro-batches on ``n_dp`` data-parallel ranks (``extra`` runs in
    micro-batches ``k >= 2`` only) under
    ``ReproduciblePolicy(virtual_world_size=4)``, with ``set_reduce_scatter_unused_params``
    when ``unused``: the routed parameter has no gradient on the rank that ran micro-batches
    0 and 1."""
    import torch.distributed as dist

    from functional_fsdp import ReproduciblePolicy, fully_shard

    ws = dist.get_world_size()
    mesh = shared_mesh((ws // n_dp, n_dp), ("copies", "dp"))["dp"]
    torch.manual_seed(0)
    model = Routed()
    policy = ReproduciblePolicy(virtual_world_size=4)
    fully_shard(model.blocks[1], mesh=mesh, reproducible=policy)
    fully_shard(model, mesh=mesh, reproducible=policy)
    model.set_reduce_scatter_unused_params(unused)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    per = 4 // n_dp
    mine = range(mesh.get_local_rank() * per, (mesh.get_local_rank() + 1) * per)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        xs, ys = torch.randn(4, 2, 8, generator=g), torch.randn(4, 2, 8, generator=g)
        for k in mine:
            model.use_extra = k >= 2
            (torch.nn.functional.mse_loss(model(xs[k]), ys[k]) / per).backward()
        opt.step()
        opt.zero_grad()
    return {
        "params": {n: p.detach().full_tensor() for n, p in model.named_parameters()},
        "stateless": sorted(n for n, p in model.named_parameters() if p not in opt.state),
    }


@pytest.mark.parametrize("unused", [True, False])
def test_a_parameter_some_ranks_never_use_trains_alike_on_one_and_two_ranks(
    world2, unused: bool
) -> None:
    """The tree reduction lands the summed gradient of a parameter this rank never used, with
    ``set_reduce_scatter_unused_params(True)`` (FSDP2's setting for routed parameters) and
    without it (the presence flags the tree carries: ``core.reduction.agreed_present``).
    Before, its shard on that rank was left without a gradient and without optimizer state,
    and 2 ranks differed from 1 everywhere (0.03)."""
    one = world2.run(case_routed_parameter, 1, unused)
    two = world2.run(case_routed_parameter, 2, unused)
    for a, b in zip(one, two):
        assert a["stateless"] == [] and b["stateless"] == [], (a["stateless"], b["stateless"])
        for n in a["params"]:
            assert torch.equal(a["params"][n], b["params"][n]), n
