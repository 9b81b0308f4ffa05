"""``fully_shard`` and the ``FSDPModule`` methods: the drop-in for torch FSDP2."""

from __future__ import annotations

import functools
import math
import numbers
import types
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from ..errors import MeshError, PolicyError, StateError, TiedParameterError
from ..layout import check_sub_group_size
from ..records import GroupLayout, MixedPrecisionPolicy, OffloadPolicy, ParamSpec
from ..transitions import shard_tensors
from ._copy import deepcopy_fsdp_module
from .checkpoint import readopt_after_load
from .comm import ProcessGroupComm
from .group import ParamGroup
from .state import FSDPState, hooks_for

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
        dp_mesh_dims: accepted for signature compatibility; only ``None`` is supported.

    Returns:
        The same module (now an :class:`FSDPModule`).

    Example:
        >>> for block in model.blocks:  # doctest: +SKIP
        ...     fully_shard(block)
        >>> fully_shard(model)  # doctest: +SKIP
    """
    if dp_mesh_dims is not None:
        raise NotImplementedError(
            "fully_shard(dp_mesh_dims=...) is not supported by functional_fsdp yet; pass a 1-D "
            "data-parallel mesh, or a 2-D (replicate, shard) mesh for HSDP"
        )
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError("fully_shard expects an nn.Module or a non-empty list of nn.Modules")
    mp = MixedPrecisionPolicy.coerce(mp_policy)
    offload = OffloadPolicy.coerce(offload_policy)
    mesh = _resolve_mesh(mesh, modules)
    shard_size = mesh.size(-1)
    raf = _validate_reshard(reshard_after_forward, shard_size)
    ignored = set(ignored_params or ())
    name = type(modules[0]).__name__

    # Collect managed parameters and every (module, name) that holds each of them.
    managed_below: set[int] = set()
    for m in modules:
        for sub in m.modules():
            st = getattr(sub, "_ffsdp_state", None)
            if st is not None and st.group is not None:
                managed_below.update(id(p) for p in st.group.params)
    params: list[nn.Parameter] = []
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    fqns: dict[int, str] = {}
    for m in modules:
        for mod_name, sub in m.named_modules(remove_duplicate=False):
            for pname, p in list(sub._parameters.items()):
                if p is None or id(p) in managed_below or p in ignored:
                    continue
                owner = getattr(p, _OWNER_ATTR, None)
                if owner is not None:
                    raise TiedParameterError(
                        f"parameter {mod_name + '.' + pname if mod_name else pname!r} of {name} is "
                        f"already managed by the fully_shard group of {owner!r}; a parameter tied "
                        "across groups cannot be sharded twice: call fully_shard on a common parent "
                        "that holds both users, or untie the weights"
                    )
                if id(p) not in holders:
                    holders[id(p)] = []
                    params.append(p)
                    fqns[id(p)] = f"{mod_name}.{pname}" if mod_name else pname
                holders[id(p)].append((sub, pname))

    group = None
    if params:
        group = _build_group(
            params, holders, fqns, mesh, raf, shard_placement_fn, mp, offload, name
        )
        for p in params:
            setattr(p, _OWNER_ATTR, name)
    state = FSDPState(modules[0], group, mp, name)
    state.user_reshard_after_forward = reshard_after_forward
    if group is not None:
        group.reshard_after_forward = raf
        group.forward_users = len(modules)
    for i, m in enumerate(modules):
        st = state if i == 0 else FSDPState(m, None, mp, type(m).__name__)
        if i > 0:
            # A list of modules shares one group: the first owns it, the rest forward through it.
            st.group = group
        m._ffsdp_state = st  # type: ignore[assignment]
        pre, post = hooks_for(st)
        m.register_forward_pre_hook(pre, prepend=True, with_kwargs=True)
        m.register_forward_hook(post)
        m.register_load_state_dict_post_hook(readopt_after_load)  # load_state_dict(assign=True)
        _swap_class(m)
    return module


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
            f"mesh must be 1-D (FSDP) or 2-D (replicate, shard) for HSDP, got a {mesh.ndim}-D mesh; "
            "slice the data-parallel dims out of a larger mesh (mesh['dp'])"
        )
    if mesh.get_coordinate() is None:
        raise MeshError("this rank is not part of the mesh passed to fully_shard")
    return mesh


def _validate_reshard(value: bool | int | None, shard_size: int) -> bool | int:
    if value is None or isinstance(value, bool):
        return True if value is None else value
    if not isinstance(value, int):
        raise PolicyError(
            f"reshard_after_forward must be a bool, an int or None, got {type(value).__name__}"
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
    raf: bool | int,
    shard_placement_fn: Callable | None,
    mp: MixedPrecisionPolicy,
    offload: OffloadPolicy,
    name: str,
) -> ParamGroup:
    shard_size = mesh.size(-1)
    rank = mesh.get_local_rank(-1) if mesh.ndim == 2 else mesh.get_local_rank()
    specs = []
    for p in params:
        if isinstance(p, DTensor):
            raise MeshError(
                f"parameter {fqns[id(p)]!r} is already a DTensor (tensor parallel?); 2-D FSDP+TP "
                "is not supported yet: fully_shard plain-tensor parameters"
            )
        dim = 0
        if shard_placement_fn is not None:
            placement = shard_placement_fn(p)
            if placement is not None:
                if not isinstance(placement, Shard):
                    raise PolicyError(
                        f"shard_placement_fn must return Shard(i) or None, got {placement!r}"
                    )
                dim = placement.dim
        specs.append(ParamSpec(fqns[id(p)], tuple(p.shape), p.dtype, p.requires_grad, dim))
    layout = GroupLayout.build(
        specs, shard_size, param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype
    )
    if mp.reduce_dtype is not None and mp.reduce_dtype == mp.param_dtype:
        layout = GroupLayout.build(specs, shard_size, param_dtype=mp.param_dtype, reduce_dtype=None)
    device = _compute_device(mesh)
    src = [p.detach() for p in params]
    if not any(t.is_meta for t in src):
        src = [t if t.device == device else t.to(device) for t in src]
    state = shard_tensors(src, layout, rank)
    from ..records import CPUOffloadPolicy

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
    comm = _mesh_comm(mesh, -1)
    rep = _mesh_comm(mesh, 0) if mesh.ndim == 2 else None
    sub = (
        _sub_group_comm(mesh, raf) if (isinstance(raf, int) and not isinstance(raf, bool)) else None
    )
    return ParamGroup(
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
    )


def _compute_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _mesh_comm(mesh: DeviceMesh, dim: int) -> ProcessGroupComm:
    """The one communicator of this rank's group along ``dim`` of ``mesh``.

    Every group on the mesh shares it, so the point-to-point tag ranges of concurrent
    collectives (one group's reduce-scatter beside another's prefetch) never overlap. Cached on
    the mesh object (per-rank state, not a global).
    """
    cache = mesh.__dict__.setdefault("_ffsdp_comms", {})
    key = dim % mesh.ndim
    if key not in cache:
        cache[key] = ProcessGroupComm(mesh.get_group(key) if mesh.ndim > 1 else mesh.get_group())
    return cache[key]


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


def _swap_class(module: nn.Module) -> None:
    cls = module.__class__
    if isinstance(module, FSDPModule):
        return
    new_cls: type = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": cls.__module__})
    module.__class__ = new_cls


class UnshardHandle:
    """Handle of :meth:`FSDPModule.unshard` with ``async_op=True``; ``wait()`` finishes it."""

    def __init__(self, groups: list[ParamGroup]) -> None:
        self._groups = groups

    def wait(self) -> None:
        """Block until the all-gathers are done and the full parameters are on the modules."""
        for g in self._groups:
            g.wait_unshard()
            g.register_full(g.views)
        self._groups = []


def _states(module: nn.Module, recurse: bool) -> list[FSDPState]:
    if not recurse:
        return [module._ffsdp_state]  # type: ignore[list-item]
    return [s for m in module.modules() if (s := getattr(m, "_ffsdp_state", None)) is not None]


class FSDPModule:
    """Mixin of every module passed to :func:`fully_shard`; FSDP2's ``FSDPModule`` methods."""

    _ffsdp_state: FSDPState

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Indexing a container (nn.Sequential[1:]) builds a new instance: give the original class.
        orig: Any = cls.__mro__[2]
        self = orig.__new__(orig)
        self.__init__(*args, **kwargs)
        return self

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters (they stay unsharded until resharded)."""
        g = self._ffsdp_state.group
        groups = [g] if g is not None else []
        for gr in groups:
            gr.start_unshard()
        handle = UnshardHandle(groups)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded ones."""
        g = self._ffsdp_state.group
        if g is not None:
            g.discard_pending()
            g.free()
            g.register_sharded()

    def __deepcopy__(self, memo: dict[Any, Any]) -> Any:
        """An independent sharded copy: own sharded buffers, parameters, groups and hooks."""
        return deepcopy_fsdp_module(self, memo)  # type: ignore[arg-type]

    def reset_iter_state(self) -> None:
        """Reset training state after an exception mid-iteration (nothing is corrupted)."""
        self._ffsdp_state.reset()

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last of the iteration (root only)."""
        self._ffsdp_state.is_last_backward = is_last_backward

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """Reduce gradients in backward (``True``) or accumulate them unsharded (``False``)."""
        for s in _states(self, recurse):  # type: ignore[arg-type]
            if s.group is not None:
                s.group.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: all-reduce across replicas now (``True``) or keep a partial sum (``False``)."""
        for s in _states(self, recurse):  # type: ignore[arg-type]
            if s.group is not None:
                s.group.requires_all_reduce = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Change ``reshard_after_forward`` (bool only, as in FSDP2)."""
        if not isinstance(reshard_after_forward, bool):
            raise PolicyError(
                f"reshard_after_forward should be a bool, got {type(reshard_after_forward).__name__}"
            )
        for s in _states(self, recurse):  # type: ignore[arg-type]
            s.user_reshard_after_forward = reshard_after_forward
            if s.group is not None:
                s.group.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """Free the unsharded parameters after backward (default ``True``)."""
        for s in _states(self, recurse):  # type: ignore[arg-type]
            if s.group is not None:
                s.group.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Explicit forward prefetch: all-gather these modules when this one's forward starts."""
        _check_fsdp_modules(modules)
        self._ffsdp_state.explicit_forward_prefetch = [m._ffsdp_state for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Explicit backward prefetch: all-gather these modules when this one's backward starts."""
        _check_fsdp_modules(modules)
        self._ffsdp_state.explicit_backward_prefetch = [m._ffsdp_state for m in modules]

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide gradients by ``factor`` instead of the data-parallel size.

        Raises:
            PolicyError: ``factor`` is not a positive, finite number (checked before any change).
        """
        if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
            raise PolicyError(
                f"set_gradient_divide_factor expects a positive number, got {type(factor).__name__}"
            )
        if not (math.isfinite(factor) and factor > 0):
            raise PolicyError(
                f"set_gradient_divide_factor({factor!r}): the factor must be a positive, finite "
                "number (gradients are divided by it); use the data-parallel size for averaging"
            )
        for s in _states(self, True):  # type: ignore[arg-type]
            if s.group is not None:
                s.group.divide_factor = factor

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated alias of :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Use sum reductions with explicit pre/post division (no ``avg`` reductions)."""
        for s in _states(self, True):  # type: ignore[arg-type]
            if s.group is not None:
                s.group.force_sum = enable

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool) -> None:
        """Also reduce-scatter (zero) gradients of parameters that got none."""
        for s in _states(self, True):  # type: ignore[arg-type]
            if s.group is not None:
                s.group.reduce_unused = reduce_scatter_unused_params

    def set_post_optim_event(self, event: Any) -> None:
        """Accepted for compatibility; CPU collectives need no cross-stream event."""
        del event

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        self.reshard()
        ret = super()._apply(*args, **kwargs)  # type: ignore[misc]
        g = self._ffsdp_state.group
        if g is not None:
            g.refresh_from_modules()
        return ret


def _check_fsdp_modules(modules: Iterable[Any]) -> None:
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise StateError(
                f"expected modules passed to fully_shard, got {type(m).__name__}; fully_shard it first"
            )


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run FSDP's pre/post-forward around ``module.method_name`` (e.g. ``generate``)."""
    if not isinstance(module, FSDPModule):
        raise StateError(
            f"{type(module).__name__} is not an FSDP module; call fully_shard on it first"
        )
    orig = getattr(type(module), method_name)
    state = module._ffsdp_state

    @functools.wraps(orig)
    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = state.pre_forward(self, args, kwargs)
        out = orig(self, *args, **kwargs)
        return state.post_forward(self, args, out)

    object.__setattr__(module, method_name, types.MethodType(wrapped, module))
