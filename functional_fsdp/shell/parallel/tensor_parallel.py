"""2-D parallelism in the shell: tensor-parallel ``DTensor`` parameters under ``fully_shard``.

The pure math lives in :mod:`functional_fsdp.core.tensor_parallel`; this module maps it onto ``DTensor``:

* :func:`plan_tensor_parallel` reads the parameters of a new group once, checks each TP
  parameter's mesh and placements against the data-parallel mesh (named errors, before any
  collective), and returns a :class:`TensorParallelPlan`: per parameter, the spec of the
  sharded ``DTensor`` on the full SPMD mesh (FSDP2's ``(Shard(0) | _StridedShard, <tp>)`` and
  ``(Replicate(), Shard(0), <tp>)`` for HSDP) and the spec of the unsharded ``DTensor`` the
  module sees (the parameter's own TP spec).
* The group (:class:`~.group.ParamGroup`) asks the plan for its sharded specs when it builds
  its layout and wraps its full TP-local tensors with :meth:`TensorParallelPlan.wrap_full`
  before putting them on the modules. Nothing else changes: 2-D runs through the same engine
  (gathers and reductions over the dp ranks only; TP collectives stay with ``DTensor``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ..._compat import FSDP2_UPCASTS_TP_REPLICATED_GRADS
from ...core import tensor_parallel as TP
from ...core.errors import (
    FSDPError,
    IncompatibleMeshError,
    MeshError,
    TiedPlacementError,
    UnsupportedError,
)
from ...core.records import GroupLayout, ParamSpec
from ..engine.group_common import _contiguous_stride

__all__ = ["TensorParallelPlan", "WrapFullFn", "plan_tensor_parallel", "resolve_dp_mesh_dims"]


def placement_text(p: Placement) -> str:
    """The core's spelling of a TP placement (``"Shard(d)"``, ``"Replicate()"``, else repr)."""
    if type(p) is Shard:
        return f"Shard({p.dim})"
    if isinstance(p, Replicate):
        return "Replicate()"
    return repr(p)


class _TPParam:
    """Shell-side facts of one TP parameter (meshes and placements; the core keeps strings)."""

    __slots__ = (
        "dp_dims",
        "mesh",
        "placements",
        "replicated_over_tp",
        "tp_dims",
        "tp_sizes",
        "unsharded_mesh",
    )

    def __init__(
        self,
        unsharded_mesh: DeviceMesh,
        mesh: DeviceMesh,
        placements: tuple[Placement, ...],
        dp_dims: tuple[int, ...],
        tp_dims: tuple[int, ...],
    ) -> None:
        self.unsharded_mesh = unsharded_mesh  # the mesh the module's DTensor lives on
        self.mesh = mesh  # the full SPMD mesh of the sharded DTensor
        self.placements = placements  # the unsharded DTensor's placements
        self.dp_dims = dp_dims  # dims of `unsharded_mesh` that are data parallel (SPMD form)
        self.tp_dims = tp_dims
        self.tp_sizes = tuple(unsharded_mesh.size(d) for d in tp_dims)
        # Replicated over a TP dim: its gradient may be Partial there and all-reduced by DTensor
        # (FSDP2 2.15's ``may_reduce_grad_outside_dp``).
        self.replicated_over_tp = any(
            isinstance(placements[d], Replicate) for d in tp_dims if d < len(placements)
        )


