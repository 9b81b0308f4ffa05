"""Weights tied across groups: ``head.weight is tok.weight`` with the embedding and the
head sharded as separate groups (and the blocks as groups) trains like one process.

The model is the test GPT with ``tie_weights=True`` and a vocabulary of 61 rows, so the tied
weight's shards are uneven on 2 ranks (31 + 30 rows) and on 4 (16 + 16 + 16 + 13). Each rank runs
its slice of the global batch; the reference runs the whole batch in one process (mean loss, so
FSDP's averaging over ranks equals its gradient). fp32 is held to 1e-6 of the reference, and to
torch FSDP2 where FSDP2 can run the same model: with both uses of the weight in one group (the
root's). Before this, ours raised ``TiedParameterError`` at ``fully_shard`` (FSDP2 raises too,
pytorch#176225, and before that trained the last rank's rows wrongly, pytorch#176076). A wrong
implementation fails here too: a gradient reduced twice is twice the reference, a dropped use's
contribution is far from it, and every case counts the owner's reductions (one per step).

The N = 4 cases run in the session's 4-rank world, the N = 1 and 2 cases in its 2-rank world
(on 4 processes of 2 cores each collective waits 4-6x longer). The checkpoint case saves at one
world size and loads at the other in the 4-rank world, where ``N = 2`` runs as two independent
2-rank worlds (ranks {0, 1} and {2, 3}). Snapshots gather a step's parameters and gradients in
one all-gather per mesh (``full_named``), not one per tensor.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dist import shared_mesh

pytestmark = pytest.mark.multiprocess

STEPS = 2
BATCH = 8  # sequences in the global batch; each of N ranks runs BATCH / N of them
LR = 1e-2
TOL = 1e-6  # fp32: the reference sums the batch in one order, the ranks in N parts
# How the model is sharded (each: the order of fully_shard calls):
#   tok_first: tok, blocks, head, root  (the embedding owns the weight; the head borrows it)
#   head_first: head, blocks, tok, root (the head owns it; the embedding, which runs first in
#               forward and last in backward, borrows it)
#   root_uses: tok, blocks, root        (the head stays in the root's group, which borrows it)
#   one_group: blocks, root             (both uses in the root's group: what FSDP2 can run)
LAYOUTS = ("tok_first", "head_first", "root_uses")


def _cfg() -> Any:
    from functional_fsdp.testing.models import GPTConfig

    return GPTConfig(vocab=61, dim=32, n_layers=2, n_heads=2, seq=8, tie_weights=True)


def _mesh(n: int) -> tuple[Any, int]:
    """This rank's data-parallel mesh of ``n`` ranks (``ws / n`` independent copies) and its
    rank in it."""
    import torch.distributed as dist

    ws = dist.get_world_size()
    mesh = shared_mesh((ws // n, n), ("copies", "dp"))["dp"]
    return mesh, mesh.get_local_rank()


def _shard(model: Any, layout: str, mesh: Any, impl: str = "ours", **kw: Any) -> Any:
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from functional_fsdp import fully_shard
    if layout == "head_first":
        fully_shard(model.head, mesh=mesh, **kw)
    if layout in ("tok_first", "root_uses"):
        fully_shard(model.tok, mesh=mesh, **kw)
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh, **kw)
    if layout == "tok_first":
        fully_shard(model.head, mesh=mesh, **kw)
    if layout == "head_first":
        fully_shard(model.tok, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def _model(
    layout: str, mesh: Any, impl: str = "ours", checkpointed: bool = False, **kw: Any
) -> Any:
    from functional_fsdp.testing.models import GPT

    torch.manual_seed(0)
    model = GPT(_cfg())
    if checkpointed:  # activation checkpointing around the head and each block
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper,
        )

        model.head = checkpoint_wrapper(model.head)
        model.blocks = torch.nn.ModuleList(checkpoint_wrapper(b) for b in model.blocks)
    return model if layout == "ref" else _shard(model, layout, mesh, impl, **kw)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    data = torch.randint(0, _cfg().vocab, (BATCH, _cfg().seq + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def _mine(t: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    k = BATCH // n
    return t[rank * k : (rank + 1) * k]


def _full(t: Any) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().clone()


def _fulls(named: dict[str, Any]) -> dict[str, torch.Tensor]:
    """:func:`_full` of each value, in few collectives."""
    from _helpers import full_named

    return {k: v.float() for k, v in full_named(named).items()}


def _snapshot(model: Any, step: int, out: dict[str, torch.Tensor]) -> None:
    named = {}
    for name, p in model.named_parameters():
        n = name.replace("_checkpoint_wrapped_module.", "")
        named[f"param{step}/{n}"] = p
        if p.grad is not None:
            named[f"grad{step}/{n}"] = p.grad
    out.update(_fulls(named))


class _CountReductions:
    """Counts each group's gradient reductions (``ParamGroup.begin_reduce`` calls), by id."""

    def __init__(self) -> None:
        from functional_fsdp.shell.engine.group import ParamGroup

        self.cls, self.orig = ParamGroup, ParamGroup.begin_reduce
        self.counts: dict[int, int] = {}

    def __enter__(self) -> dict[int, int]:
        orig, counts = self.orig, self.counts

        def counting(group: Any, *args: Any, **kwargs: Any) -> Any:
            counts[id(group)] = counts.get(id(group), 0) + 1
            return orig(group, *args, **kwargs)

        self.cls.begin_reduce = counting  # type: ignore[method-assign]
        return counts

    def __exit__(self, *exc: Any) -> None:
        self.cls.begin_reduce = self.orig  # type: ignore[method-assign]


