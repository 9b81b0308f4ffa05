"""State dicts, DCP resharding N -> M, resume-equals-uninterrupted, safe loading, deepcopy.

Damaged and crafted checkpoints (paths outside the directory, flipped bytes) are in
``test_reliability.py``.

One 2-rank and one 4-rank gloo world serve the module. World size 1 runs inside the 2-rank
world: each rank shards over a mesh of its own one-rank group and loads independently.
"""

from __future__ import annotations

import copy
import io
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _dist import World

from functional_fsdp import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    fully_shard,
    load_checkpoint,
    save_checkpoint,
    summon_full_params,
)
from functional_fsdp.core.errors import StateError, UncheckedCheckpointWarning
from functional_fsdp.testing.models import GPT, Block, GPTConfig, synthetic_batch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

CFG = GPTConfig(vocab=37, dim=12, n_layers=2, n_heads=2, seq=8)
GLOBAL_BATCH = 4


# ----------------------------------------------------------------------------- model (ranks)


class Net(GPT):
    """The test GPT plus a one-row parameter, so ranks > 0 hold empty shards of it."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.logit_bias = nn.Parameter(0.01 * torch.randn(1, cfg.vocab))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx) + self.logit_bias


def _mesh(world_size_one: bool = False):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if not world_size_one:
        return init_device_mesh("cpu", (dist.get_world_size(),))
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return DeviceMesh.from_group(groups[dist.get_rank()], "cpu")


def _sharded(seed: int, mesh=None, *, meta: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            model = Net(CFG)
    else:
        model = Net(CFG)
    mesh = mesh if mesh is not None else _mesh()
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _groups(model: nn.Module) -> list:
    return [
        m._ffsdp_state.group
        for m in model.modules()
        if getattr(m, "_ffsdp_state", None) is not None
    ]


def _assert_consistent(model: nn.Module) -> None:
    """Registered params are each group's DTensors, whose local tensors view its flat buffer."""
    from torch.distributed.tensor import DTensor

    for g in _groups(model):
        base = g.state.flat.untyped_storage().data_ptr()
        for p, holders in zip(g.params, g.holders):
            for m, n in holders:
                assert m._parameters[n] is p
            assert isinstance(p, DTensor) and not p.is_meta
            if p._local_tensor.numel():
                assert p._local_tensor.untyped_storage().data_ptr() == base


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    from _helpers import full_named

    return full_named(dict(model.named_parameters()))


