"""The whole-matrix engine: one owner rank per matrix gathers it, computes, and scatters pieces.

A parameter sharded with ``fully_shard`` is a ``DTensor`` whose rows are split over the shard
group as ``torch.chunk`` splits them (``ceil(rows / n)`` rows per rank, then a partial chunk,
then empty ones). Element-wise optimizers run on those local rows; a rule that needs the whole
matrix (Muon's Newton-Schulz orthogonalization, Shampoo-like preconditioners, a spectral norm)
does not: run on a shard, it computes a different function (this is what ``torch.optim.Muon``
does on FSDP parameters today).

Under 2-D FSDP x tensor parallel (``parallelize_module`` on the ``tp`` sub-mesh, then
``fully_shard`` on ``dp``; HSDP x TP on ``(replicate, shard, tp)``), FSDP shards the
**TP-local** block over dp: a rank's piece is the dp chunk (``torch.chunk`` over rows) of its
tp coordinate's block (:func:`functional_fsdp.core.tensor_parallel.tp_local_extents`).
``DTensor`` spells FSDP's dp placement ``Shard(0)``, or ``_StridedShard(0, split_factor=tp)``
when TP also shards dim 0. Every piece is a rectangle of the global matrix: whole rows
(colwise TP, FSDP alone) or a block of rows of a block of columns (rowwise TP).

The plan (pure, integers only):

- :func:`piece_extents`: the rectangle of every rank of the group the matrix is split over
  (the mesh dims with more than one rank and a non-``Replicate`` placement), row-major over
  those dims. Replicated dims (HSDP's replicate dim, ``Replicate()`` on tp) hold copies: each
  replica runs the same plan on its own ranks and computes the same result.
- :func:`assign_owners`: each matrix of a group gets one owner rank, round-robin over the
  matrices sorted by size (largest first), so every rank of the group (``dp x tp`` of them
  under 2-D) computes about ``1/n`` of the work.

The exchange (:func:`map_whole_matrices`, point-to-point, one hop whatever the mesh):

1. every rank sends its piece of matrix ``i`` to the owner (``isend``); the owner receives
   whole-row pieces straight into their rows of one full buffer (``irecv`` into a row slice)
   and column blocks into their own buffers, copied into place once they have arrived;
2. the owner runs ``fn(i, full)`` (once: the other ranks of the group do not compute it);
3. the owner sends each rank its piece of the result; each rank receives into its own buffer.

The process group is the mesh dim's group when the matrix is split over one mesh dim, and the
default group (the ranks found in ``mesh.mesh``) when it is split over several (FSDP x TP):
one hop to the owner instead of a gather over dp then over tp, so each byte crosses the wire
once and a single rank computes. The sends and receives of matrix ``i + 1`` are posted before
matrix ``i`` is computed, so the gathers overlap the computation (gloo and NCCL progress them
in the background), and an owner holds at most two full matrices (plus, under rowwise TP, the
column blocks of one of them until they are copied in). Bytes on the wire per matrix:
``(n - 1) / n`` of the matrix to the owner and the same back (uneven pieces: everything but the
owner's piece), i.e. below twice the matrix, in the dtype the caller chooses (Muon sends
bfloat16: its iteration starts by casting to bfloat16, so nothing is lost).

Why point-to-point and not ``gather`` / ``scatter`` collectives: the pieces are uneven
(``torch.chunk``), collectives need equal sizes (padding on the wire), receiving into row
slices of the full buffer needs no copy-out, and no collective spans the ranks of two mesh
dims without building a new process group.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ..core.errors import WholeMatrixError
from ..core.layout import shard_extent
from ..core.tensor_parallel import tp_local_extents

__all__ = [
    "ExchangeStats",
    "MatrixLayout",
    "assign_owners",
    "local_rows",
    "map_whole_matrices",
    "matrix_layout",
    "piece_extents",
    "plan_owners",
]

#: ``((row start, rows), (col start, cols))`` of one rank's piece of a matrix.
Rect = tuple[tuple[int, int], tuple[int, int]]

_SUPPORTED = (
    "supported are Shard(0) and Shard(1) on each sharded mesh dim, FSDP's "
    "_StridedShard(0, split_factor=<ranks of the later dims sharding dim 0>) on the outermost "
    "one, and Replicate() elsewhere: FSDP, HSDP, tensor parallel, and 2-D FSDP x TP as "
    "fully_shard(mesh=mesh['dp']) after parallelize_module(..., mesh['tp'], ...) builds them"
)


@functools.lru_cache(maxsize=4096)
def piece_extents(
    global_shape: tuple[int, int],
    dp_size: int,
    tp_placements: tuple[str, ...],
    tp_sizes: tuple[int, ...],
) -> tuple[Rect, ...]:
    """The rectangle every rank holds of a matrix split over ``dp x tp`` ranks.

    FSDP's rule over tensor parallelism: the TP dims (in mesh order, ``"Shard(d)"`` texts,
    ``DTensor`` 's nesting) cut the TP-local block of each tp coordinate, then FSDP chunks that
    block's rows over ``dp_size`` ranks (``torch.chunk``'s rule; ``dp_size`` 1: no FSDP dim).

    Args:
        global_shape: ``(rows, cols)``.
        dp_size: ranks of FSDP's mesh dim (the outermost), 1 when none.
        tp_placements: per TP mesh dim, ``"Shard(0)"`` or ``"Shard(1)"``.
        tp_sizes: per TP mesh dim, its ranks.

    Returns:
        One ``((row start, rows), (col start, cols))`` per rank, row-major over
        ``(dp, *tp)`` coordinates.

    Example:
        >>> piece_extents((5, 7), 2, ("Shard(1)",), (2,))
        (((0, 3), (0, 4)), ((0, 3), (4, 3)), ((3, 2), (0, 4)), ((3, 2), (4, 3)))
    """
    out: list[Rect] = []
    for d in range(dp_size):
        for tp in itertools.product(*(range(n) for n in tp_sizes)):
            (r0, nr), cols = tp_local_extents(global_shape, tp_placements, tp_sizes, tp)
            s, k = shard_extent(nr, dp_size, d)
            out.append(((r0 + s, k), (cols[0], cols[1])))
    return tuple(out)


@attrs.frozen
class MatrixLayout:
    """Where the pieces of one 2-D matrix live (hashable: it is static pytree metadata in the
    functional optimizers' states, the same on every rank).

    Attributes:
        global_shape: ``(rows, cols)`` of the whole matrix.
        mesh: the ``DeviceMesh`` the matrix is split over, or ``None`` when this rank holds the
            whole matrix (a plain tensor, or a ``DTensor`` not sharded on a mesh dim > 1).
        shard_dim: FSDP's mesh dim, whose ``Shard(0)`` / ``_StridedShard(0)`` chunks the rows
            of the TP-local block (``-1``: none).
        owner: the rank that computes this matrix, as an index into the ranks of the split
            mesh dims (``shard_dim`` then ``tp_dims``), row-major.
        tp_dims: the other mesh dims (size > 1) that split the matrix: tensor parallel.
        tp_placements: their placements, ``"Shard(0)"`` or ``"Shard(1)"``, in mesh order
            (applied as ``DTensor`` nests them, before FSDP's rows).
    """

    global_shape: tuple[int, int]
    mesh: DeviceMesh | None = None
    shard_dim: int = -1
    owner: int = 0
    tp_dims: tuple[int, ...] = ()
    tp_placements: tuple[str, ...] = ()

    @property
    def sharded(self) -> bool:
        """Whether the matrix is split over more than one rank."""
        return self.mesh is not None

    @property
    def split_dims(self) -> tuple[int, ...]:
        """The mesh dims that split the matrix: FSDP's (if any), then TP's."""
        return ((self.shard_dim,) if self.shard_dim >= 0 else ()) + self.tp_dims

    @property
    def group_size(self) -> int:
        """Ranks the matrix is split over (1 when not sharded)."""
        if self.mesh is None:
            return 1
        return math.prod(self.mesh.size(d) for d in self.split_dims)

    def pieces(self) -> tuple[Rect, ...]:
        """Every rank's rectangle (:func:`piece_extents`), indexed like :attr:`owner`."""
        if self.mesh is None:
            return (((0, self.global_shape[0]), (0, self.global_shape[1])),)
        dp = self.mesh.size(self.shard_dim) if self.shard_dim >= 0 else 1
        tp_sizes = tuple(self.mesh.size(d) for d in self.tp_dims)
        return piece_extents(self.global_shape, dp, self.tp_placements, tp_sizes)

    def index(self) -> int:
        """This rank's index among the ranks the matrix is split over (0 when not sharded)."""
        if self.mesh is None:
            return 0
        index = 0
        for d in self.split_dims:
            index = index * self.mesh.size(d) + self.mesh.get_local_rank(d)
        return index

    def local_shape(self) -> tuple[int, int]:
        """The shape of this rank's piece."""
        (_, rows), (_, cols) = self.pieces()[self.index()]
        return rows, cols


def _shard_dim(p: Placement) -> int | None:
    """``d`` of a plain ``Shard(d)`` (normalized for a 2-D tensor), else ``None``."""
    if type(p) is not Shard:
        return None
    return p.dim + 2 if p.dim < 0 else p.dim


def matrix_layout(t: torch.Tensor, name: str) -> MatrixLayout:
    """The layout of a 2-D tensor (owner 0; :func:`plan_owners` assigns owners).

    Args:
        t: a plain tensor (the whole matrix) or a ``DTensor``: FSDP (``Shard(0)``), HSDP
            (``Replicate()`` and ``Shard(0)``), tensor parallel (``Shard(0)`` / ``Shard(1)``),
            2-D FSDP x TP (``(Shard(0), Shard(1))`` or ``(_StridedShard(0, split_factor=tp),
            Shard(0))`` on ``(dp, tp)``), HSDP x TP (the same after a ``Replicate()`` dim).
        name: the tensor's name, for messages.

    Raises:
        WholeMatrixError: not 2-D; another placement (``Partial``, a strided shard that is not
            FSDP's over TP); a local piece that is not the one the placements give.
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
    placements = tuple(t.placements)
    split = [d for d, p in enumerate(placements) if mesh.size(d) > 1 and not p.is_replicate()]
    if not split:
        return MatrixLayout(shape)
    first = placements[split[0]]
    dim0_tp = [d for d in split[1:] if _shard_dim(placements[d]) == 0]
    shard_dim, tp_dims = -1, split
    if isinstance(first, _StridedShard):
        factor = math.prod(mesh.size(d) for d in dim0_tp)
        if first.dim != 0 or first.split_factor != factor or not dim0_tp:
            raise _unsupported(name, placements, mesh, f"{first!r} is not FSDP's placement")
        shard_dim, tp_dims = split[0], split[1:]
    elif _shard_dim(first) == 0 and not dim0_tp:
        shard_dim, tp_dims = split[0], split[1:]
    texts = []
    for d in tp_dims:
        dim = _shard_dim(placements[d])
        if dim is None or not 0 <= dim < 2:
            raise _unsupported(name, placements, mesh, f"{placements[d]!r} on mesh dim {d}")
        texts.append(f"Shard({dim})")
    layout = MatrixLayout(shape, mesh, shard_dim, 0, tuple(tp_dims), tuple(texts))
    _check_local(layout, t._local_tensor, name)
    return layout


def _unsupported(
    name: str, placements: tuple[Placement, ...], mesh: DeviceMesh, what: str
) -> WholeMatrixError:
    return WholeMatrixError(
        f"{name}: placements {placements} on mesh {tuple(mesh.shape)} are not supported by the "
        f"whole-matrix optimizers ({what}); {_SUPPORTED}. Redistribute the parameter (a "
        "Partial one to Replicate() with .redistribute()), or step it with an element-wise "
        "optimizer (use_muon=False in its param group)"
    )


def _check_local(layout: MatrixLayout, local: torch.Tensor, name: str) -> None:
    expected = layout.local_shape()
    if tuple(local.shape) != expected:
        assert layout.mesh is not None
        raise WholeMatrixError(
            f"{name}: this rank holds a {tuple(local.shape)} piece of a "
            f"{layout.global_shape} matrix, but its placements on mesh "
            f"{tuple(layout.mesh.shape)} give rank {layout.index()} of the split dims "
            f"{layout.split_dims} a {expected} piece (torch.chunk's rule: FSDP's dim-0 chunks "
            "of the TP-local block)"
        )


def local_rows(layout: MatrixLayout, t: torch.Tensor, name: str) -> torch.Tensor:
    """This rank's piece of a matrix with ``layout``: a ``DTensor`` 's local tensor, or a plain
    tensor checked against the layout (the functional step passes local shards)."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    if layout.sharded:
        _check_local(layout, local, name)
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
    """``layouts`` with owners assigned by :func:`assign_owners`, per group of ranks: matrices
    split over the same ranks share one round-robin, whatever their mesh (FSDP's 1-D dp mesh
    and a ``(dp, tp)`` parameter replicated on tp share the dp ranks) and placements."""
    groups: dict[Any, list[int]] = {}
    for i, lay in enumerate(layouts):
        groups.setdefault(_global_ranks(lay), []).append(i)
    out = list(layouts)
    for idx in groups.values():
        size = layouts[idx[0]].group_size
        sizes = [layouts[i].global_shape[0] * layouts[i].global_shape[1] for i in idx]
        for i, owner in zip(idx, assign_owners(sizes, size)):
            out[i] = attrs.evolve(layouts[i], owner=owner)
    return tuple(out)


def _global_ranks(lay: MatrixLayout) -> tuple[int, ...]:
    """The global ranks of this rank's group for ``lay``, by piece index (``()``: whole)."""
    mesh = lay.mesh
    if mesh is None:
        return ()
    coord = mesh.get_coordinate()
    assert coord is not None, "this rank is not in the parameter's mesh"
    at = list(coord)
    ranks = []
    for c in itertools.product(*(range(mesh.size(d)) for d in lay.split_dims)):
        for d, v in zip(lay.split_dims, c):
            at[d] = v
        ranks.append(int(mesh.mesh[tuple(at)].item()))
    return tuple(ranks)


@attrs.define
class ExchangeStats:
    """What one :func:`map_whole_matrices` call did on this rank.

    Attributes:
        bytes_sent: bytes this rank sent (pieces to owners and results back to the ranks, over
            dp and tp alike).
        computed: matrices this rank computed (owned, or held whole).
        computed_flops: a cost estimate of those computations, ``rows * cols * min(rows, cols)``
            per matrix (Newton-Schulz's shape of cost), for load-balance reports.
    """

    bytes_sent: int = 0
    computed: int = 0
    computed_flops: int = 0


class _Peers:
    """The process group of a matrix's ranks and each rank's number in it (by piece index)."""

    def __init__(self, lay: MatrixLayout) -> None:
        mesh = lay.mesh
        assert mesh is not None
        dims = lay.split_dims
        self.group: Any = None
        self.ranks: list[int]
        if len(dims) == 1:
            self.group = mesh.get_group(dims[0])
            self.ranks = list(range(mesh.size(dims[0])))
        else:
            # Several mesh dims (FSDP x TP): the default group, addressed by global rank, at
            # this rank's coordinates on the other (replicated) dims.
            self.ranks = list(_global_ranks(lay))

    def global_ranks(self) -> list[int]:
        """Every rank of the matrix, as global ranks (what the watchdog reads)."""
        if self.group is None:
            return list(self.ranks)
        return [dist.get_global_rank(self.group, r) for r in self.ranks]

    def isend(self, t: torch.Tensor, to: int, tag: int) -> Any:
        return dist.isend(t, group=self.group, group_dst=self.ranks[to], tag=tag)

    def irecv(self, t: torch.Tensor, src: int, tag: int) -> Any:
        return dist.irecv(t, group=self.group, group_src=self.ranks[src], tag=tag)


class _Pending:
    """The in-flight receives of one matrix (its owner's full buffer, or a rank's result)."""

    def __init__(self, peers: _Peers) -> None:
        self.peers = peers
        self.full: torch.Tensor | None = None  # the owner's buffer, pieces arriving
        self.recvs: list[Any] = []
        self.blocks: list[tuple[torch.Tensor, Rect]] = []  # column blocks, copied in on arrival
        self.result: torch.Tensor | None = None  # a non-owner's piece of the result
        self.result_recv: Any = None


def _view(full: torch.Tensor, rect: Rect) -> torch.Tensor:
    (r0, nr), (c0, nc) = rect
    return full[r0 : r0 + nr, c0 : c0 + nc]


def _numel(rect: Rect) -> int:
    return rect[0][1] * rect[1][1]


def _post_gather(
    i: int,
    shard: torch.Tensor,
    lay: MatrixLayout,
    out_dtype: torch.dtype,
    sends: list[Any],
    stats: ExchangeStats,
) -> _Pending:
    peers = _Peers(lay)
    me = lay.index()
    pieces = lay.pieces()
    pending = _Pending(peers)
    # Tags keep the messages of different matrices apart on the same pair of ranks.
    gather_tag, scatter_tag = 2 * i, 2 * i + 1
    if me == lay.owner:
        full = torch.empty(lay.global_shape, dtype=shard.dtype, device=shard.device)
        _view(full, pieces[me]).copy_(shard)
        for r, rect in enumerate(pieces):
            if r == me or not _numel(rect):
                continue
            if rect[1] == (0, lay.global_shape[1]):  # whole rows: contiguous in `full`
                buf = _view(full, rect)
            else:
                buf = full.new_empty((rect[0][1], rect[1][1]))
                pending.blocks.append((buf, rect))
            pending.recvs.append(peers.irecv(buf, r, gather_tag))
        pending.full = full
    else:
        mine = shard.new_empty(lay.local_shape(), dtype=out_dtype)
        pending.result = mine
        if _numel(pieces[me]):
            data = shard.contiguous()
            sends.append(peers.isend(data, lay.owner, gather_tag))
            stats.bytes_sent += data.numel() * data.element_size()
            # The owner's reply, posted now so its send finds a receive waiting.
            pending.result_recv = peers.irecv(mine, lay.owner, scatter_tag)
    return pending


def _cost(shape: tuple[int, int]) -> int:
    return shape[0] * shape[1] * min(shape)


def map_whole_matrices(
    shards: Sequence[torch.Tensor],
    layouts: Sequence[MatrixLayout],
    fn: Callable[[int, torch.Tensor], torch.Tensor],
    out_dtypes: Sequence[torch.dtype],
) -> tuple[list[torch.Tensor], ExchangeStats]:
    """This rank's piece of ``fn(i, whole matrix i)`` for every matrix ``i``.

    Every rank of each group must call it with the same matrices in the same order (the
    layouts, owners included, are the same on every rank).

    Args:
        shards: this rank's piece of each matrix (the dtype sent on the wire).
        layouts: their layouts, owners assigned (:func:`plan_owners`).
        fn: ``fn(i, full) -> full result`` (same shape); runs on matrix ``i`` 's owner only (on
            every rank holding it whole when it is not sharded; on the owner of each replica
            under HSDP or a ``Replicate()`` dim). ``full`` is a new tensor ``fn`` may overwrite.
        out_dtypes: the dtype of each result (the owner casts to it; the others receive it).

    Returns:
        ``(pieces, stats)``: this rank's piece of each result, and what this rank sent and
        computed.
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
            # Not the owner: the piece arrives through the receive posted with the gather.
            results[i] = p.result
            if p.result_recv is not None:
                result_recvs.append(p.result_recv)
            continue
        _wait(p.recvs, f"the pieces of matrix {i} (its owner's gather)", p.peers)
        full, p.full = p.full, None
        for buf, rect in p.blocks:
            _view(full, rect).copy_(buf)
        p.blocks.clear()
        out = _checked(fn(i, full), lay, i).to(out_dtypes[i]).contiguous()
        del full
        stats.computed += 1
        stats.computed_flops += _cost(lay.global_shape)
        me = lay.index()
        pieces = lay.pieces()
        for r, rect in enumerate(pieces):
            if r != me and _numel(rect):
                part = _view(out, rect).contiguous()
                sends.append(p.peers.isend(part, r, 2 * i + 1))
                stats.bytes_sent += part.numel() * part.element_size()
        results[i] = _view(out, pieces[me]).clone()
    everyone = sorted({r for lay in layouts if lay.sharded for r in _Peers(lay).global_ranks()})
    _wait(result_recvs, "the results of the matrices other ranks own", everyone)
    _wait(sends, "the sends of this rank's pieces and results", everyone)
    assert all(r is not None for r in results)
    return [r for r in results if r is not None], stats


def _wait(works: list, what: str, peers: _Peers | list[int]) -> None:
    """Wait for the exchange's messages behind the package's watchdog (a rank that skipped
    the optimizer step, or left, is named within seconds instead of a hang)."""
    if not works:
        return
    # (Imported here: the functional optimizers use this module and load no shell.)
    from ..shell.comm.watchdog import watched_wait

    ranks = peers.global_ranks() if isinstance(peers, _Peers) else peers
    _ABANDONED[:] = _ABANDONED[-16:]  # keep the latest given-up waits' buffers referenced
    watched_wait(
        works,
        f"the whole-matrix exchange ({what})",
        ranks,
        family="whole-matrix exchange",
        on_abandon=_ABANDONED.append,
    )


# Works of given-up waits (with their buffers): a late message must never land in freed memory.
_ABANDONED: list[list] = []


def _checked(out: torch.Tensor, lay: MatrixLayout, i: int) -> torch.Tensor:
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != lay.global_shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise WholeMatrixError(
            f"matrix {i}: the whole-matrix function must return a tensor of the matrix's shape "
            f"{lay.global_shape}, got {got}"
        )
    return out
