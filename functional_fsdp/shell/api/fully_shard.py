"""``fully_shard`` and the ``FSDPModule`` methods: the drop-in for torch FSDP2."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, cast

import attrs
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from ...core.codec import has_hooks
from ...core.errors import (
    AlreadyShardedError,
    MeshError,
    PolicyError,
    ReproducibilityError,
    TiedParameterError,
)
from ...core.layout import check_sub_group_size
from ...core.records import MixedPrecisionPolicy, OffloadPolicy, ParamSpec
from ...core.reproducible import ReproduciblePolicy
from ...core.transitions import shard_tensors
from ..comm.process_group import ProcessGroupComm
from ..comm.scoped import scoped
from ..engine import local_step
from ..engine.autograd import explain_forward_ad_on_dtensor
from ..engine.config import GroupConfig
from ..engine.group import ParamGroup, TrainingState, layout_for
from ..engine.reproducible import check_no_partial_trees
from ..engine.tied import TiedUse
from ..io.reload import readopt_after_load
from ..parallel.tensor_parallel import (
    TensorParallelPlan,
    plan_tensor_parallel,
    resolve_dp_mesh_dims,
    tp_spec,
)
from . import replaced
from .codecs import adopt_codecs, plain_data
from .finalization import torch_state
from .module import FSDPModule, UnshardHandle, register_fsdp_forward_method, swap_class
from .state import FSDPState, hooks_for
from .torch_clip import watch as watch_torch_clip

__all__ = ["FSDPModule", "UnshardHandle", "fully_shard", "register_fsdp_forward_method"]

_OWNER_ATTR = "_functional_fsdp_owner"


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: Any = None,
    offload_policy: Any = None,
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: Any = None,
    reproducible: ReproduciblePolicy | None = None,
    bucket_bytes: int | None = None,
) -> Any:
    """Shard ``module``'s parameters across the data-parallel ranks of ``mesh`` (FSDP2's API).

    Call it bottom-up (each block, then the root). Parameters of ``module`` not already managed
    by a ``fully_shard``-ed submodule (nor in ``ignored_params``) form one group: one all-gather
    before its forward, one reduce-scatter of its gradients in backward. The module's parameters
    become ``DTensor`` s with ``Shard(0)`` placement (``(Replicate(), Shard(0))`` on a 2-D HSDP
    mesh), and its class becomes a subclass of :class:`FSDPModule`.

    Args:
        module: the module, or a list of modules sharing one group.
        mesh: a 1-D mesh (FSDP) or 2-D ``(replicate, shard)`` mesh (HSDP); default: all ranks.
        reshard_after_forward: ``True`` frees the unsharded parameters after forward (gathered
            again in backward); ``False`` keeps them; an ``int`` ``k`` keeps a ``1/k`` slice
            for a ``k``-rank sub-group; ``None`` means ``True`` except for the root (``False``).
        shard_placement_fn: ``param -> Shard(i) | None`` to shard a dim other than 0.
        mp_policy: a :class:`~functional_fsdp.MixedPrecisionPolicy` (or torch's).
        offload_policy: :class:`~functional_fsdp.OffloadPolicy` / ``CPUOffloadPolicy`` (or torch's).
        ignored_params: parameters left unsharded and unmanaged.
        dp_mesh_dims: FSDP2's SPMD form (``DataParallelMeshDims(shard=..., replicate=...)``):
            ``mesh`` is then the full mesh and every parameter a ``DTensor`` on it with
            ``Replicate()`` on the named data-parallel dims (which must lead the mesh).
        reproducible: beyond FSDP2: a :class:`~functional_fsdp.ReproduciblePolicy`: gradients
            summed in one canonical tree, bit-identical on every world size that divides its
            virtual world size (the same policy to every call; ``docs/reproducibility.md``).
        bucket_bytes: beyond FSDP2, on the root: adjacent small groups' collectives travel
            together up to this many unsharded bytes (``0``: one per group; ``None``: the
            measured default); bit-identical either way (``docs/design.md``, coalescing).

    With tensor parallelism, parameters that are already ``DTensor`` s on a TP mesh (from
    ``parallelize_module(model, world["tp"], plan)``) are sharded over ``mesh=world["dp"]``
    from their TP-local tensors: they become ``DTensor`` s on the full mesh with FSDP2's
    placements (``(Shard(0), <tp>)``, ``_StridedShard`` when TP also shards dim 0, and
    ``(Replicate(), Shard(0), <tp>)`` for HSDP); during forward the module sees TP ``DTensor`` s.

    Returns:
        The same module (now an :class:`FSDPModule`).

    Example:
        >>> for block in model.blocks:  # doctest: +SKIP
        ...     fully_shard(block)
        >>> fully_shard(model)  # doctest: +SKIP
    """
    _validate_bucket_bytes(bucket_bytes)
    modules = _modules(module)
    _install_process_hooks()
    mp = MixedPrecisionPolicy.coerce(mp_policy)
    offload = OffloadPolicy.coerce(offload_policy)
    mesh, spmd_mesh, dp_names = _meshes(mesh, dp_mesh_dims, modules)
    raf = _validate_reshard(reshard_after_forward, mesh.size(-1))
    _validate_reproducible(reproducible, mesh)
    ignored = set(ignored_params or ())
    name = type(modules[0]).__name__

    params, holders, fqns, borrowed = _collect_params(modules, ignored, name)
    _check_borrowed(borrowed, mesh, mp, reproducible, name)
    group = None
    if params:
        tp = plan_tensor_parallel(
            params, fqns, mesh, spmd_mesh=spmd_mesh, dp_names=dp_names, raf=raf, name=name
        )
        users = len(modules)  # fully_shard([m1, m2]): the modules forwarding through it
        config = GroupConfig(reshard_after_forward=raf, reproducible=reproducible)
        group = _build_group(
            params, holders, fqns, mesh, config, shard_placement_fn, mp, offload, name, tp, users
        )
    _attach(modules, group, mp, name, reshard_after_forward, borrowed).bucket_bytes = bucket_bytes
    return module


# FSDP2's ``fully_shard.state(module)`` (torch's pipelining and trainers call it).
fully_shard.state = torch_state  # type: ignore[attr-defined]


def _meshes(
    mesh: DeviceMesh | None, dp_mesh_dims: Any, modules: list[nn.Module]
) -> tuple[DeviceMesh, DeviceMesh | None, tuple[str, ...]]:
    """The data-parallel mesh, and for FSDP2's SPMD form (``dp_mesh_dims``) the full mesh
    and the names of its dp dims."""
    spmd_mesh, dp_names = None, cast(tuple[str, ...], ())
    if dp_mesh_dims is not None:  # FSDP2's SPMD form: the full mesh plus the names of dp dims
        spmd_mesh = mesh
        mesh, dp_names = resolve_dp_mesh_dims(mesh, dp_mesh_dims)
    return _resolve_mesh(mesh, modules), spmd_mesh, dp_names


def _validate_bucket_bytes(bucket_bytes: Any) -> None:
    if bucket_bytes is not None and (
        isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 0
    ):
        raise PolicyError(
            f"bucket_bytes must be an int >= 0 (0 turns coalescing off) or None, got "
            f"{bucket_bytes!r}"
        )


def _validate_reproducible(policy: Any, mesh: DeviceMesh) -> None:
    """A :class:`ReproduciblePolicy` whose virtual world size the data-parallel ranks of
    ``mesh`` divide (raised before any collective)."""
    if policy is None:
        return
    if not isinstance(policy, ReproduciblePolicy):
        raise PolicyError(
            f"reproducible must be a functional_fsdp.ReproduciblePolicy or None, got "
            f"{type(policy).__name__}"
        )
    policy.micro_batches_per_rank(mesh.size())


def _modules(module: nn.Module | list[nn.Module]) -> list[nn.Module]:
    """The modules of one ``fully_shard`` call, checked (containers without forward refused)."""
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError("fully_shard expects an nn.Module or a non-empty list of nn.Modules")
    for m in modules:
        if (state := getattr(m, "_ffsdp_state", None)) is not None:
            # FSDP2's composable-API check, at the call (a second state would only fail later).
            raise AlreadyShardedError(
                f"fully_shard has already been applied to the following module: "
                f"{type(m).__name__} ({state.name!r}). Each distinct composable "
                "distributed API can only be applied to a module once; call fully_shard once "
                "per module (each block, then the root)"
            )
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            raise PolicyError(
                f"fully_shard does not support containers that do not implement forward "
                f"({type(m).__name__}): no hook would ever gather its parameters; call "
                "fully_shard on each child (for block in model.layers: fully_shard(block)) and on "
                "the module whose forward runs them"
            )
    return modules


def _install_process_hooks() -> None:
    """What the first ``fully_shard`` of a process installs in torch (each idempotent):
    ``DTensor``'s named refusal of forward-mode AD, and the optimizer's global step hooks, the
    check for replaced parameters (replaced.py) then the local-shard step (local_step.py),
    before any group is built: a group registers post-hooks of its own (ReproduciblePolicy's
    step count, a checking runtime's access report), which must run after the swap's restore
    (a post-hook before it keeps every step of the process on the ``DTensor`` path)."""
    explain_forward_ad_on_dtensor()
    local_step.install(check_no_partial_trees, replaced.install())


def _attach(
    modules: list[nn.Module],
    group: ParamGroup | None,
    mp: MixedPrecisionPolicy,
    name: str,
    reshard_after_forward: bool | int | None,
    borrowed: Borrowed,
) -> FSDPState:
    """Give each module its FSDP state, forward hooks, state-dict hooks and FSDP class, and
    the parameters of other groups it uses (``borrowed``, tied across groups); the first
    module's state."""
    state = FSDPState(modules[0], group, mp, name)
    state.user_reshard_after_forward = reshard_after_forward
    for i, m in enumerate(modules):
        st = state if i == 0 else FSDPState(m, None, mp, type(m).__name__)
        if i > 0:
            # A list of modules shares one group: the first owns it, the rest forward through it.
            st.group = group
        m._ffsdp_state = st  # type: ignore[assignment]
        pre, post, exit_ = hooks_for(st)
        m.register_forward_pre_hook(pre, prepend=True, with_kwargs=True)
        m.register_forward_hook(post)
        m.register_forward_hook(exit_, always_call=True)
        m.register_load_state_dict_post_hook(readopt_after_load)  # load_state_dict(assign=True)
        m.register_state_dict_pre_hook(_to_sharded_hook)
        m._register_load_state_dict_pre_hook(_to_sharded_hook, with_module=True)
        swap_class(m)
    _borrow(borrowed)
    return state


Holders = dict[int, list[tuple[nn.Module, str]]]
# A parameter another group owns, held by one of this call's modules: (owner group, its index
# there, the module of this call that holds it, the (module, name) pairs under that module,
# its name there).
Borrowed = dict[
    tuple[int, int], tuple[ParamGroup, int, nn.Module, list[tuple[nn.Module, str]], str]
]


def _collect_params(
    modules: list[nn.Module], ignored: set[nn.Parameter], name: str
) -> tuple[list[nn.Parameter], Holders, dict[int, str], Borrowed]:
    """The parameters a new group manages (not already managed below, not ignored), every
    ``(module, name)`` that holds each, and their names; and the parameters another group
    already owns (tied across groups: this call's modules borrow them), by module of the call."""
    managed_below: set[int] = set()
    for m in modules:
        for sub in m.modules():
            st = getattr(sub, "_ffsdp_state", None)
            if st is not None and st.group is not None:
                managed_below.update(id(p) for p in st.group.params)
    params: list[nn.Parameter] = []
    holders: Holders = {}
    fqns: dict[int, str] = {}
    borrowed: Borrowed = {}
    for m in modules:
        for mod_name, sub in m.named_modules(remove_duplicate=False):
            for pname, p in list(sub._parameters.items()):
                if p is None or id(p) in managed_below or p in ignored:
                    continue
                owner = getattr(p, _OWNER_ATTR, None)
                fqn = f"{mod_name}.{pname}" if mod_name else pname
                if owner is not None:  # tied to a parameter another group owns: borrow it
                    entry = borrowed.setdefault((id(p), id(m)), (owner[1], owner[2], m, [], fqn))
                    entry[3].append((sub, pname))
                    continue
                if id(p) not in holders:
                    holders[id(p)] = []
                    params.append(p)
                    fqns[id(p)] = fqn
                holders[id(p)].append((sub, pname))
    return params, holders, fqns, borrowed


def _check_borrowed(
    borrowed: Borrowed,
    mesh: DeviceMesh,
    mp: MixedPrecisionPolicy,
    reproducible: ReproduciblePolicy | None,
    name: str,
) -> None:
    """Refuse, before anything changes, a weight tied across groups that the owner cannot
    lend to this call's modules (``engine/tied.py``: the owner's full tensor is used as is)."""
    for owner, index, _, _, fqn in borrowed.values():
        tied = (
            f"parameter {fqn!r} of {name} is tied to {owner.sharded_params[index].fqn!r} of "
            f"{owner.name}, whose group shards it already (a weight tied across groups)"
        )
        fix = None
        if owner.tp is not None:
            fix = "weights tied across groups are not supported under tensor parallelism"
        elif owner.mesh != mesh:
            fix = "the two groups shard over different meshes; pass the same mesh to both"
        elif owner.layout.codec_inputs is not None:
            fix = "the owner all-gathers tensor subclasses through their fsdp_*_all_gather hooks"
        elif owner.mp_policy.param_dtype != mp.param_dtype:
            fix = (
                f"the groups compute in different dtypes ({owner.mp_policy.param_dtype} and "
                f"{mp.param_dtype}); pass the same MixedPrecisionPolicy(param_dtype=...) to both"
            )
        if fix is not None:
            raise TiedParameterError(
                f"{tied}: {fix}. Otherwise call fully_shard on a common parent that holds both "
                "users (one group), or untie the weights"
            )
        if owner.config.reproducible != reproducible:
            raise ReproducibilityError(
                f"{tied}: that group reduces its gradient with reproducible="
                f"{owner.config.reproducible!r} and this call asks for {reproducible!r}; pass "
                "the same ReproduciblePolicy to every fully_shard call"
            )


def _borrow(borrowed: Borrowed) -> None:
    """Give each module of this call a :class:`TiedUse` per parameter of another group that it
    holds: the owner lends it (its sharded parameter is registered there from now on)."""
    for owner, index, m, hl, fqn in borrowed.values():
        owner.lend(index, hl)
        state: Any = m._ffsdp_state
        state.tied.append(TiedUse(owner, index, hl, f"{fqn!r} of {state.name}"))


def _to_sharded_hook(module: nn.Module, *args: Any, **kwargs: Any) -> None:
    """``state_dict`` / ``load_state_dict`` pre-hook: reshard first (as FSDP2 does), so both see
    and write the sharded ``DTensor`` s and a load never leaves a stale unsharded copy behind.

    A module-level function reading the module's state when it runs: ``deepcopy`` keeps it.
    """
    del args, kwargs
    state: Any = module._ffsdp_state
    group = state.group
    if group is not None and group.training_state is TrainingState.IDLE:
        group.reshard()


def _resolve_mesh(mesh: DeviceMesh | None, modules: list[nn.Module]) -> DeviceMesh:
    if not dist.is_available() or not dist.is_initialized():
        raise MeshError(
            "fully_shard needs an initialised default process group: call "
            "torch.distributed.init_process_group('gloo' or 'nccl') first (torchrun sets the env)"
        )
    if mesh is None:
        dev = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
        return init_device_mesh(dev, (dist.get_world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise MeshError(f"mesh must be a torch DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim not in (1, 2):
        raise MeshError(
            f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}: 1-D (FSDP) or 2-D "
            f"(replicate, shard) for HSDP, not {mesh.ndim}-D; slice the data-parallel dims out "
            "of a larger mesh (mesh['dp'])"
        )
    if mesh.get_coordinate() is None:
        raise MeshError("this rank is not part of the mesh passed to fully_shard")
    return mesh


def _validate_reshard(value: bool | int | None, shard_size: int) -> bool | int:
    if value is None or isinstance(value, bool):
        return True if value is None else value
    if not isinstance(value, int):
        raise PolicyError(
            f"reshard_after_forward should be a bool or an int (or None), got {type(value).__name__}"
        )
    check_sub_group_size(value, shard_size)
    if value == 1:
        warnings.warn(
            "reshard_after_forward=1 keeps the full parameters on every rank; it acts as False",
            UserWarning,
            stacklevel=3,
        )
        return False
    if value == shard_size:
        return True
    return value


def _build_group(
    params: list[nn.Parameter],
    holders: dict[int, list[tuple[nn.Module, str]]],
    fqns: dict[int, str],
    mesh: DeviceMesh,
    config: GroupConfig,
    shard_placement_fn: Callable | None,
    mp: MixedPrecisionPolicy,
    offload: OffloadPolicy,
    name: str,
    tp: TensorParallelPlan | None = None,
    users: int = 1,
) -> ParamGroup:
    shard_size = mesh.size(-1)
    rank = mesh.get_local_rank(-1) if mesh.ndim == 2 else mesh.get_local_rank()
    specs = _param_specs(params, fqns, shard_placement_fn, tp, mp)
    layout = layout_for(specs, shard_size, mp)
    device = _compute_device(mesh)
    src = [(p._local_tensor if isinstance(p, DTensor) else p).detach() for p in params]
    templates = [t if has_hooks(t) else None for t in src]
    src = [plain_data(t) if tm is not None else t for t, tm in zip(src, templates)]
    if not any(t.is_meta for t in src):
        src = [t if t.device == device else t.to(device) for t in src]
    state = shard_tensors(src, layout, rank)
    from ...core.records import CPUOffloadPolicy

    if (
        isinstance(offload, CPUOffloadPolicy)
        and state.flat.device.type != "cpu"
        and not state.flat.is_meta
    ):
        flat = state.flat.cpu()
        if offload.pin_memory and torch.cuda.is_available():
            flat = flat.pin_memory()
        import attrs

        state = attrs.evolve(state, flat=flat)
    raf = config.reshard_after_forward
    # Each group gets its own scoped view of the shared communicators (the schedule check).
    comm = scoped(ProcessGroupComm.for_mesh(mesh, -1))
    rep = scoped(ProcessGroupComm.for_mesh(mesh, 0)) if mesh.ndim == 2 else None
    sub = (
        scoped(_sub_group_comm(mesh, raf))
        if (isinstance(raf, int) and not isinstance(raf, bool))
        else None
    )
    group = ParamGroup(
        layout,
        state,
        [holders[id(p)] for p in params],
        [p.requires_grad for p in params],
        mesh=mesh,
        comm=comm,
        replicate_comm=rep,
        sub_comm=sub,
        device=device,
        mp_policy=mp,
        offload_policy=offload,
        name=name,
        tp=tp,
        config=config,
        forward_users=users,
    )
    adopt_codecs(group, templates, mesh, raf)
    for i, p in enumerate(params):  # a later fully_shard holding it borrows it (tied weights)
        setattr(p, _OWNER_ATTR, (name, group, i))
    # An optimizer built before now holds these: its first step raises (replaced.py).
    replaced.mark_replaced(((p, fqns[id(p)]) for p in params), name)
    if config.reproducible is not None:  # torch's clip_grad_norm_ over its parameters warns
        watch_torch_clip(group)
    return group


def _param_specs(
    params: list[nn.Parameter],
    fqns: dict[int, str],
    shard_placement_fn: Callable | None,
    tp: TensorParallelPlan | None,
    mp: MixedPrecisionPolicy | None = None,
) -> list[ParamSpec]:
    """Each parameter's spec: its shard dim (``shard_placement_fn``), whether
    ``mp.param_dtype_override_fn`` keeps its dtype and, for a TP ``DTensor``, its TP-local
    shape, global shape and TP placements."""
    specs = []
    for i, p in enumerate(params):
        dim = 0
        if shard_placement_fn is not None:
            placement = shard_placement_fn(p)
            if placement is not None:
                if not isinstance(placement, Shard):
                    raise PolicyError(
                        f"shard_placement_fn must return Shard(i) or None, got {placement!r}"
                    )
                dim = placement.dim
        info = tp.params[i] if tp is not None else None
        spec = tp_spec(info, p, fqns[id(p)], dim)
        if mp is not None and mp.keeps_original_dtype(p):
            spec = attrs.evolve(spec, keep_dtype=True)
        specs.append(spec)
    return specs


def _compute_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _sub_group_comm(mesh: DeviceMesh, size: int) -> ProcessGroupComm:
    """Communicator over this rank's ``size``-rank block of its shard group.

    Every rank creates every block's group (``new_group`` is collective), once per mesh and size;
    the groups are cached on the mesh object (per-rank state, not a global).
    """
    cache = mesh.__dict__.setdefault("_ffsdp_sub_groups", {})
    if size not in cache:
        rows = mesh.mesh.reshape(-1, mesh.size(-1)).tolist()
        me = dist.get_rank()
        mine = None
        for row in rows:
            for start in range(0, len(row), size):
                ranks = row[start : start + size]
                pg = dist.new_group(ranks)
                if me in ranks:
                    mine = pg
        cache[size] = ProcessGroupComm(mine)
    return cache[size]
