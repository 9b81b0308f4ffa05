"""Drop-in error types (issue 13): each FSDP2 user mistake runs against torch's ``fully_shard``
and ours on every rank of a 2-rank gloo world; ours must be an instance of the exception type
FSDP2 raised (and a named ``FSDPError``). Rows ours accepts on purpose, and known gaps, are
listed with their reasons. The table in ``docs/fsdp2_mapping.md`` summarises it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _dist import World

import functional_fsdp
from functional_fsdp import fully_shard
from functional_fsdp.errors import FSDPError

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _lin() -> nn.Module:
    return nn.Linear(4, 4)


class _Scalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


class _NonContiguous(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 4).t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def _x() -> torch.Tensor:
    return torch.randn(2, 4)


def _fsdp_mod(fs, mesh) -> nn.Module:
    m = nn.Sequential(_lin(), _lin())
    fs(m[0], mesh=mesh)
    fs(m, mesh=mesh)
    return m


def _shard1(p):
    from torch.distributed.tensor import Shard

    return Shard(1) if p.ndim == 2 else None


def _shard2(p):
    from torch.distributed.tensor import Shard

    return Shard(2) if p.ndim == 2 else None


def _replicate(p):
    from torch.distributed.tensor import Replicate

    return Replicate()


def _tied(fs, mesh) -> None:
    m = nn.Sequential(_lin(), _lin())
    m[1].weight = m[0].weight
    fs(m[0], mesh=mesh)
    fs(m[1], mesh=mesh)
    fs(m, mesh=mesh)
    m(_x())


def _child_first(fs, mesh) -> None:
    m = _fsdp_mod(fs, mesh)
    m[0](_x())
    m(_x())


def _reset_iter_on_child(fs, mesh) -> None:
    m = _fsdp_mod(fs, mesh)
    m(_x())
    m[0].reset_iter_state()


def _meta(fs, mesh) -> None:
    with torch.device("meta"):
        m = _lin()
    fs(m, mesh=mesh)
    m(_x())


def _two_roots(fs, mesh) -> None:
    a, b = _lin(), _lin()
    fs([a, b], mesh=mesh)
    a(_x())


def _prefetch_plain(fs, mesh) -> None:
    m = _fsdp_mod(fs, mesh)
    m.set_modules_to_forward_prefetch([_lin()])


def _mesh_3d(fs, mesh) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    fs(_lin(), mesh=init_device_mesh("cpu", (dist.get_world_size(), 1, 1)))


def _mesh_2d_unnamed(fs, mesh) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    fs(_lin(), mesh=init_device_mesh("cpu", (1, dist.get_world_size())))


# name -> (mistake(fully_shard, mesh), the phrase of FSDP2's message)
MISTAKES = {
    "container_without_forward": (
        lambda fs, mesh: fs(nn.ModuleList([_lin()]), mesh=mesh),
        "does not support containers that do not implement forward",
    ),
    "mesh_3d": (_mesh_3d, "expects a 1D or 2D DeviceMesh"),
    "mesh_2d_without_names": (_mesh_2d_unnamed, "mesh_dim_names"),
    "reshard_after_forward_str": (
        lambda fs, mesh: fs(_lin(), mesh=mesh, reshard_after_forward="yes"),
        "reshard_after_forward should be a bool or an int",
    ),
    "reshard_after_forward_not_a_factor": (
        lambda fs, mesh: fs(_lin(), mesh=mesh, reshard_after_forward=3),
        "factor of",
    ),
    "scalar_parameter": (lambda fs, mesh: fs(_Scalar(), mesh=mesh), "scalar parameters"),
    "uneven_shard_dim1": (
        lambda fs, mesh: fs(nn.Linear(3, 4), mesh=mesh, shard_placement_fn=_shard1),
        "uneven sharding",
    ),
    "shard_dim_out_of_range": (
        lambda fs, mesh: fs(_lin(), mesh=mesh, shard_placement_fn=_shard2),
        "is invalid for",
    ),
    "placement_not_shard": (
        lambda fs, mesh: fs(_lin(), mesh=mesh, shard_placement_fn=_replicate),
        "shard_placement_fn",
    ),
    "non_contiguous_parameter": (
        lambda fs, mesh: fs(_NonContiguous(), mesh=mesh),
        "non-contiguous",
    ),
    "tied_across_groups": (_tied, "already managed by another FSDP group"),
    "child_forward_before_root": (_child_first, "running forward through the root module first"),
    "reset_iter_state_on_child": (_reset_iter_on_child, "must be called on the root"),
    "forward_method_missing": (
        lambda fs, mesh: _register(fs)(fs(_lin(), mesh=mesh), "generate"),
        "does not have a method",
    ),
    "set_reshard_after_forward_str": (
        lambda fs, mesh: fs(_lin(), mesh=mesh).set_reshard_after_forward("yes"),
        "reshard_after_forward should be a bool",
    ),
    "meta_parameters_at_forward": (_meta, "materialized from meta device"),
    "two_modules_as_root": (_two_roots, "requires a single root module"),
    "prefetch_plain_module": (_prefetch_plain, "Expects FSDPModule"),
}


def _register(fs):
    if fs is fully_shard:
        return functional_fsdp.register_fsdp_forward_method
    from torch.distributed.fsdp import register_fsdp_forward_method

    return register_fsdp_forward_method


def _outcome(fn, fs) -> BaseException | None:
    torch.manual_seed(0)
    try:
        fn(fs, _mesh())
    except Exception as e:
        return e
    return None


def case_error_table() -> dict:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    rows = {}
    for name, (fn, phrase) in MISTAKES.items():
        theirs, ours = _outcome(fn, torch_fully_shard), _outcome(fn, fully_shard)
        rows[name] = {
            "torch": None if theirs is None else (type(theirs).__name__, str(theirs)[:200]),
            "ours": None if ours is None else (type(ours).__name__, str(ours)[:300]),
            "compatible": theirs is None or isinstance(ours, type(theirs)),
            "named": ours is None or isinstance(ours, FSDPError),
            "phrase": ours is not None and phrase.lower() in str(ours).lower(),
        }
    return rows


# FSDP2 mistakes that functional_fsdp accepts (it supports them, or reads the input another way).
ACCEPTED = {
    "non_contiguous_parameter": "sharding copies the rows, so any strides work",
    "mesh_2d_without_names": "the 2-D mesh is read as (replicate, shard) by position",
    "reset_iter_state_on_child": "resets the states under the module it is called on",
    "two_modules_as_root": "a multi-module group can run as a root",
}
# Mistakes where ours is not yet drop-in; each needs a change in a shell file owned by another
# part of issue 13's work (listed in the report). Strict: a fixed row fails until removed here.
KNOWN_GAPS: dict[str, str] = {}


def test_errors_are_drop_in_for_fsdp2(world2: World) -> None:
    rows = world2.run(case_error_table)[0]
    problems = {}
    for name, r in rows.items():
        assert r["torch"] is not None, f"{name}: FSDP2 no longer raises; update MISTAKES"
        # Drop-in: same built-in type, one of our named errors, and FSDP2's key phrase.
        ok = r["ours"] is not None and r["compatible"] and r["named"] and r["phrase"]
        if name in ACCEPTED:
            if r["ours"] is not None and not (r["compatible"] and r["named"]):
                problems[name] = r
        elif name in KNOWN_GAPS:
            assert not ok, f"{name} is fixed: remove it from KNOWN_GAPS"
        elif not ok:
            problems[name] = r
    assert not problems, problems
