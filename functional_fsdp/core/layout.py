"""Pure integer math of sharding: chunk extents, padding, packed offsets, divide factors.

Nothing here touches tensor data or a process group; every function takes sizes and ranks as
integers and is cached where a training loop calls it repeatedly.

The chunking rule is ``torch.chunk``'s (and FSDP2's): a dimension of size ``d`` split over
``ws`` ranks uses chunks of ``ceil(d / ws)`` rows: full chunks first, then at most one partial
chunk, then empty chunks. ``d=5, ws=4`` gives 2, 2, 1, 0 rows.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from .errors import IndivisibleError, ScalarParameterError

if TYPE_CHECKING:
    import torch

__all__ = [
    "DivideFactors",
    "PackLayout",
    "check_shard_dim",
    "chunk_size",
    "divide_factors",
    "padded_size",
    "shard_extent",
    "shard_extents",
    "sharded_shape",
]


def chunk_size(dim_size: int, world_size: int) -> int:
    """Rows per chunk: ``ceil(dim_size / world_size)``."""
    _check_world(world_size)
    return -(-dim_size // world_size)


def padded_size(dim_size: int, world_size: int) -> int:
    """``dim_size`` rounded up to ``world_size`` chunks of :func:`chunk_size` rows."""
    return chunk_size(dim_size, world_size) * world_size


@functools.lru_cache(maxsize=4096)
def shard_extent(dim_size: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(start, length)`` of ``rank``'s unpadded rows; ``length`` may be 0."""
    _check_world(world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world of size {world_size}")
    c = chunk_size(dim_size, world_size)
    start = min(rank * c, dim_size)
    return start, max(0, min(c, dim_size - start))


def shard_extents(dim_size: int, world_size: int) -> tuple[tuple[int, int], ...]:
    """:func:`shard_extent` for every rank."""
    return tuple(shard_extent(dim_size, world_size, r) for r in range(world_size))


def check_shard_dim(
    shape: Sequence[int], shard_dim: int, world_size: int, *, name: str = "tensor"
) -> int:
    """Validate a shard dimension for ``shape``; returns it normalised to be non-negative.

    Raises:
        ScalarParameterError: ``shape`` is 0-d.
        IndivisibleError: ``shard_dim > 0`` and the dimension does not divide by ``world_size``
            (FSDP2 requires even division for ``Shard(i)``, ``i > 0``).
    """
    _check_world(world_size)
    if len(shape) == 0:
        raise ScalarParameterError(
            f"{name} is a 0-d (scalar) tensor: fully_shard doesn't support scalar parameters. "
            f"Change {name} to a 1D tensor with numel equal to 1, or keep it out of FSDP with "
            "ignored_params"
        )
    if not -len(shape) <= shard_dim < len(shape):
        raise IndivisibleError(
            f"{name}: Shard dim {shard_dim} is invalid for {len(shape)}D tensor: "
            f"torch.Size({list(shape)}) (dim out of range)",
            dim=shard_dim,
            size=len(shape),
            factor=world_size,
        )
    dim = shard_dim % len(shape)
    if dim > 0 and shape[dim] % world_size != 0:
        raise IndivisibleError(
            f"{name}: Shard({dim}) would need uneven sharding: dim {dim} (size {shape[dim]}) must divide evenly by the "
            f"world size {world_size}; pick Shard(0) or a dim divisible by {world_size}",
            dim=dim,
            size=shape[dim],
            factor=world_size,
        )
    return dim


def sharded_shape(shape: Sequence[int], shard_dim: int, world_size: int) -> tuple[int, ...]:
    """Padded per-rank shard shape: ``shape`` with ``shard_dim`` replaced by its chunk size."""
    out = list(shape)
    out[shard_dim] = chunk_size(shape[shard_dim], world_size)
    return tuple(out)


def _check_world(world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")


@attrs.frozen
class PackLayout:
    """How a list of flat tensors packs into one 1-D buffer.

    All tensors of one dtype pack in that dtype; mixed dtypes pack as bytes (``torch.uint8``),
    with every region aligned to 16 bytes so each can be viewed back as its own dtype.

    Attributes:
        itemsizes: bytes per element of each tensor's dtype.
        numels: elements per tensor.
        uniform: all itemsizes and dtypes equal (then units are elements, else bytes).
        offsets: start of each region, in units.
        sizes: length of each region, in units.
        total: length of the packed buffer, in units.
    """

    itemsizes: tuple[int, ...]
    numels: tuple[int, ...]
    uniform: bool
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    total: int

    @classmethod
    def build(cls, numels: Sequence[int], itemsizes: Sequence[int], uniform: bool) -> PackLayout:
        """Lay out regions back to back (uniform) or 16-byte aligned byte regions (mixed)."""
        offsets, sizes, pos = [], [], 0
        for n, isz in zip(numels, itemsizes):
            if uniform:
                size = n
            else:
                size = n * isz
                pos = -(-pos // 16) * 16
            offsets.append(pos)
            sizes.append(size)
            pos += size
        if not uniform:
            pos = -(-pos // 16) * 16
        return cls(tuple(itemsizes), tuple(numels), uniform, tuple(offsets), tuple(sizes), pos)


@attrs.frozen
class DivideFactors:
    """How gradients are divided around a reduction (FSDP2's rule).

    ``pre`` divides before the reduce-scatter, ``post`` after the last reduction, ``op`` is the
    reduction the reduce-scatter uses (``"avg"``, ``"sum"``), ``premul`` an extra multiplier
    applied before a sum (a custom factor), ``all_reduce_op`` the replica reduction (HSDP).
    """

    pre: float | None
    post: float | None
    op: str
    all_reduce_op: str
    premul: float | None = None

    def scale_input(self, t: torch.Tensor, *, donate: bool = False) -> torch.Tensor:
        """The reduce-scatter's input divided by ``pre`` or multiplied by ``premul`` (at most
        one is set). ``donate=True`` writes into ``t`` (a buffer of the caller's own, e.g. the
        eager reduction's packed input); else a new tensor (a traced graph's node)."""
        if self.pre is not None and self.pre != 1:
            return t.div_(self.pre) if donate else t / self.pre
        if self.premul is not None:
            return t.mul_(self.premul) if donate else t * self.premul
        return t

    def scale_output(self, t: torch.Tensor) -> torch.Tensor:
        """The reduced gradients divided by ``post`` (a new tensor), after the last
        reduction."""
        return t / self.post if self.post is not None and self.post != 1 else t


@functools.lru_cache(maxsize=256)
def divide_factors(
    reduce_scatter_size: int,
    all_reduce_size: int,
    *,
    overflow_risk: bool,
    factor: float | None = None,
    force_sum: bool = False,
) -> DivideFactors:
    """Divide factors for averaging gradients over ``reduce_scatter_size * all_reduce_size`` ranks.

    Args:
        reduce_scatter_size: ranks in the shard group.
        all_reduce_size: ranks in the replicate group (1 without HSDP).
        overflow_risk: the reduce dtype has a small range (fp16): split the division into a
            power-of-two pre-divide and a post-divide (``f=8`` → 4, 2; ``f=6`` → 4, 1.5).
        factor: a custom divide factor (``set_gradient_divide_factor``), or ``None`` for the
            data-parallel size.
        force_sum: always reduce with sums (no ``avg`` reductions).
    """
    dp = reduce_scatter_size * all_reduce_size
    if not overflow_risk and not force_sum:
        if factor is None:
            op = "sum" if dp == 1 else "avg"
            return DivideFactors(None, None, op, op)
        if factor == reduce_scatter_size:
            return DivideFactors(None, None, "avg", "sum")
        return DivideFactors(None, None, "sum", "sum", premul=1.0 / factor)
    f = float(dp) if factor is None else float(factor)
    if overflow_risk:
        pre = 1
        while f % pre == 0 and f / pre > pre:
            pre *= 2
        return DivideFactors(float(pre), f / pre, "sum", "sum")
    return DivideFactors(None, f, "sum", "sum")


def check_sub_group_size(size: int, world_size: int) -> None:
    """Validate an int ``reshard_after_forward``: it must divide the shard group size."""
    if size < 1 or world_size % size != 0:
        raise IndivisibleError(
            f"reshard_after_forward={size} must be a positive divisor (a factor of) the shard group size "
            f"{world_size} (e.g. the ranks per node); use True, False or a divisor",
            dim=None,
            size=world_size,
            factor=size,
        )


def prod(shape: Sequence[int]) -> int:
    """Product of a shape's sizes (1 for a 0-d shape)."""
    return math.prod(shape)