def _local_batch(step: int, mesh) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch of ``step`` (the same data at every world size)."""
    x, y = synthetic_batch(CFG, GLOBAL_BATCH, seed=step)
    ws, rank = mesh.size(), mesh.get_local_rank()
    per = GLOBAL_BATCH // ws
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, mesh) -> list[float]:
    """AdamW steps; returns the global mean loss per step."""
    losses = []
    for step in steps:
        x, y = _local_batch(step, mesh)
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t, group=mesh.get_group())
        losses.append(t.item() / mesh.size())
    return losses


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _full_optim(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    state = {k: {s: v.detach().clone() for s, v in d.items()} for k, d in osd["state"].items()}
    return {"state": state, "param_groups": osd["param_groups"]}


# ----------------------------------------------------------------------------- cases (ranks)


def case_sharded_state_dict() -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    a, b, c = _sharded(0), _sharded(1), _sharded(2)
    mesh = a.tok.weight.device_mesh
    x, _ = _local_batch(0, mesh)
    collective_names = [
        n
        for n in (
            "all_gather_into_tensor",
            "all_gather_single",
            "all_gather",
            "broadcast",
            "all_reduce",
            "reduce_scatter_tensor",
            "reduce_scatter_single",
            "all_to_all_single",
            "batch_isend_irecv",
            "isend",
            "irecv",
            "send",
            "recv",
        )
        if hasattr(dist, n)
    ]
    saved = {n: getattr(dist, n) for n in collective_names}

    def forbidden(*args, **kwargs):
        raise AssertionError("state_dict() must not communicate")

    for n in collective_names:
        setattr(dist, n, forbidden)
    try:
        sd = a.state_dict()
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)
    flats = {g.state.flat.untyped_storage().data_ptr() for g in _groups(a)}
    for k, v in sd.items():
        assert isinstance(v, DTensor) and tuple(v.placements) == (Shard(0),), k
        if v._local_tensor.numel():
            assert v._local_tensor.untyped_storage().data_ptr() in flats, k
    with torch.no_grad():
        want = a(x)
    # Plain load (copy into the local tensors): same Parameter objects, same buffer.
    before = list(b.parameters())
    b.load_state_dict(sd)
    assert list(b.parameters()) == before
    _assert_consistent(b)
    with torch.no_grad():
        assert torch.equal(b(x), want)
    # assign=True replaces the parameters: the group re-adopts them into a fresh buffer.
    c.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, assign=True)
    _assert_consistent(c)
    with torch.no_grad():
        assert torch.equal(c(x), want)
    # Round trip: snapshot, train, restore.
    snapshot = {k: v.detach().clone() for k, v in sd.items()}
    _train(a, _adamw(a), range(1), mesh)
    a.load_state_dict(snapshot)
    with torch.no_grad():
        assert torch.equal(a(x), want)
    # assign=True with other placements (replicated) and with full plain tensors.
    d, e = _sharded(3), _sharded(4)
    d.load_state_dict({k: v.redistribute(mesh, [Replicate()]) for k, v in sd.items()}, assign=True)
    e.load_state_dict({k: v.full_tensor() for k, v in sd.items()}, assign=True)
    for m in (d, e):
        _assert_consistent(m)
        with torch.no_grad():
            assert torch.equal(m(x), want)
    # The re-adopted model still trains like the original.
    la = _train(a, _adamw(a), range(1, 3), mesh)
    le = _train(e, _adamw(e), range(1, 3), mesh)
    assert la == le


def case_full_state_dict() -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    rank = dist.get_rank()
    a = _sharded(0)
    mesh = a.tok.weight.device_mesh
    _train(a, _adamw(a), range(2), mesh)
    x, _ = _local_batch(5, mesh)
    with torch.no_grad():
        want = a(x)
    full = get_model_state_dict(a, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        plain = Net(CFG)
        plain.load_state_dict(full)  # strict: keys and shapes of a plain model
        assert all(type(v) is torch.Tensor and v.device.type == "cpu" for v in full.values())
        with torch.no_grad():
            assert torch.equal(plain(x), want)
    else:
        assert full == {}
    # FSDP1's route to the same dict: summon on rank 0 only, on CPU.
    with summon_full_params(a, writeback=False, rank0_only=True, offload_to_cpu=True):
        if rank == 0:
            summoned = {k: v.detach().clone() for k, v in a.state_dict().items()}
            assert summoned.keys() == full.keys()
            assert all(torch.equal(summoned[k], full[k]) for k in full)
    # Broadcast from rank 0 into a fresh sharded model, and into one built on the meta device.
    for meta in (False, True):
        f = _sharded(7, meta=meta)
        # set_model_state_dict updates the dict it is given in place: pass a copy to reuse it.
        set_model_state_dict(
            f,
            dict(full) if rank == 0 else {},
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        )
        _assert_consistent(f)
        with torch.no_grad():
            assert torch.equal(f(x), want)


def case_train_save(path: str, save_at: int, total: int) -> dict | None:
    """Train ``total`` steps uninterrupted, saving model + AdamW after ``save_at`` with
    ``save_checkpoint`` (DCP plus checksums: resharded loads verify the chunks they read)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _sharded(0)
    mesh = model.tok.weight.device_mesh
    opt = _adamw(model)
    losses = _train(model, opt, range(save_at), mesh)
    msd, osd = get_state_dict(model, opt)
    save_checkpoint({"model": msd, "optim": osd}, path)
    saved = {"full": _full(model), "optim": _full_optim(model, opt)}
    losses += _train(model, opt, range(save_at, total), mesh)
    return {"losses": losses, **saved} if dist.get_rank() == 0 else None


