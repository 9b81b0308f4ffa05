"""Full values of many sharded tensors in one collective, for the tests' comparisons.

``DTensor.full_tensor()`` is one all-gather (and a pass through DTensor's redistribution
machinery) per tensor: comparing a 38-parameter model's full parameters cost a rank about
55 ms of CPU, twice per parity case (5 % of the parity files' rank CPU, py-spy ``--gil``).
:func:`full_tensors` sends every rank's local pieces as bytes in one all-gather (12 ms) and
places them itself, for the placements whose pieces are blocks (``Shard`` and ``Replicate``)
on a mesh of the whole world; a tensor placed otherwise (``_StridedShard``, ``Partial``, a
sub-mesh) still takes ``full_tensor()``. Every rank must call it with the same names in the
same order, as it would call ``full_tensor()``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist


def _is_block(t: Any) -> bool:
    """A DTensor over every rank of the world whose pieces are blocks."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return (
        isinstance(t, DTensor)
        and t.device_mesh.size() == dist.get_world_size()
        and all(type(p) is Replicate or type(p) is Shard for p in t.placements)
    )


def _block(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: tuple[int, ...], placements: Any
) -> tuple[slice, ...]:
    """Where the piece of the rank at mesh coordinate ``coord`` lies in the full tensor: each
    ``Shard(d)`` splits what the mesh dims before it left of dim ``d`` as ``torch.chunk``
    does (DTensor's rule), in mesh-dim order."""
    start, size = [0] * len(shape), list(shape)
    for i, p in enumerate(placements):
        if p.is_shard():
            d = p.dim % len(shape)
            chunk = -(-size[d] // mesh_shape[i])
            lo = min(coord[i] * chunk, size[d])
            start[d], size[d] = start[d] + lo, min(chunk, size[d] - lo)
    return tuple(slice(a, a + n) for a, n in zip(start, size))


def full_tensors(tensors: Mapping[Any, Any]) -> dict[Any, Any]:
    """``{name: full value}`` of ``tensors``: a DTensor's full value, detached; anything else
    (a plain tensor, a number) as it is. The block-placed DTensors' pieces travel in one
    all-gather of bytes over the world."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    coords: dict[int, dict[int, tuple[int, ...]]] = {}  # per mesh: rank -> coordinate
    pieces: list[tuple[Any, torch.Tensor, list[tuple[slice, ...]]]] = []
    for k, t in tensors.items():
        if _is_block(t):
            mesh = t.device_mesh
            if id(mesh) not in coords:
                ranks = mesh.mesh
                coords[id(mesh)] = {
                    int(ranks[c]): c for c in itertools.product(*map(range, ranks.shape))
                }
            at = coords[id(mesh)]
            shape, mesh_shape = tuple(t.shape), tuple(mesh.shape)
            pieces.append(
                (k, t, [_block(shape, mesh_shape, at[r], t.placements) for r in range(world)])
            )
    out: dict[Any, Any] = {}
    if pieces:
        # Every rank's piece sizes follow from the shapes: rank r's buffer is its pieces' bytes
        # in order, padded to the longest.
        def nbytes(t: torch.Tensor, where: tuple[slice, ...]) -> int:
            return math.prod(s.stop - s.start for s in where) * t.element_size()

        lengths = [sum(nbytes(t, w[r]) for _, t, w in pieces) for r in range(world)]
        mine = [
            t.to_local().detach().contiguous().reshape(-1).view(torch.uint8) for _, t, _ in pieces
        ]
        buf = torch.zeros(max(lengths), dtype=torch.uint8)
        flat = torch.cat(mine)
        buf[: flat.numel()] = flat
        everyone = [torch.empty_like(buf) for _ in range(world)]
        dist.all_gather(everyone, buf)
        full = {k: torch.empty(t.shape, dtype=t.dtype) for k, t, _ in pieces}
        for r in range(world):
            at = 0
            for k, t, where in pieces:
                n = nbytes(t, where[r])
                shape = tuple(s.stop - s.start for s in where[r])
                full[k][where[r]] = everyone[r][at : at + n].clone().view(t.dtype).reshape(shape)
                at += n
        out.update(full)
    for k, t in tensors.items():
        if k not in out:
            out[k] = t.full_tensor().detach() if hasattr(t, "full_tensor") else t
    return {k: out[k] for k in tensors}


def full_list(tensors: Iterable[Any]) -> list[Any]:
    """:func:`full_tensors` of a sequence (a state's leaves, say), in its order."""
    return list(full_tensors(dict(enumerate(tensors))).values())


def full_parameters(model: torch.nn.Module) -> dict[str, Any]:
    """:func:`full_tensors` of ``model``'s named parameters."""
    return full_tensors(dict(model.named_parameters()))
