"""Coalesced collectives: adjacent small groups gather and reduce-scatter together.

Coalescing changes who travels together, not what is summed, so every case trains the same
small deep GPT twice on real gloo ranks, with coalescing off (``bucket_bytes=0``: one collective
per group) and on (buckets of several groups), and asserts ``torch.equal`` on every parameter;
the plain fp32 case is also compared with torch FSDP2. Each case also checks that the schedule
really coalesced (fewer buckets than groups) so the equality is not vacuous, and counts the
collectives the communicator issued. The plan itself (pure) is a hypothesis property.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import pytest
import torch
from _dist import shared_mesh
from _helpers import random_like
from hypothesis import given
from hypothesis import strategies as st
from strategies import param_trees, world_sizes

from functional_fsdp._compat import HAS_SWAP_DATA_PTR
from functional_fsdp.core.coalesce import (
    begin_unshard_coalesced,
    finish_reductions,
    issue_reduce_coalesced,
    lands_by_member,
    packs_members,
    plan_buckets,
)
from functional_fsdp.core.codec import wire
from functional_fsdp.core.errors import StateError
from functional_fsdp.core.reduction import pack_grads, reduce_grad, reduce_input, reduce_row_numel
from functional_fsdp.core.transitions import finish_unshard, shard, unshard
from functional_fsdp.testing import SimulatedWorld

CFG = dict(vocab=64, dim=16, n_layers=6, n_heads=2, seq=8)
STEPS = 2


# ----------------------------------------------------------------------------- the plan (pure)


@given(
    sizes=st.lists(st.integers(0, 50), min_size=0, max_size=12),
    ok=st.lists(st.booleans(), min_size=12, max_size=12),
    bucket=st.integers(-1, 120),
)
def test_plan_keeps_order_and_bounds(sizes: list[int], ok: list[bool], bucket: int) -> None:
    names = [f"g{i}" for i in range(len(sizes))]
    eligible = ok[: len(sizes)]
    buckets = plan_buckets(names, sizes, eligible, bucket)
    # Every group once, in order; each bucket adjacent groups.
    assert [n for b in buckets for n in b.groups] == names
    for b in buckets:
        idx = [names.index(n) for n in b.groups]
        assert b.unsharded_bytes == sum(sizes[i] for i in idx)
        if len(idx) > 1:
            assert bucket > 0 and b.unsharded_bytes <= bucket
            assert all(eligible[i] for i in idx)
    if bucket <= 0:
        assert all(len(b.groups) == 1 for b in buckets)
    # Greedy: two adjacent multi-member-capable buckets could not have been merged.
    for a, b in itertools.pairwise(buckets):
        ia, ib = names.index(a.groups[-1]), names.index(b.groups[0])
        if eligible[ia] and eligible[ib] and bucket > 0 and sizes[ib] <= bucket:
            assert a.unsharded_bytes + sizes[ib] > bucket or sizes[ia] > bucket


# ----------------------------------------------------------------------------- cases (ranks)


def _model(kind: str, bucket_bytes: int, opts: dict[str, Any], cfg: dict | None = None) -> Any:
    import torch.distributed as dist

    from functional_fsdp.testing.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**(cfg or CFG)))
    if kind == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    else:
        from functional_fsdp import MixedPrecisionPolicy, fully_shard
    kw: dict[str, Any] = {}
    ws = dist.get_world_size()
    if opts.get("hsdp"):
        kw["mesh"] = shared_mesh((2, ws // 2), ("rep", "shard"))
    if opts.get("bf16"):
        kw["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    raf = opts.get("raf")
    for i, b in enumerate(model.blocks):
        # raf_mixed: every other block keeps 1/2 of its rows (travels alone), the rest do not.
        r = (2 if i % 2 else True) if opts.get("raf_mixed") else raf
        fully_shard(b, reshard_after_forward=r, **kw)
    extra = {} if kind == "fsdp2" else {"bucket_bytes": bucket_bytes}
    fully_shard(model, **kw, **extra)
    if opts.get("explicit_prefetch"):
        blocks = list(model.blocks)
        for i, b in enumerate(blocks):
            b.set_modules_to_forward_prefetch(blocks[i + 1 : i + 3])
            b.set_modules_to_backward_prefetch(blocks[max(0, i - 2) : i][::-1])
    return model


def _train(model: Any, opts: dict[str, Any], cfg: dict | None = None) -> list[float]:
    import torch.distributed as dist

    from functional_fsdp.testing.models import GPTConfig, synthetic_batch

    conf = GPTConfig(**(cfg or CFG))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rank = dist.get_rank()
    losses = []
    for step in range(STEPS):
        x, y = synthetic_batch(conf, 4, seed=100 * step + rank)
        if opts.get("no_sync"):
            model.set_requires_gradient_sync(False)
            model.loss(x[:2], y[:2]).div(2).backward()
            model.set_requires_gradient_sync(True)
            loss = model.loss(x[2:], y[2:]).div(2)
        else:
            loss = model.loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _full(model: Any) -> dict[str, torch.Tensor]:
    from _helpers import full_named

    return full_named(dict(model.named_parameters()))


def case_equal(opts: dict[str, Any], with_fsdp2: bool) -> dict[str, Any]:
    """Ours coalesced vs ours per group (and FSDP2): ``torch.equal`` on every parameter."""

    import os

    runs = {}
    counts = {}
    if opts.get("member_messages"):  # every member its own message (read by new communicators)
        os.environ["FFSDP_PIECES_MIN_BYTES"] = "0"
    try:
        for name, size in (("alone", 0), ("coalesced", 1 << 20)):
            model = _model("ours", size, opts)
            before = _collectives(model)
            _train(model, opts)
            counts[name] = _collectives(model) - before
            runs[name] = _full(model)
            if name == "coalesced":
                sched = model.communication_schedule()
                group = model.blocks[0]._ffsdp_state.group
                pack, dtype = wire(group.layout)
                packs = packs_members(group.comm, [pack.total * dtype.itemsize] * 2)
    finally:
        os.environ.pop("FFSDP_PIECES_MIN_BYTES", None)
    out: dict[str, Any] = {
        "packs_members": packs,
        "equal": all(torch.equal(runs["alone"][k], runs["coalesced"][k]) for k in runs["alone"]),
        "forward_buckets": len(sched.forward),
        "backward_buckets": len(sched.backward),
        "groups": CFG["n_layers"] + 1,
        "collectives": counts,
    }
    if with_fsdp2:
        theirs = _model("fsdp2", 0, opts)
        _train(theirs, opts)
        t = _full(theirs)
        out["equal_fsdp2"] = all(torch.equal(t[k], runs["coalesced"][k]) for k in t)
    return out


# Blocks of about 200 KiB: their buffers are in the host pool's range (64 KiB to 4 MiB).
POOL_CFG = dict(vocab=256, dim=64, n_layers=4, n_heads=2, seq=16)


def case_host_pool() -> dict[str, Any]:
    """Coalesced training with the host buffer pool (the default) and without it, and FSDP2:
    ``torch.equal`` on every parameter; the pool's hits while each ran."""
    from functional_fsdp.shell.device.pool import host_buffer_pool, set_host_buffer_pool_bytes

    # The pool is the CPU runtime's, also when the suite runs on the simulator (which keeps
    # none); the world puts the environment back after the case.
    os.environ.pop("FFSDP_RUNTIME", None)
    pool = host_buffer_pool()
    runs, hits, kept = {}, {}, {}
    for name, size in (("pooled", 16 << 20), ("unpooled", 0)):
        set_host_buffer_pool_bytes(size)
        before = pool.hits
        # Buckets of about two blocks: (root, b0), (b1, b2), (b3); the last is kept for the
        # backward, the others gather again there through the pool.
        model = _model("ours", 512 << 10, {}, POOL_CFG)
        at_forward_end: list[int] = []
        model.register_forward_hook(lambda *_, seen=at_forward_end: seen.append(pool.retained))
        _train(model, {}, POOL_CFG)
        hits[name] = pool.hits - before
        # The end of each forward (where activations peak) and of each backward gave it back.
        kept[name] = pool.retained + sum(at_forward_end)
        runs[name] = _full(model)
    set_host_buffer_pool_bytes(16 << 20)
    theirs = _model("fsdp2", 0, {}, POOL_CFG)
    _train(theirs, {}, POOL_CFG)
    t = _full(theirs)
    return {
        "equal": all(torch.equal(runs["pooled"][k], runs["unpooled"][k]) for k in t),
        "equal_fsdp2": all(torch.equal(t[k], runs["pooled"][k]) for k in t),
        "hits": hits,
        "kept": kept,
    }


