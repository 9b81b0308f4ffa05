"""The engine's stream program: which stream runs each copy-in, collective, copy-out, reduction
and free, and the events that order them (FSDP2's layout, on a
:class:`~functional_fsdp.shell.device.runtime.DeviceRuntime`).

All-gather (a group's :class:`~.gather.GatherSlot`)::

    compute -wait_stream-> copy_in:    [offload: host-to-device copy of the shards]
                                       copy-in (encode: pack, cast, or the codecs)
    copy_in -wait_stream-> all_gather: the all-gather (into the unsharded buffer, or an output)
    all_gather: work.wait(); event "gathered"
    compute -wait_event(gathered)-> copy-out and decode (compute), then the forward/backward
    the copy-in's buffer is freed after "gathered", the all-gather output after the copy-out

Reduction (:meth:`~.group.ParamGroup.begin_reduce` / ``finish_reduce``)::

    compute:        the gradients (backward), the copy-in (pack, cast, pre-divide)
    compute -wait_stream-> reduce_scatter: the reduce-scatter (or the reproducible all-to-all)
    reduce_scatter: work.wait(); event "reduced" (the packed input is freed after it)
    reduce_scatter -wait_stream-> all_reduce (HSDP): the replicas' all-reduce
    post-reduce stream (all_reduce under HSDP, else reduce_scatter): post-divide, split, cast,
        accumulate into ``.grad``; compute waits for its event before anything reads ``.grad``

Frees go through ``runtime.free_after(tensor, events)``: the unsharded buffer after an event on
compute (its last reader), temporaries after the event of the stream that used them last (no
``Tensor.record_stream``, as FSDP2 after pytorch#147168). On the CPU every call is a no-op (the
buffers are freed at once); the stream-ordering simulator checks every ordering here against the
buffers each operation reads and writes, which the engine reports only to a runtime with
``checks`` set. Each ordering step is a function of its own, so a test can plant a bug in it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from ...core import transitions as T
from ...core.coalesce import Landed, begin_unshard_coalesced, issue_reduce_coalesced
from ...core.coalesce import finish_reductions as finish_landed
from ...core.codec import GatherCodec
from ...core.comm import Communicator
from ...core.records import PostForwardState, ShardedState
from ...core.reproducible import PendingTreeReduce
from ..device.runtime import DeviceRuntime, Event, Stream

__all__ = [
    "BucketWait",
    "consumers_done",
    "copy_out_stream",
    "finish_reduce",
    "finish_reductions",
    "free_buffers",
    "gather_done",
    "host_may_write_shards",
    "issue_gather",
    "issue_gather_coalesced",
    "issue_reduce_coalesced_after_compute",
    "issue_reduce",
    "issue_tree_reduce",
    "land_gather",
    "optimizer_stepped",
    "reduce_after_compute",
    "reduce_copy_in",
    "retire_gather",
    "wait_for_gather",
]

Reduction = T.PendingReduce | PendingTreeReduce


# ------------------------------------------------------------------------------ all-gather


def issue_gather(
    rt: DeviceRuntime,
    source: ShardedState | PostForwardState,
    comm: Communicator,
    *,
    codecs: Sequence[GatherCodec | None] | None,
    into: torch.Tensor | None,
    stage_to: torch.device | None = None,
) -> tuple[T.PendingUnshard, torch.Tensor | None]:
    """The copy-in on the copy-in stream, then the all-gather (async) on the all-gather stream.

    ``stage_to``: the device an offloaded group's shards are copied to first (on the copy-in
    stream, ``non_blocking`` from pinned memory). Returns the gather in flight and that staged
    copy (``None`` when nothing was staged), which :func:`land_gather` frees.
    """
    ci, ag = rt.side_stream("copy_in"), rt.side_stream("all_gather")
    # The shards were written on compute (the optimizer); the buffer was freed there.
    rt.wait_stream(ci, rt.compute)
    staged = None
    with rt.use(ci):
        if stage_to is not None and isinstance(source, ShardedState):
            source, staged = _stage(rt, ci, source, stage_to)
        enc = T.encode_unshard(source, comm, codecs=codecs)
        if enc.fresh:  # made on the copy-in stream (freed after the all-gather)
            rt.allocated(ci, enc.tensor)
        if rt.checks:
            own = source.flat if isinstance(source, ShardedState) else source.rows
            made = [enc.tensor] if enc.fresh else []
            rt.access(ci, "all-gather copy-in", reads=[own], writes=made)
    rt.wait_stream(ag, ci)
    with rt.use(ag):
        pending = T.begin_unshard(
            source, comm, codecs=codecs, into=into, encoded=enc, alloc=rt.empty
        )
        if rt.checks:
            out = pending.output if pending.output is not None else pending.into
            assert out is not None
            rt.access(ag, "all-gather", reads=[enc.tensor], writes=[out], in_flight=True)
    return pending, staged


def issue_gather_coalesced(
    rt: DeviceRuntime,
    sources: Sequence[ShardedState],
    comm: Communicator,
    intos: Callable[[], Sequence[torch.Tensor]],
    *,
    guard: Callable[[tuple[torch.Tensor, ...]], Any] | None = None,
) -> tuple[list[T.PendingUnshard], BucketWait | None]:
    """A bucket's one all-gather (:func:`~functional_fsdp.core.coalesce.begin_unshard_coalesced`):
    the copy-in (the members' shards side by side) and the collective on the all-gather
    stream, after compute (which wrote the shards and freed the buffers). ``intos`` allocates
    the members' buffers (on compute) when the core copies the bucket out at once: then the
    bucket's output is copied out into every member's buffer when the first member's landing
    waits for it, on the all-gather stream, before the event compute waits for. Otherwise
    (the members land one by one, :func:`~functional_fsdp.core.coalesce.lands_by_member`)
    each member's landing lays its rows out on compute (:func:`land_gather`), and the rows
    are freed after compute's reads once every member is done; the members' handles then
    come with the bucket's shared wait (:class:`BucketWait`), else ``None``."""
    ci, ag = rt.side_stream("copy_in"), rt.side_stream("all_gather")
    rt.wait_stream(ci, rt.compute)
    rt.wait_stream(ag, ci)
    made: list[torch.Tensor] = []
    bucket = BucketWait(())

    def buffers() -> Sequence[torch.Tensor]:
        with rt.use(rt.compute):  # allocated on compute, as a one-group gather's buffer
            made.extend(intos())
        rt.wait_stream(ag, rt.compute)  # the collective writes after the allocation
        return made

    def free(t: torch.Tensor) -> None:
        # The rows: after compute's reads of the landed members, and after the bucket's wait
        # (every member may have been dropped unlanded: compute then never waited for it).
        events = [] if made else consumers_done(rt)
        if bucket.gathered is not None:
            events.append(bucket.gathered)
        else:
            # Nobody waited for the collective: every member was abandoned by a failed step,
            # and the rows are given up once its work reported itself complete
            # (engine/abandoned.py). Its accesses are over: free after them, on its stream.
            if rt.checks:
                rt.complete(ag, [t])
            events.append(rt.record(ag))
        rt.free_after(t, events)

    with rt.use(ag):
        pendings = begin_unshard_coalesced(
            sources, comm, buffers, guard=guard, alloc=rt.empty, free=free
        )
        share = pendings[0].share
        if rt.checks:
            rt.access(
                ag,
                "all-gather (coalesced)",
                reads=[s.flat for s in sources],
                writes=list(made) if share is None else [share.rows],
                in_flight=True,
            )
    if share is None:
        return pendings, None
    if rt.checks:
        bucket.buffers = [share.rows, *(s.flat for s in sources)]
    return pendings, bucket


def _stage(
    rt: DeviceRuntime, stream: Stream, source: ShardedState, device: torch.device
) -> tuple[ShardedState, torch.Tensor | None]:
    """An offloaded group's shards copied to ``device`` (``non_blocking``: from pinned memory
    the copy overlaps). Nothing to copy when they are there already, except under a checking
    runtime, which stages a copy anyway so the copy's ordering is checked on the CPU too."""
    flat = source.flat
    if flat.device == device and not rt.checks:
        return source, None
    moved = flat.to(device, non_blocking=True, copy=True)
    rt.allocated(stream, moved)
    if rt.checks:
        rt.access(stream, "offload copy (host to device)", reads=[flat], writes=[moved])
    return attrs.evolve(source, flat=moved), moved


class BucketWait:
    """A *handle*: the shell's side of one bucket's all-gather whose members land one by one
    (:func:`~functional_fsdp.core.coalesce.lands_by_member`). The collective is one, so it is
    waited for once, on the all-gather stream, by the first member to land; every member's
    landing then waits for that one event (:func:`gather_done`).

    Attributes:
        buffers: what the collective reads and writes (the received rows, every member's
            shards), told to a checking runtime at the wait; empty on the CPU runtime.
        gathered: the event after the wait, ``None`` until a member has waited.
    """

    __slots__ = ("buffers", "gathered")

    def __init__(self, buffers: Sequence[torch.Tensor]) -> None:
        self.buffers = list(buffers)
        self.gathered: Event | None = None


def gather_done(
    rt: DeviceRuntime, pending: T.PendingUnshard, bucket: BucketWait | None = None
) -> Event:
    """Wait for the all-gather on its stream (a stream dependency on CUDA; the host waits on
    gloo); the event after it. A member of ``bucket`` whose collective was waited for already
    takes that wait's event."""
    if bucket is not None and bucket.gathered is not None:
        return bucket.gathered
    ag = rt.side_stream("all_gather")
    with rt.use(ag):
        pending.work.wait()
    if rt.checks:
        rt.complete(ag, bucket.buffers if bucket is not None else _gather_buffers(pending))
    gathered = rt.record(ag)
    if bucket is not None:
        bucket.gathered = gathered
    return gathered


def _gather_buffers(pending: T.PendingUnshard) -> list[torch.Tensor | None]:
    """Every buffer an all-gather in flight may read or write (its accesses complete at its
    wait: :meth:`~functional_fsdp.shell.device.runtime.DeviceRuntime.complete`)."""
    source = pending.source
    return [
        pending.input,
        pending.output,
        pending.into,
        pending.share.rows if pending.share is not None else None,
        source.flat if source is not None else None,
    ]


def wait_for_gather(rt: DeviceRuntime, gathered: Event) -> None:
    """Compute waits for the all-gather before it reads the output (copy-out, forward)."""
    rt.wait_event(rt.compute, gathered)


def copy_out_stream(rt: DeviceRuntime) -> Stream:
    """The stream the copy-out and decode run on: compute, whose forward reads the result."""
    return rt.compute


def land_gather(
    rt: DeviceRuntime,
    pending: T.PendingUnshard,
    staged: torch.Tensor | None,
    *,
    into: torch.Tensor,
    out: tuple[torch.Tensor, ...] | None,
    keep_output: bool,
    bucket: BucketWait | None = None,
) -> T.Landed:
    """Wait for the all-gather, copy out and decode on compute
    (:func:`~functional_fsdp.core.transitions.land_unshard`), then free the copy-in's buffers
    after the all-gather and the output after the copy-out (unless ``keep_output``).
    ``bucket``: the shared wait of the bucket ``pending`` is a member of."""
    gathered = gather_done(rt, pending, bucket)
    wait_for_gather(rt, gathered)
    s = copy_out_stream(rt)
    with rt.use(s):
        if rt.checks and pending.share is not None:
            # (before the landing: the last member's frees the bucket's rows)
            reads = [pending.share.rows] + ([pending.source.flat] if pending.source else [])
            rt.access(s, "all-gather copy-out (bucket member)", reads=reads, writes=[into])
        landed = T.land_unshard(pending, into=into, out=out)
        if rt.checks and pending.share is None:
            _annotate_landing(rt, s, pending, into, landed)
    copied = rt.record(s)
    _free_temporaries(rt, pending, staged, gathered)
    if pending.output is not None and not keep_output:
        rt.free_after(pending.output, [copied])
    return landed


def _annotate_landing(
    rt: DeviceRuntime, s: Stream, pending: T.PendingUnshard, into: torch.Tensor, landed: T.Landed
) -> None:
    if pending.output is None and pending.metadata is None:
        # The pieces landed in place: nothing is copied, the views are made.
        rt.access(s, "all-gather landing (views)", reads=[into])
        return
    src = pending.output if pending.output is not None else into
    rt.access(s, "all-gather copy-out", reads=[src], writes=[into, *landed.inner])


def retire_gather(
    rt: DeviceRuntime,
    pending: T.PendingUnshard,
    staged: torch.Tensor | None,
    bucket: BucketWait | None = None,
) -> Event:
    """Wait for a gather nobody lands (dropped, or freed while in flight; every rank issued
    it); free its buffers after it; the event after it. ``bucket``: the shared wait of the
    bucket ``pending`` is a member of (the rows are freed after it).

    Compute waits for it too: the gather read the shards, which compute writes next (the
    optimizer step after a forward that skipped a prefetched group; the stream simulator
    found the step's write racing the all-gather's read)."""
    gathered = gather_done(rt, pending, bucket)
    wait_for_gather(rt, gathered)
    _free_temporaries(rt, pending, staged, gathered)
    if pending.output is not None:
        rt.free_after(pending.output, [gathered])
    if pending.share is not None:
        pending.share.drop()
    return gathered


def _free_temporaries(
    rt: DeviceRuntime, pending: T.PendingUnshard, staged: torch.Tensor | None, gathered: Event
) -> None:
    for t in (pending.input, staged):
        if t is not None:
            rt.free_after(t, [gathered])


def consumers_done(rt: DeviceRuntime) -> list[Event]:
    """The events after the last readers of an unsharded buffer: compute's (the forward or
    backward that read it; it waited for the all-gather that wrote it)."""
    return [rt.record(rt.compute)]


def host_may_write_shards(rt: DeviceRuntime) -> None:
    """The host is about to run a CPU optimizer step over an offloaded group: it writes the
    shards in host memory, so the host-to-device copies that read them (copy-in stream) must be
    done, and it reads ``.grad``, which the post-reduce stream wrote (compute waited for it)."""
    rt.host_wait(rt.record(rt.side_stream("copy_in")))
    rt.host_wait(rt.record(rt.compute))


def optimizer_stepped(
    rt: DeviceRuntime,
    grads: Sequence[torch.Tensor],
    shards: Sequence[torch.Tensor],
    *,
    on_host: bool,
) -> None:
    """An optimizer step read ``grads`` and wrote ``shards``: on compute, or on the host (a
    CPU step over offloaded shards). Reported to a checking runtime only
    (:mod:`.optimizer_access`)."""
    stream = rt.host_stream if on_host else rt.compute
    rt.access(stream, "the optimizer step", reads=grads, writes=shards)


def free_buffers(rt: DeviceRuntime, tensors: Sequence[torch.Tensor], events: list[Event]) -> None:
    """Free the storage of ``tensors`` (those still allocated) after ``events``."""
    for t in tensors:
        if t.untyped_storage().size() != 0:
            rt.free_after(t, events)


# ------------------------------------------------------------------------------ reduction


def reduce_after_compute(rt: DeviceRuntime) -> None:
    """The reduce-scatter stream waits for everything compute issued (the gradients and the
    copy-in that packed them)."""
    rt.wait_stream(rt.side_stream("reduce_scatter"), rt.compute)


def issue_reduce(
    rt: DeviceRuntime,
    grads: Sequence[torch.Tensor | None],
    sharded: ShardedState,
    comm: Communicator,
    *,
    replicate_comm: Communicator | None,
    policy: T.ReducePolicy,
    reduce_state: T.ReduceState,
    async_op: bool,
    alloc: Callable[[int, torch.dtype, torch.device], torch.Tensor],
) -> T.PendingReduce:
    """The copy-in on compute (:func:`reduce_copy_in`), then the reduce-scatter on its
    stream, as ``policy`` says, from ``reduce_state``."""
    rin = reduce_copy_in(
        rt,
        grads,
        sharded,
        comm,
        replicate_comm=replicate_comm,
        policy=policy,
        reduce_state=reduce_state,
    )
    present = [g for g in grads if g is not None] if rt.checks else []
    rs = rt.side_stream("reduce_scatter")
    reduce_after_compute(rt)
    with rt.use(rs):
        pending = T.issue_reduce(rin, comm, async_op=async_op, alloc=alloc)
        if rt.checks:
            sent = [rin.packed] if rin.packed is not None else present
            rt.access(
                rs,
                "reduce-scatter",
                reads=sent,
                writes=[pending.output],
                in_flight=rin.packed is not None,
            )
    return pending


def reduce_copy_in(
    rt: DeviceRuntime,
    grads: Sequence[torch.Tensor | None],
    sharded: ShardedState,
    comm: Communicator,
    *,
    replicate_comm: Communicator | None,
    policy: T.ReducePolicy,
    reduce_state: T.ReduceState,
    out: torch.Tensor | None = None,
) -> T.ReduceInput:
    """A reduction's copy-in on compute, where backward made the gradients
    (:func:`~functional_fsdp.core.transitions.reduce_input`: pack, cast, pre-divide; into
    ``out`` when given, a bucket's columns)."""
    c = rt.compute
    present = [g for g in grads if g is not None] if rt.checks else []
    if rt.checks:  # backward made the gradients on compute
        rt.access(c, "backward (the gradients)", writes=present)
    with rt.use(c):
        rin = T.reduce_input(
            grads,
            sharded,
            comm,
            replicate_comm=replicate_comm,
            policy=policy,
            reduce_state=reduce_state,
            out=out,
            alloc=rt.empty,
        )
        if rt.checks:
            packed = [rin.packed] if rin.packed is not None else []
            rt.access(c, "reduce-scatter copy-in", reads=present, writes=packed)
    return rin


def issue_reduce_coalesced_after_compute(
    rt: DeviceRuntime,
    rins: Sequence[T.ReduceInput],
    comm: Communicator,
    *,
    alloc: Callable[[int, torch.dtype, torch.device], torch.Tensor],
) -> list[T.PendingReduce]:
    """A bucket's one reduce-scatter (the members' copy-ins already made on compute, as
    :func:`issue_reduce` makes one) on the reduce-scatter stream, after compute."""
    reduce_after_compute(rt)
    rs = rt.side_stream("reduce_scatter")
    with rt.use(rs):
        pendings = issue_reduce_coalesced(rins, comm, alloc=alloc)
        if rt.checks:
            sent = [r.packed for r in rins if r.packed is not None]
            outs = [p.output for p in pendings]
            rt.access(rs, "reduce-scatter (coalesced)", reads=sent, writes=outs, in_flight=True)
    return pendings


def issue_tree_reduce(
    rt: DeviceRuntime, subtree: torch.Tensor, begin: Callable[[], PendingTreeReduce]
) -> PendingTreeReduce:
    """The reproducible reduction's all-to-all of ``subtree`` (summed on compute) on the
    reduce-scatter stream; ``begin`` issues it."""
    if rt.checks:
        rt.access(rt.compute, "the canonical tree's sum", writes=[subtree])
    reduce_after_compute(rt)
    rs = rt.side_stream("reduce_scatter")
    with rt.use(rs):
        pending = begin()
        if rt.checks:
            rt.access(
                rs,
                "reproducible all-to-all",
                reads=[subtree],
                writes=[pending.pieces],
                in_flight=True,
            )
    return pending


def finish_reduce(rt: DeviceRuntime, pending: Reduction) -> tuple[ShardedState, T.ReduceState]:
    """One reduction's :func:`finish_reductions`, landing nowhere: the core's new record and
    the reduction's state for the next one (none for the reproducible tree)."""
    new, state, _ = finish_reductions(rt, [pending])[0]
    return new, state


def finish_reductions(
    rt: DeviceRuntime,
    pendings: Sequence[Reduction],
    currents: Sequence[Sequence[torch.Tensor | None]] | None = None,
    land: Callable[[int, tuple[torch.Tensor | None, ...]], Sequence[torch.Tensor]] | None = None,
) -> list[Landed]:
    """Reductions that land together (a bucket's members share one collective; or one
    group's): wait for their collective on its stream (once), free their packed input after
    it, and finish them on the post-reduce stream (HSDP all-reduce, post-divide, split, cast,
    and the addition into ``currents[i]``, each group's local ``.grad`` tensors, donated: one
    core call, :func:`~functional_fsdp.core.coalesce.finish_reductions`), where
    ``land(i, grads)`` puts reduction ``i``'s new local gradients where they go (returning the
    tensors it wrote in place); compute waits for all of it. Returns the core's answers."""
    rs = rt.side_stream("reduce_scatter")
    with rt.use(rs):
        for pending in {id(p.work): p for p in pendings}.values():  # a bucket's: one
            pending.work.wait()
    if rt.checks:
        for p in pendings:
            rt.complete(rs, [p.input, _reduced(p)])
    reduced = rt.record(rs)
    for t in {id(p.input): p.input for p in pendings if p.input is not None}.values():
        rt.free_after(t, [reduced])
    post = rs
    if any(p.replicate_comm is not None for p in pendings):
        post = rt.side_stream("all_reduce")
        rt.wait_stream(post, rs)
    with rt.use(post):
        landed = finish_landed(pendings, currents, donate=True)
        for i, (new, _, grads) in enumerate(landed):
            wrote = land(i, grads) if land is not None and grads is not None else ()
            if rt.checks:
                _annotate_post_reduce(rt, post, pendings[i], new, wrote)
    rt.wait_event(rt.compute, rt.record(post))
    return landed


def _reduced(pending: Reduction) -> torch.Tensor:
    """Where a reduction's collective writes (the tree's all-to-all: its pieces)."""
    return pending.pieces if isinstance(pending, PendingTreeReduce) else pending.output


def _annotate_post_reduce(
    rt: DeviceRuntime,
    post: Stream,
    pending: Reduction,
    new: ShardedState,
    wrote: Sequence[torch.Tensor],
) -> None:
    out = _reduced(pending)
    partial = None if isinstance(pending, PendingTreeReduce) else pending.reduce_state.partial
    reads = [out] if partial is None else [out, partial]
    made = [g for g in new.grads or () if g is not None]
    rt.access(post, "post-reduce (split, cast, .grad)", reads=reads, writes=[*made, *wrote])
