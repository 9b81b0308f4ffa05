"""Where a traced step's collectives go (pure): each issued early, each waited late.

A compiled step's graph (:mod:`functional_fsdp.functional.compiled`) holds each bucket's
all-gather and reduce-scatter as two nodes: the *issue* (the collective starts, asynchronously)
and the *wait* (its result is needed). Traced, each wait follows its issue at once, so nothing
overlaps. :func:`overlap_order` returns a new order of the same nodes in which

- each **wait** runs just before the first node that needs its result; a reduction's result
  that only leaves the graph (a reduce-scatter's reduced shard and its post-divide) is
  computed at the end, or when the next reduction needs its place;
- each **all-gather** whose input is ready from the graph's inputs alone (the packed local
  shards: a *prefetch*) is issued as soon as the previous prefetch was waited for, so it
  travels while the previous bucket's compute runs; the compute itself keeps its traced order;
- at most ``depth`` collectives of each kind (prefetches; the others: reductions, and
  all-gathers of computed values such as HSDP's) are in flight at once, so memory stays
  bounded as in the eager engine: with ``depth=1`` one bucket's gathered parameters are
  prefetched ahead, and one reduction travels while the backward goes on;
- nodes marked ``ordered`` (random ops: each draws from the generator's state) keep their
  order among themselves.

The order is a function of the graph's shape alone, so every rank, tracing the same step,
issues the same collectives in the same order. The shell describes a graph as
:class:`GraphNode` records and reorders the graph as told.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import attrs

__all__ = ["GraphNode", "NodeKind", "overlap_order"]

NodeKind = Literal["input", "gather", "reduce", "wait", "compute", "output"]


@attrs.frozen
class GraphNode:
    """One node of a traced graph, as the scheduler sees it.

    Attributes:
        kind: ``"input"`` (a graph input or constant: stays first, in order), ``"gather"``
            (an all-gather issued), ``"reduce"`` (a reduce-scatter or all-reduce issued),
            ``"wait"`` (a collective's result awaited), ``"compute"`` (anything else),
            ``"output"`` (the graph's output: stays last).
        inputs: the indices (in the graph's order) of the nodes it reads. A ``"wait"`` reads
            one node: its collective, or another wait of it.
        ordered: a compute node that must keep its order relative to every other ``ordered``
            node (a random op: reordering two changes what each draws).
    """

    kind: NodeKind
    inputs: tuple[int, ...] = ()
    ordered: bool = False


def overlap_order(nodes: Sequence[GraphNode], *, depth: int = 1) -> tuple[int, ...]:
    """A topological order of ``nodes`` (given in a topological order) that issues each
    collective early and waits for it late (see the module docstring); ``depth``: the most
    collectives of one kind (gathers; reductions) in flight at once.

    Raises:
        ValueError: ``nodes`` is not in topological order, a wait does not read exactly one
            collective (or a wait of one), or ``depth < 1``.
    """
    if depth < 1:
        raise ValueError(f"overlap_order: depth must be at least 1, got {depth}")
    return _Schedule(nodes, depth).run()


class _Schedule:
    """One run of :func:`overlap_order`: the order so far and the collectives in flight."""

    def __init__(self, nodes: Sequence[GraphNode], depth: int) -> None:
        self.nodes, self.depth = nodes, depth
        n = len(nodes)
        self.users: list[list[int]] = [[] for _ in range(n)]
        for i, node in enumerate(nodes):
            for j in node.inputs:
                if not 0 <= j < i:
                    raise ValueError(
                        f"overlap_order: node {i} reads node {j}: the nodes must be in a "
                        "topological order (each after the nodes it reads)"
                    )
                self.users[j].append(i)
        self.issue_of = _issues(nodes)
        self.prep = _prep(nodes)
        self.lazy = _lazy(nodes, self.users, self.issue_of)
        # The in-flight slot each collective takes: a prefetch (an all-gather of what the
        # inputs alone make) a "gather" one, any other collective a "reduce" one.
        self.slot = {
            i: "gather"
            if nd.kind == "gather" and all(self.prep[j] for j in nd.inputs)
            else "reduce"
            for i, nd in enumerate(nodes)
            if nd.kind in ("gather", "reduce")
        }
        self.done = [False] * n
        self.order: list[int] = []
        self.flying: dict[str, list[int]] = {"gather": [], "reduce": []}  # issued, not waited
        self.gathers = [i for i in range(n) if self.slot.get(i) == "gather"]
        self.next_gather = 0

    def run(self) -> tuple[int, ...]:
        nodes, n = self.nodes, len(self.nodes)
        for i in range(n):  # the graph's inputs first, as they were
            if nodes[i].kind == "input":
                self.emit(i)
        for i in range(n):
            self.prefetch()
            if not self.done[i] and not self.lazy[i] and nodes[i].kind != "output":
                self.emit(i)
        for i in range(n):  # what was left for later: the waits whose results only leave
            if nodes[i].kind != "output":
                self.emit(i)
        for i in range(n):
            self.emit(i)
        return tuple(self.order)

    def emit(self, i: int) -> None:
        """Place node ``i`` next, after every node it reads that is not placed yet."""
        nodes, done, flying = self.nodes, self.done, self.flying
        stack = [i]
        while stack:  # depth-first
            top = stack[-1]
            if done[top]:
                stack.pop()
                continue
            missing = [j for j in nodes[top].inputs if not done[j]]
            if missing:
                stack.extend(reversed(missing))
                continue
            stack.pop()
            kind = nodes[top].kind
            if kind in ("gather", "reduce"):
                queue = flying[self.slot[top]]
                while len(queue) >= self.depth:  # make room: the oldest's wait first
                    self.wait_for(queue[0])
                queue.append(top)
            elif kind == "wait":
                self.landed(self.issue_of[top])
            done[top] = True
            self.order.append(top)

    def wait_for(self, issue: int) -> None:
        waits = [u for u in self.users[issue] if self.nodes[u].kind == "wait"]
        if waits:
            self.emit(waits[0])
        else:  # a collective nobody waits for holds no place
            self.landed(issue)

    def landed(self, issue: int | None) -> None:
        for queue in self.flying.values():
            if issue in queue:
                queue.remove(issue)

    def prefetch(self) -> None:
        """Issue the next all-gather now if there is room and its input is ready from the
        graph's inputs alone."""
        gathers = self.gathers
        while self.next_gather < len(gathers) and self.done[gathers[self.next_gather]]:
            self.next_gather += 1
        if self.next_gather == len(gathers) or len(self.flying["gather"]) >= self.depth:
            return
        self.emit(gathers[self.next_gather])  # its input is packed from the inputs alone


def _issues(nodes: Sequence[GraphNode]) -> list[int | None]:
    """For each wait, the collective it completes (through a wait of a wait), else ``None``."""
    out: list[int | None] = [None] * len(nodes)
    for i, node in enumerate(nodes):
        if node.kind != "wait":
            continue
        src = node.inputs[0] if len(node.inputs) == 1 else None
        if src is not None and nodes[src].kind in ("gather", "reduce"):
            out[i] = src
        elif src is not None and nodes[src].kind == "wait":
            out[i] = out[src]
        else:
            raise ValueError(
                f"overlap_order: wait {i} reads {list(node.inputs)}; a wait reads exactly one "
                "node, its collective (or a wait of it)"
            )
    return out


def _lazy(
    nodes: Sequence[GraphNode], users: Sequence[Sequence[int]], issue_of: Sequence[int | None]
) -> list[bool]:
    """Nodes that run only when something needs them: waits, and the compute after a
    *reduction's* wait whose every user is lazy or the output (a reduced shard's post-divide
    and split). The compute after a gather's wait keeps its place: it is the model's, and
    deferring it would gather every bucket before any compute runs."""
    after = [False] * len(nodes)  # a reduction's wait, or compute that reads one
    for i, node in enumerate(nodes):
        if node.kind == "wait":
            issue = issue_of[i]
            after[i] = issue is not None and nodes[issue].kind == "reduce"
        elif node.kind == "compute" and not node.ordered:
            after[i] = any(after[j] for j in node.inputs)
    lazy = [False] * len(nodes)
    for i in reversed(range(len(nodes))):  # every user of a node is decided before it
        node = nodes[i]
        lazy[i] = node.kind == "wait" or (
            after[i]
            and bool(users[i])
            and all(lazy[u] or nodes[u].kind == "output" for u in users[i])
        )
    return lazy


def _prep(nodes: Sequence[GraphNode]) -> list[bool]:
    """Compute that reads only the graph's inputs, directly or through such compute (packing
    and casting the local shards): cheap to run early, so a gather reading it may be issued
    ahead of its place."""
    prep = [False] * len(nodes)
    for i, node in enumerate(nodes):
        if node.kind == "input":
            prep[i] = True
        elif node.kind == "compute" and not node.ordered:
            prep[i] = all(prep[j] for j in node.inputs)
    return prep