def _owner(model: Any, layout: str) -> int:
    """The id of the group that reduces the tied weight (0 for FSDP2)."""
    owner = {"one_group": model, "head_first": model.head}.get(layout, model.tok)
    return id(owner._ffsdp_state.group) if hasattr(owner, "_ffsdp_state") else 0


def _train(
    n: int,
    layout: str,
    impl: str = "ours",
    micro: int = 1,
    steps: int = STEPS,
    evaluate: bool = False,
    **kw: Any,
) -> dict[str, Any]:
    """``steps`` AdamW steps on ``n`` ranks; parameters and gradients after each step, and the
    owner group's reductions per step (``micro`` micro-batches per rank, with no-sync;
    ``evaluate``: a forward under ``no_grad`` before each step)."""
    mesh, rank = _mesh(n)
    model = _model(layout, mesh, impl, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    out: dict[str, Any] = {"tied": model.head.weight is model.tok.weight, "reductions": []}
    for step in range(steps):
        x, y = (_mine(t, rank, n) for t in _batch(step))
        if evaluate:
            with torch.no_grad():
                model(x)
        with _CountReductions() as counts:
            for j, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
                if micro > 1:
                    model.set_requires_gradient_sync(j == micro - 1)
                (model.loss(xm, ym) / micro).backward()
        out["reductions"].append(counts.get(_owner(model, layout), 0))
        opt.step()
        _snapshot(model, step, out)
        opt.zero_grad()
    return out


def _reference() -> dict[str, Any]:
    model = _model("ref", None)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    out: dict[str, Any] = {}
    for step in range(STEPS):
        model.loss(*_batch(step)).backward()
        opt.step()
        _snapshot(model, step, out)
        opt.zero_grad()
    return out


def _reference_bf16() -> dict[str, Any]:
    """The single-process reference of mixed precision: each step computes in a bf16 copy of
    the fp32 parameters, and AdamW updates the fp32 ones with the fp32 gradients."""
    import copy

    model = _model("ref", None)
    low = copy.deepcopy(model).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    out: dict[str, Any] = {}
    for step in range(STEPS):
        with torch.no_grad():
            for p, q in zip(model.parameters(), low.parameters()):
                q.copy_(p)
        low.zero_grad()
        low.loss(*_batch(step)).backward()
        for p, q in zip(model.parameters(), low.parameters()):
            p.grad = q.grad.float()
        opt.step()
        _snapshot(model, step, out)
        opt.zero_grad()
    return out


def _diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    keys = [k for k in b if isinstance(b[k], torch.Tensor)]
    assert keys and all(k in a for k in keys), sorted(set(keys) - set(a))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in keys)