class TensorParallelPlan:
    """Per parameter of one group: how its sharded and unsharded ``DTensor`` s are built.

    Args:
        params: ``None`` for a plain parameter, else its :class:`_TPParam`.
        hsdp: whether the dp mesh is ``(replicate, shard)``.
    """

    def __init__(self, params: Sequence[_TPParam | None], *, hsdp: bool) -> None:
        self.params = tuple(params)
        self.hsdp = hsdp
        self._wrapped: tuple[Any, ...] = ()
        self._wrapped_from: tuple[Any, ...] = ()
        self._spec_cache: dict[tuple[int, torch.dtype], DTensorSpec] = {}
        self._global_shapes: list[tuple[int, ...]] = []
        # The dtype a TP-replicated parameter's gradient is cast to before its TP reduction
        # (torch 2.15's FSDP2); ``None``: reduced over TP in the compute dtype (2.11-2.14).
        self._replicated_grad_dtype: torch.dtype | None = None
        # Per parameter index: (the gradient WrapFullFn handed autograd, its wider original).
        self._wide_grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def sharded_specs(
        self, layout: GroupLayout, placements: list[Any], specs: list[DTensorSpec]
    ) -> tuple[list[Any], list[DTensorSpec]]:
        """The group's sharded placements and specs with those of TP parameters replaced."""
        placements, specs = list(placements), list(specs)
        self._global_shapes = [s.global_shape or s.shape for s in layout.specs]
        self._replicated_grad_dtype = None
        if FSDP2_UPCASTS_TP_REPLICATED_GRADS:
            # no uniform reduce dtype: the group's reduction names the problem
            with contextlib.suppress(FSDPError):
                self._replicated_grad_dtype = layout.grad_reduce_dtype()
        for i, (info, spec) in enumerate(zip(self.params, layout.specs)):
            if info is None:
                continue
            pl = self._sharded_placements(info, layout.shard_dims[i], spec)
            shape = spec.global_shape or spec.shape
            meta = TensorMeta(torch.Size(shape), _contiguous_stride(shape), spec.dtype)
            placements[i] = pl
            specs[i] = DTensorSpec(info.mesh, pl, tensor_meta=meta)
        self._spec_cache.clear()
        return placements, specs

    def _sharded_placements(
        self, info: _TPParam, dim: int, spec: ParamSpec
    ) -> tuple[Placement, ...]:
        sf = TP.dp_split_factor(dim, spec.tp_placements, info.tp_sizes)
        shard: Placement = _StridedShard(dim, split_factor=sf) if sf > 1 else Shard(dim)
        dp: tuple[Placement, ...] = (Replicate(), shard) if self.hsdp else (shard,)
        if not info.dp_dims:  # FSDP + TP: the SPMD mesh is (dp dims..., tp dims...)
            return (*dp, *info.placements)
        out = list(info.placements)
        for d, p in zip(info.dp_dims, dp):
            out[d] = p
        return tuple(out)

    def wrap_full(self, tensors: Sequence[torch.Tensor]) -> list[Any]:
        """The module-facing parameters: each TP parameter's full TP-local tensor as a
        ``DTensor`` with its TP spec (differentiably); plain parameters unchanged.

        The same tensors get the same wrappers back: the pre-backward hook and an activation
        checkpoint's recompute re-register the forward's outputs and must see the forward's
        ``DTensor`` s (made with grad enabled), not new ones made inside backward.
        """
        if len(tensors) == len(self._wrapped_from) and all(
            a is b for a, b in zip(tensors, self._wrapped_from)
        ):
            return list(self._wrapped)
        out: list[Any] = []
        for i, (t, info) in enumerate(zip(tensors, self.params)):
            if info is None or isinstance(t, DTensor):
                out.append(t)
                continue
            wide = (self, i) if info.replicated_over_tp and self._replicated_grad_dtype else None
            out.append(WrapFullFn.apply(t, self._unsharded_spec(i, t), info.dp_dims, wide))
        self._wrapped = tuple(out)
        self._wrapped_from = tuple(tensors)
        return out

    def keep_wide_grad(self, i: int, handed: torch.Tensor, wide: torch.Tensor) -> None:
        """:class:`WrapFullFn` reduced parameter ``i``'s gradient over TP in a wider dtype than
        the parameter's and handed autograd ``handed`` (autograd casts a gradient to its
        input's dtype): keep ``wide`` for :meth:`widen_grads`."""
        self._wide_grads[i] = (handed, wide)

    def widen_grads(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """The group's full gradients with each one :meth:`keep_wide_grad` kept put back in
        its wide dtype: only where autograd passed on the very tensor handed to it (nothing
        else was added to it on the way)."""
        out = list(grads)
        for i, (handed, wide) in self._wide_grads.items():
            if i < len(out) and out[i] is handed:
                out[i] = wide
        self._wide_grads.clear()
        return out

    def to_global(self, i: int, spec: ParamSpec, full_local: torch.Tensor) -> torch.Tensor:
        """Parameter ``i``'s global tensor from its dp-unsharded TP-local one (an all-gather
        over the TP ranks; ``summon_full_params``). Plain parameters pass through."""
        info = self.params[i]
        if info is None:
            return full_local
        return TP.gather_global(full_local, spec, self._tp_comm(info, spec), info.tp_sizes)

    def to_local(self, i: int, spec: ParamSpec, full: torch.Tensor) -> torch.Tensor:
        """This rank's TP-local block of parameter ``i``'s global tensor (no communication)."""
        info = self.params[i]
        if info is None:
            return full
        coords = info.unsharded_mesh.get_coordinate()
        assert coords is not None
        tp_coords = tuple(coords[d] for d in info.tp_dims)
        return TP.local_from_global(full, spec, info.tp_sizes, tp_coords)

    @staticmethod
    def _tp_comm(info: _TPParam, spec: ParamSpec) -> Any:
        if len(info.tp_dims) != 1:
            raise UnsupportedError(
                f"gathering the global tensor of {spec.fqn!r} over a {len(info.tp_dims)}-D TP "
                "mesh is not supported yet (1-D TP only); use DCP or p.full_tensor() instead"
            )
        from ..comm.process_group import ProcessGroupComm

        return ProcessGroupComm.for_mesh(info.unsharded_mesh, info.tp_dims[0])

    def owns(self, i: int, t: Any) -> bool:
        """Whether ``t`` is the wrapper :meth:`wrap_full` last made for parameter ``i``."""
        return i < len(self._wrapped) and t is self._wrapped[i]

    def _unsharded_spec(self, i: int, t: torch.Tensor) -> DTensorSpec:
        key = (i, t.dtype)
        spec = self._spec_cache.get(key)
        if spec is None:
            info = self.params[i]
            assert info is not None
            shape = self._global_shapes[i]
            meta = TensorMeta(torch.Size(shape), _contiguous_stride(shape), t.dtype)
            spec = DTensorSpec(info.unsharded_mesh, info.placements, tensor_meta=meta)
            self._spec_cache[key] = spec
        return spec


class WrapFullFn(torch.autograd.Function):
    """Forward: a TP-local tensor as the ``DTensor`` the module sees. Backward: the gradient's
    local tensor after redistributing its TP dims to the parameter's placements (a ``Partial``
    gradient of a replicated TP parameter is all-reduced over TP), keeping any data-parallel
    dims as they are: FSDP's reduce-scatter handles those.

    ``wide`` (torch 2.15's FSDP2, parameters replicated over a TP dim): ``(plan, index)``; the
    local gradient is cast to the plan's reduce dtype before the TP reduction, as 2.15's
    ``grad_dtype`` on such a parameter makes autograd do, so the TP all-reduce runs in the
    reduce dtype rather than the compute dtype. Autograd casts what this returns back to the
    compute dtype, so the wide result goes to the plan (:meth:`TensorParallelPlan.widen_grads`
    hands it to the group's reduction)."""

    @staticmethod
    def forward(
        ctx: Any,
        local: torch.Tensor,
        spec: DTensorSpec,
        dp_dims: tuple[int, ...],
        wide: tuple[TensorParallelPlan, int] | None = None,
    ) -> Any:
        ctx.spec = spec
        ctx.dp_dims = dp_dims
        ctx.wide = wide
        ctx.grad_dtype = wide[0]._replicated_grad_dtype if wide is not None else None
        return DTensor(local.view_as(local), spec, requires_grad=local.requires_grad)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None, None, None]:
        if not isinstance(grad, DTensor):
            return grad, None, None, None
        compute_dtype = grad.dtype
        if ctx.grad_dtype is not None and grad.dtype != ctx.grad_dtype:
            # Cast the local tensor: DTensor's own cast of a Partial gradient reduces it first.
            grad = DTensor.from_local(
                grad.to_local().to(ctx.grad_dtype),
                grad.device_mesh,
                grad.placements,
                run_check=False,
                shape=grad.shape,
                stride=grad.stride(),
            )
        want = tuple(
            grad.placements[d] if d in ctx.dp_dims else p for d, p in enumerate(ctx.spec.placements)
        )
        if tuple(grad.placements) != want:
            grad = grad.redistribute(placements=want)
        local = grad.to_local()
        if ctx.wide is not None and local.dtype != compute_dtype:
            handed = local.to(compute_dtype)
            ctx.wide[0].keep_wide_grad(ctx.wide[1], handed, local)
            return handed, None, None, None
        return local, None, None, None


