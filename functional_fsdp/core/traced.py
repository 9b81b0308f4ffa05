"""A group's all-gather input and full parameters as differentiable tensor expressions.

The compiled step (:mod:`functional_fsdp.functional.compiled`) traces the whole forward and
backward into one graph, so the packing the eager engine does with in-place copies into
preallocated buffers (:func:`~.transitions.pack_locals`, :func:`~.transitions.copy_out`) is
written here once more as out-of-place ops that autograd differentiates and a tracer records:
:func:`pack_shards` turns this rank's unpadded local shards into the padded flat all-gather
input, :func:`full_params` turns the rank-major all-gather output back into the full
parameters (views). Their backward passes are the same expressions transposed: the gradient of
the flat input is the packed (padded) sharded gradient. The layouts are the engine's own
:class:`~.records.GroupLayout`, so a group packs to the same offsets in both paths.

Only layouts the trace can express as views are accepted (:func:`traceable_reason`): every
parameter sharded on dim 0, one storage dtype and one gather dtype per group, no all-gather
codec. Pure: no communication.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .records import GroupLayout

__all__ = ["full_params", "pack_shards", "traceable_reason"]


def traceable_reason(layout: GroupLayout) -> str | None:
    """Why ``layout`` cannot be traced as views (``None``: it can)."""
    if layout.codec_inputs is not None:
        return "a parameter has an all-gather codec (fsdp_pre_all_gather)"
    if not layout.dim0:
        return "a parameter is sharded on a dim other than 0 (shard_placement_fn)"
    if not layout.storage.uniform:
        return "its parameters have more than one dtype"
    if not layout.gather.uniform:
        return "its parameters are gathered in more than one dtype"
    return None


def pack_shards(locals_: Sequence[torch.Tensor], layout: GroupLayout) -> torch.Tensor:
    """This rank's all-gather input in the storage dtype: each unpadded local shard padded with
    zero rows to the layout's shard shape, flattened, concatenated in layout order (the offsets
    of ``layout.storage``). Differentiable: its gradient is each shard's rows of the packed
    gradient."""
    pieces = []
    for i, t in enumerate(locals_):
        rows = layout.shard_shapes[i][0]
        if t.shape[0] < rows:
            t = torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])
        pieces.append(t.reshape(-1))
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def full_params(rows: torch.Tensor, layout: GroupLayout) -> tuple[torch.Tensor, ...]:
    """The full parameters, unpadded, from every rank's :func:`pack_shards` input as gathered:
    ``rows`` is ``(world_size, layout.gather.total)``, rank ``r``'s packed shards in row ``r``
    (the all-gather output viewed so, or a column block of a bucket's). For each parameter,
    every rank's rows side by side, reshaped to the padded full shape and cut to the
    parameter's rows. Differentiable (views and one ``reshape`` copy per parameter)."""
    pack = layout.gather
    out = []
    for i, spec in enumerate(layout.specs):
        piece = rows.narrow(1, pack.offsets[i], pack.sizes[i])
        out.append(piece.reshape(layout.padded_full_shape(i)).narrow(0, 0, spec.shape[0]))
    return tuple(out)