@pytest.fixture
def on(world2: Any, world4: Any) -> Any:
    """The world an ``N``-rank case runs in: 4 ranks for N = 4; the 2-rank world for N = 1
    and 2 (on 4 processes of 2 cores every collective waits 4-6x longer)."""
    return lambda n: world4 if n == 4 else world2


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return _reference()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_trains_like_one_process_on_2_and_4_ranks(
    on: Any, reference: dict[str, Any], layout: str
) -> None:
    for n in (2, 4):
        for r, res in enumerate(on(n).run(_train, n, layout)):
            assert res["tied"], "head.weight and tok.weight must stay one parameter"
            assert res["reductions"] == [1] * STEPS, (n, r, res["reductions"])
            d = _diff(res, reference)
            print(f"{layout} N={n} rank {r}: max |ours - reference| = {d:.3g}")
            assert d <= TOL, (layout, n, r, d)


def _mp() -> Any:
    from functional_fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _torch_mp() -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _compare_runs(n: int, mixed: bool) -> dict[str, Any]:
    """Ours with the weight tied across groups, ours with both uses in one group, and FSDP2
    with both uses in one group, on the same ``n`` ranks (optionally in bf16)."""
    ours_kw = {"mp_policy": _mp()} if mixed else {}
    torch_kw = {"mp_policy": _torch_mp()} if mixed else {}
    return {
        "across": _train(n, "tok_first", **ours_kw),
        "one_group": _train(n, "one_group", **ours_kw),
        "fsdp2": _train(n, "one_group", "torch", **torch_kw),
    }


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in b if isinstance(b[k], torch.Tensor))


def test_equals_fsdp2_with_both_uses_in_one_group(on: Any, reference: dict[str, Any]) -> None:
    """fp32: the same bits as FSDP2 running both uses in one group on 2 ranks (on 4, gloo's
    ring sums in another order than our rank order: last bits), and as ours in one group."""
    for n in (2, 4):
        for r, res in enumerate(on(n).run(_compare_runs, n, False)):
            d_fsdp2 = _diff(res["across"], res["fsdp2"])
            print(f"fp32 N={n} rank {r}: max |tied across - FSDP2 one group| = {d_fsdp2:.3g}")
            assert _equal(res["across"], res["one_group"]), (n, r)
            assert _equal(res["across"], res["fsdp2"]) if n == 2 else d_fsdp2 <= TOL
            assert _diff(res["fsdp2"], reference) <= TOL
            assert res["across"]["reductions"] == [1] * STEPS


def test_mixed_precision_equals_fsdp2_with_both_uses_in_one_group(on: Any) -> None:
    """bf16 compute, fp32 reduction: the same bits as FSDP2 with both uses in one group on 2
    ranks and as ours in one group; the gradients within bf16's rounding of a single process
    computing in a bf16 copy (1.2% here; a dropped or doubled use is 50-100% off)."""
    ref16 = _reference_bf16()
    grads = [k for k in ref16 if k.startswith("grad")]
    for n in (2, 4):
        for r, res in enumerate(on(n).run(_compare_runs, n, True)):
            across = res["across"]
            d_fsdp2 = _diff(across, res["fsdp2"])
            rel = max(((across[k] - ref16[k]).norm() / ref16[k].norm()).item() for k in grads)
            print(
                f"bf16 N={n} rank {r}: tied across - FSDP2 one group {d_fsdp2:.3g}, "
                f"gradients' relative error to the bf16 reference {rel:.3g}"
            )
            assert _equal(across, res["one_group"]), (n, r)
            assert _equal(across, res["fsdp2"]) if n == 2 else d_fsdp2 <= TOL
            assert rel <= 0.03, (n, r, rel)
            assert across["reductions"] == [1] * STEPS


# ------------------------------------------------------------------ no-sync, reshard variants


def _variants(n: int) -> dict[str, dict[str, Any]]:
    out = {
        # two micro-batches per rank, the first without gradient sync
        "no_sync": _train(n, "tok_first", micro=2),
        "no_sync_head_first": _train(n, "head_first", micro=2),
        "keep_after_forward": _train(n, "tok_first", reshard_after_forward=False),
        "root_uses_keep": _train(n, "root_uses", reshard_after_forward=False),
        "checkpointed": _train(n, "tok_first", checkpointed=True),
        "evaluate_between": _train(n, "head_first", evaluate=True),
        "checkpointed_head_first": _train(n, "head_first", checkpointed=True),
    }
    if n == 4:  # keep a 1/2 slice for a 2-rank sub-group after forward
        out["reshard_to_2"] = _train(n, "tok_first", reshard_after_forward=2)
        out["head_first_to_2"] = _train(n, "head_first", reshard_after_forward=2)
    return out


