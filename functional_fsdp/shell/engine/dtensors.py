"""A local tensor as a ``DTensor`` laid out like a parameter, without moving it.

Gradients, optimizer moments and new shards are wrapped with their parameter's layout in
several places (the optimizer step on local shards, ``summon_full_params``' gradient writeback,
re-sharding a replaced parameter, the recovery's state). All go through :func:`shard_like`,
every wrapping with a known spec (a gradient each step) through :func:`wrap`, and the
functional step's wrapping of a new value like its old one through :func:`wrap_like` (both
in ``functional_fsdp._dtensor``, which the shell-free functional optimizers import too).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ..._dtensor import wrap, wrap_like

__all__ = ["shard_like", "wrap", "wrap_like"]


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
