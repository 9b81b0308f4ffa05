"""The CUDA runtime: real ``torch.cuda`` streams and events (FSDP2's stream layout).

Side streams by role (:data:`~.runtime.ROLES`): the all-gather copy-in and the all-gather get
their own high-priority streams so the next group's gather overlaps this group's compute, the
reduce-scatter and the HSDP all-reduce theirs so gradient reduction overlaps the rest of
backward.

**Frees in stream order.** A buffer used on more than one stream is freed
(:meth:`CudaRuntime.free_after`) without ``Tensor.record_stream`` (pytorch#147168) and without
the host waiting for the GPU. The runtime keeps vector clocks of its streams
(:mod:`.clocks`: each ``record`` ticks, each ``wait_event`` / ``wait_stream`` merges), and
remembers on which stream it allocated each buffer. The caching allocator hands a freed block
only to later allocations on that same stream, and those run after everything that stream has
waited for. So once the allocating stream has seen the events of the buffer's last users, the
buffer is freed at once; until then it is kept, and freed when a later wait makes it so (the
next reduction's wait for the previous one frees the previous packed input; the next gather's
wait for compute frees the last all-gather output), or when the host finds its events complete
(``query()``, polled at later calls: the fallback for a buffer whose stream is not known).
Before this, every free waited for the host to see its events complete: with the host running
ahead of the GPU, buffers stayed allocated until the GPU caught up (the unsharded parameters of
every group of a backward, at worst), above FSDP2's peak memory.

Checked only where a GPU exists (tests marked ``gpu``), and on the CPU with a stand-in for
``torch.cuda`` (``backend``) whose events never complete, so that only the clocks free; the
ordering logic is the one the stream simulator checks on the CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .clocks import VectorClocks
from .pool import spanned_bytes
from .runtime import ROLES, Event, Stream

__all__ = ["CudaRuntime", "TorchCuda"]

#: The attribute of a storage (Python keeps one object per storage, views included) that names
#: the stream (its clock) the runtime allocated it on.
_ALLOCATED_ON = "_ffsdp_allocated_on"


class TorchCuda:
    """What the runtime uses of ``torch.cuda`` for one device, with the per-call costs cut.

    ``torch.cuda.current_stream`` resolves its device argument in Python (about 20 us a call
    on an H200 host; the runtime asks at every call to know the compute stream), and the
    ``torch.cuda.stream`` context asks it twice more. Here the current stream is compared by
    its raw handle (``torch._C._cuda_getCurrentRawStream``, one C call) and a stream is entered
    and left with ``torch.cuda.set_stream`` (the caller knows the stream to go back to). That
    also makes the stream's device current, as FSDP2 expects it to be already
    (``torch.cuda.set_device`` before the mesh; DeviceMesh warns otherwise).
    """

    def __init__(self, device: torch.device) -> None:
        self.index = device.index if device.index is not None else torch.cuda.current_device()

    def raw_current(self) -> int:
        """The current stream's raw handle (cheap; for comparing)."""
        return int(torch._C._cuda_getCurrentRawStream(self.index))

    def current_stream(self) -> Any:
        """``torch.cuda.current_stream`` of the device."""
        return torch.cuda.current_stream(self.index)

    def new_stream(self, priority: int) -> Any:
        """A new ``torch.cuda.Stream`` of the device."""
        return torch.cuda.Stream(device=self.index, priority=priority)

    def event(self) -> Any:
        """A new ``torch.cuda.Event``."""
        return torch.cuda.Event()

    def set_stream(self, native: Any) -> None:
        """Make ``native`` the current stream."""
        torch.cuda.set_stream(native)


