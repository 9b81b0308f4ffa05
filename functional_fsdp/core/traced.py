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

import hashlib
import json
from collections.abc import Sequence

import torch

from .records import GroupLayout

__all__ = [
    "GraphCollective",
    "collectives_difference",
    "collectives_digest",
    "full_params",
    "pack_full_grads",
    "pack_shards",
    "traceable_reason",
]

# One collective node of a compiled graph: (op, ranks in its group, elements, dtype).
GraphCollective = tuple[str, int, int, str]


def collectives_difference(by_rank: dict[int, Sequence[GraphCollective]]) -> str | None:
    """Where the ranks' compiled graphs run different collectives (``None``: every rank runs
    the same ones in the same order), for an error message: the first position at which two
    ranks differ and what each runs there."""
    ranks = sorted(by_rank)
    first = by_rank[ranks[0]]
    for r in ranks[1:]:
        other = by_rank[r]
        if list(map(tuple, other)) == list(map(tuple, first)):
            continue
        k = next(
            (i for i, (a, b) in enumerate(zip(first, other)) if tuple(a) != tuple(b)),
            min(len(first), len(other)),
        )
        return (
            f"rank {ranks[0]}'s graphs run {len(first)} collectives, rank {r}'s {len(other)}; "
            f"collective #{k + 1} is {_describe(first, k)} on rank {ranks[0]} and "
            f"{_describe(other, k)} on rank {r}"
        )
    return None


def collectives_digest(collectives: Sequence[GraphCollective]) -> int:
    """A 52-bit digest of a graph's collectives (exact in a ``float64``, so the ranks can
    compare digests with one max all-reduce): equal lists give equal digests."""
    text = json.dumps([list(c) for c in collectives], separators=(",", ":"))
    return int(hashlib.sha256(text.encode()).hexdigest()[:13], 16)


def _describe(seq: Sequence[GraphCollective], k: int) -> str:
    if k >= len(seq):
        return "nothing (its graphs end)"
    op, size, numel, dtype = seq[k]
    return f"{op} of {numel} {dtype} elements over {size} ranks"


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
    for i in range(len(locals_)):  # not enumerate: dynamo traces its Python polyfill each call
        t, rows = locals_[i], layout.shard_shapes[i][0]
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
    for i in range(len(layout.specs)):  # (see pack_shards)
        spec = layout.specs[i]
        piece = rows.narrow(1, pack.offsets[i], pack.sizes[i])
        out.append(piece.reshape(layout.padded_full_shape(i)).narrow(0, 0, spec.shape[0]))
    return tuple(out)


def pack_full_grads(
    grads: Sequence[torch.Tensor | None], layout: GroupLayout, dtype: torch.dtype
) -> torch.Tensor:
    """The transpose of :func:`full_params`: the full parameters' gradients (``None``: zeros)
    as ``(world_size, layout.gather.total)`` rows in ``dtype``, rank ``r``'s padded shard rows
    in row ``r``, ready for a reduce-scatter. One concatenation, where differentiating the views
    of :func:`full_params` would build a zero buffer of the whole bucket for each parameter."""
    ws, pack = layout.world_size, layout.gather
    cols = []
    for i in range(len(layout.specs)):  # (see pack_shards)
        spec, padded = layout.specs[i], layout.padded_full_shape(i)
        g = grads[i]
        if g is None:
            cols.append(torch.zeros((ws, pack.sizes[i]), dtype=dtype, device=_device(grads)))
            continue
        g = g.to(dtype)
        if padded[0] > spec.shape[0]:
            g = torch.cat([g, g.new_zeros((padded[0] - spec.shape[0], *padded[1:]))])
        cols.append(g.reshape(ws, pack.sizes[i]))
    return torch.cat(cols, dim=1) if len(cols) > 1 else cols[0]


def _device(grads: Sequence[torch.Tensor | None]) -> torch.device:
    return next((g.device for g in grads if g is not None), torch.device("cpu"))
