"""The CUDA runtime: real ``torch.cuda`` streams and events (FSDP2's stream layout).

Side streams by role (:data:`~.runtime.ROLES`): the all-gather copy-in and the all-gather get
their own high-priority streams so the next group's gather overlaps this group's compute, the
reduce-scatter and the HSDP all-reduce theirs so gradient reduction overlaps the rest of
backward. Buffers used across streams are freed by event: :meth:`CudaRuntime.free_after` keeps
the tensor referenced until its consumers' events complete (polled at every later call), so the
caching allocator never hands its memory to another stream while a kernel still reads it, and no
``Tensor.record_stream`` is needed (pytorch#147168).

Checked only where a GPU exists (tests marked ``gpu``); the ordering logic is the one the stream
simulator checks on the CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from .pool import spanned_bytes
from .runtime import ROLES, Event, Stream

__all__ = ["CudaRuntime"]


class CudaRuntime:
    """Streams and events of one CUDA device.

    Args:
        device: the CUDA device.
    """

    name = "cuda"
    checks = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._compute = Stream("compute", 0, torch.cuda.current_stream(device))
        # Made on first use: fully_shard builds a runtime per group, the root's lazy init
        # then gives every group of the model the root's (one set of streams per model).
        self._side: dict[str, Stream] = {}
        self._depth = 0  # inside use(): compute stays the stream current before it
        # Storage (by its StorageImpl) -> (a tensor on it, the events to wait for).
        self._deferred: dict[int, tuple[torch.Tensor, list[Event]]] = {}

    @property
    def compute(self) -> Stream:
        """The current stream (forward and backward run on it), as FSDP2 takes it per call;
        inside :meth:`use` the stream current before it."""
        if self._depth == 0:
            native = torch.cuda.current_stream(self.device)
            if native != self._compute.native:
                self._compute = Stream("compute", 0, native)
        return self._compute

    def side_stream(self, role: str) -> Stream:
        """The side stream of ``role`` (high priority, as FSDP2's all-gather and
        reduce-scatter streams; FSDP2's HSDP all-reduce stream has the default priority)."""
        s = self._side.get(role)
        if s is None:
            priority = 0 if role == "all_reduce" else -1
            native = torch.cuda.Stream(device=self.device, priority=priority)
            s = self._side[role] = Stream(role, ROLES.index(role) + 1, native)
        return s

    @contextlib.contextmanager
    def use(self, stream: Stream) -> Iterator[None]:
        """``torch.cuda.stream(stream)``."""
        _ = self.compute  # fix the compute stream before switching away from it
        self._depth += 1
        try:
            with torch.cuda.stream(stream.native):
                yield
        finally:
            self._depth -= 1

    def wait_stream(self, waiter: Stream, producer: Stream) -> None:
        """``waiter.wait_stream(producer)``."""
        waiter.native.wait_stream(producer.native)

    def record(self, stream: Stream) -> Event:
        """A ``torch.cuda.Event`` recorded on ``stream``."""
        ev = torch.cuda.Event()
        ev.record(stream.native)
        return Event(stream, ev)

    def wait_event(self, stream: Stream, event: Event) -> None:
        """``stream.wait_event(event)``."""
        stream.native.wait_event(event.native)

    def host_wait(self, event: Event) -> None:
        """``event.synchronize()``."""
        event.native.synchronize()

    def access(
        self,
        stream: Stream,
        what: str,
        *,
        reads: Sequence[torch.Tensor] = (),
        writes: Sequence[torch.Tensor] = (),
    ) -> None:
        """Nothing to check on a real device (the simulator checks the same program)."""

    def allocated(self, stream: Stream, tensor: torch.Tensor) -> None:
        """A storage used again before its deferred free ran keeps its memory: the free is
        cancelled (the engine orders the new writer after the old readers by events)."""
        self._deferred.pop(tensor.untyped_storage()._cdata, None)
        self._collect()

    def free_after(self, tensor: torch.Tensor, events: Sequence[Event]) -> None:
        """Free now if ``events`` are complete, else when a later call finds them complete."""
        self._deferred[tensor.untyped_storage()._cdata] = (tensor, list(events))
        self._collect()

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``torch.empty`` (the caching allocator reuses memory)."""
        return torch.empty(numel, dtype=dtype, device=device)

    def release_kept(self) -> None:
        """Nothing (the caching allocator keeps its own)."""

    def regrow(self, tensor: torch.Tensor) -> None:
        """``resize_`` (the caching allocator reuses memory)."""
        tensor.untyped_storage().resize_(spanned_bytes(tensor))

    def _collect(self) -> None:
        for key, (tensor, events) in list(self._deferred.items()):
            if all(e.native.query() for e in events):
                tensor.untyped_storage().resize_(0)
                del self._deferred[key]