def case_kept_for_backward() -> dict[str, Any]:
    """Which blocks keep their unsharded buffer from the forward into the backward: with
    buckets of two blocks (the root rides with the first two), the last forward bucket's, after a forward that has a backward to
    serve, unless the user chose ``reshard_after_forward``. The sharded parameters are
    registered either way; the backward frees what it kept."""
    from torch.distributed.tensor import DTensor

    from functional_fsdp.testing.models import GPTConfig, synthetic_batch

    def live(model: Any) -> list[bool]:
        return [b._ffsdp_state.group.slot.live for b in model.blocks]

    out: dict[str, Any] = {}
    for name, opts in (("default", {}), ("explicit", {"raf": True})):
        model = _model("ours", 0, opts)
        block = model.blocks[0]._ffsdp_state.group.layout.unsharded_bytes
        root = model._ffsdp_state.group.layout.unsharded_bytes  # smaller than a block
        model.set_bucket_bytes(root + 2 * block)  # (root, b0, b1), (b2, b3), (b4, b5)
        _train(model, opts)  # the first forward records the order the schedule is cut from
        x, y = synthetic_batch(GPTConfig(**CFG), 4, seed=7)
        with torch.no_grad():
            model.loss(x, y)
        out[f"{name} no_grad"] = live(model)
        loss = model.loss(x, y)
        out[f"{name} forward"] = live(model)
        out[f"{name} last bucket"] = len(model.communication_schedule().forward[-1].groups)
        out[f"{name} sharded"] = all(isinstance(p, DTensor) for p in model.parameters())
        before = _collectives(model)
        loss.backward()
        out[f"{name} backward collectives"] = _collectives(model) - before
        out[f"{name} backward"] = live(model)
        if name == "default":
            # A block whose backward does not unshard has nothing to keep its buffer for.
            model.blocks[-1].set_unshard_in_backward(False)
            model.loss(x, y)  # the graph is dropped unused
            out["no unshard in backward forward"] = live(model)
    return out


