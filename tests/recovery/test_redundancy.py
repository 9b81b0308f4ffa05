"""Neighbour copies (the first part of surviving a lost rank) on 4 gloo ranks.

After every optimizer step each rank holds its neighbour's sharded parameters and Adam state
(``keep_neighbour_copies``). The copies must equal what the neighbour holds bit for bit, and
be enough to rebuild the group on the survivors of a lost rank: ``core.recovery.regroup`` over
a process group of the 3 survivors, fed each survivor's own state and the copy it holds, must
give exactly the shards of the full tensors for 3 ranks (parameters and both moments).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

CFG = dict(vocab=64, dim=16, n_layers=3, n_heads=2, seq=8)

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _sharded_with_copies() -> tuple[Any, Any, Any, Any]:
    """The GPT sharded by block, AdamW, and its neighbour copies (config, model, optimizer,
    copies)."""
    from functional_fsdp import fully_shard, keep_neighbour_copies
    from functional_fsdp.testing.models import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(**CFG)
    model = GPT(cfg)
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return cfg, model, opt, keep_neighbour_copies(model, opt)


def case_copies(lost: int) -> dict[str, Any]:
    import torch.distributed as dist

    from functional_fsdp.core.recovery import copy_source, regroup, relayout
    from functional_fsdp.core.transitions import pack_locals, shard_tensors
    from functional_fsdp.shell.comm.process_group import ProcessGroupComm
    from functional_fsdp.testing.models import synthetic_batch

    cfg, model, opt, copies = _sharded_with_copies()
    rank, ws = dist.get_rank(), dist.get_world_size()
    for step in range(3):
        x, y = synthetic_batch(cfg, 2, seed=10 * step + rank)
        model.loss(x, y).backward()
        opt.step()
        opt.zero_grad()
    held = copies.held()
    groups = {"(root)": model._ffsdp_state.group}
    groups.update({f"blocks.{i}": b._ffsdp_state.group for i, b in enumerate(model.blocks)})

    def own(g: Any) -> dict[str, Any]:
        st = [opt.state[p] for p in g.params]
        return {
            "params": g.state.flat.clone(),
            "exp_avg": pack_locals([s["exp_avg"].to_local() for s in st], g.layout, rank).flat,
            "exp_avg_sq": pack_locals(
                [s["exp_avg_sq"].to_local() for s in st], g.layout, rank
            ).flat,
            "step": torch.cat([s["step"].float().reshape(1) for s in st]),
        }

    mine = {name: own(g) for name, g in groups.items()}
    everyone: list[Any] = [None] * ws
    dist.all_gather_object(everyone, mine)
    src = everyone[copy_source(rank, ws)]
    equal = all(
        torch.equal(held[n].params.flat, src[n]["params"])
        and torch.equal(held[n].moments["exp_avg"].flat, src[n]["exp_avg"])
        and torch.equal(held[n].moments["exp_avg_sq"].flat, src[n]["exp_avg_sq"])
        and torch.equal(held[n].scalars["step"], src[n]["step"])
        and held[n].params.rank == copy_source(rank, ws)
        for n in groups
    )
    # The full tensors (every rank computes them), then the survivors rebuild from memory.
    fulls = {
        n: {
            "params": [p.full_tensor() for p in g.params],
            "exp_avg": [opt.state[p]["exp_avg"].full_tensor() for p in g.params],
        }
        for n, g in groups.items()
    }
    survivors = [r for r in range(ws) if r != lost]
    pg = dist.new_group(survivors)
    rebuilt = None
    if rank != lost:
        comm = ProcessGroupComm(pg)
        rebuilt = True
        for n, g in groups.items():
            new_lay = relayout(g.layout, len(survivors))
            got = regroup(g.state, held[n].params, [lost], comm)
            want = shard_tensors(fulls[n]["params"], new_lay, comm.rank)
            own_avg = pack_locals(
                [opt.state[p]["exp_avg"].to_local() for p in g.params], g.layout, rank
            )
            got_avg = regroup(own_avg, held[n].moments["exp_avg"], [lost], comm)
            want_avg = shard_tensors(fulls[n]["exp_avg"], new_lay, comm.rank)
            assert got is not None and got_avg is not None
            rebuilt = (
                rebuilt
                and torch.equal(got.flat, want.flat)
                and torch.equal(got_avg.flat, want_avg.flat)
            )
    dist.barrier()
    copies.remove()
    return {
        "equal": equal,
        "rebuilt": rebuilt,
        "steps": copies.steps,
        "bytes": copies.bytes_per_step,
        "state_bytes": sum(t.numel() * t.element_size() for v in mine.values() for t in v.values()),
        # one fp32 mark per parameter: whether it has optimizer state (copies.HAS_STATE)
        "marks": 4 * sum(len(g.params) for g in groups.values()),
    }


def test_copies_equal_the_neighbours_state_and_rebuild_a_lost_rank(world4) -> None:
    for lost in (1, 3):
        res = world4.run(case_copies, lost)
        for r in res:
            assert r["equal"], r
            assert r["steps"] == 3, r
            # At most one copy of this rank's state per step (moments without their padding),
            # and the marks of which parameters have optimizer state.
            assert r["bytes"] <= r["state_bytes"] + r["marks"], r
        survivors = [r for i, r in enumerate(res) if i != lost]
        assert all(r["rebuilt"] is True for r in survivors), res
        assert res[lost]["rebuilt"] is None


def case_load_after_copies() -> list[str]:
    """Copies kept, a step, then a checkpoint loaded (the model's own state, written back in
    place) before the next step: what recovery's first call, ``restorable()``, says before
    and after the load."""
    from functional_fsdp.core.errors import StateError
    from functional_fsdp.testing.models import synthetic_batch

    cfg, model, opt, copies = _sharded_with_copies()
    model.loss(*synthetic_batch(cfg, 2, seed=0)).backward()
    opt.step()
    opt.zero_grad()
    # Complete the exchange the step started (restorable() polls one in flight, as after a
    # failure, which a healthy run's later wait would then miss).
    copies.wait()
    out = [repr(copies.restorable())]
    model.load_state_dict(model.state_dict())
    try:
        out.append(f"no error: {copies.restorable()!r}")
    except StateError as e:
        out.append(str(e))
    copies.remove()
    return out


def test_a_checkpoint_loaded_after_the_copies_is_named_at_recovery(world4) -> None:
    """Loaded after ``keep_neighbour_copies``, a checkpoint leaves every copy of the state
    from before it: a rebuild would mix the two. Recovery says so by name instead (it restored
    the stale copies before)."""
    for before, after in world4.run(case_load_after_copies):
        assert before.startswith("Restorable("), before
        assert "written after step 1's neighbour copies" in after, after
        assert "copies.remove(), load" in after, after


def test_redundancy_policy_is_validated() -> None:
    from functional_fsdp import Redundancy
    from functional_fsdp.core.errors import StateError

    assert Redundancy().copies == 1
    with pytest.raises(StateError, match="copies=1"):
        Redundancy(copies=2)