def plan_tensor_parallel(
    params: Sequence[nn.Parameter],
    fqns: dict[int, str],
    dp_mesh: DeviceMesh,
    *,
    spmd_mesh: DeviceMesh | None = None,
    dp_names: tuple[str, ...] = (),
    raf: bool | int = True,
    name: str = "",
) -> TensorParallelPlan | None:
    """Check the group's ``DTensor`` parameters and describe them; ``None`` if there are none.

    Args:
        params: the group's parameters.
        fqns: their names (for messages).
        dp_mesh: the data-parallel mesh (1-D, or 2-D ``(replicate, shard)``).
        spmd_mesh: with ``dp_mesh_dims``, the full SPMD mesh every parameter must live on.
        dp_names: with ``dp_mesh_dims``, the dp dim names of ``spmd_mesh`` (replicate first).
        raf: the group's validated ``reshard_after_forward``.
        name: the group's name (for messages).

    Raises:
        IncompatibleMeshError: a parameter's mesh does not compose with ``dp_mesh``.
        UnsupportedPlacementError: a TP placement FSDP cannot compose with.
        TiedPlacementError: parameters sharing storage with different TP placements.
        UnsupportedError: an int ``reshard_after_forward``.
    """
    if not any(isinstance(p, DTensor) for p in params) and spmd_mesh is None:
        return None
    if isinstance(raf, int) and not isinstance(raf, bool):
        raise UnsupportedError(
            f"fully_shard({name}): reshard_after_forward={raf} (an int) with tensor-parallel "
            "parameters is not supported: its sub-groups would have to be created over the dp "
            "ranks of every TP coordinate (FSDP2 also refuses an int with dp_mesh_dims); use "
            "True or False"
        )
    infos: list[_TPParam | None] = []
    for p in params:
        name = fqns[id(p)]
        if not isinstance(p, DTensor):
            if spmd_mesh is not None:
                raise IncompatibleMeshError(
                    f"fully_shard(dp_mesh_dims=...): parameter {name!r} is a plain tensor; with "
                    "dp_mesh_dims every parameter must be a DTensor on the full SPMD mesh (with "
                    "Replicate() on the data-parallel dims), e.g. via distribute_module"
                )
            infos.append(None)
            continue
        if spmd_mesh is not None:
            infos.append(_spmd_param(p, name, spmd_mesh, dp_names))
        else:
            infos.append(_tp_param(p, name, dp_mesh))
        # Placements the core cannot compose with raise here, before any collective.
        for pl in p.placements:
            TP.parse_placement(placement_text(pl))
    _check_tied(params, fqns)
    return TensorParallelPlan(infos, hsdp=dp_mesh.ndim == 2)


