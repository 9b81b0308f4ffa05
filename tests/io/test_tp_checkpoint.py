"""Checkpoints across parallelism changes: 2-D (2 dp x 2 tp) <-> 1-D FSDP <-> TP-only <-> plain.

One 4-rank gloo world serves the module; the plain (unsharded) model loads in the test process
itself (DCP without a process group). The 2-D model (``_tp_helpers``' transformer stack under
our ``fully_shard`` on ``world["dp"]`` after ``parallelize_module`` on ``world["tp"]``) trains
two AdamW steps and saves its ``get_state_dict`` (model and optimizer) twice: with plain
``dcp.save`` (what FSDP2 users do) and with our ``save_checkpoint``. Rank 0 also writes the full
state dict (``get_model_state_dict(full_state_dict=True)``) as the reference every load is
compared with, bit for bit (``torch.equal`` of full tensors):

- 2-D -> 2-D (model and AdamW state), 2-D -> TP-only (tp = 4), 2-D -> 1-D FSDP on 2 ranks
  (two independent 2-rank meshes of the 4-rank world), 2-D -> plain model (one process);
- 1-D -> 2-D and plain -> 2-D (checkpoints written by those layouts);
- full state dicts into a 2-D model: ``set_model_state_dict(broadcast_from_rank0=True)`` and
  ``load_state_dict(full, assign=True)``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from _full import full_parameters, full_tensors
from _tp_helpers import batch, build, reference_model, tp_plan, train, world_mesh
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from functional_fsdp import fully_shard, load_checkpoint, save_checkpoint

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

SAVE_STEPS = 2
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


@pytest.fixture(scope="module")
def saved(world4, tmp_path_factory) -> tuple[str, dict]:
    """The 2-D checkpoints (``dcp``, ``ours``) and the reference full state dict."""
    path = str(tmp_path_factory.mktemp("tp_ckpt"))
    res = world4.run(case_save_2d, path)
    assert all(r["full_is_global"] for r in res), res
    return path, torch.load(os.path.join(path, "full.pt"), weights_only=True)


# ----------------------------------------------------------------------------- helpers (ranks)


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    """Global tensors of every parameter (``full_tensor()`` of DTensors)."""
    return {n: t.detach().clone() for n, t in full_parameters(model).items()}


def _diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors are not bit-identical (or missing)."""
    assert set(got) == set(want), (sorted(got), sorted(want))
    return [k for k in want if not torch.equal(got[k], want[k])]


def _full_optim(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """AdamW state as global tensors, keyed ``fqn/exp_avg`` (no param_groups)."""
    msd, osd = get_state_dict(model, opt)
    del msd
    flat = {f"{fqn}/{k}": v for fqn, st in osd["state"].items() for k, v in st.items()}
    return {k: v.clone() for k, v in full_tensors(flat).items()}


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)


def _load(model: nn.Module, opt: torch.optim.Optimizer | None, path: str, how: str, **kw) -> None:
    """Load ``path`` into ``model`` (and ``opt``) as FSDP2 users do: target state dicts from
    ``get_state_dict``, DCP (``dcp.load`` or our ``load_checkpoint``), ``set_state_dict``."""
    if opt is None:
        sd: dict[str, Any] = {"model": get_model_state_dict(model)}
    else:
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
    if how == "dcp":
        dcp.load(sd, checkpoint_id=path, **kw)
    else:
        load_checkpoint(sd, path, **kw)
    if opt is None:
        set_model_state_dict(model, sd["model"])
    else:
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def _full_ref(path: str) -> dict[str, torch.Tensor]:
    return torch.load(os.path.join(path, "full.pt"), weights_only=True)


def _one_d(seed: int) -> tuple[nn.Module, Any]:
    """The plain model under 1-D FSDP on 2 ranks (ranks {0,1} and {2,3} are two replicas)."""
    mesh = world_mesh((2, 2), ("rep", "dp"))
    torch.manual_seed(seed)
    model = reference_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(float(seed))  # differs from what is loaded
    for b in model.blocks:
        fully_shard(b, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, mesh


def _tp_only() -> nn.Module:
    """TP over all 4 ranks, no FSDP (the MLP's 86 rows split unevenly, 22/22/21/21)."""
    from torch.distributed.tensor.parallel import parallelize_module

    model = reference_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    parallelize_module(model, world_mesh((4,), ("tp",)), tp_plan())
    return model


# ----------------------------------------------------------------------------- cases (ranks)


def case_save_2d(path: str) -> dict:
    """Train the 2-D model, save it both ways and the full state dict; check the full state
    dict against ``full_tensor()`` and against FSDP2 + TP's after the same steps."""
    mesh = world_mesh()
    model = build("ours", mesh)
    opt = _adamw(model)
    train_steps(model, opt, mesh)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(path, "dcp"))
    save_checkpoint({"model": msd, "optim": osd}, os.path.join(path, "ours"))
    full = get_model_state_dict(model, options=FULL)
    theirs = build("torch", mesh)
    train_steps(theirs, _adamw(theirs), mesh)
    their_full = get_model_state_dict(theirs, options=FULL)
    globals_ = _full(model)
    optim = _full_optim(model, opt)
    if dist.get_rank() == 0:
        torch.save(full, os.path.join(path, "full.pt"))
        torch.save(optim, os.path.join(path, "optim.pt"))
        ok = not _diff(full, globals_) and not _diff(full, their_full)
        ok = ok and all(type(v) is torch.Tensor for v in full.values())
    else:
        ok = full == {} and their_full == {}
    return {"full_is_global": ok}


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, mesh) -> None:
    for s in range(SAVE_STEPS):
        x, y = batch(s, mesh["dp"].get_local_rank())
        model.loss(x, y).backward()
        opt.step()
        opt.zero_grad()


