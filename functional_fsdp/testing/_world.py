"""A simulated N-rank world: ranks are threads of one process, collectives meet at a rendezvous.

The ranks take turns: a rank runs until its next collective, where it hands the turn to another
(the *baton*). One thread runs at a time, so torch's GIL releases inside every op do not make
the ranks fight for the interpreter (with four ranks that contention cost more CPU than the
ranks' own work), and a collective is one wait, not two barrier crossings.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..core.comm import DoneWork, Work

__all__ = ["SimulatedComm", "SimulatedGroup", "SimulatedWorld"]

_TIMEOUT_S = 60.0
_turn = threading.local()  # .baton: the world's turn lock, on a thread running a rank's function


class SimulatedGroup:
    """A group of simulated ranks with its own rendezvous (one per sub-group / mesh dim)."""

    def __init__(
        self, ranks: Sequence[int], *, pieces: bool = False, pieces_min_bytes: int = 0
    ) -> None:
        self.ranks = tuple(ranks)
        self.pieces = pieces
        self.pieces_min_bytes = pieces_min_bytes
        self._cv = threading.Condition()
        # collective number -> [values by rank, ranks arrived, ranks that read the values]
        self._open: dict[int, list[Any]] = {}
        self._count = [0] * len(self.ranks)  # collectives each rank entered
        self.broken = False
        self.calls = 0

    def comm(self, global_rank: int) -> SimulatedComm:
        """The communicator of ``global_rank`` (must be a member) in this group."""
        return SimulatedComm(self, self.ranks.index(global_rank))

    def abort(self) -> None:
        """Break the rendezvous so ranks blocked in a collective raise instead of hanging."""
        with self._cv:
            self.broken = True
            self._cv.notify_all()

    def _exchange(self, rank: int, value: Any) -> list[Any]:
        """Every member's ``value`` of this collective, by rank: each rank's n-th call meets
        the others' n-th. A rank that waits hands its turn on; raises
        ``threading.BrokenBarrierError`` when the group was aborted or a member never came
        (``_TIMEOUT_S``)."""
        n = len(self.ranks)
        with self._cv:
            if self.broken:
                raise threading.BrokenBarrierError
            seq = self._count[rank]
            self._count[rank] = seq + 1
            entry = self._open.setdefault(seq, [[None] * n, 0, 0])
            entry[0][rank] = value
            entry[1] += 1
            if entry[1] == n:
                self._cv.notify_all()
        if entry[1] < n:
            baton = getattr(_turn, "baton", None)
            if baton is not None:
                baton.release()
            try:
                with self._cv:
                    if not self._cv.wait_for(lambda: entry[1] == n or self.broken, _TIMEOUT_S):
                        self.broken = True
                        self._cv.notify_all()
            finally:
                if baton is not None:
                    baton.acquire()
        with self._cv:
            if entry[1] < n:
                raise threading.BrokenBarrierError
            entry[2] += 1
            if entry[2] == n:  # the last reader closes it
                del self._open[seq]
                self.calls += 1
            return list(entry[0])


class SimulatedComm:
    """A :class:`~functional_fsdp.core.comm.Communicator` for one rank of a :class:`SimulatedGroup`.

    Collectives are computed exactly (reductions add in rank order) and complete immediately;
    ``async_op=True`` returns a completed work handle.
    """

    def __init__(self, group: SimulatedGroup, rank: int) -> None:
        self._group = group
        self._rank = rank

    @property
    def rank(self) -> int:
        """This rank's index in the group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Ranks in the group."""
        return len(self._group.ranks)

    @property
    def supports_pieces(self) -> bool:
        """Whether this world offers the optional pieces collectives (``pieces=True``)."""
        return self._group.pieces

    @property
    def pieces_min_bytes(self) -> int:
        """The world's ``pieces_min_bytes`` (0 by default: every group takes the pieces
        collectives when offered, which the tests want)."""
        return self._group.pieces_min_bytes

    def all_gather_pieces(
        self,
        outputs: list[list[torch.Tensor]],
        inputs: list[torch.Tensor],
        *,
        async_op: bool = False,
    ) -> Work:
        """``outputs[r][i]`` receives rank ``r``'s ``inputs[i]`` (an empty ``outputs[rank]``:
        no copy of this rank's own)."""
        values = self._group._exchange(self._rank, [t.detach().clone() for t in inputs])
        for r, vals in enumerate(values):
            for o, v in zip(outputs[r], vals):
                o.copy_(v)
        return DoneWork()

    def reduce_scatter_pieces(
        self,
        outputs: list[torch.Tensor],
        inputs: list[list[torch.Tensor]],
        *,
        op: str = "sum",
        async_op: bool = False,
    ) -> Work:
        """``outputs[i]`` receives the reduction (rank order) of every rank's ``inputs[rank][i]``."""
        mine = [[t.detach().clone() for t in row] for row in inputs]
        values = self._group._exchange(self._rank, mine)
        for i, out in enumerate(outputs):
            out.copy_(_reduce([v[self._rank][i] for v in values], op))
        return DoneWork()

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False
    ) -> Work:
        """Rank-major gather of every rank's 1-D ``input`` into ``output``."""
        values = self._group._exchange(self._rank, input.detach().clone())
        torch.cat([v.reshape(-1) for v in values], out=output.view(-1))
        return DoneWork()

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, op: str = "sum", async_op: bool = False
    ) -> Work:
        """Reduce every rank's ``input`` and keep chunk ``rank``."""
        values = self._group._exchange(self._rank, input.detach().clone())
        n = output.numel()
        chunks = [v.reshape(-1).narrow(0, self._rank * n, n) for v in values]
        output.view(-1).copy_(_reduce(chunks, op))
        return DoneWork()

    def all_reduce(self, tensor: torch.Tensor, *, op: str = "sum", async_op: bool = False) -> Work:
        """Reduce ``tensor`` over ranks, in place."""
        values = self._group._exchange(self._rank, tensor.detach().clone())
        tensor.copy_(_reduce(values, op))
        return DoneWork()

    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False
    ) -> Work:
        """Chunk ``r`` of every rank's ``input`` goes to rank ``r``, into ``output``'s chunk of
        the sender."""
        values = self._group._exchange(self._rank, input.detach().clone())
        ws = len(values)
        torch.cat([v.reshape(ws, -1)[self._rank] for v in values], out=output.view(-1))
        return DoneWork()


