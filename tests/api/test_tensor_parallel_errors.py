"""Bad 2-D input: each mistake raises a named error at ``fully_shard``, before any collective.

One 4-rank gloo world (2 dp x 2 tp). Every case catches the error on every rank, checks the
module was left untouched (no FSDP state, parameters unchanged), then runs a collective that
would hang or mismatch if any rank had entered one inside ``fully_shard``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _tp_helpers import world_mesh

from functional_fsdp._compat import HAS_DATA_PARALLEL_MESH_DIMS

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _param(t: torch.Tensor, mesh, placements) -> nn.Parameter:
    from torch.distributed.tensor import DTensor

    return nn.Parameter(DTensor.from_local(t, mesh, placements, run_check=False))


def _mistakes(world) -> dict:
    """Each mistake: (module, fully_shard kwargs)."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    tp, dp = world["tp"], world["dp"]
    lin = nn.Linear(4, 4)
    out: dict = {}
    m = nn.Linear(4, 4)  # a DTensor on the dp mesh itself: FSDP's dim is taken
    m.weight = _param(torch.randn(2, 4), dp, [Shard(0)])
    out["dtensor_on_dp_mesh"] = (m, {"mesh": dp})
    m = nn.Linear(4, 4)  # a TP mesh from another mesh (overlapping ranks)
    other = world_mesh((4,), ("x",))
    m.weight = _param(torch.randn(1, 4), other, [Shard(0)])
    out["tp_mesh_from_another_mesh"] = (m, {"mesh": dp})
    m = nn.Linear(4, 4)  # no names on the dp mesh
    m.weight = _param(torch.randn(2, 4), tp, [Shard(0)])
    out["default_mesh_without_names"] = (m, {})
    for name, pl in (("partial", Partial()), ("strided", _StridedShard(0, split_factor=2))):
        m = nn.Linear(4, 4)
        m.weight = _param(torch.randn(2, 4), tp, [pl])
        out[f"placement_{name}"] = (m, {"mesh": dp})
    m = nn.Module()  # tied storage, different TP placements
    t = torch.randn(4, 4)
    m.a = _param(t, tp, [Shard(0)])
    m.b = _param(t, tp, [Shard(1)])
    m.forward = lambda x: x  # type: ignore[method-assign]
    out["tied_different_placements"] = (m, {"mesh": dp})
    m = nn.Linear(4, 4)  # an int that is a proper factor needs 4 dp ranks: a (4, 1) mesh
    mesh41 = world_mesh((4, 1))
    m.weight = _param(torch.randn(4, 4), mesh41["tp"], [Shard(0)])
    out["reshard_after_forward_int"] = (m, {"mesh": mesh41["dp"], "reshard_after_forward": 2})
    if not HAS_DATA_PARALLEL_MESH_DIMS:  # torch 2.11: no SPMD form to get wrong
        return out
    from torch.distributed.fsdp import DataParallelMeshDims

    out["dp_mesh_dims_plain_param"] = (
        lin,
        {"mesh": world, "dp_mesh_dims": DataParallelMeshDims(shard="dp")},
    )
    m = nn.Linear(4, 4)
    m.weight = _param(torch.randn(2, 4), world, [Shard(0), Shard(0)])
    out["dp_mesh_dims_not_replicate_on_dp"] = (
        m,
        {"mesh": world, "dp_mesh_dims": DataParallelMeshDims(shard="dp")},
    )
    out["dp_mesh_dims_flattened"] = (
        nn.Linear(4, 4),
        {"mesh": world, "dp_mesh_dims": DataParallelMeshDims(shard=("dp", "tp"))},
    )
    out["dp_mesh_dims_after_tp"] = (
        nn.Linear(4, 4),
        {"mesh": world, "dp_mesh_dims": DataParallelMeshDims(shard="tp")},
    )
    del Replicate
    return out


def case_errors() -> dict:
    from functional_fsdp import fully_shard

    world = world_mesh()
    res = {}
    for name, (module, kw) in _mistakes(world).items():
        before = {n: p for n, p in module.named_parameters()}
        try:
            fully_shard(module, **kw)
            res[name] = ("no error", "")
        except Exception as e:
            res[name] = (type(e).__name__, str(e))
        untouched = not hasattr(module, "_ffsdp_state") and all(
            p is before[n] for n, p in module.named_parameters()
        )
        res[name] += (untouched,)
    t = torch.ones(1)
    dist.all_reduce(t)  # every rank is still in step
    res["_in_step"] = t.item() == dist.get_world_size()
    return res


EXPECTED = {
    "dtensor_on_dp_mesh": ("IncompatibleMeshError", "must meet in exactly this rank"),
    "tp_mesh_from_another_mesh": ("IncompatibleMeshError", "does not compose"),
    "default_mesh_without_names": ("IncompatibleMeshError", "both need dim names"),
    "placement_partial": ("UnsupportedPlacementError", "supported are Shard(d) and Replicate()"),
    "placement_strided": ("UnsupportedPlacementError", "supported are Shard(d) and Replicate()"),
    "tied_different_placements": ("TiedPlacementError", "'a' ((Shard(dim=0),)) and 'b'"),
    "reshard_after_forward_int": ("UnsupportedError", "use True or False"),
    "dp_mesh_dims_plain_param": ("IncompatibleMeshError", "is a plain tensor"),
    "dp_mesh_dims_not_replicate_on_dp": ("IncompatibleMeshError", "must be Replicate() there"),
    "dp_mesh_dims_flattened": ("MeshError", "flattening several mesh dims"),
    "dp_mesh_dims_after_tp": ("MeshError", "must be the leading dims"),
}
if not HAS_DATA_PARALLEL_MESH_DIMS:
    EXPECTED = {k: v for k, v in EXPECTED.items() if not k.startswith("dp_mesh_dims")}


def test_bad_2d_input_raises_named_errors_before_any_collective(world4):
    import functional_fsdp.core.errors as E

    res = world4.run(case_errors)
    for r in res:
        assert r.pop("_in_step")
        assert r.keys() == EXPECTED.keys()
        for name, (kind, phrase) in EXPECTED.items():
            got, message, untouched = r[name]
            assert got == kind, (name, got, message)
            assert phrase in message, (name, message)
            assert untouched, name
            assert issubclass(getattr(E, kind), E.FSDPError)
    # Drop-in types: FSDP2 raises ValueError / NotImplementedError for these layouts.
    assert issubclass(E.UnsupportedPlacementError, NotImplementedError)
    assert issubclass(E.IncompatibleMeshError, ValueError)
    assert issubclass(E.TiedPlacementError, E.TiedParameterError)
