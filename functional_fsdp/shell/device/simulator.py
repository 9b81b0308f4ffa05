"""A stream-ordering simulator: a race detector for CUDA stream semantics, on the CPU.

:class:`StreamSimulator` implements the engine's device runtime
(:class:`~functional_fsdp.shell.device.runtime.DeviceRuntime`) with the streams of the CUDA
runtime (compute, copy-in, all-gather, reduce-scatter, all-reduce), but every operation runs at
once on the CPU. What it adds is bookkeeping: each stream has a *vector clock* (how far it has
seen every other stream), events snapshot a clock, ``wait_event`` / ``wait_stream`` merge one
into another, and every annotated buffer access is checked against the buffer's history:

- a **read** must come after the buffer's last write: on the same stream, or on a stream that
  waited on an event recorded after the write ("read before its producer's event");
- a **write** must come after every earlier read and write of the buffer on other streams ("a
  write while another stream may still read it");
- a **free** (``free_after(tensor, events)``) must come after every access of the buffer, as
  seen from ``events`` (and the host) ("a free before the last consuming event"); an access to a
  freed buffer that was not re-allocated is a use after free.

A violation raises :class:`StreamOrderError` at the access that breaks the order (or, with
``strict=False``, is recorded in :attr:`StreamSimulator.violations`). A buffer's history lives
as long as its storage: memory freed by Python and handed out again starts afresh. On real
hardware such a race shows up rarely and silently (stale or half-written parameters); here it
fails the test that runs the program. ``tests/device/test_stream_simulator.py`` seeds four bugs on
purpose in small programs, ``tests/device/test_streams_engine.py`` the same four in the engine (a
missing wait, a missing event before a free, a copy-out on the wrong stream, a reduction
reading a gradient too early), and shows each is caught.

Example:
    >>> import torch
    >>> sim = StreamSimulator()
    >>> buf = torch.zeros(4)
    >>> ag = sim.side_stream("all_gather")
    >>> sim.access(ag, "all-gather", writes=[buf])
    >>> sim.access(sim.compute, "forward", reads=[buf])  # no wait: a race
    Traceback (most recent call last):
    ...
    functional_fsdp.shell.device.simulator.StreamOrderError: forward on stream compute reads a buffer written by all-gather on stream all_gather without waiting for it ...
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch

from .clocks import VectorClocks
from .pool import spanned_bytes
from .runtime import ROLES, Event, Stream

__all__ = ["StreamOrderError", "StreamSimulator", "Violation"]


class StreamOrderError(AssertionError):
    """An operation that, on a real device, could race with another stream."""


@attrs.frozen
class Violation:
    """One ordering bug: what happened, on which stream, against which earlier access."""

    kind: str  # "read-before-write", "write-while-in-use", "free-while-in-use", "use-after-free"
    message: str


@attrs.frozen
class _Access:
    stream: int
    tick: int
    what: str
    # A collective's access before its work was waited for: seen by no stream (on a device
    # its stream covers it only after work.wait()); complete() stamps it with a tick then.
    in_flight: bool = False


class _History:
    __slots__ = ("freed", "reads", "write")

    def __init__(self) -> None:
        self.write: _Access | None = None
        self.reads: list[_Access] = []
        self.freed = False


class StreamSimulator:
    """The device runtime of the simulator (see the module docstring).

    Args:
        strict: raise :class:`StreamOrderError` at the first violation (default); otherwise
            collect them in :attr:`violations`.
    """

    name = "simulator"
    #: The engine annotates buffer accesses for this runtime (it checks them).
    checks = True

    def __init__(self, *, strict: bool = True) -> None:
        self.strict = strict
        self.streams = [Stream("compute", 0)] + [
            Stream(role, i + 1) for i, role in enumerate(ROLES)
        ]
        self.host = len(self.streams)  # the host is one more clock
        self._clocks = VectorClocks(len(self.streams) + 1)
        self._current = 0
        self._buffers: dict[int, _History] = {}
        self.violations: list[Violation] = []
        self.operations = 0

    # ------------------------------------------------------------------ streams and events

    @property
    def compute(self) -> Stream:
        """The compute stream."""
        return self.streams[0]

    def side_stream(self, role: str) -> Stream:
        """The stream of ``role`` (one of the CUDA runtime's roles)."""
        return self.streams[ROLES.index(role) + 1]

    @contextlib.contextmanager
    def use(self, stream: Stream) -> Iterator[None]:
        """Annotated accesses without an explicit stream run on ``stream`` here."""
        prev, self._current = self._current, stream.index
        try:
            yield
        finally:
            self._current = prev

    def wait_stream(self, waiter: Stream, producer: Stream) -> None:
        """``waiter`` has seen everything issued on ``producer`` so far."""
        self._clocks.merge(waiter.index, self._clocks.snapshot(producer.index))

    def record(self, stream: Stream) -> Event:
        """An event holding ``stream``'s clock now."""
        return Event(stream, clock=self._clocks.snapshot(stream.index))

    def wait_event(self, stream: Stream, event: Event) -> None:
        """``stream`` has seen everything ``event`` saw."""
        self._clocks.merge(stream.index, event.clock)

    def wait_user_event(self, stream: Stream, event: Any) -> None:
        """Nothing: the simulator cannot know what a user's native event covers."""

    def host_wait(self, event: Event) -> None:
        """The host has seen everything ``event`` saw."""
        self._clocks.merge(self.host, event.clock)

    def _tick(self, stream: int) -> int:
        # The host issues every operation, so each stream has seen what the host has.
        self._clocks.merge(stream, self._clocks.snapshot(self.host))
        self.operations += 1
        return self._clocks.tick(stream)

    def _seen(self, by: int, access: _Access) -> bool:
        return not access.in_flight and self._clocks.seen(by, access.stream, access.tick)

    # ------------------------------------------------------------------ buffers

    def _key(self, t: torch.Tensor) -> int:
        return t.untyped_storage()._cdata

    def _history(self, t: torch.Tensor) -> _History:
        key = self._key(t)
        h = self._buffers.get(key)
        if h is None:
            h = self._buffers[key] = _History()
            # When the storage dies its address may be handed out again: forget it then.
            weakref.finalize(t.untyped_storage(), self._buffers.pop, key, None)
        return h

    def access(
        self,
        stream: Stream,
        what: str,
        *,
        reads: Sequence[torch.Tensor] = (),
        writes: Sequence[torch.Tensor] = (),
        in_flight: bool = False,
    ) -> None:
        """Check, then record, an operation ``what`` on ``stream`` (see the module docstring).
        ``in_flight``: a collective, whose accesses no event covers until :meth:`complete`."""
        s = stream.index
        for t in reads:
            self._check_read(s, self._history(t), what)
        for t in writes:
            self._check_write(s, self._history(t), what)
        tick = self._tick(s)
        for t in reads:
            self._history(t).reads.append(_Access(s, tick, what, in_flight))
        for t in writes:
            h = self._history(t)
            h.write, h.reads = _Access(s, tick, what, in_flight), []

    def complete(self, stream: Stream, tensors: Sequence[torch.Tensor | None]) -> None:
        """The collectives in flight that use ``tensors`` were waited for on ``stream``: their
        accesses happen now (an event recorded on ``stream`` before this covers none of them)."""
        tick = self._tick(stream.index)
        for t in tensors:
            if t is None:
                continue
            h = self._history(t)
            if h.write is not None and h.write.in_flight:
                h.write = _Access(stream.index, tick, h.write.what)
            h.reads = [_Access(stream.index, tick, a.what) if a.in_flight else a for a in h.reads]

    @property
    def host_stream(self) -> Stream:
        """The host as a stream (what runs on the host: a CPU optimizer step over offloaded
        shards)."""
        return Stream("host", self.host)

    def allocated(self, stream: Stream, tensor: torch.Tensor) -> None:
        """``tensor``'s storage is (re)allocated on ``stream``: a freed buffer may be used
        again, by ``stream`` first (the allocation counts as its write there, so another
        stream must wait for it). Memory that was never freed keeps its history (its old
        readers still order the new writer)."""
        h = self._history(tensor)
        if h.freed:
            h = self._buffers[self._key(tensor)] = _History()
            h.write = _Access(stream.index, self._tick(stream.index), "the allocation")

    def free_after(self, tensor: torch.Tensor, events: Sequence[Event]) -> None:
        """Check that every access of ``tensor`` is seen by ``events`` or the host, then free
        its storage (as the CPU runtime does)."""
        n = len(self.streams) + 1
        seen = list(self._clocks.snapshot(self.host))
        for e in events:
            seen = [max(a, b) for a, b in zip(seen, e.clock or (0,) * n)]
        h = self._history(tensor)
        for acc in ([h.write] if h.write is not None else []) + h.reads:
            if seen[acc.stream] < acc.tick:
                self._fail(
                    "free-while-in-use",
                    f"a buffer is freed while {acc.what} on stream "
                    f"{self._name(acc.stream)} may still use it: free it after an event "
                    "recorded on that stream after its last use",
                )
                break
        h.freed = True
        tensor.untyped_storage().resize_(0)

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``torch.empty`` (the simulator checks orders, not memory reuse)."""
        return torch.empty(numel, dtype=dtype, device=device)

    def forward_ends(self) -> None:
        """Nothing kept on the host here."""

    def release_kept(self) -> None:
        """Nothing (the simulator keeps nothing)."""

    def regrow(self, tensor: torch.Tensor) -> None:
        """``resize_``, as the CPU did before the host buffer pool."""
        tensor.untyped_storage().resize_(spanned_bytes(tensor))

    # ------------------------------------------------------------------ checks

    def _check_read(self, s: int, h: _History, what: str) -> None:
        if h.freed:
            self._fail("use-after-free", f"{what} on stream {self._name(s)} reads a freed buffer")
        elif h.write is not None and not self._seen(s, h.write):
            self._fail(
                "read-before-write",
                f"{what} on stream {self._name(s)} reads a buffer written by {h.write.what} on "
                f"stream {self._name(h.write.stream)} without waiting for it (record an event "
                "after the write and wait on it)",
            )

    def _check_write(self, s: int, h: _History, what: str) -> None:
        if h.freed:
            self._fail("use-after-free", f"{what} on stream {self._name(s)} writes a freed buffer")
            return
        for acc in ([h.write] if h.write is not None else []) + h.reads:
            if not self._seen(s, acc):
                self._fail(
                    "write-while-in-use",
                    f"{what} on stream {self._name(s)} writes a buffer that {acc.what} on stream "
                    f"{self._name(acc.stream)} may still use (wait on an event recorded after "
                    "that use)",
                )
                return

    def _name(self, s: int) -> str:
        return "host" if s == self.host else self.streams[s].name

    def _fail(self, kind: str, message: str) -> None:
        self.violations.append(Violation(kind, message))
        if self.strict:
            raise StreamOrderError(message)
