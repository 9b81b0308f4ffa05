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

- :func:`~.reload.readopt_after_load`, a ``load_state_dict`` post-hook that ``fully_shard``
  registers (``load_state_dict(assign=True)`` replaces the parameter objects; the group
  re-adopts them), in :mod:`.reload`.
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

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ...core.errors import FSDPError, MissingDependencyError
from .checkpoint_files import ChecksummingFileSystemWriter, SafeFileSystemReader, SafeLoadPlanner

__all__ = [
    "ChecksummingFileSystemWriter",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "load_checkpoint",
    "save_checkpoint",
]


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
        CheckpointIntegrityError: an item's file is missing or unreadable, the item is
            truncated, or its bytes do not match their checksum (names the item).
        pickle.UnpicklingError: the metadata holds objects that are not DCP metadata.

    Every rank of the group raises the same error, and a load that raises has written nothing:
    every item (model and optimizer) is checked on every rank before any is loaded, so
    ``state_dict`` (and the model and optimizer whose tensors it holds) is left exactly as it
    was. Without checksums (plain ``dcp.save``) only missing, unreadable or truncated items are
    caught up front; bytes changed in place are not detectable.

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