def _reduce(values: list[torch.Tensor], op: str) -> torch.Tensor:
    acc = values[0].clone()
    for v in values[1:]:
        acc += v
    if op == "avg":
        acc /= len(values)
    elif op != "sum":
        raise ValueError(f"unsupported reduction {op!r}; use 'sum' or 'avg'")
    return acc


class SimulatedWorld:
    """``world_size`` ranks in one process, for testing sharding without processes.

    Example:
        >>> import torch
        >>> from functional_fsdp import shard, unshard
        >>> world = SimulatedWorld(4)
        >>> full = {"w": torch.randn(5, 3)}
        >>> outs = world.run(lambda comm: unshard(shard(full, world_size=4, rank=comm.rank), comm))
        >>> all(torch.equal(o.params[0], full["w"]) for o in outs)
        True

    Args:
        world_size: number of simulated ranks.
        mesh_shape: optional 2-D ``(replicate, shard)`` shape for HSDP; ranks are row-major.
        pieces: offer the optional pieces collectives (as ``ProcessGroupComm`` does on gloo), so
            the core takes its unpacked paths.
        pieces_min_bytes: what the communicators declare as ``pieces_min_bytes`` (gloo's is
            1 MiB): groups smaller than this, and coalesced members averaging under 1/16 of it,
            travel packed. 0 (the default) takes the pieces paths wherever they are offered.
    """

    def __init__(
        self,
        world_size: int,
        *,
        mesh_shape: tuple[int, int] | None = None,
        pieces: bool = False,
        pieces_min_bytes: int = 0,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if mesh_shape is not None and mesh_shape[0] * mesh_shape[1] != world_size:
            raise ValueError(
                f"mesh_shape {mesh_shape} does not multiply to world_size {world_size}"
            )
        self.world_size = world_size
        self.mesh_shape = mesh_shape
        self.pieces = pieces
        self.pieces_min_bytes = pieces_min_bytes
        self.world = self._new_group(tuple(range(world_size)))
        self._groups: dict[tuple[int, ...], SimulatedGroup] = {tuple(range(world_size)): self.world}
        # Ranks ask for sub-groups concurrently; without the lock two ranks could each create
        # (and wait on) their own copy of a group and never meet.
        self._lock = threading.Lock()

    def _new_group(self, ranks: tuple[int, ...]) -> SimulatedGroup:
        return SimulatedGroup(ranks, pieces=self.pieces, pieces_min_bytes=self.pieces_min_bytes)

    def group(self, ranks: Sequence[int]) -> SimulatedGroup:
        """The (cached) sub-group of ``ranks``; every member must use the same one."""
        key = tuple(ranks)
        with self._lock:
            group = self._groups.get(key)
            if group is None:
                group = self._groups[key] = self._new_group(key)
        return group

    def comm(self, rank: int) -> SimulatedComm:
        """Rank ``rank``'s communicator over the whole world."""
        return self.world.comm(rank)

    def shard_comm(self, rank: int) -> SimulatedComm:
        """Rank's communicator over its row of the ``(replicate, shard)`` mesh."""
        _, s = self._mesh()
        row = rank // s
        return self.group(range(row * s, row * s + s)).comm(rank)

    def replicate_comm(self, rank: int) -> SimulatedComm:
        """Rank's communicator over its column of the ``(replicate, shard)`` mesh."""
        r, s = self._mesh()
        return self.group(range(rank % s, r * s, s)).comm(rank)

    def sub_group_comm(
        self, rank: int, size: int, *, within: Sequence[int] | None = None
    ) -> SimulatedComm:
        """Communicator over the consecutive ``size``-rank block containing ``rank``."""
        base = list(within) if within is not None else list(range(self.world_size))
        idx = base.index(rank)
        start = idx // size * size
        return self.group(base[start : start + size]).comm(rank)

    def _mesh(self) -> tuple[int, int]:
        if self.mesh_shape is None:
            return 1, self.world_size
        return self.mesh_shape

    def run(self, fn: Callable[..., Any], *per_rank: Sequence[Any]) -> list[Any]:
        """Run ``fn(comm, *args_r)`` on every rank (threads taking turns at the collectives);
        return the results by rank.

        ``per_rank`` are sequences with one element per rank. If any rank raises, the others
        are released from their collectives and the first error is re-raised.
        """
        results: list[Any] = [None] * self.world_size
        errors: list[BaseException | None] = [None] * self.world_size
        baton = threading.Lock()  # the turn: one rank runs at a time, until its next collective

        def body(rank: int) -> None:
            _turn.baton = baton
            try:
                with baton:
                    results[rank] = fn(self.comm(rank), *(a[rank] for a in per_rank))
            except BaseException as e:
                errors[rank] = e
                for g in list(self._groups.values()):
                    g.abort()
            finally:
                _turn.baton = None

        threads = [
            threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.world_size)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=_TIMEOUT_S * 4)
        # Groups broken by an aborted run are replaced so the world can be reused.
        for key, g in list(self._groups.items()):
            if g.broken:
                self._groups[key] = self._new_group(key)
                if key == tuple(range(self.world_size)):
                    self.world = self._groups[key]
        first = next(
            (
                e
                for e in errors
                if e is not None and not isinstance(e, threading.BrokenBarrierError)
            ),
            None,
        )
        first = first or next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return results