def case_lazy_landing() -> dict[str, Any]:
    """While a bucket's gather is in flight (prefetched during the bucket before it, in the
    forward and in the backward), its members hold no buffer memory: each member's buffer is
    allocated when the member lands, from its peers' received rows and its own shards."""
    from functional_fsdp.testing.models import GPTConfig, synthetic_batch

    model = _model("ours", 0, {})
    block = model.blocks[0]._ffsdp_state.group.layout.unsharded_bytes
    model.set_bucket_bytes(2 * block)  # buckets of two blocks
    _train(model, {})
    groups = [b._ffsdp_state.group for b in model.blocks]
    seen: list[bool] = []  # per bucket member with its gather in flight: buffer allocated

    def look(*_: Any) -> None:
        for g in groups:
            # (A group gathering alone receives straight into its buffer: no rows beside it.)
            if g.slot.pending is not None and g.slot.pending.share is not None:
                buf = g.slot.buffer
                seen.append(buf is not None and buf.untyped_storage().size() > 0)

    for b in model.blocks:
        b.register_forward_hook(look)
        b.register_full_backward_hook(look)
    x, y = synthetic_batch(GPTConfig(**CFG), 4, seed=7)
    model.loss(x, y).backward()
    return {"in_flight": len(seen), "allocated": sum(seen)}


