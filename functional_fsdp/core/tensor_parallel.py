"""Pure math of 2-D parallelism: FSDP over the TP-local tensor of a tensor-parallel parameter.

A parameter that arrives as a tensor-parallel ``DTensor`` is described by its global shape and
its placements on the TP mesh dims (``"Shard(d)"`` or ``"Replicate()"``, in mesh-dim order).
FSDP shards its **TP-local** tensor over the data-parallel ranks, so every transition
(``shard``/``unshard``/``reshard``/``writeback``/``reduce_grad``) runs unchanged on TP-local
shapes: a :class:`~functional_fsdp.core.records.ParamSpec` built by :func:`tp_param_spec` has
``shape`` = the TP-local shape, ``global_shape`` and ``tp_placements`` set.

Everything here takes sizes and coordinates as integers (no process group): the TP-local
extent of any TP coordinate (:func:`tp_local_extents`), FSDP2's data-parallel placement for the
composed 2-D parameter (:func:`dp_split_factor`: ``Shard(0)``, or a strided shard when TP also
shards dim 0), slicing a global tensor to a TP-local one (:func:`local_from_global`) and the
reverse (:func:`global_from_locals`, and :func:`gather_global` with an injected communicator).

The nesting rule is ``DTensor``'s: ``Shard`` placements apply in mesh-dim order, each one
chunking (``torch.chunk``'s rule) what the previous ones left.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from . import layout as L
from .comm import Communicator
from .errors import LayoutMismatchError, UnsupportedPlacementError
from .records import ParamSpec

__all__ = [
    "SUPPORTED_TP_PLACEMENTS",
    "dp_split_factor",
    "gather_global",
    "global_from_locals",
    "local_from_global",
    "parse_placement",
    "tp_coords_of",
    "tp_local_extents",
    "tp_local_shape",
    "tp_param_spec",
]

SUPPORTED_TP_PLACEMENTS = "Shard(d) and Replicate() on each tensor-parallel mesh dim"


@functools.lru_cache(maxsize=1024)
def parse_placement(text: str) -> int | None:
    """``"Shard(d)"`` -> ``d``; ``"Replicate()"`` -> ``None``; anything else raises
    :class:`~functional_fsdp.core.errors.UnsupportedPlacementError`."""
    if text == "Replicate()":
        return None
    if text.startswith("Shard(") and text.endswith(")") and text[6:-1].isdigit():
        return int(text[6:-1])
    raise UnsupportedPlacementError(
        f"FSDP cannot compose with the tensor-parallel placement {text}: supported are "
        f"{SUPPORTED_TP_PLACEMENTS} (Partial parameters must be reduced, and strided shards "
        "re-distributed, before fully_shard)"
    )


@functools.lru_cache(maxsize=4096)
def tp_local_extents(
    global_shape: tuple[int, ...],
    tp_placements: tuple[str, ...],
    tp_sizes: tuple[int, ...],
    tp_coords: tuple[int, ...],
) -> tuple[tuple[int, int], ...]:
    """``(start, length)`` per tensor dim of the TP-local block at ``tp_coords``.

    Example:
        >>> tp_local_extents((5, 4), ("Shard(0)",), (2,), (1,))
        ((3, 2), (0, 4))
    """
    _check_sizes(tp_placements, tp_sizes, tp_coords)
    ext = [(0, n) for n in global_shape]
    for text, size, coord in zip(tp_placements, tp_sizes, tp_coords):
        dim = parse_placement(text)
        if dim is None:
            continue
        if not 0 <= dim < len(global_shape):
            raise UnsupportedPlacementError(
                f"tensor-parallel placement {text} is out of range for a {len(global_shape)}-D "
                "parameter"
            )
        start, length = ext[dim]
        sub_start, sub_len = L.shard_extent(length, size, coord)
        ext[dim] = (start + sub_start, sub_len)
    return tuple(ext)


def tp_local_shape(
    global_shape: Sequence[int],
    tp_placements: Sequence[str],
    tp_sizes: Sequence[int],
    tp_coords: Sequence[int],
) -> tuple[int, ...]:
    """Shape of the TP-local tensor at ``tp_coords`` (what FSDP shards over dp)."""
    ext = tp_local_extents(
        tuple(global_shape), tuple(tp_placements), tuple(tp_sizes), tuple(tp_coords)
    )
    return tuple(n for _, n in ext)


def dp_split_factor(shard_dim: int, tp_placements: Sequence[str], tp_sizes: Sequence[int]) -> int:
    """FSDP2's split factor for the data-parallel ``Shard(shard_dim)`` of a TP parameter.

    FSDP shards the TP-local tensor; when TP dims (after the dp dim in the mesh) also shard
    ``shard_dim``, the global rows a dp rank holds are strided, which ``DTensor`` spells
    ``_StridedShard(shard_dim, split_factor=f)``. Returns ``f`` (``1`` means plain ``Shard``).
    """
    factor = 1
    for text, size in zip(tp_placements, tp_sizes):
        if parse_placement(text) == shard_dim:
            factor *= size
    return factor


def tp_param_spec(
    fqn: str,
    global_shape: Sequence[int],
    dtype: torch.dtype,
    *,
    tp_placements: Sequence[str],
    tp_sizes: Sequence[int],
    tp_coords: Sequence[int],
    requires_grad: bool = True,
    shard_dim: int = 0,
) -> ParamSpec:
    """The :class:`ParamSpec` of a TP parameter: FSDP shards its TP-local shape.

    Raises:
        UnsupportedPlacementError: a TP placement FSDP cannot compose with.
    """
    for text in tp_placements:
        parse_placement(text)
    local = tp_local_shape(global_shape, tp_placements, tp_sizes, tp_coords)
    return ParamSpec(
        fqn,
        local,
        dtype,
        requires_grad,
        shard_dim,
        global_shape=tuple(global_shape),
        tp_placements=tuple(tp_placements),
    )


def tp_coords_of(rank: int, tp_sizes: Sequence[int]) -> tuple[int, ...]:
    """Row-major coordinates of ``rank`` in a TP mesh of ``tp_sizes``."""
    coords = []
    for size in reversed(tuple(tp_sizes)):
        coords.append(rank % size)
        rank //= size
    return tuple(reversed(coords))


def _spec_global(spec: ParamSpec) -> tuple[int, ...]:
    return spec.global_shape if spec.global_shape is not None else spec.shape


def local_from_global(
    full: torch.Tensor, spec: ParamSpec, tp_sizes: Sequence[int], tp_coords: Sequence[int]
) -> torch.Tensor:
    """The TP-local block of a global tensor at ``tp_coords`` (a view; no copy)."""
    shape = _spec_global(spec)
    if tuple(full.shape) != shape:
        raise LayoutMismatchError(
            f"{spec.fqn!r}: a global tensor of shape {tuple(full.shape)} given, expected {shape}"
        )
    out = full
    for dim, (start, length) in enumerate(
        tp_local_extents(shape, spec.tp_placements, tuple(tp_sizes), tuple(tp_coords))
    ):
        if length != shape[dim]:
            out = out.narrow(dim, start, length)
    return out


def global_from_locals(
    locals_: Sequence[torch.Tensor], spec: ParamSpec, tp_sizes: Sequence[int]
) -> torch.Tensor:
    """Assemble the global tensor from the TP-local tensors of every TP coordinate (row-major).

    Replicated dims take the block of the first coordinate along them (all are equal).
    """
    shape = _spec_global(spec)
    n = L.prod(tp_sizes)
    if len(locals_) != n:
        raise LayoutMismatchError(
            f"{spec.fqn!r}: {len(locals_)} TP-local tensors given for a TP mesh of {n} ranks"
        )
    out = locals_[0].new_empty(shape)
    for r, loc in enumerate(locals_):
        local_from_global(out, spec, tp_sizes, tp_coords_of(r, tp_sizes)).copy_(loc)
    return out


def gather_global(
    local: torch.Tensor, spec: ParamSpec, tp_comm: Communicator, tp_sizes: Sequence[int]
) -> torch.Tensor:
    """All-gather the TP-local tensors over ``tp_comm`` and assemble the global tensor.

    ``tp_comm`` spans the TP ranks in row-major order of ``tp_sizes``. Blocks of uneven TP
    shards are padded to the largest for the one collective.
    """
    n = L.prod(tp_sizes)
    if tp_comm.world_size != n:
        raise LayoutMismatchError(
            f"{spec.fqn!r}: the TP communicator has {tp_comm.world_size} ranks, the spec {n}"
        )
    shape = _spec_global(spec)
    shapes = [
        tp_local_shape(shape, spec.tp_placements, tp_sizes, tp_coords_of(r, tp_sizes))
        for r in range(n)
    ]
    width = max(L.prod(s) for s in shapes)
    send = local.new_zeros(width)
    send[: local.numel()].copy_(local.reshape(-1))
    recv = local.new_empty(width * n)
    tp_comm.all_gather(recv, send).wait()
    rows = recv.view(n, width)
    blocks = [rows[r, : L.prod(s)].view(s) for r, s in enumerate(shapes)]
    return global_from_locals(blocks, spec, tp_sizes)


def _check_sizes(
    tp_placements: Sequence[str], tp_sizes: Sequence[int], tp_coords: Sequence[int]
) -> None:
    if not len(tp_placements) == len(tp_sizes) == len(tp_coords):
        raise LayoutMismatchError(
            f"TP placements {tuple(tp_placements)}, sizes {tuple(tp_sizes)} and coordinates "
            f"{tuple(tp_coords)} must have one entry per TP mesh dim"
        )
    for size, coord in zip(tp_sizes, tp_coords):
        if not 0 <= coord < size:
            raise LayoutMismatchError(f"TP coordinate {coord} is outside a mesh dim of {size}")
