"""State dicts and ``torch.distributed.checkpoint`` (DCP) on sharded modules.

What we use unchanged from torch, and why it works: parameters are ``DTensor`` s with
``Shard(0)`` placement whose local tensors are views into the group's sharded buffer, so

- ``module.state_dict()`` returns those ``DTensor`` s (no communication);
- ``load_state_dict`` of ``DTensor`` s copies into the local tensors in place, i.e. into the
  sharded buffer, so the buffer the all-gather reads stays current;
- ``torch.distributed.checkpoint.state_dict`` (``get_state_dict``, ``set_state_dict``,
  ``get_model_state_dict``, ``StateDictOptions(full_state_dict=True, cpu_offload=True,
  broadcast_from_rank0=True)``) gathers one tensor at a time and distributes by copying each
  rank's slice into the local tensor;
- ``dcp.save`` writes each rank's shards with their global offsets, and ``dcp.load`` reads any
  other world size's layout (resharding N -> M).

What we add:

- :func:`readopt_after_load`, a ``load_state_dict`` post-hook that ``fully_shard`` registers:
  ``load_state_dict(assign=True)`` (and torch's meta-device path of ``set_model_state_dict``)
  *replaces* the parameter objects, so the group re-adopts the new parameters into a fresh
  sharded buffer (FSDP2 does the same with its ``reset_sharded_param`` hook).
- :func:`save_checkpoint` / :func:`load_checkpoint`, ``dcp.save`` / ``dcp.load`` with a
  checksumming writer and a safe reader (no arbitrary unpickling, no path outside the
  checkpoint directory, every item verified): see :mod:`.checkpoint_io`, re-exported here.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pathlib
import pickle
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from ..errors import FSDPError, LayoutMismatchError, MissingDependencyError
from .checkpoint_io import ChecksummingFileSystemWriter, SafeFileSystemReader, SafeLoadPlanner
from .group import ParamGroup, TrainingState

__all__ = [
    "ChecksummingFileSystemWriter",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "load_checkpoint",
    "readopt_after_load",
    "save_checkpoint",
]


# ------------------------------------------------------------------ load_state_dict(assign=True)


def readopt_after_load(module: nn.Module, incompatible_keys: Any) -> None:
    """``load_state_dict`` post-hook: re-adopt parameters that loading replaced.

    ``load_state_dict(assign=True)`` puts new parameter objects on the modules. Each one is
    brought to the group's sharding (a ``DTensor`` with other placements is redistributed, a
    full plain tensor is sliced locally) and the group packs them into a fresh sharded buffer
    that their local tensors view. A plain (non-assign) load copies in place and needs nothing.

    Args:
        module: a module passed to ``fully_shard`` (the hook's owner).
        incompatible_keys: unused (the hook protocol's second argument).
    """
    del incompatible_keys
    state = getattr(module, "_ffsdp_state", None)
    group: ParamGroup | None = state.group if state is not None else None
    if group is None or group.training_state is not TrainingState.IDLE:
        return
    replaced = [
        i
        for i, holders in enumerate(group.holders)
        if holders[0][0]._parameters.get(holders[0][1]) is not group.params[i]
    ]
    if not replaced:
        return
    for i in replaced:
        mod, name = group.holders[i][0]
        new = mod._parameters.get(name)
        ref: Any = group.params[i]
        if new is None:
            mod._parameters[name] = ref
            continue
        if _same_sharding(new, ref):
            continue
        local = _local_for(new, ref, group, i)
        dt = DTensor.from_local(
            local,
            ref.device_mesh,
            ref.placements,
            run_check=False,
            shape=ref.shape,
            stride=ref.stride(),
        )
        mod._parameters[name] = nn.Parameter(dt, requires_grad=ref.requires_grad)
    group.refresh_from_modules()


def _same_sharding(new: torch.Tensor, ref: Any) -> bool:
    return (
        isinstance(new, nn.Parameter)
        and isinstance(new, DTensor)
        and new.device_mesh == ref.device_mesh
        and tuple(new.placements) == tuple(ref.placements)
        and new.dtype == ref.dtype
        and new._local_tensor.shape == ref._local_tensor.shape
    )


def _local_for(new: torch.Tensor, ref: Any, group: ParamGroup, i: int) -> torch.Tensor:
    """This rank's shard of parameter ``i`` from ``new`` (a global tensor or any ``DTensor``).

    Under 2-D FSDP + TP the shapes compared are global (``ParamSpec.global_shape``); a plain
    global tensor is first cut to this rank's TP-local block, then to its dp slice.
    """
    spec = group.layout.specs[i]
    shape = spec.global_shape or spec.shape
    if tuple(new.shape) != shape:
        raise LayoutMismatchError(
            f"load_state_dict(assign=True): {spec.fqn!r} has shape {tuple(new.shape)} but the sharded "
            f"module expects the full shape {shape}; load a state dict of the same model"
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


def _reraise_named(e: CheckpointException) -> None:
    """DCP wraps every rank's exception in ``CheckpointException`` (on every rank): surface the
    first of ours, so each rank raises the same named error."""
    for _rank, (exc, _tb) in sorted(e.failures.items()):
        if isinstance(exc, (FSDPError, pickle.UnpicklingError)):
            raise exc from e


def _single_process() -> bool:
    """No process group: save or load in this process alone (e.g. a plain model reading a
    sharded checkpoint)."""
    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """Without a process group DCP warns that it assumes a single process; that is the
    documented meaning of calling ours without one, so the warning is dropped."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is (disabled, )?unavailable", category=UserWarning
        )
        yield


def _require_numpy() -> None:
    try:
        importlib.import_module("numpy")
    except ImportError as e:
        raise MissingDependencyError(
            "save_checkpoint needs numpy (torch.distributed.checkpoint imports it while saving): "
            "run `pip install numpy` on every rank's machine (it is a dependency of "
            "functional_fsdp; the install may be incomplete)"
        ) from e


def save_checkpoint(
    state_dict: dict[str, Any],
    checkpoint_id: str | os.PathLike,
    *,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """``torch.distributed.checkpoint.save`` with per-item checksums.

    Writes DCP's format with :class:`ChecksummingFileSystemWriter`, so plain ``dcp.load`` reads
    it too, and :func:`load_checkpoint` verifies every item it reads.

    Args:
        state_dict: e.g. ``{"model": msd, "optim": osd}`` from
            ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)``.
        checkpoint_id: the checkpoint directory (created if missing).
        process_group: the group that saves (default: the world; without an initialised
            process group, this process alone, e.g. a plain model's state dict).

    Raises:
        MissingDependencyError: numpy is not importable (checked before any collective).

    Example:
        >>> msd, osd = get_state_dict(model, opt)  # doctest: +SKIP
        >>> save_checkpoint({"model": msd, "optim": osd}, "ckpt/step100")  # doctest: +SKIP
    """
    _require_numpy()
    try:
        with _quiet_single_process():
            dcp.save(
                state_dict,
                storage_writer=ChecksummingFileSystemWriter(pathlib.Path(checkpoint_id)),
                process_group=process_group,
                no_dist=_single_process(),
            )
    except CheckpointException as e:
        _reraise_named(e)
        raise


def load_checkpoint(
    state_dict: dict[str, Any],
    checkpoint_id: str | os.PathLike,
    *,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """``torch.distributed.checkpoint.load`` with :class:`SafeFileSystemReader` and
    :class:`SafeLoadPlanner`: loads in place into ``state_dict`` at any world size.

    Args:
        state_dict: e.g. ``{"model": msd, "optim": osd}`` from
            ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`` on the
            (freshly sharded) model; loaded in place, then apply it with ``set_state_dict``.
        checkpoint_id: the checkpoint directory written by :func:`save_checkpoint` (or by plain
            ``dcp.save``: then it loads unverified, with an ``UncheckedCheckpointWarning``).
        process_group: the group that loads (default: the world; without an initialised
            process group, this process alone: a plain model reads any sharded checkpoint).

    Raises:
        CheckpointPathError: the metadata names a storage file outside the directory (nothing
            was read).
        CheckpointIntegrityError: an item's bytes do not match their checksum (names the item).
        pickle.UnpicklingError: the metadata holds objects that are not DCP metadata.

    Every rank of the group raises the same error.

    Example:
        >>> msd, osd = get_state_dict(model, opt)  # doctest: +SKIP
        >>> sd = {"model": msd, "optim": osd}  # doctest: +SKIP
        >>> load_checkpoint(sd, "ckpt/step100")  # doctest: +SKIP
        >>> set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])  # doctest: +SKIP
    """
    reader = SafeFileSystemReader(pathlib.Path(checkpoint_id))
    try:
        with _quiet_single_process():
            dcp.load(
                state_dict,
                storage_reader=reader,
                planner=SafeLoadPlanner(),
                process_group=process_group,
                no_dist=_single_process(),
            )
    except CheckpointException as e:
        if reader.refusal is not None:
            raise reader.refusal from e
        _reraise_named(e)
        raise