def case_reduce_order() -> dict[str, Any]:
    """Where the backward's reduce-scatters are issued, with buckets that would put the root
    with the last blocks if cut on the backward's gather order: every bucket flushes when its
    last member hands in its gradients (none waits for the end of the backward), its members
    hand in one after another, and when a bucket's first member packs, no other group's
    reduction is in flight (one send buffer at a time)."""
    from functional_fsdp.shell.engine.coalesced import ReduceBucket
    from functional_fsdp.shell.engine.group import ParamGroup

    model = _model("ours", 0, {})
    groups = [m._ffsdp_state.group for m in [model, *model.blocks]]
    names = {id(g): ("root" if i == 0 else f"b{i - 1}") for i, g in enumerate(groups)}
    block = groups[1].layout.unsharded_bytes
    model.set_bucket_bytes(groups[0].layout.unsharded_bytes + 2 * block)
    handed: list[str] = []
    flushes: list[tuple[list[str], int, bool]] = []  # members, handed so far, in a hook
    in_flight_at_pack: list[list[str]] = []
    in_hook = [False]
    originals = (ParamGroup.post_backward, ReduceBucket.flush, ReduceBucket.columns)

    def post_backward(self: Any, grads: Any) -> None:
        handed.append(names[id(self)])
        in_hook[0] = True
        try:
            originals[0](self, grads)
        finally:
            in_hook[0] = False

    def flush(self: Any) -> None:
        if self._inputs:
            members = [names[id(g)] for g in self.members if id(g) in self._inputs]
            flushes.append((members, len(handed), in_hook[0]))
        originals[1](self)

    def columns(self: Any, group: Any) -> Any:
        first = not self._inputs
        out = originals[2](self, group)  # the bucket's send buffer exists now
        if first:
            in_flight_at_pack.append([names[id(g)] for g in groups if g.pending_reduce is not None])
        return out

    ParamGroup.post_backward = post_backward  # type: ignore[method-assign]
    ReduceBucket.flush = flush  # type: ignore[method-assign]
    ReduceBucket.columns = columns  # type: ignore[method-assign]
    try:
        _train(model, {})
    finally:
        ParamGroup.post_backward, ReduceBucket.flush, ReduceBucket.columns = originals  # type: ignore[method-assign]
    sched = model.communication_schedule()
    from functional_fsdp.shell.comm.custom import base_comm

    comm = base_comm(groups[1].comm)
    assert comm is not None
    return {
        "wait_stats": comm.wait_stats,
        "issued": comm.collectives_issued,
        "gather_first": sched.backward[0].groups[0],
        "reduce_last": sched.reduce[-1].groups[-1],
        "handed": handed[: len(groups)],
        "flushes": flushes,
        "in_flight_at_pack": in_flight_at_pack,
        "reduce_buckets": [list(b.groups) for b in sched.reduce],
    }


def _collectives(model: Any) -> int:
    """Collectives issued so far by the model's process-group communicators."""
    from functional_fsdp.shell.comm.custom import base_comm

    bases = {}
    for m in model.modules():
        st = getattr(m, "_ffsdp_state", None)
        if st is not None and st.group is not None:
            for c in st.group.comms():
                b = base_comm(c)
                if b is not None:
                    bases[id(b)] = b
    return sum(b.collectives_issued for b in bases.values())


def case_2d() -> dict[str, Any]:
    """2-D FSDP + TP (2 dp x 2 tp): coalesced over dp vs one collective per group."""
    from _tp_helpers import batch, build, dp_rank, full_params, optimizer, world_mesh

    mesh = world_mesh()
    runs, counts, buckets = {}, {}, {}
    for name, size in (("alone", 0), ("coalesced", 1 << 20)):
        model = build("ours", mesh)
        model.set_bucket_bytes(size)
        opt = optimizer(model.parameters())
        before = _collectives(model)
        for step in range(STEPS):
            x, y = batch(step, dp_rank(mesh))
            model.loss(x, y).backward()
            opt.step()
            opt.zero_grad()
        counts[name] = _collectives(model) - before
        runs[name] = full_params(model)
        buckets[name] = len(model.communication_schedule().forward)
    return {
        "equal": all(torch.equal(runs["alone"][k], runs["coalesced"][k]) for k in runs["alone"]),
        "collectives": counts,
        "buckets": buckets,
    }