def case_load_2d(path: str, src: str, how: str, with_optim: bool) -> list[str]:
    """A fresh 2-D model (untrained) loads ``src``; the names that differ from the reference."""
    mesh = world_mesh()
    model = build("ours", mesh)
    opt = _adamw(model) if with_optim else None
    _load(model, opt, os.path.join(path, src), how)
    bad = _diff(_full(model), _full_ref(path))
    if opt is not None:
        want = torch.load(os.path.join(path, "optim.pt"), weights_only=True)
        bad += _diff(_full_optim(model, opt), want)
    return bad


def case_load_tp_only(path: str, how: str) -> list[str]:
    model = _tp_only()
    _load(model, None, os.path.join(path, "ours" if how == "ours" else "dcp"), how)
    return _diff(_full(model), _full_ref(path))


def case_load_1d_and_save(path: str, how: str) -> list[str]:
    """1-D FSDP on 2 ranks loads the 2-D checkpoint (model and AdamW state), then saves its
    own for the 1-D -> 2-D direction."""
    model, _ = _one_d(3)
    opt = _adamw(model)
    _load(model, opt, os.path.join(path, "ours" if how == "ours" else "dcp"), how)
    bad = _diff(_full(model), _full_ref(path))
    want = torch.load(os.path.join(path, "optim.pt"), weights_only=True)
    bad += _diff(_full_optim(model, opt), want)
    msd, osd = get_state_dict(model, opt)
    save_checkpoint({"model": msd, "optim": osd}, os.path.join(path, "from_1d_" + how))
    return bad


def case_full_into_2d(path: str) -> list[str]:
    """Full state dicts into 2-D: broadcast from rank 0, and ``load_state_dict(assign=True)``
    of the global plain tensors and of replicated 2-D ``DTensor`` s (re-adopted by each
    group)."""
    from torch.distributed.tensor import Replicate

    mesh = world_mesh()
    full = _full_ref(path)
    a = build("ours", mesh)
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(a, dict(full) if dist.get_rank() == 0 else {}, options=opts)
    b = build("ours", mesh)
    b.load_state_dict(dict(full), assign=True)
    # assign=True with 2-D DTensors of other placements: redistributed to the group's.
    c = build("ours", mesh)
    replicated = [Replicate(), Replicate()]
    c.load_state_dict(
        {k: v.redistribute(placements=replicated) for k, v in a.state_dict().items()}, assign=True
    )
    bad = [f"bcast:{k}" for k in _diff(_full(a), full)]
    bad += [f"assign:{k}" for k in _diff(_full(b), full)]
    bad += [f"assign_dtensor:{k}" for k in _diff(_full(c), full)]
    # b's parameters stay 2-D DTensors viewing the group's buffer: one step trains like a.
    for m in (a, b):
        m.losses = train(m, mesh, steps=1, kind="sgd")
    if a.losses != b.losses:
        bad.append("train after assign")
    bad += [f"trained:{k}" for k in _diff(_full(b), _full(a))]
    return bad


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("how", ["dcp", "ours"])
def test_2d_round_trip_with_optimizer(world4, saved, how) -> None:
    path, _ = saved
    assert world4.run(case_load_2d, path, how, how, True) == [[]] * 4


@pytest.mark.parametrize("how", ["dcp", "ours"])
def test_2d_into_tp_only(world4, saved, how) -> None:
    path, _ = saved
    assert world4.run(case_load_tp_only, path, how) == [[]] * 4


@pytest.mark.parametrize("how", ["dcp", "ours"])
def test_2d_into_1d_and_back(world4, saved, how) -> None:
    path, _ = saved
    assert world4.run(case_load_1d_and_save, path, how) == [[]] * 4
    assert world4.run(case_load_2d, path, "from_1d_" + how, "ours", True) == [[]] * 4


@pytest.mark.parametrize("how", ["dcp", "ours"])
def test_2d_into_plain_and_back(world4, saved, how) -> None:
    """One process, no process group: DCP reads every 2-D shard into the full tensors."""
    path, full = saved
    model = reference_model()
    sd = {"model": model.state_dict()}
    src = os.path.join(path, "ours" if how == "ours" else "dcp")
    if how == "dcp":
        with pytest.warns(UserWarning, match="single process"):  # DCP's, without a group
            dcp.load(sd, checkpoint_id=src, no_dist=True)
    else:
        load_checkpoint(sd, src)
    model.load_state_dict(sd["model"])
    assert _diff(dict(model.state_dict()), full) == []
    # ... and the plain model's checkpoint loads into 2-D.
    out = os.path.join(path, "from_plain_" + how)
    save_checkpoint({"model": model.state_dict()}, out)
    assert world4.run(case_load_2d, path, "from_plain_" + how, how, False) == [[]] * 4


def test_full_state_dicts_into_2d(world4, saved) -> None:
    path, _ = saved
    assert world4.run(case_full_into_2d, path) == [[]] * 4
