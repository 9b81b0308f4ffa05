"""Communicators over real ``torch.distributed`` process groups.

On gloo the native collectives are slow on small CPU machines; measured on 2 ranks, 2 cores,
4 MiB per rank: ``all_gather_into_tensor`` 24 ms vs one async ``broadcast`` per rank 4 ms;
``reduce_scatter_tensor`` 27 ms (an all-reduce inside gloo) vs point-to-point exchange of
the chunks plus a local sum 6 ms. Both
replacements move the same bytes as the native collective, so gloo groups use them by default
(``strategy="auto"``). NCCL (and other backends) use the native collectives.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ...core.comm import DoneWork, Work
from ...core.errors import (
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    PeerAbortedError,
)
from . import watchdog
from .schedule import ALL_REDUCE, OPS, Position, reap, thread_waiter

__all__ = ["ProcessGroupComm"]

_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG}


def _all_gather_tensor(*args: Any, **kwargs: Any) -> Any:
    """``dist.all_gather_single`` (torch 2.13 renamed it and warns on the old name), or
    ``dist.all_gather_into_tensor`` where torch has no new name; looked up at each call, as
    a caller that replaces torch's functions (a test that forbids communication) expects."""
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(
        *args, **kwargs
    )


def _reduce_scatter_tensor(*args: Any, **kwargs: Any) -> Any:
    """``dist.reduce_scatter_single``, or ``dist.reduce_scatter_tensor`` (see above)."""
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(
        *args, **kwargs
    )


# Collectives remembered per communicator (what each rank ran as collective #n, for the
# mismatch check; and the ones posted but not yet waited for, for resync).
_RING = 4096
# Every communicator of this process, by process group (resync updates the ones no group
# owns too, e.g. the functional step's norm communicator: scoped.resync).
LIVE: weakref.WeakSet[ProcessGroupComm] = weakref.WeakSet()


class _ThenWork:
    """Wait for ``works`` (bounded, abort-aware, through ``comm``), then run ``then`` once
    (e.g. the local sum of a point-to-point reduce-scatter). ``seq``: the collective's number
    in the communicator's epoch (names it in errors; its position in the mismatch check)."""

    __slots__ = ("_comm", "_seq", "_then", "_works")

    def __init__(
        self,
        works: list,
        then: Callable[[], None] | None = None,
        *,
        comm: ProcessGroupComm,
        seq: int,
    ) -> None:
        self._works = works
        self._then = then
        self._comm = comm
        self._seq = seq

    def wait(self) -> None:
        if self._works:
            # Cleared only once waited: a failed wait leaves them in flight (is_completed).
            self._comm.wait_works(self._works, seq=self._seq)
            self._works = []
        self._comm._pending.pop(self._seq, None)
        if self._then is not None:
            then, self._then = self._then, None
            then()

    def is_completed(self) -> bool:
        """Whether every message completed (no waiting; ``then`` may not have run yet)."""
        return all(w.is_completed() for w in self._works)