def case_divergent_order() -> str:
    """After the schedule is derived, ranks whose forwards differ (rank 1 skips a block, so
    its buckets hold fewer groups) end in a named error, never a hang or a crash."""
    import torch.distributed as dist

    from functional_fsdp.core.errors import FSDPError
    from functional_fsdp.testing.models import GPTConfig, synthetic_batch

    model = _model("ours", 1 << 20, {})
    cfg = GPTConfig(**CFG)
    x, y = synthetic_batch(cfg, 2, seed=dist.get_rank())
    model.loss(x, y).backward()
    if dist.get_rank() == 1:
        model.blocks = torch.nn.ModuleList(list(model.blocks)[:-1])
    try:
        model.loss(x, y).backward()
        return "no error"
    except FSDPError as e:
        return type(e).__name__
    finally:
        model.reset_iter_state()


# ----------------------------------------------------------------------------- tests

CASES = {
    "fp32": ({}, True),
    "bf16": ({"bf16": True}, False),
    "raf_false": ({"raf": False}, False),
    "no_sync": ({"no_sync": True}, False),
    "explicit_prefetch": ({"explicit_prefetch": True}, False),
    "member_messages": ({"member_messages": True}, True),
}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CASES))
def test_coalesced_equals_one_collective_per_group(world2, name: str) -> None:
    opts, with_fsdp2 = CASES[name]
    res = world2.run(case_equal, opts, with_fsdp2)
    r = res[0]
    print(name, r)
    assert all(x["equal"] for x in res), r
    if with_fsdp2:
        assert all(x["equal_fsdp2"] for x in res), r
    # Not vacuous: buckets of several groups, and fewer collectives than one per group.
    assert r["forward_buckets"] < r["groups"] and r["backward_buckets"] < r["groups"], r
    assert r["collectives"]["coalesced"] < r["collectives"]["alone"], r
    # These blocks are small: their buckets gather in one packed message per peer, unless
    # every member is made to travel as its own message.
    assert all(x["packs_members"] == (name != "member_messages") for x in res), r


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_last_forward_bucket_keeps_its_buffer_for_the_backward(world2) -> None:
    n = CFG["n_layers"]
    for r in world2.run(case_kept_for_backward):
        k = r["default last bucket"]  # blocks, the last ones
        assert 2 <= k < n, r
        assert r["default forward"] == [False] * (n - k) + [True] * k, r
        assert r["no unshard in backward forward"] == [False] * (n - k) + [True] * (k - 1) + [
            False
        ], r
        assert r["explicit forward"] == [False] * n, r
        assert r["default no_grad"] == r["explicit no_grad"] == [False] * n, r
        assert r["default backward"] == r["explicit backward"] == [False] * n, r
        assert r["default sharded"] and r["explicit sharded"], r
        # The kept bucket is not gathered again: one collective fewer in the backward (its
        # members' gather was one).
        assert r["default backward collectives"] == r["explicit backward collectives"] - 1, r


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_prefetched_bucket_holds_no_member_buffers(world2) -> None:
    for r in world2.run(case_lazy_landing):
        # Not vacuous: gathers were seen in flight, in forward and backward hooks.
        assert r["in_flight"] >= 4 and r["allocated"] == 0, r


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_reduce_buckets_follow_the_order_post_backwards_run(world2) -> None:
    n = CFG["n_layers"]
    for r in world2.run(case_reduce_order):
        # The backward reaches the root first (its output is the loss) but runs its
        # post-backward last (its unshard node is the oldest, and autograd runs the ready
        # nodes latest-made first): gathers and reductions are cut on different orders.
        assert r["gather_first"] == "GPT" and r["reduce_last"] == "GPT", r
        assert r["handed"] == [f"b{i}" for i in range(n - 1, -1, -1)] + ["root"], r
        assert len(r["flushes"]) == STEPS * len(r["reduce_buckets"]), r
        assert any(len(b) > 1 for b in r["reduce_buckets"]), r
        for members, handed, in_hook in r["flushes"]:
            # Issued by the post-backward of its last member, right after the others'.
            assert in_hook, r
            step_order = r["handed"]
            i = handed % len(step_order) or len(step_order)
            assert step_order[i - len(members) : i] == members, r
        assert r["in_flight_at_pack"] and all(x == [] for x in r["in_flight_at_pack"]), r
        # The waits are counted (bench_step.py reports the time they block).
        waits, seconds = r["wait_stats"]
        assert 0 < waits <= r["issued"] and seconds > 0.0, r


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_host_buffer_pool_changes_no_bits(world2) -> None:
    res = world2.run(case_host_pool)
    print(res[0])
    assert all(r["equal"] and r["equal_fsdp2"] for r in res), res
    # Not vacuous: the pooled run reused memory every step, the unpooled one never did (on
    # torch 2.11, without UntypedStorage._swap_data_ptr_, the pool keeps nothing: no hits).
    pooled_hits = (lambda n: n > 10) if HAS_SWAP_DATA_PTR else (lambda n: n == 0)
    assert all(pooled_hits(r["hits"]["pooled"]) and r["hits"]["unpooled"] == 0 for r in res), res
    assert all(r["kept"] == {"pooled": 0, "unpooled": 0} for r in res), res


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["hsdp", "raf_int"])
def test_coalesced_on_four_ranks(world4, name: str) -> None:
    # raf_int: blocks with reshard_after_forward=2 (of 4 ranks) travel alone, between blocks
    # that coalesce.
    opts = {"hsdp": True} if name == "hsdp" else {"raf_mixed": True}
    res = world4.run(case_equal, opts, False)
    r = res[0]
    print(name, r)
    assert all(x["equal"] for x in res), r
    assert r["forward_buckets"] < r["groups"], r
    assert r["collectives"]["coalesced"] < r["collectives"]["alone"], r


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_coalesced_2d_fsdp_tp(world4) -> None:
    res = world4.run(case_2d)
    r = res[0]
    print(r)
    assert all(x["equal"] for x in res), r
    assert r["buckets"]["coalesced"] < r["buckets"]["alone"], r
    assert r["collectives"]["coalesced"] < r["collectives"]["alone"], r


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_divergent_forward_order_is_a_named_error(world2) -> None:
    res = world2.run(case_divergent_order)
    assert all(x != "no error" for x in res), res


