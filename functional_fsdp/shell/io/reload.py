"""``load_state_dict(assign=True)`` on sharded modules: re-adopt the new parameter objects.

``load_state_dict(assign=True)`` (and torch's meta-device path of ``set_model_state_dict``)
*replaces* the parameter objects, so the group re-adopts the new parameters into a fresh
sharded buffer (FSDP2 does the same with its ``reset_sharded_param`` hook). ``fully_shard``
registers :func:`readopt_after_load` as a post-hook. Kept apart from :mod:`.checkpoint` so that
importing ``fully_shard`` does not import ``torch.distributed.checkpoint`` (about 6 MiB of RSS
per rank that a training run without checkpoints does not need).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ...core.errors import LayoutMismatchError
from ..engine.dtensors import shard_like
from ..engine.group import ParamGroup, TrainingState

__all__ = ["readopt_after_load"]


def readopt_after_load(module: nn.Module, incompatible_keys: Any) -> None:
    """``load_state_dict`` post-hook: re-adopt parameters that loading replaced.

    ``load_state_dict(assign=True)`` puts new parameter objects on the modules. Each one is
    brought to the group's sharding (a ``DTensor`` with other placements is redistributed, a
    full plain tensor is sliced locally) and the group packs them into a fresh sharded buffer
    that their local tensors view. A plain (non-assign) load copies in place and needs nothing
    more. Either way the group's compression residual is reset (``ParamGroup.reset_residual``:
    a run resumed from a checkpoint starts from zero, docs/compression.md).

    Args:
        module: a module passed to ``fully_shard`` (the hook's owner).
        incompatible_keys: unused (the hook protocol's second argument).
    """
    del incompatible_keys
    state = getattr(module, "_ffsdp_state", None)
    for use in state.tied if state is not None else ():
        # A weight tied across groups: the owner's parameter again (assign=True put the
        # state dict's own object there); the owner re-adopts its value from its own modules.
        if use.owner.training_state is TrainingState.IDLE:
            use.to_sharded()
    group: ParamGroup | None = state.group if state is not None else None
    if group is None or group.training_state is not TrainingState.IDLE:
        return
    group.reset_residual()
    readopt_replaced(group, "load_state_dict(assign=True)")


def readopt_replaced(
    group: ParamGroup, why: str, *, parameters_only: bool = False, warn_new_objects: bool = False
) -> bool:
    """Re-adopt the parameters of ``group`` that were replaced on their modules.

    A replacement (``load_state_dict(assign=True)``, or ``block.fc.weight = nn.Parameter(...)``
    between ``fully_shard`` and the first forward, as FSDP2 re-registers at lazy init) is
    brought to the group's sharding: a ``DTensor`` with the group's placements is kept, one
    with other placements is redistributed, and a full plain tensor is sliced locally (this
    rank's ``torch.chunk`` rows). The group then packs them into a fresh sharded buffer that
    their local tensors view, unless some parameter is still on the meta device (the first
    forward then refuses it; ``to_empty`` re-adopts later).

    Args:
        group: the group (idle).
        why: what replaced the parameters, for error messages.
        parameters_only: leave a slot alone unless it holds an ``nn.Parameter`` (what
            ``module.weight = ...`` must assign): ``functional_call`` puts plain tensors there
            for one forward, which the forward takes as sources (``functional_path``).
        warn_new_objects: warn when a replacement is registered as a new parameter object
            (an optimizer that holds the replacing object would silently not train it).

    Returns:
        Whether any parameter was replaced.

    Raises:
        LayoutMismatchError: a replacement's global shape differs from the parameter's.
    """
    replaced = [
        sp
        for sp in group.sharded_params
        if (slot := sp.registered()) is not sp.sharded
        and not (parameters_only and not isinstance(slot, nn.Parameter))
    ]
    if not replaced:
        return False
    for sp in replaced:
        mod, name = sp.holders[0]
        new = mod._parameters.get(name)
        ref: Any = sp.sharded
        if new is None:
            mod._parameters[name] = ref
            continue
        if _same_sharding(new, ref):
            continue
        local = _local_for(new, ref, group, sp.index, why)
        dt = shard_like(local, ref)  # where the new tensor is (from_local: to the mesh device)
        if warn_new_objects:
            warnings.warn(
                f"{why}: {sp.fqn!r} of {group.name!r} is not a DTensor with "
                f"the placements {tuple(ref.placements)}; it was sharded into a new parameter "
                "object, so an optimizer built before this forward does not train it. Build "
                "the optimizer after the first forward, or assign nn.Parameter("
                "distribute_tensor(t, mesh, placements)), which is kept as it is",
                UserWarning,
                stacklevel=2,
            )
        mod._parameters[name] = nn.Parameter(dt, requires_grad=ref.requires_grad)
    current = [sp.registered() for sp in group.sharded_params]
    locals_ = [p._local_tensor if isinstance(p, DTensor) else p for p in current]
    if not any(t is not None and t.is_meta for t in locals_):
        group.refresh_from_modules()
    return True


def _same_sharding(new: torch.Tensor, ref: Any) -> bool:
    return (
        isinstance(new, nn.Parameter)
        and isinstance(new, DTensor)
        and new.device_mesh == ref.device_mesh
        and tuple(new.placements) == tuple(ref.placements)
        and new.dtype == ref.dtype
        and new._local_tensor.shape == ref._local_tensor.shape
    )


def _local_for(new: torch.Tensor, ref: Any, group: ParamGroup, i: int, why: str) -> torch.Tensor:
    """This rank's shard of parameter ``i`` from ``new`` (a global tensor or any ``DTensor``).

    Under 2-D FSDP + TP the shapes compared are global (``ParamSpec.global_shape``); a plain
    global tensor is first cut to this rank's TP-local block, then to its dp slice.
    """
    spec = group.layout.specs[i]
    shape = spec.global_shape or spec.shape
    if tuple(new.shape) != shape:
        raise LayoutMismatchError(
            f"{why}: {spec.fqn!r} has shape {tuple(new.shape)} but the sharded module expects "
            f"the full shape {shape}; give it a tensor of the parameter's full shape"
        )
    with torch.no_grad():
        if isinstance(new, DTensor):
            return (
                new.redistribute(ref.device_mesh, ref.placements).to_local().detach().to(ref.dtype)
            )
        full = new.detach()
        if group.tp is not None:
            full = group.tp.to_local(i, spec, full)
        start, length = group.layout.extent(i, group.state.rank)
        dim = group.layout.shard_dims[i]
        return full.narrow(dim, start, length).to(ref.dtype).clone()


# ------------------------------------------------------------------------------- entry points