class ProcessGroupComm:
    """A :class:`~functional_fsdp.core.comm.Communicator` over a ``torch.distributed`` process group.

    Args:
        group: the process group (default: the world).
        strategy: ``"auto"`` (broadcast all-gather and all-to-all reduce-scatter on gloo, native
            elsewhere), ``"native"`` (always the native collectives) or ``"p2p"`` (the gloo
            replacements everywhere).
    """

    # Capability (core.comm.coalesces): several groups' collectives may run as one bucket.
    coalesces = True

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
        # Waits so far and the seconds they blocked (``wait_stats``: where a step's time goes
        # on gloo).
        self._waits = 0
        self._waited_s = 0.0
        # Schedule check: a tag also encodes which collective it belongs to (group key and
        # kind) and the epoch, so ranks that run different collectives never pair their
        # messages; they time out instead and every rank raises a named error.
        self.check_schedule = os.environ.get("FFSDP_SCHEDULE_CHECK", "1") != "0"
        self.timeout_s = float(os.environ.get("FFSDP_COLLECTIVE_TIMEOUT", "600"))
        # Mismatch check: a wait longer than this publishes the rank's position and compares
        # it with the peers' (a mismatch is found in seconds; a slow peer is waited for).
        self.grace_s = float(os.environ.get("FFSDP_MISMATCH_GRACE", "2"))
        self._epoch = 0
        self._retired: list[threading.Thread] = []  # waiter threads of abandoned waits
        self._abandoned: list[Any] = []  # works (and their buffers) a failed step left posted
        # Collective #n of this epoch: (n, key, kind, group name) at n % _RING.
        self._history: list[tuple[int, int, int, str | None] | None] = [None] * _RING
        # Point-to-point collectives posted and not yet waited for: seq -> (fp, messages).
        self._pending: dict[int, tuple[int, list]] = {}
        # The communicators of the same process group the model uses (a peer's position may
        # be on any of them); told at the root's lazy init (scoped.introduce).
        self._siblings: weakref.WeakValueDictionary[int, ProcessGroupComm] = (
            weakref.WeakValueDictionary()
        )
        # Ids that agree across ranks without any global registry: per-rank counters in the
        # process group's store (rank r's k-th id is k on every rank, as fully_shard runs in
        # the same order everywhere).
        self._store: Any = None
        self._pg_prefix = f"ffsdp/{getattr(self.group, 'group_name', 'pg')}/"
        self._uid = self._next_id("comms") if self._world_size > 1 else 0
        self._aborts_seen = self._aborts() if self._world_size > 1 else 0
        LIVE.add(self)
        if self._world_size > 1 and backend != "nccl":
            watchdog.start()  # what this rank does, for peers that wait for it

    @property
    def base(self) -> ProcessGroupComm:
        """The shared process-group communicator: itself (a scoped or custom view's ``base``
        is the one it runs on)."""
        return self

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

    def next_group_key(self) -> int:
        """The next parameter group's key on this process group (``fully_shard`` order: the
        same on every rank; 0 at world size 1, where no collective needs one)."""
        return self._next_id("group_keys") if self._world_size > 1 else 0

    def _next_id(self, what: str) -> int:
        return int(self._get_store().add(f"{self._pg_prefix}{what}/{dist.get_rank()}", 1))

    def _aborts(self) -> int:
        return int(self._get_store().add(f"{self._pg_prefix}aborts", 0))

    @property
    def collectives_issued(self) -> int:
        """Collectives this communicator numbered so far (the same on every rank)."""
        return self._calls

    @property
    def wait_stats(self) -> tuple[int, float]:
        """``(waits, seconds)``: host waits for this communicator's collectives so far and the
        seconds they blocked. On gloo a wait is where the peers' bytes are received (a
        point-to-point work reports itself complete only once waited for, so every wait goes
        to the waiter thread and counts): the transfer cost the compute did not hide. Zeros on
        NCCL, where a wait is a stream dependency."""
        return self._waits, self._waited_s

    def _begin(self, key: int, kind: int, name: str | None) -> int:
        """Number the next collective (every rank counts alike) and remember what it is."""
        seq = self._calls
        self._calls += 1
        self._history[seq % _RING] = (seq, key, kind, name)
        watchdog.activity.note_issued((self._describe_issued, seq))
        return seq

    def _describe_issued(self, seq: int) -> str:
        return self._what(seq, None)

    def _tags(self, seq: int, count: int, key: int = 0, kind: int = 0) -> int:
        """Base tag of collective ``seq``: ``epoch (2 bits) | fingerprint (9) | seq (8) | piece (12)``."""
        if count > 4096:
            raise ValueError(
                f"too many pieces in one collective ({count} > 4096); split the group with "
                "more fully_shard calls"
            )
        fp = (key * 8 + kind) % 509 if self.check_schedule else 0
        return ((((self._epoch % 4) << 9 | fp) << 8) | seq % 256) << 12

    def _remember(self, seq: int, key: int, kind: int, messages: list) -> None:
        """Note collective ``seq``'s posted messages until it is waited for (see :meth:`drain`)."""
        if messages:
            self._pending[seq] = (key * 16 + kind, messages)
            if len(self._pending) > _RING:  # dropped unwaited long ago: surely complete
                del self._pending[next(iter(self._pending))]

    # ------------------------------------------------------------------ bounded waits

    def _get_store(self) -> Any:
        if self._store is None:
            self._store = dist.distributed_c10d._get_default_store()
        return self._store

    def wait_works(self, works: list, what: str | None = None, *, seq: int | None = None) -> None:
        """Wait for ``works`` (collective ``seq`` of this epoch, or ``what``); raise a named
        error (never hang) when the peers diverged or abandoned them. Costs nothing when they
        are already complete; the store is read every 0.1 s of waiting (the peers' abort flag)
        and, past ``grace_s``, the ranks' positions are compared every 0.5 s.

        On NCCL a wait is a stream dependency, not a host wait: it runs here, on the caller's
        thread, so the caller's current stream (the engine's side stream) waits for the work
        (NCCL's own watchdog bounds it)."""
        if self.backend == "nccl":
            for w in works:
                w.wait()
            return
        self._waits += 1
        if all(w.is_completed() for w in works):
            for w in works:
                w.wait()
            return
        done, box = thread_waiter().submit(works)
        start = time.monotonic()
        deadline = start + self.timeout_s
        check_at = start + self.grace_s if seq is not None and self._world_size > 1 else math.inf
        peers_at = start + min(self.grace_s, watchdog.idle_grace_s())
        if self._world_size == 1:
            peers_at = math.inf
        published: str | None = None
        record: dict[str, Any] = {}
        watchdog.activity.begin_wait(lambda: self._what(seq, what), "fsdp")
        try:
            while not done.wait(0.1):
                aborted = self._peer_aborted()
                if aborted is not None:
                    self._abandon(works)
                    reason = self._mismatch_reason()
                    if reason is not None:
                        raise CollectiveMismatchError(reason)
                    raise PeerAbortedError(
                        f"rank {aborted} abandoned the current collectives while rank "
                        f"{self._rank} waited for {self._what(seq, what)}; call "
                        "reset_iter_state() on the root module on every rank to recover"
                    )
                now = time.monotonic()
                if now >= check_at:
                    assert seq is not None
                    if published is None:
                        published = self._position_key(self._rank)
                        record = {"at": self._position(seq).to_json(), "unposted": []}
                        self._get_store().set(published, json.dumps(record))
                    message = self._mismatch(published, record)
                    if message is not None:
                        self._abandon(works)
                        self._post_abort(message)
                        raise CollectiveMismatchError(message)
                    check_at = now + 0.5
                if now >= peers_at:
                    self._check_peers(works, now - start, seq, what)
                    peers_at = now + 0.5
                if now > deadline:
                    self._abandon(works)
                    self._post_abort()
                    raise self._timed_out(seq, what)
        finally:
            watchdog.activity.end_wait()
            self._waited_s += time.monotonic() - start
            if published is not None:
                self._get_store().set(published, "")  # no longer waiting there
        if box:
            self._tell_peers_failed()
            raise CollectiveError(
                f"{self._what(seq, what)} failed on rank {self._rank}: {box[0]}; a peer process "
                "probably died or closed the connection (see its log)"
            ) from box[0]

    def _timed_out(self, seq: int | None, what: str | None) -> CollectiveTimeoutError:
        return CollectiveTimeoutError(
            f"rank {self._rank} waited {self.timeout_s:g} s for {self._what(seq, what)} (epoch "
            f"{self._epoch}); the other ranks are running a different schedule of collectives (a "
            "submodule run on some ranks only, a different number of micro-batches, "
            "set_requires_gradient_sync on some ranks only, or an exception on another rank) or "
            "are stuck outside FSDP. Call reset_iter_state() on the root module on every rank to "
            "recover (FFSDP_COLLECTIVE_TIMEOUT sets the limit in seconds)"
        )

    def _tell_peers_failed(self, mismatch: str | None = None) -> None:
        """Post an abort for the peers' waits (:class:`PeerAbortedError` within 0.1 s): a
        peer still waiting for a message from this rank (a collective the dead peer is not in)
        would otherwise wait until this rank's sockets close, which, with the old group still
        referenced, is long after the survivors stopped waiting for it to report alive (it was
        then declared lost). The store may be gone with the peer that hosted it: nothing left
        to tell then."""
        with contextlib.suppress(Exception):
            self._post_abort(mismatch)

    def _check_peers(self, works: list, waited_s: float, seq: int | None, what: str | None) -> None:
        """Raise (telling the peers) when the watchdog's records show a peer that can never
        post what this rank waits for: it left, its program ended, or it waits in a wait of
        another kind (:func:`.watchdog.peer_trouble`)."""
        trouble = watchdog.peer_trouble(self._global_ranks, "fsdp", waited_s, self._what(seq, what))
        if trouble is not None:
            self._abandon(works)
            self._post_abort(str(trouble))
            raise trouble

    # ------------------------------------------------------------------ positions

    def _what(self, seq: int | None, what: str | None) -> str:
        if seq is None:
            return what or "a collective"
        return self._position(seq).describe()

    def _entry(self, seq: int) -> tuple[int, int, int, str | None] | None:
        """What this rank ran as collective ``seq`` of this epoch (``None``: not yet, or too
        long ago to remember)."""
        entry = self._history[seq % _RING] if 0 <= seq < self._calls else None
        return entry if entry is not None and entry[0] == seq else None

    def _position(self, seq: int) -> Position:
        """This rank's collective ``seq``, named by its group's module path (``introduce``)."""
        entry = self._entry(seq)
        if entry is None:
            return Position(self._rank, self._uid, self._epoch, seq, -1, "collective", "?")
        _, key, kind, name = entry
        nth = 0
        if seq < _RING:
            nth = sum(
                1 for e in self._history[: seq + 1] if e is not None and e[1:3] == (key, kind)
            )
        return Position(
            self._rank,
            self._uid,
            self._epoch,
            seq,
            key * 16 + kind,
            OPS.get(kind, f"collective of kind {kind}"),
            self._label(key, name),
            nth,
        )

    def _label(self, key: int, name: str | None) -> str:
        return name or f"#{key}"

    def meet(self, comms: list[ProcessGroupComm]) -> None:
        """Know the other communicators of this process group (``scoped.introduce``)."""
        for c in comms:
            if c._pg_prefix == self._pg_prefix:
                self._siblings[c._uid] = c

    def _sibling(self, uid: int) -> ProcessGroupComm | None:
        """This rank's communicator ``uid`` on the same process group (if the model uses it)."""
        return self if uid == self._uid else self._siblings.get(uid)

    def _position_key(self, rank: int) -> str:
        return f"{self._pg_prefix}position/{rank}"

    def _mismatch(self, published: str, record: dict[str, Any]) -> str | None:
        """Compare this rank's position with the waiting peers'; the message when they can
        never complete, ``None`` while every waiting peer agrees, none waits, or it is not
        yet known.

        A waiting rank posts nothing until its wait ends, so the ranks are stuck for good when
        a peer waits for a collective this rank posted differently (another group or kind),
        or when each waits for one the other has not posted. This rank's ``record`` (in the
        store under ``published``) lists the peers' positions it has not posted, for them to
        decide the latter. A slow peer (computing, or a long transfer) publishes nothing or a
        position this rank posted alike: it is waited for.
        """
        store = self._get_store()
        mine = Position.from_json(record["at"])
        unposted = [list(u) for u in record["unposted"]]
        for r in range(self._world_size):
            key = self._position_key(r)
            if r == self._rank or not store.check([key]):
                continue
            text = store.get(key).decode()
            if not text:
                continue
            peer = json.loads(text)
            theirs = Position.from_json(peer["at"])
            comm = self._sibling(theirs.uid)
            if comm is None or comm._epoch != theirs.epoch:
                continue  # cannot tell: wait
            if comm._entry(theirs.seq) is None:
                # Not posted here (and this rank posts nothing while it waits): stuck for good
                # if the peer has not posted this rank's collective either.
                ident = [r, theirs.uid, theirs.epoch, theirs.seq]
                mine_ident = [self._rank, mine.uid, mine.epoch, mine.seq]
                if mine_ident in peer["unposted"]:
                    return _mismatch_message(mine, theirs, None)
                if ident not in unposted:
                    unposted.append(ident)
                    record["unposted"] = unposted
                    store.set(published, json.dumps(record))
                continue
            same = comm is self and theirs.seq == mine.seq
            ours = mine if same else comm._position(theirs.seq)
            if ours.fp != theirs.fp:
                return _mismatch_message(mine, theirs, None if same else ours)
            # The same collective: it completes once the transfer does; keep waiting.
        return None

    def _mismatch_reason(self) -> str | None:
        key = f"{self._pg_prefix}mismatch/{self._aborts_seen}"
        store = self._get_store()
        return store.get(key).decode() if store.check([key]) else None

    def _peer_aborted(self) -> str | None:
        """Which rank gave up on the current collectives (``None``: nobody)."""
        if self._aborts() <= self._aborts_seen:
            return None
        last = self._get_store().get(f"{self._pg_prefix}last_abort")
        return last.decode()

    def _post_abort(self, mismatch: str | None = None) -> None:
        store = self._get_store()
        if mismatch is not None:  # the peers raise CollectiveMismatchError with this message
            store.set(f"{self._pg_prefix}mismatch/{self._aborts_seen}", mismatch)
        store.set(f"{self._pg_prefix}last_abort", str(dist.get_rank()))
        store.add(f"{self._pg_prefix}aborts", 1)

    def _abandon(self, works: list) -> None:
        # The posted buffers stay referenced: a late message must never land in freed memory.
        self._abandoned.append(works)
        retired = thread_waiter().abandon()
        if retired is not None:
            self._retired.append(retired)

    def drain(self) -> None:
        """``reset_iter_state`` on every rank, once every rank has stopped issuing collectives
        of this epoch: complete each point-to-point message the failed step left posted.

        A collective that one rank posted and its peer posted differently (or never) can never
        complete on its own: its receives would stay posted, their waiter threads blocked,
        until gloo's own timeout closes the connection (every later collective then fails) or
        the peer's exit wakes them during interpreter shutdown (the process aborts with
        ``terminate called without an active exception``). Each rank publishes its unwaited
        collectives; for each one a peer ran differently, the peer posts the counterpart
        messages (zeros into a scratch buffer), and waits for them.
        """
        if self._world_size == 1:
            return
        store = self._get_store()
        me = self._rank
        mine = [[seq, fp, messages] for seq, (fp, messages) in self._pending.items()]
        key = f"{self._pg_prefix}{self._uid}/unwaited/{self._epoch}/"
        store.set(f"{key}{me}", json.dumps(mine))
        self._barrier("drain")
        device = torch.device("cuda") if self.backend == "nccl" else torch.device("cpu")
        fixes = []
        for r in range(self._world_size):
            if r == me:
                continue
            for seq, fp, ops in json.loads(store.get(f"{key}{r}").decode()):
                ours = self._entry(seq)
                if ours is not None and ours[1] * 16 + ours[2] == fp:
                    continue  # this rank posted the same collective: they pair
                for is_send, peer, tag, nbytes in ops:
                    if peer == me:
                        scratch = torch.zeros(nbytes, dtype=torch.uint8, device=device)
                        post = dist.irecv if is_send else dist.isend
                        fixes.append(
                            dist.P2POp(post, scratch, self._global_ranks[r], self.group, tag)
                        )
        works = dist.batch_isend_irecv(fixes) if fixes else []
        self.wait_works(works, "the messages reset_iter_state completes for the failed step")
        self._pending.clear()
        self._abandoned.clear()
        self._retired = reap(self._retired, self.timeout_s)

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
        seq: int,
        key: int,
        kind: int,
    ) -> list:
        """Post collective ``seq``: ``sends[k]`` to and ``recvs[k]`` from group rank
        ``peers[k]`` (piece ``i`` on tag ``base + i``); the works."""
        count = max([len(x) for x in sends] + [len(x) for x in recvs] + [0])
        base = self._tags(seq, count, key, kind)
        # (is a send, group rank, tag, tensor) of each message, in posting order
        posts = []
        for r, out, into in zip(peers, sends, recvs):
            posts += [(True, r, base + i, t) for i, t in enumerate(out) if t.numel()]
            posts += [(False, r, base + i, o) for i, o in enumerate(into) if o.numel()]
        # What resync completes if a peer never posts the counterpart (sizes only: the
        # caller keeps the tensors).
        self._remember(
            seq, key, kind, [(s, r, tag, t.numel() * t.element_size()) for s, r, tag, t in posts]
        )
        if self.backend == "gloo":
            # The process group's own calls (group ranks): batch_isend_irecv's wrapping costs
            # about 10 us a message, and gloo has no batch to open (-4% per-group CPU at 2 ranks).
            pg = self.group
            assert pg is not None
            return [pg.send([t], r, tag) if s else pg.recv([t], r, tag) for s, r, tag, t in posts]
        ops = [
            dist.P2POp(dist.isend if s else dist.irecv, t, self._global_ranks[r], self.group, tag)
            for s, r, tag, t in posts
        ]
        return dist.batch_isend_irecv(ops) if ops else []

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        async_op: bool = False,
        key: int = 0,
        kind: int = 0,
        name: str | None = None,
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
        seq = self._begin(key, kind, name)
        works = self._post(
            peers, [[ins[r]] for r in peers], [[outs[r]] for r in peers], seq, key, kind
        )
        outs[me].copy_(ins[me])
        work = _ThenWork(works, comm=self, seq=seq)
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
        name: str | None = None,
    ) -> Work:
        """``outputs[r][i]`` receives rank ``r``'s ``inputs[i]`` (this rank's: a local copy,
        none when ``outputs[rank]`` is empty)."""
        me, ws = self._rank, self._world_size
        if ws == 1:
            for o, t in zip(outputs[me], inputs):
                o.copy_(t)
            return DoneWork()
        seq = self._begin(key, kind, name)
        peers = [r for r in range(ws) if r != me]
        works = self._post(
            peers, [inputs] * len(peers), [outputs[r] for r in peers], seq, key, kind
        )
        # The local copy runs while the peers' pieces are on the wire.
        for o, t in zip(outputs[me], inputs):
            o.copy_(t)
        work = _ThenWork(works, comm=self, seq=seq)
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
        name: str | None = None,
    ) -> Work:
        """``outputs[i]`` receives the reduction over ranks of their ``inputs[rank][i]``.

        Sums run in rank order (two ranks: ``a + b``, which is commutative bit for bit).
        """
        me, ws = self._rank, self._world_size
        own = inputs[me]
        seq = self._begin(key, kind, name)
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
        works = self._post(peers, [inputs[r] for r in peers], slots, seq, key, kind)

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

        work = _ThenWork(works, then, comm=self, seq=seq)
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
        name: str | None = None,
    ) -> Work:
        """Rank-major all-gather of 1-D ``input`` into ``output``."""
        if self._world_size == 1:
            output.copy_(input)
            return DoneWork()
        if not self._p2p:
            w = _all_gather_tensor(output, input, group=self.group, async_op=async_op)
            return _done(w, async_op)
        # Point to point, one piece per rank (same bytes as gloo's broadcasts, and the tags
        # carry the schedule check).
        chunks = output.chunk(self._world_size)
        return self.all_gather_pieces(
            [[c] for c in chunks], [input], async_op=async_op, key=key, kind=kind, name=name
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
        name: str | None = None,
    ) -> Work:
        """Reduce 1-D ``input`` (``ws * n``) over ranks; this rank keeps chunk ``rank``."""
        ws = self._world_size
        if ws == 1:
            output.copy_(input)
            return DoneWork()
        if not self._p2p and not (self._sum_only and op == "avg"):
            w = _reduce_scatter_tensor(
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
                outs, ins, op=op, async_op=async_op, key=key, kind=kind, name=name
            )
        seq = self._begin(key, kind, name)
        received = input.clone()
        works = [dist.all_reduce(received, group=self.group, async_op=True)]

        def then() -> None:
            output.copy_(received.view(ws, -1)[self._rank])
            if op == "avg":
                output.div_(ws)

        work = _ThenWork(works, then, comm=self, seq=seq)
        if not async_op:
            work.wait()
        return work

    def all_reduce(
        self,
        tensor: torch.Tensor,
        *,
        op: str = "sum",
        async_op: bool = False,
        key: int = 0,
        name: str | None = None,
    ) -> Work:
        """In-place all-reduce; ``avg`` is a sum and a division on gloo. (gloo's native
        collective: its waits are bounded and abort-aware, its messages carry no key.)"""
        if self._world_size == 1:
            return DoneWork()
        seq = self._begin(key, ALL_REDUCE, name)
        then = None
        if op == "avg" and self._sum_only:
            w = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

            def then() -> None:
                tensor.div_(self._world_size)

        else:
            w = dist.all_reduce(tensor, op=_OPS[op], group=self.group, async_op=True)
        work = _ThenWork([w], then, comm=self, seq=seq)
        if not async_op:
            work.wait()
        return work