def test_bucket_bytes_is_validated() -> None:
    from functional_fsdp import fully_shard
    from functional_fsdp.core.errors import PolicyError

    with pytest.raises(PolicyError, match="bucket_bytes"):
        fully_shard(torch.nn.Linear(2, 2), bucket_bytes=-1)


@given(
    trees=st.lists(param_trees(dtypes=[torch.float32], max_leaves=3), min_size=1, max_size=3),
    ws=world_sizes(),
    seed=st.integers(0, 2**16),
)
def test_members_packed_into_one_send_buffer_reduce_the_same(
    trees: list[Any], ws: int, seed: int
) -> None:
    """Members packing into their columns of one bucket buffer (``pack_grads(out=...)``) send
    that buffer without the concatenating copy, and reduce to the same bits."""
    # A row: the padded shard, then the presence flags (the exact reduction carries them on
    # more than one rank).
    sizes = [reduce_row_numel(shard(t, world_size=ws, rank=0).layout, ws > 1) for t in trees]
    grads = [[random_like(t, seed + 7 * r + m) for m, t in enumerate(trees)] for r in range(ws)]

    def rank(c: Any, gs: list[Any]) -> tuple[list[torch.Tensor], list[torch.Tensor], bool]:
        states = [shard(t, world_size=ws, rank=c.rank) for t in trees]
        alone = [reduce_input(g, s, c) for g, s in zip(gs, states)]
        buf = torch.empty(ws, sum(sizes))
        cols = [buf.narrow(1, sum(sizes[:i]), n) for i, n in enumerate(sizes)]
        joined = [reduce_input(g, s, c, out=o) for g, s, o in zip(gs, states, cols)]
        a = issue_reduce_coalesced(alone, c, async_op=False)
        b = issue_reduce_coalesced(joined, c, async_op=False)
        sent_buffer = b[0].input is not None and b[0].input.data_ptr() == buf.data_ptr()
        return [p.output for p in a], [p.output for p in b], sent_buffer

    for outs_alone, outs_joined, sent_buffer in SimulatedWorld(ws).run(rank, grads):
        assert sent_buffer or ws == 1 or sum(sizes) == 0
        for x, y in zip(outs_alone, outs_joined):
            assert torch.equal(x, y)