def test_no_sync_accumulation_and_reshard_variants(on: Any, reference: dict[str, Any]) -> None:
    for n in (2, 4):
        for r, results in enumerate(on(n).run(_variants, n)):
            for name, res in results.items():
                d = _diff(res, reference)
                print(f"{name} N={n} rank {r}: max |ours - reference| = {d:.3g}")
                assert d <= TOL, (name, n, r, d)
                assert res["reductions"] == [1] * STEPS, (name, n, r, res["reductions"])


# ------------------------------------------------------------------ the gather schedule


def _schedule(n: int, layout: str, embedding_unshards: bool = True) -> dict[str, Any]:
    """When the tied weight is unsharded on this rank during one training step, and how many
    times the owner all-gathers it."""
    from functional_fsdp.shell.engine.gather import GatherSlot

    mesh, rank = _mesh(n)
    model = _model(layout, mesh)
    if not embedding_unshards:  # FSDP2's advice for an embedding: its backward needs no weight
        model.tok.set_unshard_in_backward(False)
    owner = (model.head if layout == "head_first" else model.tok)._ffsdp_state.group
    seen: list[tuple[str, bool]] = []
    gathers = []
    orig = GatherSlot.wait

    def wait(slot: Any, *args: Any, **kwargs: Any) -> None:
        if slot is owner.slot:
            gathers.append(len(seen))
        orig(slot, *args, **kwargs)

    def note(where: str) -> Any:
        return lambda *a: seen.append((where, owner.is_unsharded))

    for i, blk in enumerate(model.blocks):
        blk.register_forward_pre_hook(note(f"block{i} forward"))
        blk.register_full_backward_pre_hook(note(f"block{i} backward"))
    model.head.register_forward_pre_hook(note("head forward"))
    model.head.register_full_backward_pre_hook(note("head backward"))
    x, y = (_mine(t, rank, n) for t in _batch(0))
    GatherSlot.wait = wait  # type: ignore[method-assign]
    try:
        model.loss(x, y).backward()
    finally:
        GatherSlot.wait = orig  # type: ignore[method-assign]
    return {"seen": seen, "gathers": len(gathers), "live_after": owner.is_unsharded}


def test_the_tied_weight_is_gathered_for_each_use_and_freed_between(world2: Any) -> None:
    """The owner's buffer is live while a module using the weight runs and freed between uses
    (during the blocks), in both orders of ownership: 2 gathers in forward, 2 in backward."""
    for layout in ("tok_first", "head_first"):
        for res in world2.run(_schedule, 2, layout):
            live = {where for where, unsharded in res["seen"] if unsharded}
            assert live <= {"head forward", "head backward"}, (layout, res["seen"])
            assert "head forward" in live, (layout, res["seen"])
            assert res["gathers"] == 4 and not res["live_after"], (layout, res)
    # The embedding owns the weight and skips its backward gather: the head still gets one.
    for res in world2.run(_schedule, 2, "tok_first", False):
        assert res["gathers"] == 3 and not res["live_after"], res


# ------------------------------------------------------------------ checkpoints


