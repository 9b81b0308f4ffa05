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

from .runtime import ROLES, Event, Stream

__all__ = ["CudaRuntime"]


class CudaRuntime:
    """Streams and events of one CUDA device.

    Args:
        device: the CUDA device.
    """

    name = "cuda"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._compute = Stream("compute", 0, torch.cuda.current_stream(device))
        self._side = {
            role: Stream(role, i + 1, torch.cuda.Stream(device=device, priority=-1))
            for i, role in enumerate(ROLES)
        }
        # Storage (by its StorageImpl) -> (a tensor on it, the events to wait for).
        self._deferred: dict[int, tuple[torch.Tensor, list[Event]]] = {}

    @property
    def compute(self) -> Stream:
        """The current stream at construction (forward and backward run on it)."""
        return self._compute

    def side_stream(self, role: str) -> Stream:
        """The side stream of ``role``."""
        return self._side[role]

    @contextlib.contextmanager
    def use(self, stream: Stream) -> Iterator[None]:
        """``torch.cuda.stream(stream)``."""
        with torch.cuda.stream(stream.native):
            yield

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

    def _collect(self) -> None:
        for key, (tensor, events) in list(self._deferred.items()):
            if all(e.native.query() for e in events):
                tensor.untyped_storage().resize_(0)
                del self._deferred[key]
