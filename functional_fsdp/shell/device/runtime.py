"""The device seam: streams, events and buffer lifetimes, as the engine sees them.

The engine issues every copy-in, collective, copy-out, reduction and free through a
:class:`DeviceRuntime`: it names the stream an operation runs on, records and waits on events
between streams, annotates which buffers an operation reads and writes, and frees a buffer only
*after* the events of its last consumers (no ``Tensor.record_stream``: FSDP2's memory trouble in
pytorch#147168). Three implementations:

- :class:`CPURuntime` (here): one stream, every operation done when issued; today's behaviour.
- :class:`~.cuda.CudaRuntime`: real ``torch.cuda`` streams and events (FSDP2's layout: copy-in,
  all-gather, reduce-scatter and all-reduce streams beside the compute stream).
- :class:`~.simulator.StreamSimulator` (public as ``functional_fsdp.testing.streams``): runs on
  the CPU but keeps a vector clock per stream and fails on a read before its producer's event, a
  write while another stream may still use the buffer, or a free before the last consumer's
  event: a race detector for stream semantics, as the simulated world is for collectives.

Only a runtime with ``checks`` set is told which buffers an operation reads and writes
(:meth:`DeviceRuntime.access`): the engine builds those lists for the simulator alone, so the
CPU and CUDA runtimes cost a few no-op calls per collective.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from .pool import host_buffer_pool, spanned_bytes

__all__ = ["ROLES", "CPURuntime", "DeviceRuntime", "Event", "Stream"]

#: The side streams the engine uses, by role (FSDP2's: all-gather copy-in, all-gather,
#: reduce-scatter, HSDP all-reduce).
ROLES = ("copy_in", "all_gather", "reduce_scatter", "all_reduce")


class Stream:
    """A stream handle: ``name`` for messages, ``native`` the backend's stream (or ``None``)."""

    __slots__ = ("index", "name", "native")

    def __init__(self, name: str, index: int, native: Any = None) -> None:
        self.name = name
        self.index = index
        self.native = native

    def __repr__(self) -> str:
        return f"Stream({self.name})"


class Event:
    """An event handle: ``native`` the backend's event; ``clock`` the simulator's snapshot."""

    __slots__ = ("clock", "native", "stream")

    def __init__(self, stream: Stream, native: Any = None, clock: Any = None) -> None:
        self.stream = stream
        self.native = native
        self.clock = clock


class DeviceRuntime(Protocol):
    """What the engine needs of a device (see the module docstring)."""

    name: str
    #: Whether :meth:`access` checks anything (the engine annotates only then).
    checks: bool

    @property
    def compute(self) -> Stream:
        """The stream forward and backward run on."""
        ...

    def side_stream(self, role: str) -> Stream:
        """The stream of one of :data:`ROLES`."""
        ...

    def use(self, stream: Stream) -> contextlib.AbstractContextManager[None]:
        """Issue the enclosed operations on ``stream``."""
        ...

    def wait_stream(self, waiter: Stream, producer: Stream) -> None:
        """Later work on ``waiter`` runs after everything issued on ``producer`` so far."""
        ...

    def record(self, stream: Stream) -> Event:
        """An event marking everything issued on ``stream`` so far."""
        ...

    def wait_event(self, stream: Stream, event: Event) -> None:
        """Later work on ``stream`` runs after ``event``."""
        ...

    def host_wait(self, event: Event) -> None:
        """The host blocks until ``event`` completes."""
        ...

    def wait_user_event(self, stream: Stream, event: Any) -> None:
        """Later work on ``stream`` runs after ``event``, a native event the user recorded
        (``set_post_optim_event``); what it covers is unknown, so it proves no free."""
        ...

    def access(
        self,
        stream: Stream,
        what: str,
        *,
        reads: Sequence[torch.Tensor] = (),
        writes: Sequence[torch.Tensor] = (),
        in_flight: bool = False,
    ) -> None:
        """Annotate an operation ``what`` on ``stream`` reading / writing these buffers.
        ``in_flight``: a collective, which reads and writes them until its work is waited for
        (:meth:`complete`), not when issued."""
        ...

    def complete(self, stream: Stream, tensors: Sequence[torch.Tensor | None]) -> None:
        """The collectives in flight on ``stream`` that use ``tensors`` were waited for: their
        accesses happen now, on ``stream`` (events recorded there from now on cover them)."""
        ...

    @property
    def host_stream(self) -> Stream:
        """The host, as the stream of what it runs itself (a CPU optimizer step over offloaded
        shards), for :meth:`access`."""
        ...

    def allocated(self, stream: Stream, tensor: torch.Tensor) -> None:
        """``tensor``'s storage was (re)allocated for use on ``stream``."""
        ...

    def free_after(self, tensor: torch.Tensor, events: Sequence[Event]) -> None:
        """Free ``tensor``'s storage (``resize_(0)``) once ``events`` have completed."""
        ...

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A new 1-D buffer for the engine's own use (freed through :meth:`free_after`)."""
        ...

    def regrow(self, tensor: torch.Tensor) -> None:
        """Give the freed storage of ``tensor`` memory again (the same storage: views of it
        that autograd saved see the new contents)."""
        ...

    def release_kept(self) -> None:
        """The backward is over: give back memory kept for reuse."""
        ...

    def forward_ends(self) -> None:
        """The root's forward is over: memory kept for reuse can go (the activations peak)."""
        ...