def _tp_param(p: DTensor, name: str, dp_mesh: DeviceMesh) -> _TPParam:
    tp_mesh = p.device_mesh
    where = f"parameter {name!r} is a DTensor on {tp_mesh}, which does not compose with the "
    hint = (
        "; build one mesh, world = init_device_mesh(dev, (dp, tp), mesh_dim_names=('dp', 'tp')), "
        "call parallelize_module(model, world['tp'], plan), then fully_shard(model, "
        "mesh=world['dp'])"
    )
    if dp_mesh.mesh_dim_names is None or tp_mesh.mesh_dim_names is None:
        raise IncompatibleMeshError(
            where + f"data-parallel mesh {dp_mesh}: both need dim names" + hint
        )
    overlap = set(dp_mesh.mesh_dim_names) & set(tp_mesh.mesh_dim_names)
    dp_ranks = set(dp_mesh.mesh.flatten().tolist())
    tp_ranks = set(tp_mesh.mesh.flatten().tolist())
    if overlap or len(dp_ranks & tp_ranks) != 1 or tp_mesh.device_type != dp_mesh.device_type:
        raise IncompatibleMeshError(
            where + f"data-parallel mesh {dp_mesh} (this rank's dp ranks {sorted(dp_ranks)} and "
            f"TP ranks {sorted(tp_ranks)} must meet in exactly this rank, on disjoint mesh dims)"
            + hint
        )
    try:
        spmd = DeviceMesh._concatenate([dp_mesh, tp_mesh])
    except (RuntimeError, AssertionError) as e:
        raise IncompatibleMeshError(where + f"data-parallel mesh {dp_mesh}: {e}" + hint) from e
    n = tp_mesh.ndim
    return _TPParam(tp_mesh, spmd, tuple(p.placements), (), tuple(range(n)))


def _spmd_param(
    p: DTensor, name: str, spmd_mesh: DeviceMesh, dp_names: tuple[str, ...]
) -> _TPParam:
    mesh = p.device_mesh
    if mesh != spmd_mesh:
        raise IncompatibleMeshError(
            f"fully_shard(dp_mesh_dims=...): parameter {name!r} is a DTensor on {mesh}, not on "
            f"the SPMD mesh {spmd_mesh} given to fully_shard; distribute it on that mesh"
        )
    names = spmd_mesh.mesh_dim_names or ()
    dp_dims = tuple(names.index(n) for n in dp_names)
    for d in dp_dims:
        if not isinstance(p.placements[d], Replicate):
            raise IncompatibleMeshError(
                f"fully_shard(dp_mesh_dims=...): parameter {name!r} has {p.placements[d]} on the "
                f"data-parallel dim {names[d]!r}; it must be Replicate() there (FSDP shards it)"
            )
    tp_dims = tuple(d for d in range(mesh.ndim) if d not in dp_dims)
    return _TPParam(mesh, spmd_mesh, tuple(p.placements), dp_dims, tp_dims)


