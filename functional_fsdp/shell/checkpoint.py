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
- :class:`SafeFileSystemReader` and :class:`SafeLoadPlanner`: DCP's stock reader unpickles the
  ``.metadata`` file with plain ``pickle`` and its planner loads non-tensor entries (optimizer
  ``param_groups``) with ``torch.load(weights_only=False)``; both can run arbitrary code from a
  crafted checkpoint. Ours allow only DCP's metadata classes and ``weights_only=True`` loads.
  :func:`load_checkpoint` is ``dcp.load`` with both.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.tensor import DTensor

from ..errors import LayoutMismatchError
from .group import ParamGroup, TrainingState

__all__ = ["SafeFileSystemReader", "SafeLoadPlanner", "load_checkpoint", "readopt_after_load"]


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
    spec = group.layout.specs[i]
    if tuple(new.shape) != spec.shape:
        raise LayoutMismatchError(
            f"load_state_dict(assign=True): {spec.fqn!r} has shape {tuple(new.shape)} but the sharded "
            f"module expects the full shape {spec.shape}; load a state dict of the same model"
        )
    with torch.no_grad():
        if isinstance(new, DTensor):
            return (
                new.redistribute(ref.device_mesh, ref.placements).to_local().detach().to(ref.dtype)
            )
        start, length = group.layout.extent(i, group.state.rank)
        dim = group.layout.shard_dims[i]
        return new.detach().narrow(dim, start, length).to(ref.dtype).clone()


# ------------------------------------------------------------------------------ safe DCP loading

# (module, name) pairs the metadata unpickler may resolve: DCP's own types and plain containers.
_METADATA_CLASSES = frozenset(
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
) | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata only: DCP's dataclasses, ``torch.Size``, dtypes and layouts."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"checkpoint metadata refers to {module}.{name}, which is not a DCP metadata type; "
            "refusing to load it (the file may be corrupt or crafted). Inspect it, or load it with "
            "torch's FileSystemReader only if you trust its origin"
        )


class SafeFileSystemReader(FileSystemReader):
    """DCP ``FileSystemReader`` that never unpickles arbitrary objects.

    The ``.metadata`` file is read with an unpickler that only accepts DCP's metadata types
    (anything else raises ``pickle.UnpicklingError`` before any object is built); tensors are
    read with ``torch.load(weights_only=True)`` as in the stock reader.

    Args:
        path: the checkpoint directory.
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Read ``.metadata`` with the restricted unpickler."""
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(
                f"{os.fspath(path)} does not hold DCP Metadata (got {type(metadata).__name__})"
            )
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP ``DefaultLoadPlanner`` that loads non-tensor entries with ``weights_only=True``.

    Optimizer ``param_groups`` (floats, tuples, strings, ``None``) are stored as pickled bytes;
    the stock planner loads them with ``weights_only=False``.
    """

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Load one non-tensor entry with ``torch.load(weights_only=True)``."""
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


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
        checkpoint_id: the checkpoint directory written by ``dcp.save``.
        process_group: the group that loads (default: the world).

    Example:
        >>> msd, osd = get_state_dict(model, opt)  # doctest: +SKIP
        >>> sd = {"model": msd, "optim": osd}  # doctest: +SKIP
        >>> load_checkpoint(sd, "ckpt/step100")  # doctest: +SKIP
        >>> set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])  # doctest: +SKIP
    """
    dcp.load(
        state_dict,
        storage_reader=SafeFileSystemReader(pathlib.Path(checkpoint_id)),
        planner=SafeLoadPlanner(),
        process_group=process_group,
    )
