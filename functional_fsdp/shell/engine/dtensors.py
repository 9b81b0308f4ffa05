"""A local tensor as a ``DTensor`` laid out like a parameter, without moving it.

Gradients, optimizer moments and new shards are wrapped with their parameter's layout in
several places (the optimizer step on local shards, ``summon_full_params``' gradient writeback,
re-sharding a replaced parameter, the recovery's state). All go through :func:`shard_like`,
every wrapping with a known spec (a gradient each step) through :func:`wrap`, and the
functional step's wrapping of a new value like its old one through :func:`wrap_like`.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

__all__ = ["shard_like", "wrap", "wrap_like"]


def wrap(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """``DTensor(local, spec, requires_grad=False)``, in a third of its time outside tracing.

    ``DTensor.__init__`` does nothing but sits behind ``torch._disable_dynamo``'s wrapper: 4 of
    the 6 us a gradient's wrapper took (measured, torch 2.13, one per parameter per step).
    ``DTensor.__new__`` alone makes the same tensor; while dynamo traces, the whole
    constructor runs as torch wrote it.
    """
    if torch.compiler.is_compiling():
        return DTensor(local, spec, requires_grad=False)
    return DTensor.__new__(DTensor, local, spec, requires_grad=False)


def wrap_like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``local`` as a tensor like ``like``: a ``DTensor`` with ``like``'s spec (``like``
    itself when ``local`` is its local tensor), or ``local`` when ``like`` is a plain tensor.
    The functional step's new parameters, moments and gradients, one per parameter a step."""
    if not isinstance(like, DTensor):
        return local
    if local is like._local_tensor:
        return like
    return wrap(local, like._spec)


def shard_like(local: torch.Tensor, p: DTensor) -> DTensor:
    """``local`` itself as a ``DTensor`` laid out as ``p`` (its mesh, placements, global shape
    and stride; ``local``'s own dtype): a gradient, an optimizer moment or a new shard of ``p``.

    Not ``DTensor.from_local``: that copies a tensor on another device type than the mesh's to
    the mesh's device, and under CPU offload the shards, their gradients and the optimizer's
    moments live on the host while the mesh is a CUDA mesh (an H200 run found the first AdamW
    step's moments moved to the GPU that way, and the second step failing on mixed devices).
    """
    spec = p._spec
    meta = spec.tensor_meta
    if meta is not None and meta.dtype != local.dtype:
        spec = DTensorSpec(
            spec.mesh, spec.placements, tensor_meta=TensorMeta(meta.shape, meta.stride, local.dtype)
        )
    return DTensor(local, spec, requires_grad=False)