def _check_tied(params: Sequence[nn.Parameter], fqns: dict[int, str]) -> None:
    seen: dict[Any, nn.Parameter] = {}
    for p in params:
        local = p._local_tensor if isinstance(p, DTensor) else p
        if local.is_meta or local.untyped_storage().size() == 0:
            continue
        key = (local.device, local.untyped_storage().data_ptr())
        other = seen.setdefault(key, p)
        if other is p:
            continue
        mine = tuple(p.placements) if isinstance(p, DTensor) else None
        theirs = tuple(other.placements) if isinstance(other, DTensor) else None
        if mine != theirs:
            raise TiedPlacementError(
                f"parameters {fqns[id(other)]!r} ({theirs or 'plain tensor'}) and "
                f"{fqns[id(p)]!r} ({mine or 'plain tensor'}) share storage (tied weights) but "
                "have different tensor-parallel placements; sharding them would untie them. Give "
                "tied weights the same TP plan (e.g. the same Shard dim), or untie them"
            )


def tp_spec(info: _TPParam | None, p: nn.Parameter, name: str, shard_dim: int) -> ParamSpec:
    """The core :class:`ParamSpec` of parameter ``p`` (TP-local shape under TP)."""
    if info is None or not isinstance(p, DTensor):
        return ParamSpec(name, tuple(p.shape), p.dtype, p.requires_grad, shard_dim)
    coords = info.unsharded_mesh.get_coordinate()
    assert coords is not None
    spec = TP.tp_param_spec(
        name,
        tuple(p.shape),
        p.dtype,
        tp_placements=tuple(placement_text(info.placements[d]) for d in info.tp_dims),
        tp_sizes=info.tp_sizes,
        tp_coords=tuple(coords[d] for d in info.tp_dims),
        requires_grad=p.requires_grad,
        shard_dim=shard_dim,
    )
    if spec.shape != tuple(p._local_tensor.shape):
        raise MeshError(
            f"parameter {name!r}: its local tensor has shape {tuple(p._local_tensor.shape)} "
            f"but its placements {tuple(p.placements)} give {spec.shape}; FSDP composes with "
            "DTensors that follow torch.chunk's sharding (as distribute_tensor makes them)"
        )
    return spec


def resolve_dp_mesh_dims(mesh: Any, dp_mesh_dims: Any) -> tuple[DeviceMesh, tuple[str, ...]]:
    """``fully_shard(mesh=spmd_mesh, dp_mesh_dims=...)``: the data-parallel sub-mesh (1-D shard,
    or 2-D ``(replicate, shard)``) and the dp dim names, replicate first.

    Raises:
        MeshError: no dim names, an unknown name, flattened (tuple) dims, or dp dims after TP.
    """
    if not isinstance(mesh, DeviceMesh) or mesh.mesh_dim_names is None:
        raise MeshError("fully_shard(dp_mesh_dims=...) needs a DeviceMesh with mesh_dim_names")
    shard = _one_name(getattr(dp_mesh_dims, "shard", None), "shard")
    rep = _one_name(getattr(dp_mesh_dims, "replicate", None), "replicate")
    if shard is None:
        raise MeshError(
            "fully_shard(dp_mesh_dims=DataParallelMeshDims(replicate=...)) without a shard dim is "
            "pure data parallelism (DDP); functional_fsdp shards: name a shard dim"
        )
    names = tuple(n for n in (rep, shard) if n is not None)
    dims = mesh.mesh_dim_names
    for n in names:
        if n not in dims:
            raise MeshError(f"mesh dim name {n!r} not found in mesh.mesh_dim_names {dims}")
    idx = [dims.index(n) for n in names]
    if idx != list(range(len(idx))):
        raise MeshError(
            f"dp_mesh_dims {names} must be the leading dims of the SPMD mesh {dims} (replicate, "
            "then shard, then the model-parallel dims), as in init_device_mesh(dev, (dp, tp))"
        )
    return (mesh[names] if len(names) > 1 else mesh[names[0]]), names


def _one_name(value: Any, what: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, tuple) and len(value) == 1:
        return str(value[0])
    raise MeshError(
        f"dp_mesh_dims.{what}={value!r}: flattening several mesh dims into one dp dim is not "
        "supported yet; flatten them yourself (mesh[names]._flatten(name)) and name the result"
    )