@given(
    trees=st.lists(param_trees(dtypes=[torch.float32], max_leaves=3), min_size=1, max_size=3),
    ws=world_sizes(),
    seed=st.integers(0, 2**16),
)
def test_a_bucket_lands_together_as_each_member_alone(trees: list[Any], ws: int, seed: int) -> None:
    """``finish_reductions`` lands a bucket's members (one reduce-scatter) into their current
    local gradients, added in place when donated: the same bits as each member's own
    ``reduce_grad`` added to its gradients; without currents, the records only."""
    grads = [[random_like(t, seed + 7 * r + m) for m, t in enumerate(trees)] for r in range(ws)]

    def rank(c: Any, gs: list[Any]) -> tuple[list[Any], list[Any], list[bool], list[Any]]:
        states = [shard(t, world_size=ws, rank=c.rank) for t in trees]
        alone = [reduce_grad(g, s, c) for g, s in zip(gs, states)]
        currents = [[torch.ones_like(lg) for lg in _locals(a)] for a in alone]
        before = [list(cur) for cur in currents]
        pendings = issue_reduce_coalesced(
            [reduce_input(g, s, c) for g, s in zip(gs, states)], c, async_op=False
        )
        landed = finish_reductions(pendings, currents, donate=True)
        want = [[lg + 1 for lg in _locals(a)] for a in alone]
        got = [list(grads) for _, _, grads in landed]
        in_place = [all(x is y for x, y in zip(g, b)) for g, b in zip(got, before)]
        bare = finish_reductions(
            issue_reduce_coalesced(
                [reduce_input(g, s, c) for g, s in zip(gs, states)], c, async_op=False
            )
        )
        return want, got, in_place, [grads for _, _, grads in bare]

    for want, got, in_place, bare in SimulatedWorld(ws).run(rank, grads):
        assert all(in_place) and all(b is None for b in bare)
        for w, g in zip(want, got):
            assert all(torch.equal(x, y) for x, y in zip(w, g))


def _locals(s: Any) -> list[torch.Tensor]:
    return [s.local_grad(i) for i in range(len(s.layout))]


@given(
    trees=st.lists(param_trees(dtypes=[torch.float32], max_leaves=3), min_size=1, max_size=3),
    ws=world_sizes(),
    pieces=st.booleans(),
    packed_members=st.booleans(),
    on_demand=st.booleans(),
)
def test_coalesced_unshard_lands_every_member_as_alone(
    trees: list[Any], ws: int, pieces: bool, packed_members: bool, on_demand: bool
) -> None:
    """One all-gather for a bucket (packed, or with the pieces collectives one message per
    member and peer, or for small members one packed message per peer) lands each member's
    full parameters as its own gather does. Buffers handed as a callable are asked for only
    when the bucket copies out at once (not :func:`lands_by_member`); otherwise each member
    lands into the buffer its landing passes."""

    def rank(c: Any) -> tuple[list[Any], list[Any]]:
        states = [shard(t, world_size=ws, rank=c.rank) for t in trees]
        alone = [unshard(s, c).params for s in states]
        intos = [torch.empty(ws * wire(s.layout)[0].total) for s in states]
        asked: list[bool] = []
        given: Any = (lambda: asked.append(True) or intos) if on_demand else intos
        pendings = begin_unshard_coalesced(states, c, given, async_op=False)
        lazy = on_demand and lands_by_member(states, c)
        assert asked == ([] if lazy or not on_demand else [True])
        assert all((p.share is not None) == lazy for p in pendings)
        joined = [finish_unshard(p, into=i).params for p, i in zip(pendings, intos)]
        return alone, joined

    # A huge pieces_min_bytes makes every bucket's members small (packs_members); single
    # groups then take the packed path too.
    world = SimulatedWorld(ws, pieces=pieces, pieces_min_bytes=(1 << 40) if packed_members else 0)
    for alone, joined in world.run(rank):
        for a, b in zip(alone, joined):
            assert all(torch.equal(x, y) for x, y in zip(a, b))


