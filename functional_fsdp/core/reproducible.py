"""Reproducible reduction: the same bits on 1, 2, 4, ... ranks (pure).

Floating-point addition is not associative, so a gradient summed over a global batch depends on
the order of the sums: on ``N`` ranks a reduce-scatter adds the ranks' partial sums in whatever
order the backend picks, and gradient accumulation adds micro-batches left to right. Here every
sum has one canonical shape, fixed by the :class:`ReproduciblePolicy`'s virtual world size
``V`` alone: a complete binary tree over the ``V`` virtual micro-batches, leaf ``k`` being
micro-batch ``k``'s gradient.

On ``N`` ranks (``N`` divides ``V``, both powers of two) rank ``r`` runs micro-batches
``r*V/N ... (r+1)*V/N - 1``: a complete subtree. It sums its leaves pairwise as they arrive
(:class:`TreeSums`, a binary counter holding at most ``log2(V/N) + 1`` partial sums), and the
cross-rank reduction sums the ``N`` subtrees in the tree's upper levels in rank order
(:func:`tree_sum`), never in the order a backend chooses: an all-to-all delivers each rank the
``N`` pieces of its shard, which it adds pairwise itself.

Scaling: the usual accumulation loop divides each micro-batch's loss by ``V/N`` and the
reduction averages over ``N`` ranks. Both are powers of two, and multiplying by a power of two
is exact in binary floating point (away from overflow and subnormals), so every leaf and every
partial sum is the ``N = 1`` run's value times a power of two, and the result is bit-identical
for every ``N``.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

import attrs
import torch

from . import layout as L
from ._tree import STATIC, register
from .comm import Communicator, Work, check_comm, collective_or_copy
from .errors import ReproducibilityError, StateError
from .records import ShardedState
from .reduction import agreed_present, reduce_row_numel, split_reduced

__all__ = [
    "PendingTreeReduce",
    "ReproduciblePolicy",
    "TreeSums",
    "begin_tree_reduce",
    "canonical_mean",
    "canonical_norm",
    "canonical_sum",
    "gather_row_sums",
    "row_square_sums",
    "finish_tree_reduce",
    "push_leaf",
    "tree_reduce",
    "tree_sum",
]


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _check_virtual(_inst: object, _attr: object, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not _power_of_two(value):
        raise ReproducibilityError(
            f"ReproduciblePolicy(virtual_world_size={value!r}): the virtual world size must be "
            "a power of two (1, 2, 4, 8, ...): it is the number of micro-batches the global "
            "batch is split into, and every world size you run on must divide it"
        )


@attrs.frozen
class ReproduciblePolicy:
    """Bit-identical training for every world size that divides ``virtual_world_size``.

    The global batch is split into ``virtual_world_size`` (``V``) micro-batches in a fixed
    order. On ``N`` ranks, rank ``r`` runs micro-batches :meth:`micro_batches` ``(r, N)`` in
    order, each as one forward and backward with the loss divided by ``V/N`` (the usual FSDP2
    gradient-accumulation loop, with or without ``set_requires_gradient_sync``), then the
    optimizer steps. Pass the same policy to every ``fully_shard`` call of a model
    (``fully_shard(module, reproducible=policy)``), as with the other policies.

    Args:
        virtual_world_size: ``V``, a power of two; every world size used must divide it.
        seed: the base of :meth:`generator`'s seeds.
    """

    virtual_world_size: int = attrs.field(validator=_check_virtual)
    seed: int = 0

    def micro_batches_per_rank(self, world_size: int) -> int:
        """``V / N``; raises :class:`ReproducibilityError` unless ``N`` divides ``V``."""
        v = self.virtual_world_size
        if not _power_of_two(world_size) or v % world_size:
            raise ReproducibilityError(
                f"ReproduciblePolicy(virtual_world_size={v}) on {world_size} data-parallel ranks: "
                f"the data-parallel world size must be a power of two that divides {v} (run on "
                f"{', '.join(str(1 << i) for i in range(v.bit_length()))} ranks, or choose "
                "another virtual_world_size)"
            )
        return v // world_size

    def micro_batches(self, rank: int, world_size: int) -> range:
        """The virtual micro-batches data-parallel ``rank`` of ``world_size`` runs, in order."""
        k = self.micro_batches_per_rank(world_size)
        if not 0 <= rank < world_size:
            raise ReproducibilityError(f"rank {rank} is not in a world of {world_size}")
        return range(rank * k, (rank + 1) * k)

    def generator(self, step: int, micro_batch: int, device: str = "cpu") -> torch.Generator:
        """A generator seeded by ``(seed, step, micro_batch)`` alone: dropout (or any sampling)
        drawn from it is the same whichever rank runs the micro-batch."""
        key = f"{self.seed}/{step}/{micro_batch}".encode()
        g = torch.Generator(device=device)
        g.manual_seed(zlib.crc32(key) | (self.seed & 0xFFFFFFFF) << 32)
        return g


@register
@attrs.frozen
class TreeSums:
    """Partial sums of a pairwise tree over leaves that arrive one at a time, left to right.

    A binary counter: ``sums[i]`` is the sum of a complete subtree of ``2**levels[i]``
    consecutive leaves, levels strictly decreasing. Pushing a leaf merges equal levels
    (left + right), so after ``2**k`` leaves one sum remains: the tree's root. At most
    ``log2(leaves) + 1`` sums are alive.
    """

    sums: tuple[torch.Tensor, ...] = ()
    levels: tuple[int, ...] = attrs.field(default=(), metadata=STATIC)
    count: int = attrs.field(default=0, metadata=STATIC)

    def root(self) -> torch.Tensor:
        """The sum of all leaves; they must form one complete subtree (a power of two)."""
        if len(self.sums) != 1:
            raise ReproducibilityError(
                f"{self.count} micro-batch gradients are not a complete subtree (a power of two "
                "of them is); run every micro-batch of the step before the optimizer step"
            )
        return self.sums[0]


def push_leaf(acc: TreeSums, leaf: torch.Tensor, *, donate: bool = False) -> TreeSums:
    """``acc`` with ``leaf`` added as the next leaf. With ``donate=True`` the partial sums
    (and ``leaf``) may be added into in place: the caller gives up ``acc`` and ``leaf``."""
    sums, levels = list(acc.sums), list(acc.levels)
    sums.append(leaf)
    levels.append(0)
    while len(levels) > 1 and levels[-1] == levels[-2]:
        right = sums.pop()
        levels.pop()
        left = sums[-1]
        sums[-1] = left.add_(right) if donate else left + right
        levels[-1] += 1
    return TreeSums(tuple(sums), tuple(levels), acc.count + 1)


def tree_sum(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """``values`` summed pairwise, adjacent pairs first: ``((v0 + v1) + (v2 + v3)) + ...``.

    The count must be a power of two (the canonical tree's upper levels over ``N`` ranks). A
    new tensor; the inputs are not modified.
    """
    n = len(values)
    if not _power_of_two(n):
        raise ReproducibilityError(f"tree_sum needs a power-of-two count of values, got {n}")
    level = list(values)
    if n == 1:
        return level[0].clone()
    while len(level) > 1:
        level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
    return level[0]


@attrs.frozen(eq=False)
class PendingTreeReduce:
    """A *handle* for a reproducible reduction in flight (see :func:`begin_tree_reduce`): the
    all-to-all delivering this rank the ``N`` pieces of its shard, owned by the collective
    until ``work.wait()``, as is ``input`` (the subtree sum sent, the caller's again after
    the wait)."""

    sharded: ShardedState
    pieces: torch.Tensor
    work: Work
    present: tuple[bool, ...]
    replicate_comm: Communicator | None
    input: torch.Tensor | None = None


def begin_tree_reduce(
    subtree: torch.Tensor,
    sharded: ShardedState,
    comm: Communicator,
    *,
    present: Sequence[bool],
    replicate_comm: Communicator | None = None,
    async_op: bool = True,
) -> PendingTreeReduce:
    """Send every rank its piece of this rank's subtree sum.

    ``subtree``: this rank's micro-batch gradients summed in the canonical tree
    (:class:`TreeSums`), packed as the reduce-scatter input is (``reduction.pack_grads``:
    ``(world_size, shard_numel)`` in the reduce dtype, or with the presence flags,
    ``pack_grads(flags=True)``, when ``present`` may differ between the ranks: the reduction
    then lands what any rank had). One all-to-all over the shard group (the bytes of a
    reduce-scatter) gives this rank row ``r`` of every rank ``r``'s subtree.
    """
    if not isinstance(sharded, ShardedState):
        raise StateError(f"a reduction writes into a ShardedState, got {type(sharded).__name__}")
    lay = sharded.layout
    check_comm(comm, lay.world_size, "reproducible reduce")
    want = [lay.world_size * reduce_row_numel(lay, flagged) for flagged in (False, True)]
    if subtree.dim() != 1 or subtree.numel() not in want:
        raise ReproducibilityError(
            f"the packed subtree sum has shape {tuple(subtree.shape)}; expected ({want[0]},) "
            f"(world_size * shard_numel, packed by reduction.pack_grads) or ({want[1]},) (with "
            "the presence flags, pack_grads(flags=True))"
        )
    pieces = torch.empty_like(subtree)
    work = collective_or_copy(
        lay.world_size,
        pieces,
        subtree,
        lambda: comm.all_to_all(pieces, subtree, async_op=async_op),
    )
    return PendingTreeReduce(sharded, pieces, work, tuple(present), replicate_comm, subtree)


def _tree_flagged(pending: PendingTreeReduce) -> bool:
    """Whether the reduction's rows carry the presence flags (their width says)."""
    lay = pending.sharded.layout
    return len(lay) > 0 and pending.pieces.numel() == lay.world_size * reduce_row_numel(lay, True)


def finish_tree_reduce(pending: PendingTreeReduce, *, accumulate: bool = True) -> ShardedState:
    """Wait; add the ``N`` pieces pairwise in rank order (then, under HSDP, the replicas'
    sums pairwise in replica order, through one all-gather); average over the data-parallel
    ranks (an exact power-of-two scaling); split per parameter, cast, accumulate."""
    pending.work.wait()
    sharded = pending.sharded
    lay = sharded.layout
    flagged = _tree_flagged(pending)
    ws, size = lay.world_size, reduce_row_numel(lay, flagged)
    rep = pending.replicate_comm
    replicas = 1 if rep is None else rep.world_size

    def gather_replicas(out: torch.Tensor) -> torch.Tensor:
        assert rep is not None
        gathered = out.new_empty(replicas * size)
        rep.all_gather(gathered, out).wait()
        return gathered

    out = canonical_mean(pending.pieces.view(ws, size), replicas, gather_replicas)
    present = pending.present
    if ws > 1 or rep is not None:
        present = agreed_present(present, lay, out, flagged)
    grads = split_reduced(sharded, out, present, accumulate=accumulate)
    return attrs.evolve(sharded, grads=grads)


def canonical_mean(
    pieces: torch.Tensor,
    replicas: int,
    gather_replicas: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The reproducible reduction's arithmetic after its all-to-all, written once for the
    eager reduction (:func:`finish_tree_reduce`) and the compiled step's graph, whose
    collectives differ: ``pieces`` (``(N, size)``, row ``r`` rank ``r``'s piece of this rank's
    shard) added pairwise in rank order; with ``replicas > 1`` (HSDP) the replicas' sums,
    which ``gather_replicas(sum)`` returns (``replicas * size``, in replica order), added
    pairwise in replica order; then the average over the ``N * replicas`` ranks, an exact
    power-of-two scaling."""
    n, size = pieces.shape
    out = tree_sum(list(pieces.unbind(0)))
    if replicas > 1:
        out = tree_sum(list(gather_replicas(out).view(replicas, size).unbind(0)))
    dp = n * replicas
    return out * (1.0 / dp) if dp > 1 else out


def tree_reduce(
    subtree: torch.Tensor,
    sharded: ShardedState,
    comm: Communicator,
    *,
    present: Sequence[bool],
    replicate_comm: Communicator | None = None,
    accumulate: bool = True,
) -> ShardedState:
    """:func:`begin_tree_reduce` then :func:`finish_tree_reduce` (synchronous)."""
    pending = begin_tree_reduce(
        subtree, sharded, comm, present=present, replicate_comm=replicate_comm, async_op=False
    )
    return finish_tree_reduce(pending, accumulate=accumulate)


# ------------------------------------------------------------------------------ norms


def canonical_sum(values: torch.Tensor) -> torch.Tensor:
    """The entries of 1-D ``values`` summed in one fixed tree: padded with zeros (exact) to a
    power of two, then adjacent pairs first. Depends only on the values, not on how they were
    computed or where they were sharded."""
    x = values.reshape(-1)
    n = x.numel()
    if n == 0:
        return x.new_zeros(())
    size = 1 << (n - 1).bit_length()
    if size != n:
        x = torch.cat([x, x.new_zeros(size - n)])
    while x.numel() > 1:
        x = x[0::2] + x[1::2]
    return x.reshape(())


def row_square_sums(local: torch.Tensor) -> torch.Tensor:
    """Per dim-0 row of ``local``, the sum of its squares in float32. A row is never split by
    dim-0 sharding, and the sum over one row does not depend on how many rows the tensor has,
    so the result for a row is the same whichever shard holds it."""
    x = local.float()
    if x.dim() == 0:
        x = x.reshape(1, 1)
    elif x.dim() == 1 or x.numel() == 0:
        x = x.reshape(x.shape[0], -1 if x.numel() else 0)
    else:
        x = x.reshape(x.shape[0], -1)
    return (x * x).sum(dim=1)


def gather_row_sums(
    local_rows: Sequence[torch.Tensor], dim0: Sequence[int], comm: Communicator
) -> list[torch.Tensor]:
    """Every rank's row sums of tensors sharded on dim 0 over ``comm`` (``torch.chunk`` 's
    rule), in row order: one all-gather for all of them. ``local_rows[i]``: this rank's rows of
    tensor ``i`` (of ``dim0[i]`` rows in all)."""
    ws = comm.world_size
    if ws == 1 or not local_rows:
        return [r.clone() for r in local_rows]
    chunks = [L.chunk_size(d, ws) for d in dim0]
    send = torch.zeros(sum(chunks), dtype=torch.float32, device=local_rows[0].device)
    off = 0
    for rows, c in zip(local_rows, chunks):
        send[off : off + rows.numel()] = rows
        off += c
    recv = send.new_empty(ws * send.numel())
    comm.all_gather(recv, send).wait()
    recv = recv.view(ws, -1)
    out = []
    off = 0
    for d, c in zip(dim0, chunks):
        parts = [recv[r, off : off + L.shard_extent(d, ws, r)[1]] for r in range(ws)]
        out.append(torch.cat(parts))
        off += c
    return out


def canonical_norm(full_rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of tensors given by their full row sums of squares (in a fixed tensor order):
    one :func:`canonical_sum` over every row of every tensor, then the square root."""
    if not full_rows:
        return torch.zeros((), dtype=torch.float32)
    return canonical_sum(torch.cat([r.reshape(-1) for r in full_rows])).sqrt()
