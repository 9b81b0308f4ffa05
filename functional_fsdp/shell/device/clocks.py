"""Vector clocks of streams and the host: how far each has seen every other.

One row per clock (a stream, or the host). ``tick(i)`` advances clock ``i`` (an operation on
stream ``i``, or an event recorded there); an event carries a ``snapshot`` of its stream's row;
``merge(j, snapshot)`` is stream ``j`` (or the host) waiting on that event. Then stream ``j`` is
ordered after event ``e`` of stream ``i`` exactly when ``rows[j][i] >= e``'s tick on ``i``
(:meth:`VectorClocks.seen`): it waited, directly or through other streams' events, for an event
of ``i`` recorded at or after ``e``.

Two users: the stream-ordering simulator checks every buffer access against these clocks, and
the CUDA runtime uses them to free a buffer in stream order as soon as the stream that allocated
it has seen its last users' events (no host polling: ``cuda.py``).
"""

from __future__ import annotations

__all__ = ["VectorClocks"]


class VectorClocks:
    """The rows of ``n`` clocks (more with :meth:`add`)."""

    __slots__ = ("rows",)

    def __init__(self, n: int = 0) -> None:
        self.rows: list[list[int]] = [[0] * n for _ in range(n)]

    def add(self) -> int:
        """One more clock (a stream met for the first time), seeing nothing yet: its index."""
        for row in self.rows:
            row.append(0)
        self.rows.append([0] * (len(self.rows) + 1))
        return len(self.rows) - 1

    def tick(self, i: int) -> int:
        """Advance clock ``i``; its new tick."""
        row = self.rows[i]
        row[i] += 1
        return row[i]

    def snapshot(self, i: int) -> tuple[int, ...]:
        """Clock ``i``'s row now (what an event recorded on it carries)."""
        return tuple(self.rows[i])

    def merge(self, into: int, snapshot: tuple[int, ...]) -> None:
        """Clock ``into`` has seen everything ``snapshot`` saw."""
        mine = self.rows[into]
        for i, t in enumerate(snapshot):
            if t > mine[i]:
                mine[i] = t

    def seen(self, by: int, stream: int, tick: int) -> bool:
        """Whether clock ``by`` is ordered after tick ``tick`` of clock ``stream``."""
        return by == stream or self.rows[by][stream] >= tick