def case_resume(path: str, save_at: int, total: int, world_size_one: bool) -> dict | None:
    """Load the checkpoint into a fresh model at this world size and train to ``total``."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    mesh = _mesh(world_size_one)
    model = _sharded(123, mesh)  # different initial weights: the checkpoint must replace them
    opt = _adamw(model)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    with warnings.catch_warnings():
        # saved by save_checkpoint: every chunk this world size reads is verified
        warnings.simplefilter("error", UncheckedCheckpointWarning)
        load_checkpoint(sd, path, process_group=mesh.get_group() if world_size_one else None)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    _assert_consistent(model)
    loaded = {"full": _full(model), "optim": _full_optim(model, opt)}
    losses = _train(model, opt, range(save_at, total), mesh)
    return {"losses": losses, **loaded} if mesh.get_local_rank() == 0 else None


def case_deepcopy() -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    model = _sharded(0)
    mesh = model.tok.weight.device_mesh
    opt = _adamw(model)
    _train(model, opt, range(1), mesh)
    x, _ = _local_batch(9, mesh)
    with torch.no_grad():
        want = model(x)
    ema = copy.deepcopy(model)
    _assert_consistent(ema)
    ours, theirs = _groups(model), _groups(ema)
    assert len(ours) == len(theirs)
    for g, h in zip(ours, theirs):
        assert (
            g is not h
            and h.state.flat.untyped_storage().data_ptr()
            != g.state.flat.untyped_storage().data_ptr()
        )
        assert all(p is not q for p, q in zip(g.params, h.params))
    assert ema._ffsdp_state is not model._ffsdp_state
    with torch.no_grad():
        assert torch.equal(ema(x), want)
    # Train the copy: the original is untouched (values, grads, optimizer).
    snapshot = [g.state.flat.clone() for g in ours]
    ema_losses = _train(ema, _adamw(ema), range(1, 3), mesh)
    assert all(torch.equal(g.state.flat, s) for g, s in zip(ours, snapshot))
    assert all(p.grad is None for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(model(x), want)
    # Train the original: it continues exactly as the copy did from the same point.
    ema_snapshot = [h.state.flat.clone() for h in theirs]
    assert _train(model, _adamw(model), range(1, 3), mesh) == ema_losses
    assert all(torch.equal(h.state.flat, s) for h, s in zip(theirs, ema_snapshot))
    # EMA update through DTensor ops stays local and consistent.
    before = _full(ema)
    with torch.no_grad():
        for pe, p in zip(ema.parameters(), model.parameters()):
            pe.lerp_(p, 0.5)
    after, cur = _full(ema), _full(model)
    for n in after:
        torch.testing.assert_close(after[n], before[n].lerp(cur[n], 0.5))
    _assert_consistent(ema)
    # A child FSDP module copies on its own and runs as its own root.
    blk = copy.deepcopy(model.blocks[0])
    plain = Block(CFG)
    plain.load_state_dict(get_model_state_dict(model.blocks[0], options=_full_options()))
    h = torch.randn(2, CFG.seq, CFG.dim)
    with torch.no_grad():
        assert torch.equal(blk(h), plain(h))
    # As a root after a no_grad forward it is sharded again (nothing to keep for a backward).
    assert isinstance(blk.fc.weight, DTensor) and not blk._ffsdp_state.group.is_unsharded
    blk.reshard()
    assert isinstance(blk.fc.weight, DTensor)
    with summon_full_params(model), pytest.raises(StateError, match="deepcopy"):
        copy.deepcopy(model)


def _full_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True)


# ----------------------------------------------------------------------------- tests


def test_sharded_state_dict_round_trips(world2: World, world4: World) -> None:
    world2.run(case_sharded_state_dict)
    world4.run(case_sharded_state_dict)


def test_full_state_dict_gather_and_broadcast(world2: World, world4: World) -> None:
    world2.run(case_full_state_dict)
    world4.run(case_full_state_dict)


def _assert_same_state(got: dict, want: dict) -> None:
    assert got["full"].keys() == want["full"].keys()
    for k in want["full"]:
        assert torch.equal(got["full"][k], want["full"][k]), k
    go, wo = got["optim"], want["optim"]
    assert go["param_groups"] == wo["param_groups"]
    assert go["state"].keys() == wo["state"].keys()
    for k, d in wo["state"].items():
        for s, v in d.items():
            assert torch.equal(go["state"][k][s], v), (k, s)


SAVE_AT, TOTAL = 2, 4


@pytest.mark.parametrize(
    ("n", "m"), [(2, 1), (2, 4), (4, 2), (2, 2)], ids=["2to1", "2to4", "4to2", "2to2"]
)
def test_dcp_reshards_and_resumes(world2: World, world4: World, tmp_path, n: int, m: int) -> None:
    worlds = {2: world2, 4: world4}
    path = str(tmp_path / "ckpt")
    saved = worlds[n].run(case_train_save, path, SAVE_AT, TOTAL)[0]
    results = worlds[2 if m == 1 else m].run(case_resume, path, SAVE_AT, TOTAL, m == 1)
    resumed = [r for r in results if r is not None]
    assert len(resumed) == (2 if m == 1 else 1)
    for r in resumed:
        _assert_same_state(r, saved)
        if n == m:
            assert r["losses"] == saved["losses"][SAVE_AT:]
        else:
            # Another world size reduces gradients in another order: equal up to rounding.
            torch.testing.assert_close(r["losses"], saved["losses"][SAVE_AT:], rtol=1e-5, atol=1e-6)


def test_deepcopy_gives_an_independent_sharded_module(world2: World, world4: World) -> None:
    world2.run(case_deepcopy)
    world4.run(case_deepcopy)


# ----------------------------------------------------------------------------- safe loading


class _Marker:
    """Unpickling this creates a directory: the proof that code ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_metadata_with_foreign_globals_is_refused(tmp_path) -> None:
    marker = str(tmp_path / "pwned")
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Marker(marker)))
    with pytest.raises(pickle.UnpicklingError, match="not a DCP metadata type"):
        SafeFileSystemReader(str(tmp_path)).read_metadata()
    assert not os.path.exists(marker)