def abort_posted() -> str | None:
    """What a peer posted when it gave up on the current collectives of any live
    communicator (its mismatch message, or who gave up), else ``None``: for waits that no
    communicator numbers (:func:`.watchdog.watched_wait`)."""
    for comm in list(LIVE):
        if comm._world_size > 1:
            aborted = comm._peer_aborted()
            if aborted is not None:
                return comm._mismatch_reason() or f"rank {aborted} abandoned the collectives"
    return None


def post_abort_everywhere(message: str | None = None) -> None:
    """Tell the peers of every live communicator that this rank gave up; their waits raise
    within 0.1 s: :class:`CollectiveMismatchError` with ``message`` when one is given (why the
    ranks diverged), else :class:`PeerAbortedError` naming this rank."""
    for comm in list(LIVE):
        if comm._world_size > 1:
            comm._tell_peers_failed(message)


def _done(work: object, async_op: bool) -> Work:
    return work if (async_op and work is not None) else DoneWork()  # type: ignore[return-value]


def _mismatch_message(mine: Position, theirs: Position, ours: Position | None) -> str:
    """Both positions by rank; ``ours``: what this rank ran as the peer's collective."""
    first, second = sorted([mine, theirs], key=lambda p: p.rank)
    text = (
        f"the ranks wait for different collectives: rank {first.rank} waits for "
        f"{first.describe()}, rank {second.rank} for {second.describe()}"
    )
    if ours is not None:
        text += f"; rank {mine.rank} ran that collective #{theirs.seq} as {ours.describe()}"
    else:
        text += "; neither has run the other's"
    return (
        f"{text}. Typical causes: a different number of micro-batches, "
        "set_requires_gradient_sync or summon_full_params on some ranks only, a submodule run "
        "on some ranks only, or a sharded module whose output gets a gradient on some ranks "
        "only (its whole group reduces there only: route inside a group instead, e.g. all "
        "experts in one module). Call reset_iter_state() on the root module on every rank to "
        "recover"
    )
