"""Communicators over real ``torch.distributed`` process groups.

On gloo the native collectives are slow on small CPU machines; measured on 2 ranks, 2 cores,
4 MiB per rank: ``all_gather_into_tensor`` 24 ms vs one async ``broadcast`` per rank 4 ms;
``reduce_scatter_tensor`` 27 ms (an all-reduce inside gloo) vs point-to-point exchange of
the chunks plus a local sum 6 ms. Both
replacements move the same bytes as the native collective, so gloo groups use them by default
(``strategy="auto"``). NCCL (and other backends) use the native collectives.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..comm import DoneWork, Work
from ..errors import CollectiveError, CollectiveTimeoutError, PeerAbortedError
from .schedule import ScopedComm, Waiter

__all__ = ["ProcessGroupComm"]

_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG}


class _ThenWork:
    """Wait for ``works`` (bounded, abort-aware, through ``comm``), then run ``then`` once
    (e.g. the local sum of a point-to-point reduce-scatter)."""

    __slots__ = ("_comm", "_then", "_what", "_works")

    def __init__(
        self,
        works: list,
        then: Callable[[], None] | None = None,
        *,
        comm: ProcessGroupComm,
        what: str,
    ) -> None:
        self._works = works
        self._then = then
        self._comm = comm
        self._what = what

    def wait(self) -> None:
        if self._works:
            works, self._works = self._works, []
            self._comm.wait_works(works, self._what)
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
        self._pieces_min_bytes = int(os.environ.get("FFSDP_PIECES_MIN_BYTES", 1 << 20))
        self._sum_only = backend == "gloo"
        # Point-to-point calls of different collectives may be in flight together (a prefetch
        # all-gather beside a reduce-scatter): each call gets its own tag range. Every rank
        # issues collectives in the same order, so the counters agree.
        self._calls = 0
        # Schedule check: a tag also encodes which collective it belongs to (group key and
        # kind) and the epoch, so ranks that run different collectives never pair their
        # messages; they time out instead and every rank raises a named error.
        self.check_schedule = os.environ.get("FFSDP_SCHEDULE_CHECK", "1") != "0"
        self.timeout_s = float(os.environ.get("FFSDP_COLLECTIVE_TIMEOUT", "600"))
        self._epoch = 0
        self._waiter = Waiter()
        self._abandoned: list[Any] = []  # works (and their buffers) a failed step left posted
        # Ids that agree across ranks without any global registry: per-rank counters in the
        # process group's store (rank r's k-th id is k on every rank, as fully_shard runs in
        # the same order everywhere).
        self._store: Any = None
        self._pg_prefix = f"ffsdp/{getattr(self.group, 'group_name', 'pg')}/"
        self._uid = self._next_id("comms") if self._world_size > 1 else 0
        self._aborts_seen = self._aborts() if self._world_size > 1 else 0

    @property
    def supports_pieces(self) -> bool:
        """Whether the pieces collectives are native here (point-to-point on gloo)."""
        return self._p2p

    @property
    def pieces_min_bytes(self) -> int:
        """Groups smaller than this (unsharded bytes) send one packed message per peer instead
        of one per parameter: below about 1 MiB the per-message cost on gloo exceeds the
        packing copy (``FFSDP_PIECES_MIN_BYTES`` overrides; 0 sends pieces for every group)."""
        return self._pieces_min_bytes

    @classmethod
    def for_mesh(cls, mesh: Any, dim: int) -> ProcessGroupComm:
        """The one communicator of this rank's group along ``dim`` of ``mesh``.

        Every user of the mesh shares it (the groups' scoped views, the functional API's norms),
        so point-to-point tag ranges of concurrent collectives never overlap and no call pays
        for a new one. Cached on the mesh object (per-rank state, not a global).
        """
        cache = mesh.__dict__.setdefault("_ffsdp_comms", {})
        key = dim % mesh.ndim
        if key not in cache:
            cache[key] = cls(mesh.get_group(key) if mesh.ndim > 1 else mesh.get_group())
        comm: ProcessGroupComm = cache[key]
        return comm

    def scoped(self) -> ScopedComm:
        """A view of this communicator for one parameter group: its collectives carry the
        group's key in their tags (keys are handed out in ``fully_shard`` order, the same on
        every rank, unique within the process group)."""
        return ScopedComm(self, self._next_id("group_keys") if self._world_size > 1 else 0)

    def _next_id(self, what: str) -> int:
        return int(self._get_store().add(f"{self._pg_prefix}{what}/{dist.get_rank()}", 1))

    def _aborts(self) -> int:
        return int(self._get_store().add(f"{self._pg_prefix}aborts", 0))

    def _tags(self, count: int, key: int = 0, kind: int = 0) -> int:
        """Base tag of one collective: ``epoch (2 bits) | fingerprint (9) | seq (8) | piece (12)``."""
        if count > 4096:
            raise ValueError(
                f"too many pieces in one collective ({count} > 4096); split the group with "
                "more fully_shard calls"
            )
        seq = self._calls % 256
        self._calls += 1
        fp = (key * 8 + kind) % 509 if self.check_schedule else 0
        return ((((self._epoch % 4) << 9 | fp) << 8) | seq) << 12

    # ------------------------------------------------------------------ bounded waits

    def _get_store(self) -> Any:
        if self._store is None:
            self._store = dist.distributed_c10d._get_default_store()
        return self._store

    def wait_works(self, works: list, what: str) -> None:
        """Wait for ``works``; raise a named error (never hang) when the peers diverged or
        abandoned them. Costs nothing when they are already complete."""
        if all(w.is_completed() for w in works):
            for w in works:
                w.wait()
            return
        done, box = self._waiter.submit(works)
        deadline = time.monotonic() + self.timeout_s
        while not done.wait(0.1):
            aborted = self._peer_aborted()
            if aborted is not None or time.monotonic() > deadline:
                self._abandon(works)
                if aborted is None:
                    self._post_abort()
                    raise CollectiveTimeoutError(
                        f"rank {self._rank} waited {self.timeout_s:g} s for {what} (collective "
                        f"#{self._calls} of epoch {self._epoch}); the other ranks are running "
                        "a different schedule of collectives: a submodule run on some ranks "
                        "only, a different number of micro-batches, set_requires_gradient_sync "
                        "on some ranks only, or an exception on another rank. Call "
                        "reset_iter_state() on the root module on every rank to recover "
                        "(FFSDP_COLLECTIVE_TIMEOUT sets the limit in seconds)"
                    )
                raise PeerAbortedError(
                    f"rank {aborted} abandoned the current collectives while rank {self._rank} "
                    f"waited for {what}; call reset_iter_state() on the root module on every "
                    "rank to recover"
                )
        if box:
            raise CollectiveError(
                f"{what} failed on rank {self._rank}: {box[0]}; a peer process probably died "
                "or closed the connection (see its log)"
            ) from box[0]

    def _peer_aborted(self) -> str | None:
        """Which rank gave up on the current collectives (``None``: nobody)."""
        if self._aborts() <= self._aborts_seen:
            return None
        last = self._get_store().get(f"{self._pg_prefix}last_abort")
        return last.decode()

    def _post_abort(self) -> None:
        store = self._get_store()
        store.set(f"{self._pg_prefix}last_abort", str(dist.get_rank()))
        store.add(f"{self._pg_prefix}aborts", 1)

    def _abandon(self, works: list) -> None:
        # The posted buffers stay referenced: a late message must never land in freed memory.
        self._abandoned.append(works)
        self._waiter.abandon()

    def _barrier(self, name: str) -> None:
        """Wait until every rank of the group reached ``name`` (through the store; bounded)."""
        store = self._get_store()
        key = f"{self._pg_prefix}{self._uid}/{name}/{self._epoch}"
        store.add(key, 1)
        deadline = time.monotonic() + self.timeout_s
        while int(store.add(key, 0)) < self._world_size:
            if time.monotonic() > deadline:
                raise CollectiveTimeoutError(
                    f"reset_iter_state on rank {self._rank} waited {self.timeout_s:g} s for the "
                    "other ranks; call reset_iter_state() on the root module on every rank"
                )
            time.sleep(0.005)

    def _post(
        self,
        peers: list[int],
        sends: list[list[torch.Tensor]],
        recvs: list[list[torch.Tensor]],
        base: int,
    ) -> list:
        """Post ``sends[k]`` to and ``recvs[k]`` from group rank ``peers[k]`` (piece ``i`` on
        tag ``base + i``); the works."""
        ops = []
        for r, out, into in zip(peers, sends, recvs):
            peer = self._global_ranks[r]
            for i, t in enumerate(out):
                if t.numel():
                    ops.append(dist.P2POp(dist.isend, t, peer, self.group, base + i))
            for i, o in enumerate(into):
                if o.numel():
                    ops.append(dist.P2POp(dist.irecv, o, peer, self.group, base + i))
        return dist.batch_isend_irecv(ops) if ops else []

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        async_op: bool = False,
        key: int = 0,
        kind: int = 0,
    ) -> Work:
        """Chunk ``r`` of 1-D ``input`` goes to rank ``r``; chunk ``r`` of ``output`` comes
        from rank ``r`` (point to point on gloo: gloo's all-to-all has no bounded wait)."""
        me, ws = self._rank, self._world_size
        outs, ins = output.view(ws, -1), input.view(ws, -1)
        if ws == 1:
            outs.copy_(ins)
            return DoneWork()
        if not self._p2p:
            w = dist.all_to_all_single(output, input, group=self.group, async_op=async_op)
            return _done(w, async_op)
        peers = [r for r in range(ws) if r != me]
        works = self._post(
            peers, [[ins[r]] for r in peers], [[outs[r]] for r in peers], self._tags(1, key, kind)
        )
        outs[me].copy_(ins[me])
        work = _ThenWork(works, comm=self, what=f"all-to-all of group {key}")
        if not async_op:
            work.wait()
        return work

    def all_gather_pieces(
        self,
        outputs: list[list[torch.Tensor]],
        inputs: list[torch.Tensor],
        *,
        async_op: bool = False,
        key: int = 0,
        kind: int = 1,
    ) -> Work:
        """``outputs[r][i]`` receives rank ``r``'s ``inputs[i]`` (this rank's: a local copy)."""
        me, ws = self._rank, self._world_size
        if ws == 1:
            for o, t in zip(outputs[me], inputs):
                o.copy_(t)
            return DoneWork()
        base = self._tags(len(inputs), key, kind)
        peers = [r for r in range(ws) if r != me]
        works = self._post(peers, [inputs] * len(peers), [outputs[r] for r in peers], base)
        # The local copy runs while the peers' pieces are on the wire.
        for o, t in zip(outputs[me], inputs):
            o.copy_(t)
        work = _ThenWork(works, comm=self, what=f"all-gather of group {key}")
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
        key: int = 0,
        kind: int = 2,
    ) -> Work:
        """``outputs[i]`` receives the reduction over ranks of their ``inputs[rank][i]``.

        Sums run in rank order (two ranks: ``a + b``, which is commutative bit for bit).
        """
        me, ws = self._rank, self._world_size
        own = inputs[me]
        base = self._tags(len(outputs), key, kind)
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
        works = self._post(peers, [inputs[r] for r in peers], slots, base)

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

        work = _ThenWork(works, then, comm=self, what=f"reduce-scatter of group {key}")
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
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        async_op: bool = False,
        key: int = 0,
        kind: int = 3,
    ) -> Work:
        """Rank-major all-gather of 1-D ``input`` into ``output``."""
        if self._world_size == 1:
            output.copy_(input)
            return DoneWork()
        if not self._p2p:
            w = dist.all_gather_into_tensor(output, input, group=self.group, async_op=async_op)
            return _done(w, async_op)
        # Point to point, one piece per rank (same bytes as gloo's broadcasts, and the tags
        # carry the schedule check).
        chunks = output.chunk(self._world_size)
        return self.all_gather_pieces(
            [[c] for c in chunks], [input], async_op=async_op, key=key, kind=kind
        )

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        op: str = "sum",
        async_op: bool = False,
        key: int = 0,
        kind: int = 4,
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
            # reduce-scatter; summed in rank order as a single-process sum over ranks would.
            chunks = input.view(ws, -1)
            outs = [output.view(-1)]
            ins = [[chunks[r]] for r in range(ws)]
            return self.reduce_scatter_pieces(
                outs, ins, op=op, async_op=async_op, key=key, kind=kind
            )
        received = input.clone()
        works = [dist.all_reduce(received, group=self.group, async_op=True)]

        def then() -> None:
            output.copy_(received.view(ws, -1)[self._rank])
            if op == "avg":
                output.div_(ws)

        work = _ThenWork(works, then, comm=self, what="reduce-scatter")
        if not async_op:
            work.wait()
        return work

    def all_reduce(
        self, tensor: torch.Tensor, *, op: str = "sum", async_op: bool = False, key: int = 0
    ) -> Work:
        """In-place all-reduce; ``avg`` is a sum and a division on gloo. (gloo's native
        collective: its waits are bounded and abort-aware, its messages carry no key.)"""
        del key
        if self._world_size == 1:
            return DoneWork()
        then = None
        if op == "avg" and self._sum_only:
            w = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

            def then() -> None:
                tensor.div_(self._world_size)

        else:
            w = dist.all_reduce(tensor, op=_OPS[op], group=self.group, async_op=True)
        work = _ThenWork([w], then, comm=self, what="all-reduce")
        if not async_op:
            work.wait()
        return work


def _done(work: object, async_op: bool) -> Work:
    return work if (async_op and work is not None) else DoneWork()  # type: ignore[return-value]