def test_non_tensor_entries_load_weights_only(tmp_path) -> None:
    marker = str(tmp_path / "pwned")
    buf = io.BytesIO()
    torch.save({"lr": 0.1, "payload": _Marker(marker)}, buf)
    buf.seek(0)
    planner = SafeLoadPlanner()
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(None, buf)  # type: ignore[arg-type]
    assert not os.path.exists(marker)


# ----------------------------------------------------------- a failed load changes nothing


def _local_snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Clones of this rank's shards of every parameter and every optimizer state tensor."""
    out = {f"param {n}": p.to_local().detach().clone() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                local = v.to_local() if hasattr(v, "to_local") else v
                out[f"optim {names[id(p)]}.{k}"] = local.detach().clone()
    return out


def case_failed_load_changes_nothing(
    path: str, damaged_rank: int, plain: bool, damage: str = "truncate"
) -> dict:
    """Save model + AdamW (plain ``dcp.save`` or ours), train one more step, cut the end off
    rank ``damaged_rank``'s data file (or delete it), then load: every rank must raise the named
    error and keep its parameters and optimizer state exactly as they were before the call."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from functional_fsdp.core.errors import CheckpointIntegrityError

    model = _sharded(0)
    mesh = model.tok.weight.device_mesh
    opt = _adamw(model)
    _train(model, opt, range(1), mesh)
    msd, osd = get_state_dict(model, opt)
    if plain:
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    else:
        save_checkpoint({"model": msd, "optim": osd}, path)
    _train(model, opt, range(1, 2), mesh)  # the live state now differs from the checkpoint
    dist.barrier()
    if dist.get_rank() == 0:
        file = os.path.join(path, f"__{damaged_rank}_0.distcp")
        if damage == "truncate":
            os.truncate(file, os.path.getsize(file) - 16)  # only the last item is cut
        else:
            os.remove(file)
    dist.barrier()
    before = _local_snapshot(model, opt)
    msd, osd = get_state_dict(model, opt)
    error = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UncheckedCheckpointWarning)
        try:
            load_checkpoint({"model": msd, "optim": osd}, path)
        except CheckpointIntegrityError as e:
            error = str(e)
    after = _local_snapshot(model, opt)
    assert before.keys() == after.keys()
    diff = {
        k: (after[k].double() - before[k].double()).abs().max().item()
        for k in before
        if before[k].numel()
    }
    return {
        "error": error,
        "max_diff": max(diff.values()),
        "changed": [k for k, v in diff.items() if v],
    }


@pytest.mark.parametrize("plain", [True, False], ids=["dcp_save", "save_checkpoint"])
@pytest.mark.parametrize("damaged_rank", [0, 1])
def test_failed_load_leaves_model_and_optimizer_unchanged(
    world2: World, tmp_path, damaged_rank: int, plain: bool
) -> None:
    results = world2.run(
        case_failed_load_changes_nothing, str(tmp_path / "ckpt"), damaged_rank, plain
    )
    for rank, r in enumerate(results):
        assert r["error"] is not None and "truncated" in r["error"], (rank, r["error"])
        assert r["max_diff"] == 0.0, (rank, r["max_diff"], r["changed"][:5])


def test_missing_data_file_fails_the_load_before_any_write(world2: World, tmp_path) -> None:
    results = world2.run(case_failed_load_changes_nothing, str(tmp_path / "ckpt"), 1, True, "rm")
    for rank, r in enumerate(results):
        assert r["error"] is not None and "cannot be read" in r["error"], (rank, r["error"])
        assert r["max_diff"] == 0.0, (rank, r["max_diff"], r["changed"][:5])
