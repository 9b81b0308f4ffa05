"""The whole-matrix engine: one owner rank per matrix gathers it, computes, and scatters rows.

A parameter sharded with ``fully_shard`` is a ``DTensor`` whose rows are split over the shard
group as ``torch.chunk`` splits them (``ceil(rows / n)`` rows per rank, then a partial chunk,
then empty ones). Element-wise optimizers run on those local rows; a rule that needs the whole
matrix (Muon's Newton-Schulz orthogonalization, Shampoo-like preconditioners, a spectral norm)
does not: run on a shard, it computes a different function (this is what ``torch.optim.Muon``
does on FSDP parameters today).

The plan (pure, integers only):

- :func:`assign_owners`: each matrix of a shard group gets one owner rank, round-robin over the
  matrices sorted by size (largest first), so every rank computes about ``1/n`` of the work.
- the rows each rank holds are :func:`functional_fsdp.core.layout.shard_extent` 's.

The exchange (:func:`map_whole_matrices`, point-to-point on the shard group's process group):

1. every rank sends its rows of matrix ``i`` to the owner (``isend``); the owner receives each
   rank's rows straight into their place in one full buffer (``irecv`` into a row slice);
2. the owner runs ``fn(i, full)``;
3. the owner sends each rank its rows of the result; each rank receives into its own buffer.

The sends and receives of matrix ``i + 1`` are posted before matrix ``i`` is computed, so the
gathers overlap the computation (gloo and NCCL progress them in the background), and at most two
full matrices are alive on an owner. Bytes on the wire per matrix: ``(n - 1) / n`` of the matrix
to the owner and the same back, i.e. below twice the matrix, in the dtype the caller chooses
(Muon sends bfloat16: its iteration starts by casting to bfloat16, so nothing is lost).

Why point-to-point and not ``gather`` / ``scatter`` collectives: the shards are uneven
(``torch.chunk``), collectives need equal sizes (padding on the wire), and receiving into row
slices of the full buffer needs no copy-out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..core.errors import WholeMatrixError
from ..core.layout import shard_extents

__all__ = [
    "ExchangeStats",
    "MatrixLayout",
    "assign_owners",
    "local_rows",
    "map_whole_matrices",
    "matrix_layout",
    "plan_owners",
]


@attrs.frozen
class MatrixLayout:
    """Where the rows of one 2-D matrix live (hashable: it is static pytree metadata in the
    functional optimizers' states).

    Attributes:
        global_shape: ``(rows, cols)`` of the whole matrix.
        mesh: the ``DeviceMesh`` the rows are sharded over, or ``None`` when this rank holds the
            whole matrix (a plain tensor, or a ``DTensor`` not sharded on a mesh dim > 1).
        shard_dim: the mesh dim carrying ``Shard(0)`` (``-1`` without ``mesh``).
        owner: the rank, within the shard group, that computes this matrix.
    """

    global_shape: tuple[int, int]
    mesh: DeviceMesh | None = None
    shard_dim: int = -1
    owner: int = 0

    @property
    def sharded(self) -> bool:
        """Whether the rows are split over more than one rank."""
        return self.mesh is not None

    @property
    def group_size(self) -> int:
        """Ranks the rows are split over (1 when not sharded)."""
        return self.mesh.size(self.shard_dim) if self.mesh is not None else 1

    def extents(self) -> tuple[tuple[int, int], ...]:
        """``(start, rows)`` of every rank of the shard group (``torch.chunk``'s split)."""
        return shard_extents(self.global_shape[0], self.group_size)


def matrix_layout(t: torch.Tensor, name: str) -> MatrixLayout:
    """The layout of a 2-D tensor (owner 0; :func:`plan_owners` assigns owners).

    Args:
        t: a plain tensor (the whole matrix) or a ``DTensor`` sharded ``Shard(0)`` on at most one
            mesh dim of size > 1 (FSDP; HSDP's replicate dim is fine).
        name: the tensor's name, for messages.

    Raises:
        WholeMatrixError: not 2-D; another placement (2-D FSDP + TP, ``Shard(1)``, ``Partial``);
            local rows that are not ``torch.chunk``'s.
    """
    if t.ndim != 2:
        raise WholeMatrixError(
            f"{name}: a whole-matrix rule needs a 2-D parameter, got shape {tuple(t.shape)}; "
            "route it to AdamW (use_muon=False in its param group, or leave use_muon unset so "
            "non-2-D parameters go to AdamW automatically)"
        )
    shape = (int(t.shape[0]), int(t.shape[1]))
    if not isinstance(t, DTensor):
        return MatrixLayout(shape)
    mesh = t.device_mesh
    split = [d for d, p in enumerate(t.placements) if mesh.size(d) > 1 and not p.is_replicate()]
    if not split:
        return MatrixLayout(shape)
    placements = tuple(t.placements)
    if (
        len(split) > 1
        or type(placements[split[0]]) is not Shard
        or placements[split[0]] != Shard(0)
    ):
        raise WholeMatrixError(
            f"{name}: placements {placements} on mesh {tuple(mesh.shape)} are not supported by "
            "the whole-matrix optimizers yet: only Shard(0) on one mesh dim (FSDP, HSDP) and "
            "Replicate elsewhere; 2-D FSDP + tensor parallel (a second sharded dim) is not "
            "gathered. Use an element-wise optimizer for this parameter"
        )
    dim = split[0]
    layout = MatrixLayout(shape, mesh, dim)
    _check_rows(layout, t._local_tensor, name)
    return layout


def _check_rows(layout: MatrixLayout, local: torch.Tensor, name: str) -> None:
    assert layout.mesh is not None
    me = layout.mesh.get_local_rank(layout.shard_dim)
    rows = layout.extents()[me][1]
    if tuple(local.shape) != (rows, layout.global_shape[1]):
        raise WholeMatrixError(
            f"{name}: this rank holds a {tuple(local.shape)} shard of a "
            f"{layout.global_shape} matrix, but torch.chunk over {layout.group_size} ranks gives "
            f"rank {me} {rows} rows; the whole-matrix optimizers need FSDP's dim-0 chunking"
        )


def local_rows(layout: MatrixLayout, t: torch.Tensor, name: str) -> torch.Tensor:
    """This rank's rows of a matrix with ``layout``: a ``DTensor`` 's local tensor, or a plain
    tensor checked against the layout (the functional step passes local shards)."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    if layout.sharded:
        _check_rows(layout, local, name)
    elif tuple(local.shape) != layout.global_shape:
        raise WholeMatrixError(
            f"{name}: got a {tuple(local.shape)} tensor for a whole {layout.global_shape} matrix "
            "(the state was built from unsharded parameters); build the optimizer state from "
            "the sharded DTensor parameters (functional.init(model, opt))"
        )
    return local


def assign_owners(sizes: Sequence[int], group_size: int) -> tuple[int, ...]:
    """Owner rank of each matrix: round-robin over the matrices sorted by size, largest first
    (ties in the given order), so the ranks share the computation about equally.

    Args:
        sizes: the matrices' sizes (e.g. numel), the same on every rank.
        group_size: ranks in the shard group.

    Example:
        >>> assign_owners([10, 40, 30, 20], 2)
        (1, 0, 1, 0)
    """
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    owners = [0] * len(sizes)
    for k, i in enumerate(order):
        owners[i] = k % group_size
    return tuple(owners)


def plan_owners(layouts: Sequence[MatrixLayout]) -> tuple[MatrixLayout, ...]:
    """``layouts`` with owners assigned by :func:`assign_owners`, per shard group."""
    groups: dict[Any, list[int]] = {}
    for i, lay in enumerate(layouts):
        groups.setdefault((lay.mesh, lay.shard_dim), []).append(i)
    out = list(layouts)
    for (_, _), idx in groups.items():
        size = layouts[idx[0]].group_size
        sizes = [layouts[i].global_shape[0] * layouts[i].global_shape[1] for i in idx]
        for i, owner in zip(idx, assign_owners(sizes, size)):
            out[i] = attrs.evolve(layouts[i], owner=owner)
    return tuple(out)


@attrs.define
class ExchangeStats:
    """What one :func:`map_whole_matrices` call did on this rank.

    Attributes:
        bytes_sent: bytes this rank sent (rows to owners and results back to the ranks).
        computed: matrices this rank computed (owned, or held whole).
        computed_flops: a cost estimate of those computations, ``rows * cols * min(rows, cols)``
            per matrix (Newton-Schulz's shape of cost), for load-balance reports.
    """

    bytes_sent: int = 0
    computed: int = 0
    computed_flops: int = 0


class _Pending:
    """The in-flight receives of one matrix (its owner's full buffer, or a rank's result rows)."""

    def __init__(self) -> None:
        self.full: torch.Tensor | None = None  # the owner's buffer, rows arriving
        self.recvs: list[Any] = []
        self.result: torch.Tensor | None = None  # a non-owner's rows of the result
        self.result_recv: Any = None


def _post_gather(
    i: int,
    shard: torch.Tensor,
    lay: MatrixLayout,
    out_dtype: torch.dtype,
    sends: list[Any],
    stats: ExchangeStats,
) -> _Pending:
    assert lay.mesh is not None
    group = lay.mesh.get_group(lay.shard_dim)
    me = lay.mesh.get_local_rank(lay.shard_dim)
    extents = lay.extents()
    pending = _Pending()
    # Tags keep the messages of different matrices apart on the same pair of ranks.
    gather_tag, scatter_tag = 2 * i, 2 * i + 1
    if me == lay.owner:
        full = torch.empty(lay.global_shape, dtype=shard.dtype, device=shard.device)
        start, rows = extents[me]
        full[start : start + rows].copy_(shard)
        for r, (s, n) in enumerate(extents):
            if r != me and n:
                work = dist.irecv(full[s : s + n], group=group, group_src=r, tag=gather_tag)
                pending.recvs.append(work)
        pending.full = full
    else:
        if extents[me][1]:
            data = shard.contiguous()
            sends.append(dist.isend(data, group=group, group_dst=lay.owner, tag=gather_tag))
            stats.bytes_sent += data.numel() * data.element_size()
            # The owner's reply, posted now so its send finds a receive waiting.
            mine = torch.empty(
                (extents[me][1], lay.global_shape[1]), dtype=out_dtype, device=shard.device
            )
            pending.result = mine
            pending.result_recv = dist.irecv(
                mine, group=group, group_src=lay.owner, tag=scatter_tag
            )
        else:
            pending.result = shard.new_empty((0, lay.global_shape[1]), dtype=out_dtype)
    return pending


def _cost(shape: tuple[int, int]) -> int:
    return shape[0] * shape[1] * min(shape)


def map_whole_matrices(
    shards: Sequence[torch.Tensor],
    layouts: Sequence[MatrixLayout],
    fn: Callable[[int, torch.Tensor], torch.Tensor],
    out_dtypes: Sequence[torch.dtype],
) -> tuple[list[torch.Tensor], ExchangeStats]:
    """This rank's rows of ``fn(i, whole matrix i)`` for every matrix ``i``.

    Every rank of each shard group must call it with the same matrices in the same order (the
    layouts, owners included, are the same on every rank).

    Args:
        shards: this rank's rows of each matrix (the dtype sent on the wire).
        layouts: their layouts, owners assigned (:func:`plan_owners`).
        fn: ``fn(i, full) -> full result`` (same shape); runs on matrix ``i`` 's owner only (on
            every rank holding it whole when it is not sharded). ``full`` is a new tensor ``fn``
            may overwrite.
        out_dtypes: the dtype of each result (the owner casts to it; the others receive it).

    Returns:
        ``(rows, stats)``: this rank's rows of each result, and what this rank sent and computed.
    """
    stats = ExchangeStats()
    results: list[torch.Tensor | None] = [None] * len(shards)
    pending: dict[int, _Pending] = {}
    sends: list[Any] = []
    sharded = [i for i, lay in enumerate(layouts) if lay.sharded]

    def post(k: int) -> None:
        if k < len(sharded):
            i = sharded[k]
            pending[i] = _post_gather(i, shards[i], layouts[i], out_dtypes[i], sends, stats)

    # Whole matrices first: they need no communication, and computing them gives the first
    # gathers time to arrive.
    post(0)
    for i, lay in enumerate(layouts):
        if not lay.sharded:
            results[i] = _checked(fn(i, shards[i].clone()), lay, i).to(out_dtypes[i])
            stats.computed += 1
            stats.computed_flops += _cost(lay.global_shape)
    result_recvs: list[Any] = []
    for k, i in enumerate(sharded):
        post(k + 1)  # the next matrix's gather overlaps this one's computation
        p = pending.pop(i)
        lay = layouts[i]
        if p.full is None:
            # Not the owner: the rows arrive through the receive posted with the gather.
            results[i] = p.result
            if p.result_recv is not None:
                result_recvs.append(p.result_recv)
            continue
        for work in p.recvs:
            work.wait()
        full, p.full = p.full, None
        out = _checked(fn(i, full), lay, i).to(out_dtypes[i]).contiguous()
        del full
        stats.computed += 1
        stats.computed_flops += _cost(lay.global_shape)
        assert lay.mesh is not None
        group = lay.mesh.get_group(lay.shard_dim)
        me = lay.mesh.get_local_rank(lay.shard_dim)
        for r, (s, n) in enumerate(lay.extents()):
            if r != me and n:
                part = out[s : s + n]
                sends.append(dist.isend(part, group=group, group_dst=r, tag=2 * i + 1))
                stats.bytes_sent += part.numel() * part.element_size()
        start, rows = lay.extents()[me]
        results[i] = out[start : start + rows].clone()
    for work in result_recvs:
        work.wait()
    for work in sends:
        work.wait()
    assert all(r is not None for r in results)
    return [r for r in results if r is not None], stats


def _checked(out: torch.Tensor, lay: MatrixLayout, i: int) -> torch.Tensor:
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != lay.global_shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise WholeMatrixError(
            f"matrix {i}: the whole-matrix function must return a tensor of the matrix's shape "
            f"{lay.global_shape}, got {got}"
        )
    return out