class CudaRuntime:
    """Streams and events of one CUDA device.

    Args:
        device: the CUDA device.
        backend: what provides streams and events (default :class:`TorchCuda`; the tests
            give a stand-in with the same methods).
    """

    name = "cuda"
    checks = False

    def __init__(self, device: torch.device, backend: Any = None) -> None:
        self.device = device
        self._cuda = TorchCuda(device) if backend is None else backend
        self._clocks = VectorClocks()
        self._host = self._clocks.add()
        self._compute_raw = self._cuda.raw_current()
        native = self._cuda.current_stream()
        self._compute = Stream("compute", self._clocks.add(), native)
        # Each stream met as the current one keeps its clock (by raw handle): a loop that makes
        # a new torch.cuda.Stream() current each step draws from torch's fixed stream pool, so
        # the clocks stay few.
        self._known = {self._compute_raw: self._compute}
        # Made on first use: fully_shard builds a runtime per group, the root's lazy init
        # then gives every group of the model the root's (one set of streams per model).
        self._side: dict[str, Stream] = {}
        self._current: list[Stream] = []  # the streams use() entered, innermost last
        # Storage (by its StorageImpl) -> (a tensor on it, the events to wait for, the clock of
        # the stream it was allocated on or None).
        self._deferred: dict[int, tuple[torch.Tensor, list[Event], int | None]] = {}
        #: How the frees happened: at once, later by the clocks, later by the host polling.
        self.frees = {"at_once": 0, "by_clock": 0, "by_query": 0}

    @property
    def compute(self) -> Stream:
        """The current stream (forward and backward run on it), as FSDP2 takes it per call;
        inside :meth:`use` the stream current before it."""
        if not self._current:
            raw = self._cuda.raw_current()
            if raw != self._compute_raw:  # another stream (new: a clock that has seen nothing)
                s = self._known.get(raw)
                if s is None:
                    native = self._cuda.current_stream()
                    s = self._known[raw] = Stream("compute", self._clocks.add(), native)
                self._compute_raw, self._compute = raw, s
        return self._compute

    def side_stream(self, role: str) -> Stream:
        """The side stream of ``role`` (high priority, as FSDP2's all-gather and
        reduce-scatter streams; FSDP2's HSDP all-reduce stream has the default priority)."""
        s = self._side.get(role)
        if s is None:
            assert role in ROLES, role
            priority = 0 if role == "all_reduce" else -1
            native = self._cuda.new_stream(priority)
            s = self._side[role] = Stream(role, self._clocks.add(), native)
        return s

    @contextlib.contextmanager
    def use(self, stream: Stream) -> Iterator[None]:
        """``torch.cuda.stream(stream)``: ``stream`` is current inside, the stream current
        before it (compute, or the enclosing ``use``'s) again after."""
        back = self._current[-1] if self._current else self.compute
        self._current.append(stream)
        if stream is not back:
            self._cuda.set_stream(stream.native)
        try:
            yield
        finally:
            self._current.pop()
            if stream is not back:
                self._cuda.set_stream(back.native)

    def wait_stream(self, waiter: Stream, producer: Stream) -> None:
        """``waiter.wait_stream(producer)``."""
        waiter.native.wait_stream(producer.native)
        self._clocks.tick(producer.index)  # (torch records an event on producer)
        self._clocks.merge(waiter.index, self._clocks.snapshot(producer.index))
        self._free_proven()

    def record(self, stream: Stream) -> Event:
        """A ``torch.cuda.Event`` recorded on ``stream``."""
        ev = self._cuda.event()
        ev.record(stream.native)
        self._clocks.tick(stream.index)
        return Event(stream, ev, self._clocks.snapshot(stream.index))

    def wait_event(self, stream: Stream, event: Event) -> None:
        """``stream.wait_event(event)``."""
        stream.native.wait_event(event.native)
        self._clocks.merge(stream.index, event.clock)
        self._free_proven()

    def wait_user_event(self, stream: Stream, event: Any) -> None:
        """``stream.wait_event(event)`` for the user's event (no clock: it proves no free)."""
        stream.native.wait_event(event)

    def host_wait(self, event: Event) -> None:
        """``event.synchronize()``."""
        event.native.synchronize()
        self._clocks.merge(self._host, event.clock)
        self._free_proven()

    def access(
        self,
        stream: Stream,
        what: str,
        *,
        reads: Sequence[torch.Tensor] = (),
        writes: Sequence[torch.Tensor] = (),
        in_flight: bool = False,
    ) -> None:
        """Nothing to check on a real device (the simulator checks the same program)."""

    def complete(self, stream: Stream, tensors: Sequence[torch.Tensor | None]) -> None:
        """Nothing to check on a real device."""

    @property
    def host_stream(self) -> Stream:
        """Accesses are not checked on a real device: compute stands in."""
        return self.compute

    def allocated(self, stream: Stream, tensor: torch.Tensor) -> None:
        """A storage used again before its deferred free ran keeps its memory: the free is
        cancelled (the engine orders the new writer after the old readers by events). The
        storage was (re)allocated on the current stream: remembered for its free."""
        storage = tensor.untyped_storage()
        self._deferred.pop(storage._cdata, None)
        self._tag(storage)
        self._poll()

    def free_after(self, tensor: torch.Tensor, events: Sequence[Event]) -> None:
        """Free now if the stream that allocated ``tensor`` has seen ``events`` (or the host
        has), else when a later wait or poll finds it so (see the module docstring)."""
        storage = tensor.untyped_storage()
        on = getattr(storage, _ALLOCATED_ON, None)
        evs = list(events)
        if self._proven(on, evs):
            storage.resize_(0)
            self.frees["at_once"] += 1
        else:
            self._deferred[storage._cdata] = (tensor, evs, on)
        self._poll()

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``torch.empty`` on the current stream (remembered for its free)."""
        t = torch.empty(numel, dtype=dtype, device=device)
        self._tag(t.untyped_storage())
        return t

    def forward_ends(self) -> None:
        """Nothing kept on the host here."""

    def release_kept(self) -> None:
        """The backward is over: the gather streams wait for compute, so the buffers compute
        read last (the last gathers' outputs and copy-ins) are freed now, in stream order,
        rather than at the next forward's first gather (nothing runs on them until then)."""
        for role in ("copy_in", "all_gather"):
            s = self._side.get(role)
            if s is not None:
                self.wait_stream(s, self.compute)

    def regrow(self, tensor: torch.Tensor) -> None:
        """``resize_`` (the caching allocator reuses memory)."""
        tensor.untyped_storage().resize_(spanned_bytes(tensor))

    @property
    def deferred(self) -> int:
        """How many buffers wait for their free."""
        return len(self._deferred)

    def _tag(self, storage: torch.UntypedStorage) -> None:
        """Remember that ``storage`` was allocated on the current stream (by its clock)."""
        now = self._current[-1] if self._current else self.compute
        setattr(storage, _ALLOCATED_ON, now.index)

    def _proven(self, on: int | None, events: Sequence[Event]) -> bool:
        seen = self._clocks.seen
        for e in events:
            i, t = e.stream.index, e.clock[e.stream.index]
            if not ((on is not None and seen(on, i, t)) or seen(self._host, i, t)):
                return False
        return True

    def _free_proven(self) -> None:
        for key, (_, events, on) in list(self._deferred.items()):
            if self._proven(on, events):
                self._free_deferred(key, "by_clock")

    def _poll(self) -> None:
        for key, (_, events, _) in list(self._deferred.items()):
            if all(e.native.query() for e in events):
                self._free_deferred(key, "by_query")

    def _free_deferred(self, key: int, how: str) -> None:
        tensor = self._deferred.pop(key)[0]
        tensor.untyped_storage().resize_(0)
        self.frees[how] += 1