def _resumed(n_first: int, n_then: int, path: str, layout_then: str) -> dict[str, Any]:
    """``STEPS - 1`` steps at ``n_first`` ranks (embedding owns the weight), a DCP checkpoint of
    model and optimizer, then the last step at ``n_then`` ranks sharded as ``layout_then``."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from functional_fsdp import load_checkpoint, save_checkpoint

    mesh, rank = _mesh(n_first)
    model = _model("tok_first", mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    for step in range(STEPS - 1):
        model.loss(*(_mine(t, rank, n_first) for t in _batch(step))).backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    keys = sorted(msd)
    copy = dist.get_rank() // n_first  # each independent copy saves; all load copy 0's
    save_checkpoint({"model": msd, "optim": osd}, f"{path}/{copy}", process_group=mesh.get_group())
    dist.barrier()
    mesh, rank = _mesh(n_then)
    model = _model(layout_then, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    load_checkpoint(state, f"{path}/0", process_group=mesh.get_group())
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    out: dict[str, Any] = {"keys": keys, "tied": model.head.weight is model.tok.weight}
    model.loss(*(_mine(t, rank, n_then) for t in _batch(STEPS - 1))).backward()
    opt.step()
    _snapshot(model, STEPS - 1, out)
    return out


def test_dcp_checkpoint_resumes_at_another_world_size(
    world4: Any, reference: dict[str, Any], tmp_path: Any
) -> None:
    """Saved at 2 ranks, loaded at 4 (and back), also into the other ownership (the head owns
    the weight after the load): the last step equals the reference's."""
    last = {k: v for k, v in reference.items() if k.startswith(f"param{STEPS - 1}/")}
    cases = [(2, 4, "tok_first"), (4, 2, "head_first"), (2, 2, "root_uses")]
    for i, (a, b, layout) in enumerate(cases):
        for r, res in enumerate(world4.run(_resumed, a, b, str(tmp_path / str(i)), layout)):
            assert res["tied"] and {"tok.weight", "head.weight"} <= set(res["keys"])
            d = _diff(res, last)
            print(f"DCP {a} -> {b} ranks ({layout}) rank {r}: max |ours - reference| = {d:.3g}")
            assert d <= TOL, (a, b, layout, r, d)


# ------------------------------------------------------------------ summon_full_params