class CPURuntime:
    """One stream; every operation is complete when it returns (today's CPU behaviour)."""

    name = "cpu"
    checks = False

    def __init__(self) -> None:
        self._compute = Stream("compute", 0)
        self._done = Event(self._compute)
        self._nothing = contextlib.nullcontext()
        self._pool = host_buffer_pool()

    @property
    def compute(self) -> Stream:
        """The only stream."""
        return self._compute

    def side_stream(self, role: str) -> Stream:
        """The only stream (there are no side streams on the CPU)."""
        return self._compute

    def use(self, stream: Stream) -> contextlib.AbstractContextManager[None]:
        """Nothing to switch."""
        return self._nothing

    def wait_stream(self, waiter: Stream, producer: Stream) -> None:
        """Nothing to order: operations complete when issued."""

    def record(self, stream: Stream) -> Event:
        """A completed event."""
        return self._done

    def wait_event(self, stream: Stream, event: Event) -> None:
        """Nothing to wait for."""

    def host_wait(self, event: Event) -> None:
        """Nothing to wait for."""

    def wait_user_event(self, stream: Stream, event: Any) -> None:
        """Nothing to wait for (no streams)."""

    def access(
        self,
        stream: Stream,
        what: str,
        *,
        reads: Sequence[torch.Tensor] = (),
        writes: Sequence[torch.Tensor] = (),
        in_flight: bool = False,
    ) -> None:
        """No checks on the CPU."""

    def complete(self, stream: Stream, tensors: Sequence[torch.Tensor | None]) -> None:
        """Nothing to track."""

    @property
    def host_stream(self) -> Stream:
        """The one stream (everything runs in order on the CPU)."""
        return self.compute

    def allocated(self, stream: Stream, tensor: torch.Tensor) -> None:
        """Nothing to track."""

    def free_after(self, tensor: torch.Tensor, events: Sequence[Event]) -> None:
        """Free now (every event is complete), into the host buffer pool."""
        self._pool.drain(tensor.untyped_storage())

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """From the host buffer pool (:mod:`.pool`)."""
        return self._pool.empty(numel, dtype, device)

    def regrow(self, tensor: torch.Tensor) -> None:
        """From the host buffer pool (:mod:`.pool`)."""
        self._pool.fill(tensor.untyped_storage(), spanned_bytes(tensor))

    def release_kept(self) -> None:
        """Empty the host buffer pool: it refills within the next forward's first buckets."""
        self._pool.clear()

    def forward_ends(self) -> None:
        """Empty the host buffer pool (:mod:`.pool`): what it kept would sit in resident
        memory through the end of the forward, where a step's memory peaks."""
        self._pool.clear()
