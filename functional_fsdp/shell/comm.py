"""Communicators over real ``torch.distributed`` process groups.

On gloo the native collectives are slow on small CPU machines; measured on 2 ranks, 2 cores,
4 MiB per rank: ``all_gather_into_tensor`` 24 ms vs one async ``broadcast`` per rank 4 ms;
``reduce_scatter_tensor`` 27 ms (an all-reduce inside gloo) vs point-to-point exchange of
the chunks plus a local sum 6 ms. Both
replacements move the same bytes as the native collective, so gloo groups use them by default
(``strategy="auto"``). NCCL (and other backends) use the native collectives.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..comm import DoneWork, Work

__all__ = ["ProcessGroupComm"]

_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG}


class _ThenWork:
    """Wait for ``works``, then run ``then`` once (e.g. the local sum of an all-to-all)."""

    __slots__ = ("_then", "_works")

    def __init__(self, works: list, then: Callable[[], None] | None = None) -> None:
        self._works = works
        self._then = then

    def wait(self) -> None:
        for w in self._works:
            w.wait()
        self._works = []
        if self._then is not None:
            then, self._then = self._then, None
            then()


class ProcessGroupComm:
    """A :class:`~functional_fsdp.comm.Communicator` over a ``torch.distributed`` process group.

    Args:
        group: the process group (default: the world).
        strategy: ``"auto"`` (broadcast all-gather and all-to-all reduce-scatter on gloo, native
            elsewhere), ``"native"`` (always the native collectives) or ``"p2p"`` (the gloo
            replacements everywhere).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, strategy: str = "auto") -> None:
        if strategy not in ("auto", "native", "p2p"):
            raise ValueError(f"strategy must be 'auto', 'native' or 'p2p', got {strategy!r}")
        self.group = group if group is not None else dist.group.WORLD
        self._rank = dist.get_rank(self.group)
        self._world_size = dist.get_world_size(self.group)
        self._global_ranks = dist.get_process_group_ranks(self.group)
        backend = str(dist.get_backend(self.group)).lower()
        self.backend = backend
        self._p2p = strategy == "p2p" or (strategy == "auto" and backend == "gloo")
        self._sum_only = backend == "gloo"
        # Point-to-point calls of different collectives may be in flight together (a prefetch
        # all-gather beside a reduce-scatter): each call gets its own tag range. Every rank
        # issues collectives in the same order, so the counters agree.
        self._calls = 0

    @property
    def supports_pieces(self) -> bool:
        """Whether the pieces collectives are native here (point-to-point on gloo)."""
        return self._p2p

    def _tags(self, count: int) -> int:
        base = (self._calls % 4096) * 65536
        self._calls += 1
        if count > 65536:
            raise ValueError(f"too many pieces in one collective ({count})")
        return base

    def all_gather_pieces(
        self,
        outputs: list[list[torch.Tensor]],
        inputs: list[torch.Tensor],
        *,
        async_op: bool = False,
    ) -> Work:
        """``outputs[r][i]`` receives rank ``r``'s ``inputs[i]`` (this rank's: a local copy)."""
        me, ws = self._rank, self._world_size
        if ws == 1:
            for o, t in zip(outputs[me], inputs):
                o.copy_(t)
            return DoneWork()
        base = self._tags(len(inputs))
        ops = []
        for r in range(ws):
            if r == me:
                continue
            peer = self._global_ranks[r]
            for i, t in enumerate(inputs):
                if t.numel():
                    ops.append(dist.P2POp(dist.isend, t, peer, self.group, base + i))
            for i, o in enumerate(outputs[r]):
                if o.numel():
                    ops.append(dist.P2POp(dist.irecv, o, peer, self.group, base + i))
        works = dist.batch_isend_irecv(ops) if ops else []
        # The local copy runs while the peers' pieces are on the wire.
        for o, t in zip(outputs[me], inputs):
            o.copy_(t)
        work = _ThenWork(works)
        if not async_op:
            work.wait()
        return work

    def reduce_scatter_pieces(
        self,
        outputs: list[torch.Tensor],
        inputs: list[list[torch.Tensor]],
        *,
        op: str = "sum",
        async_op: bool = False,
    ) -> Work:
        """``outputs[i]`` receives the reduction over ranks of their ``inputs[rank][i]``.

        Sums run in rank order (two ranks: ``a + b``, which is commutative bit for bit).
        """
        me, ws = self._rank, self._world_size
        own = inputs[me]
        base = self._tags(len(outputs))
        peers = [r for r in range(ws) if r != me]
        # Two ranks receive straight into the outputs; more ranks receive into a temporary so
        # the sum can run in rank order.
        if ws == 2:
            slots = [list(outputs)]
        else:
            total = sum(o.numel() for o in outputs)
            tmp = torch.empty(len(peers), total, dtype=outputs[0].dtype, device=outputs[0].device)
            slots = []
            for k in range(len(peers)):
                row, off = tmp[k], 0
                views = []
                for o in outputs:
                    views.append(row.narrow(0, off, o.numel()))
                    off += o.numel()
                slots.append(views)
        ops = []
        for k, r in enumerate(peers):
            peer = self._global_ranks[r]
            for i, t in enumerate(inputs[r]):
                if t.numel():
                    ops.append(dist.P2POp(dist.isend, t, peer, self.group, base + i))
            for i, o in enumerate(slots[k]):
                if o.numel():
                    ops.append(dist.P2POp(dist.irecv, o, peer, self.group, base + i))

        def then() -> None:
            for i, out in enumerate(outputs):
                if ws == 2:
                    out.add_(own[i])
                else:
                    parts = [slots[k][i] for k in range(len(peers))]
                    parts.insert(me, own[i])
                    torch.add(parts[0], parts[1], out=out)
                    for p in parts[2:]:
                        out.add_(p)
                if op == "avg":
                    out.div_(ws)

        work = _ThenWork(dist.batch_isend_irecv(ops) if ops else [], then)
        if not async_op:
            work.wait()
        return work

    @property
    def rank(self) -> int:
        """This rank's index in the group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Ranks in the group."""
        return self._world_size

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False
    ) -> Work:
        """Rank-major all-gather of 1-D ``input`` into ``output``."""
        if self._world_size == 1:
            output.copy_(input)
            return DoneWork()
        if not self._p2p:
            w = dist.all_gather_into_tensor(output, input, group=self.group, async_op=async_op)
            return _done(w, async_op)
        chunks = output.chunk(self._world_size)
        chunks[self._rank].copy_(input)
        works = [
            dist.broadcast(c, src=src, group=self.group, async_op=True)
            for c, src in zip(chunks, self._global_ranks)
        ]
        work = _ThenWork(works)
        if not async_op:
            work.wait()
        return work

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, op: str = "sum", async_op: bool = False
    ) -> Work:
        """Reduce 1-D ``input`` (``ws * n``) over ranks; this rank keeps chunk ``rank``."""
        ws = self._world_size
        if ws == 1:
            output.copy_(input)
            return DoneWork()
        if not self._p2p and not (self._sum_only and op == "avg"):
            w = dist.reduce_scatter_tensor(
                output, input, op=_OPS[op], group=self.group, async_op=async_op
            )
            return _done(w, async_op)
        if self._p2p:
            # Send chunk j to rank j, receive this rank's chunk from every peer: the bytes of a
            # reduce-scatter, and a receive buffer of (ws - 1) chunks, not ws.
            n = output.numel()
            chunks = input.view(ws, n)
            peers = [r for r in range(ws) if r != self._rank]
            received = torch.empty(len(peers), n, dtype=input.dtype, device=input.device)
            tag = self._tags(1)
            ops = [
                dist.P2POp(dist.isend, chunks[r], self._global_ranks[r], self.group, tag)
                for r in peers
            ]
            ops += [
                dist.P2POp(dist.irecv, received[k], self._global_ranks[r], self.group, tag)
                for k, r in enumerate(peers)
            ]
            works = dist.batch_isend_irecv(ops)

            def then() -> None:
                # Sum in rank order (rank 0 first), as a single-process sum over ranks would.
                parts = [received[k] for k in range(len(peers))]
                parts.insert(self._rank, chunks[self._rank])
                out = output.view(-1)
                torch.add(parts[0], parts[1], out=out)
                for p in parts[2:]:
                    out.add_(p)
                if op == "avg":
                    out.div_(ws)

        else:
            received = input.clone()
            works = [dist.all_reduce(received, group=self.group, async_op=True)]

            def then() -> None:
                output.copy_(received.view(ws, -1)[self._rank])
                if op == "avg":
                    output.div_(ws)

        work = _ThenWork(works, then)
        if not async_op:
            work.wait()
        return work

    def all_reduce(self, tensor: torch.Tensor, *, op: str = "sum", async_op: bool = False) -> Work:
        """In-place all-reduce; ``avg`` is a sum and a division on gloo."""
        if self._world_size == 1:
            return DoneWork()
        if op == "avg" and self._sum_only:
            w = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

            def divide() -> None:
                tensor.div_(self._world_size)

            work = _ThenWork([w], divide)
        else:
            work = _ThenWork(
                [dist.all_reduce(tensor, op=_OPS[op], group=self.group, async_op=True)]
            )
        if not async_op:
            work.wait()
        return work


def _done(work: object, async_op: bool) -> Work:
    return work if (async_op and work is not None) else DoneWork()  # type: ignore[return-value]