def _summon(n: int) -> dict[str, Any]:
    """After a step: the full tied weight inside ``summon_full_params`` (of the model, and of
    the head alone, whose group does not own it), an edit written back through the head's
    name, then a step on the edited weight."""
    from functional_fsdp import summon_full_params

    mesh, rank = _mesh(n)
    model = _model("tok_first", mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    model.loss(*(_mine(t, rank, n) for t in _batch(0))).backward()
    opt.step()
    opt.zero_grad()
    out: dict[str, Any] = {}
    with summon_full_params(model.head):
        w = model.head.weight
        out["head_only"] = (type(w).__name__, tuple(w.shape), w is model.tok.weight)
        out["full0"] = w.detach().clone()
    with summon_full_params(model):
        out["same"] = model.head.weight is model.tok.weight
        with torch.no_grad():
            model.head.weight.mul_(0.5)
    out["tied"] = model.head.weight is model.tok.weight
    out["written"] = _full(model.tok.weight)
    model.loss(*(_mine(t, rank, n) for t in _batch(1))).backward()
    opt.step()
    _snapshot(model, 1, out)
    return out


def _summon_reference() -> dict[str, Any]:
    model = _model("ref", None)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    for step in range(2):
        model.loss(*_batch(step)).backward()
        opt.step()
        opt.zero_grad()
        if step == 0:
            with torch.no_grad():
                model.tok.weight.mul_(0.5)
    out: dict[str, Any] = {}
    _snapshot(model, 1, out)
    return out


def test_summon_full_params_with_writeback(on: Any, reference: dict[str, Any]) -> None:
    ref = _summon_reference()
    for n in (2, 4):
        for r, res in enumerate(on(n).run(_summon, n)):
            assert res["head_only"] == ("Parameter", (61, 32), True), res["head_only"]
            assert res["same"] and res["tied"]
            full0 = reference["param0/tok.weight"]
            assert (res["full0"] - full0).abs().max().item() <= TOL
            assert torch.equal(res["written"], res["full0"] * 0.5)
            d = _diff(res, ref)
            print(f"summon N={n} rank {r}: max |ours - reference| after the edit = {d:.3g}")
            assert d <= TOL, (n, r, d)


# ------------------------------------------------------------------ the functional path


def _functional(n: int, layout: str) -> dict[str, Any]:
    """The functional step (``make_train_step``, AdamW) for ``STEPS`` steps, and
    ``torch.func.functional_call`` + ``torch.autograd.grad`` on the module's parameters."""
    from functional_fsdp.functional import adamw, init, make_train_step

    mesh, rank = _mesh(n)
    model = _model(layout, mesh)
    opt = adamw(LR, weight_decay=0.1)
    state = init(model, opt)
    step_fn = make_train_step(model, lambda m, b: m.loss(*b), opt)
    out: dict[str, Any] = {"names": sorted(state.params)}
    # The caller's tensors (new DTensor leaves over the shards): the functional path.
    params = {k: p.detach().requires_grad_(True) for k, p in model.named_parameters()}
    x, y = (_mine(t, rank, n) for t in _batch(0))
    logits = torch.func.functional_call(model, params, (x,))
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    grads = torch.autograd.grad(loss, list(params.values()))
    out.update(_fulls({f"grad0/{name}": g for name, g in zip(params, grads)}))
    for step in range(STEPS):
        state, _ = step_fn(state, tuple(_mine(t, rank, n) for t in _batch(step)))
        out.update(_fulls({f"param{step}/{name}": p for name, p in state.params.items()}))
    return out


def test_functional_step_and_functional_call(on: Any, reference: dict[str, Any]) -> None:
    for n in (2, 4):
        for layout in LAYOUTS:
            for r, res in enumerate(on(n).run(_functional, n, layout)):
                assert res["names"] == sorted(
                    k.split("/")[1] for k in reference if k.startswith("param0/")
                )
                d = _diff(
                    res, {k: v for k, v in reference.items() if k.startswith(("param", "grad0"))}
                )
                print(f"functional {layout} N={n} rank {r}: max |ours - reference| = {d:.3g}")
                assert d <= TOL, (layout, n, r, d)


# ------------------------------------------------------------------ ReproduciblePolicy

V = 4  # virtual micro-batches per step; N = 1, 2, 4 divide it


def _reproducible(n: int, layout: str, functional: bool) -> dict[str, Any]:
    """``STEPS`` steps under ``ReproduciblePolicy(V)`` (module path, or the functional step):
    each rank runs its ``V / n`` micro-batches of the global batch."""
    from functional_fsdp import ReproduciblePolicy
    from functional_fsdp.functional import adamw, init, make_train_step

    policy = ReproduciblePolicy(virtual_world_size=V)
    mesh, rank = _mesh(n)
    model = _model(layout, mesh, reproducible=policy)
    mine = list(policy.micro_batches(rank, n))
    out: dict[str, Any] = {}
    if functional:
        opt = adamw(LR, weight_decay=0.1)
        state = init(model, opt)
        step_fn = make_train_step(model, lambda m, b: m.loss(*b), opt, grad_accum=len(mine))
    else:
        torch_opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    for step in range(STEPS):
        x, y = (t.view(V, BATCH // V, -1)[mine].flatten(0, 1) for t in _batch(step))
        if functional:
            state, _ = step_fn(state, (x, y))
            out.update(_fulls({f"param{step}/{name}": p for name, p in state.params.items()}))
            continue
        for xm, ym in zip(x.chunk(len(mine)), y.chunk(len(mine))):
            (model.loss(xm, ym) / len(mine)).backward()
        torch_opt.step()
        _snapshot(model, step, out)
        torch_opt.zero_grad()
    return out


def test_reproducible_policy_gives_the_same_bits_on_1_2_and_4_ranks(on: Any) -> None:
    """Under the policy the summed gradient of the tied weight goes through the owner's
    canonical tree once per micro-batch: 1, 2 and 4 ranks train to the same bits, on the
    module path and in the functional step, whichever group owns the weight."""
    for functional in (False, True):
        for layout in ("tok_first", "head_first"):
            one = on(1).run(_reproducible, 1, layout, functional)[0]
            for n in (2, 4):
                for r, res in enumerate(on(n).run(_reproducible, n, layout, functional)):
                    assert _equal(res, one), (functional, layout, n, r, _diff(res, one))


# ------------------------------------------------------------------ what is refused


def _expect(exc: type[BaseException], fn: Any, *phrases: str) -> str:
    try:
        fn()
    except exc as e:
        text = str(e)
        assert all(p in text for p in phrases), text
        return text
    raise AssertionError(f"expected {exc.__name__}")


def _misuse() -> list[str]:
    import torch.distributed as dist

    from functional_fsdp import MixedPrecisionPolicy, ReproduciblePolicy, fully_shard
    from functional_fsdp.core.errors import ReproducibilityError, TiedParameterError
    from functional_fsdp.testing.models import GPT

    def fresh() -> Any:
        torch.manual_seed(0)
        model = GPT(_cfg())
        fully_shard(model.tok)
        return model

    seen = []
    model = fresh()
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    seen.append(
        _expect(TiedParameterError, lambda: fully_shard(model.head, mp_policy=bf16), "dtype")
    )
    one = shared_mesh((dist.get_world_size(), 1), ("dp", "one"))
    seen.append(
        _expect(TiedParameterError, lambda: fully_shard(model.head, mesh=one["one"]), "mesh")
    )
    policy = ReproduciblePolicy(virtual_world_size=V)
    seen.append(_expect(ReproducibilityError, lambda: fully_shard(model.head, reproducible=policy)))
    # Refused before anything changed: the head can still borrow the weight.
    fully_shard(model.head)
    # The owner is not under the root that runs: raised at its lazy init, before a collective.
    x = torch.randn(2, _cfg().seq, _cfg().dim)
    seen.append(_expect(TiedParameterError, lambda: model.head(x), "not under the root"))
    # A caller untying the weight for one call (functional_call with tie_weights=False).
    model = _shard(GPT(_cfg()), "tok_first", None)
    idx = _batch(0)[0][:2]
    p = dict(model.named_parameters())
    other = {**p, "head.weight": p["tok.weight"].detach().clone()}
    call = lambda: torch.func.functional_call(model, other, (idx,), tie_weights=False)  # noqa: E731
    seen.append(_expect(TiedParameterError, call, "same tensor"))
    model.reset_iter_state()  # the forward stopped at the head on every rank
    only_head = {"head.weight": p["tok.weight"].detach().clone()}
    call = lambda: torch.func.functional_call(model, only_head, (idx,), tie_weights=False)  # noqa: E731
    seen.append(_expect(TiedParameterError, call, "same tensor"))
    model.reset_iter_state()
    model.loss(*(t[:2] for t in _batch(0))).backward()  # and it trains on
    return seen


def test_what_cannot_be_shared_raises_named_errors(world2: Any) -> None:
    for seen in world2.run(_misuse):
        print("\n".join(seen))


# ------------------------------------------------------------------ deepcopy


def _copies(n: int) -> dict[str, Any]:
    """``state_dict`` names the weight twice (one tensor); ``load_state_dict(assign=True)``
    of separate tensors ties them again (the owner's value); a deep copy is tied in itself."""
    import copy

    mesh, rank = _mesh(n)
    model = _model("tok_first", mesh)
    x, y = (_mine(t, rank, n) for t in _batch(0))
    sd = model.state_dict()
    local = [sd[k].to_local().untyped_storage().data_ptr() for k in ("head.weight", "tok.weight")]
    out: dict[str, Any] = {"sd": local[0] == local[1]}
    loss = model.loss(x, y).detach()
    sd = {k: v.detach().clone() for k, v in sd.items()}
    with torch.no_grad():
        sd["head.weight"].zero_()  # assign=True keeps the owner's: torch.equal losses below
    model.load_state_dict(sd, assign=True)
    out["retied"] = model.head.weight is model.tok.weight
    out["reloaded"] = (loss, model.loss(x, y).detach())
    twin = copy.deepcopy(model)
    out["tied"] = twin.head.weight is twin.tok.weight
    out["own"] = twin.tok.weight is not model.tok.weight
    out["loss"] = (model.loss(x, y).detach(), twin.loss(x, y).detach())
    twin.loss(x, y).backward()
    torch.optim.SGD(twin.parameters(), lr=1.0).step()
    out["moved"] = not torch.equal(_full(twin.tok.weight), _full(model.tok.weight))
    out["loss_after"] = (model.loss(x, y).detach(), twin.loss(x, y).detach())
    return out


def test_state_dicts_and_deepcopy_keep_the_tie(world2: Any) -> None:
    for res in world2.run(_copies, 2):
        assert res["sd"]
        assert res["retied"] and torch.equal(*res["reloaded"])
        assert res["tied"] and res["own"] and res["moved"]
        assert torch.equal(*res["loss"])
        assert not torch.equal(*res["loss_after"])
