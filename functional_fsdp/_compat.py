"""What differs between the supported torch releases (2.11 to 2.15), in one place.

Each supported torch behaves as FSDP2 of *that* torch; the facts below are the places where
FSDP2 (or a torch API the package or its tests lean on) changed between releases. Read them
where behaviour depends on the version, rather than comparing version numbers at the call site.
The values are read once at import (the torch a process runs is fixed) and are constants.
"""

from __future__ import annotations

import re

import torch

__all__ = [
    "FSDP2_RAISES_ON_TIES_ACROSS_GROUPS",
    "FSDP2_REDUCES_IN_ORIGINAL_DTYPE",
    "FSDP2_UPCASTS_TP_REPLICATED_GRADS",
    "HAS_DATA_PARALLEL_MESH_DIMS",
    "HAS_PARAM_DTYPE_OVERRIDE_FN",
    "HAS_REDUCE_SCATTER_MAX_INPUT_BUFFERS",
    "HAS_SWAP_DATA_PTR",
    "TORCH_VERSION",
    "torch_at_least",
]


def _release(version: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:  # pragma: no cover - torch always has a numeric release
        raise ValueError(f"cannot read torch's version {version!r}")
    return int(m.group(1)), int(m.group(2))


#: ``(major, minor)`` of the running torch (``2.15.0a0+git...`` counts as 2.15).
TORCH_VERSION: tuple[int, int] = _release(torch.__version__)


def torch_at_least(major: int, minor: int) -> bool:
    """Whether the running torch is ``major.minor`` or newer (pre-releases included)."""
    return (major, minor) <= TORCH_VERSION


#: FSDP2 from 2.15 reduces gradients in the parameter's original dtype (its ``grad_dtype``)
#: when ``MixedPrecisionPolicy.reduce_dtype`` is ``None``; before, it reduced in
#: ``param_dtype`` (its ``MixedPrecisionPolicy`` docs: "versionchanged 2.15").
FSDP2_REDUCES_IN_ORIGINAL_DTYPE: bool = torch_at_least(2, 15)

#: FSDP2 from 2.15 sets ``grad_dtype`` to the reduce dtype on a tensor-parallel parameter that
#: is replicated over a TP mesh dim (e.g. a sequence-parallel norm weight), so autograd casts
#: its ``Partial`` gradient before DTensor all-reduces it over TP: the TP reduction runs in the
#: reduce dtype (fp32 for bf16 compute), not in the compute dtype.
FSDP2_UPCASTS_TP_REPLICATED_GRADS: bool = torch_at_least(2, 15)

#: ``MixedPrecisionPolicy.param_dtype_override_fn`` (a per-parameter ``param_dtype``) is new
#: in torch 2.15's FSDP2.
HAS_PARAM_DTYPE_OVERRIDE_FN: bool = torch_at_least(2, 15)

#: ``FSDPModule.set_reduce_scatter_max_input_buffers`` is new in torch 2.13.
HAS_REDUCE_SCATTER_MAX_INPUT_BUFFERS: bool = torch_at_least(2, 13)

#: FSDP2 raises ``ValueError`` at the first forward for a weight tied across groups in torch
#: 2.12.1 and from 2.13 on (2.12.0 not tried); 2.11 trains it (wrongly with uneven shards).
FSDP2_RAISES_ON_TIES_ACROSS_GROUPS: bool = torch_at_least(2, 12)

#: ``torch.distributed.fsdp.DataParallelMeshDims`` (FSDP2's SPMD form, ``dp_mesh_dims=``) is
#: absent from torch 2.11.
HAS_DATA_PARALLEL_MESH_DIMS: bool = torch_at_least(2, 12)

#: ``UntypedStorage._swap_data_ptr_`` (how the host buffer pool moves memory between
#: storages) is absent from torch 2.11: there the pool keeps nothing.
HAS_SWAP_DATA_PTR: bool = hasattr(torch.UntypedStorage, "_swap_data_ptr_")