@given(
    trees=st.lists(param_trees(dtypes=[torch.float32], max_leaves=3), min_size=2, max_size=4),
    ws=st.integers(2, 4),
    order=st.randoms(use_true_random=False),
    drop=st.integers(0, 3),
)
def test_members_land_one_by_one_and_the_rows_go_with_the_last(
    trees: list[Any], ws: int, order: Any, drop: int
) -> None:
    """Without buffers (the pieces gather of dim-0 groups), each member lands its part when
    asked, in any order, equal to its own gather; the received rows are freed once, right
    after the last member landed or dropped its part. Elsewhere no buffers is a named error."""

    def rank(c: Any) -> tuple[list[Any], list[Any], list[int]]:
        states = [shard(t, world_size=ws, rank=c.rank) for t in trees]
        alone = [unshard(s, c).params for s in states]
        if not lands_by_member(states, c):
            with pytest.raises(StateError, match="pass every member's buffer"):
                begin_unshard_coalesced(states, c, None)
            return alone, alone, [len(states)]
        frees: list[int] = []
        done = 0

        def free(t: torch.Tensor) -> None:
            frees.append(done)
            t.untyped_storage().resize_(0)

        pendings = begin_unshard_coalesced(states, c, None, async_op=False, free=free)
        assert all(p.into is None and p.share is not None for p in pendings)
        idx = list(range(len(states)))
        order.shuffle(idx)
        dropped = set(idx[: min(drop, len(idx) - 1)])
        joined: list[Any] = [None] * len(states)
        for i in idx:
            if i in dropped:
                pendings[i].share.drop()
                pendings[i].share.drop()  # idempotent
                joined[i] = alone[i]
            else:
                into = torch.empty(ws * wire(states[i].layout)[0].total)
                joined[i] = finish_unshard(pendings[i], into=into).params
            done += 1
        return alone, joined, frees

    for alone, joined, frees in SimulatedWorld(ws, pieces=True).run(rank):
        last = len(trees) - 1  # members done before the last one's landing or drop
        assert frees == [last], frees  # one allocation: the rows and the send row
        for a, b in zip(alone, joined):
            assert all(torch.equal(x, y) for x, y in zip(a, b))


class _Declares:
    supports_pieces = True
    pieces_min_bytes = 1 << 20  # gloo's


def test_small_members_travel_packed_and_block_sized_ones_alone() -> None:
    """``packs_members``: the tiny benchmark's members (6.5 KiB rows) share one message per
    peer; the deep model's (393 KiB rows) keep one each; nothing packs where the pieces
    collectives are not offered."""
    comm: Any = _Declares()
    assert packs_members(comm, [6656] * 33)
    assert not packs_members(comm, [393 << 10] * 5)
    assert packs_members(comm, [(64 << 10) - 1] * 3) and not packs_members(comm, [64 << 10] * 3)
    comm.supports_pieces = False
    assert not packs_members(comm, [6656] * 33)


def test_pack_grads_into_a_wrong_buffer_is_a_named_error() -> None:
    """``pack_grads(out=...)`` checks the buffer before writing: a wrong shape or dtype names
    what it expected."""
    tree = {"w": torch.zeros(4, 3), "b": torch.zeros(5)}
    lay = shard(tree, world_size=2, rank=0).layout
    grads = [torch.ones(5), torch.ones(4, 3)]  # layout order: the sorted keys
    good = torch.full((2, lay.shard_numel), 7.0)
    packed = pack_grads(grads, lay, out=good)
    assert packed.data_ptr() == good.data_ptr() and torch.equal(packed, pack_grads(grads, lay))
    n = lay.shard_numel
    for bad in (torch.full((2, n + 1), 3.0), torch.full((2, n), 3.0, dtype=torch.float64)):
        before = bad.clone()
        with pytest.raises(StateError, match=rf"out must be \(2, {n}\) of torch.float32"):
            pack_grads(grads, lay, out=bad)
        assert torch.equal(bad, before)  # nothing written
