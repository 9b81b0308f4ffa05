"""The traced step's collective order (``core.overlap``): each collective issued early, waited
for late, at most ``depth`` of a kind in flight; a topological order of the same nodes."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from functional_fsdp.core.overlap import GraphNode, overlap_order


def _check(nodes: list[GraphNode], order: tuple[int, ...], depth: int) -> None:
    """The invariants every order must keep."""
    assert sorted(order) == list(range(len(nodes)))
    pos = {i: k for k, i in enumerate(order)}
    for i, node in enumerate(nodes):
        for j in node.inputs:
            assert pos[j] < pos[i], f"node {i} placed before its input {j}"
    inputs = [i for i, nd in enumerate(nodes) if nd.kind == "input"]
    assert list(order[: len(inputs)]) == inputs  # the graph's inputs first, as they were
    outputs = [i for i, nd in enumerate(nodes) if nd.kind == "output"]
    assert list(order[len(order) - len(outputs) :]) == outputs
    flying: dict[str, set[int]] = {"gather": set(), "reduce": set()}
    for i in order:
        kind = nodes[i].kind
        if kind in flying:
            flying[kind].add(i)
            # (a gather of a computed value takes a reduction's slot: at most 2*depth then)
            assert len(flying[kind]) <= 2 * depth, f"{len(flying[kind])} {kind}s in flight"
        elif kind == "wait":
            for queue in flying.values():
                queue.discard(nodes[i].inputs[0])
    ordered = [i for i in order if nodes[i].ordered]
    assert ordered == sorted(ordered)  # random ops draw in their traced order


class _Graph:
    """Build a graph as a traced step looks: inputs, blocks of gather -> wait -> compute,
    reductions of computed gradients whose results leave the graph."""

    def __init__(self, n_inputs: int = 2) -> None:
        self.nodes = [GraphNode("input") for _ in range(n_inputs)]
        self.leaving: list[int] = []

    def add(self, kind: Any, *inputs: int) -> int:
        self.nodes.append(GraphNode(kind, tuple(inputs)))
        return len(self.nodes) - 1

    def block(self, last: int, param: int) -> tuple[int, int, int]:
        """(gather, wait, compute): the block's compute reads the previous compute."""
        pack = self.add("compute", param)
        gather = self.add("gather", pack)
        wait = self.add("wait", gather)
        view = self.add("compute", wait)
        return gather, wait, self.add("compute", last, view)

    def reduce(self, grad: int) -> tuple[int, int]:
        rs = self.add("reduce", grad)
        wait = self.add("wait", rs)
        self.leaving.append(self.add("compute", wait))  # the post-divide: leaves the graph
        return rs, wait

    def done(self, *more: int) -> list[GraphNode]:
        self.add("output", *self.leaving, *more)
        return self.nodes


def test_the_next_bucket_is_gathered_while_this_one_computes() -> None:
    g = _Graph()
    last = 0
    blocks = []
    for _ in range(4):
        blocks.append(g.block(last, 1))
        last = blocks[-1][2]
    nodes = g.done(last)
    order = overlap_order(nodes)
    _check(nodes, order, 1)
    pos = {i: k for k, i in enumerate(order)}
    for (_, _, compute), (gather_next, _, _) in pairwise(blocks):
        assert pos[gather_next] < pos[compute]  # issued before this block's compute
    for (_, wait, _), (gather_next, _, _) in pairwise(blocks):
        assert pos[wait] < pos[gather_next]  # one gather in flight: depth=1
    for (_, _, compute), (_, wait_next, _) in pairwise(blocks):
        assert pos[compute] < pos[wait_next]  # the compute runs while the next one travels
    flying, most = 0, 0  # at most one bucket gathered ahead, never all of them first
    for i in order:
        flying += {"gather": 1, "wait": -1}.get(nodes[i].kind, 0)
        most = max(most, flying)
    assert most == 1
    # Traced order (each wait at once, nothing ahead) is what the graph had.
    assert order != tuple(range(len(nodes)))


def test_a_reduction_travels_while_the_backward_goes_on() -> None:
    g = _Graph()
    grad1 = g.add("compute", 0)
    rs1, wait1 = g.reduce(grad1)
    grad2 = g.add("compute", grad1)  # the next block's backward
    rs2, wait2 = g.reduce(grad2)
    nodes = g.done()
    order = overlap_order(nodes)
    _check(nodes, order, 1)
    pos = {i: k for k, i in enumerate(order)}
    assert pos[rs1] < pos[grad2] < pos[wait1] < pos[rs2] < pos[wait2]
    deeper = overlap_order(nodes, depth=2)
    _check(nodes, deeper, 2)
    pos = {i: k for k, i in enumerate(deeper)}
    assert pos[rs2] < pos[wait1]  # two in flight


def test_a_gather_waits_for_what_its_input_needs() -> None:
    """A gather of a computed value (here: of a reduction's result) is issued once that value
    is computed where it was: prefetching it does not pull the reduction's wait early."""
    g = _Graph()
    rs = g.add("reduce", 0)
    before = g.add("compute", 1)  # runs while the reduction travels
    wait = g.add("wait", rs)
    gather = g.add("gather", g.add("compute", wait))
    nodes = g.done(g.add("compute", g.add("wait", gather)), before)
    order = overlap_order(nodes)
    _check(nodes, order, 1)
    assert order.index(rs) < order.index(before) < order.index(wait) < order.index(gather)


def test_random_ops_keep_their_order() -> None:
    """A random op after a reduction's wait is not deferred, and one that reads only the
    inputs is not hoisted with a prefetch: each draws from the generator in its traced order."""
    g = _Graph()
    _, wait = g.reduce(g.add("compute", 0))
    noise = len(g.nodes)
    g.nodes.append(GraphNode("compute", (wait,), ordered=True))  # dropout of a reduced value
    g.leaving.append(noise)
    fresh = len(g.nodes)
    g.nodes.append(GraphNode("compute", (), ordered=True))  # a rand() of its own
    gather = g.add("gather", fresh)
    nodes = g.done(g.add("compute", g.add("wait", gather)))
    order = overlap_order(nodes)
    _check(nodes, order, 1)
    assert order.index(noise) < order.index(fresh)


def test_bad_graphs_are_refused() -> None:
    with pytest.raises(ValueError, match="topological"):
        overlap_order([GraphNode("compute", (1,)), GraphNode("input")])
    with pytest.raises(ValueError, match="exactly one"):
        overlap_order([GraphNode("input"), GraphNode("reduce", (0,)), GraphNode("wait", (0, 1))])
    with pytest.raises(ValueError, match="depth"):
        overlap_order([GraphNode("input")], depth=0)


@st.composite
def _graphs(draw: Any) -> list[GraphNode]:
    g = _Graph(draw(st.integers(1, 3)))
    live = list(range(len(g.nodes)))
    for _ in range(draw(st.integers(0, 14))):
        what = draw(st.sampled_from(["compute", "random", "block", "reduce", "wait2"]))
        if what in ("compute", "random"):
            reads = draw(st.lists(st.sampled_from(live), min_size=0, max_size=3, unique=True))
            g.nodes.append(GraphNode("compute", tuple(reads), ordered=what == "random"))
            live.append(len(g.nodes) - 1)
        elif what == "block":
            _, _, out = g.block(draw(st.sampled_from(live)), draw(st.integers(0, 0)))
            live.append(out)
        elif what == "reduce":
            g.reduce(draw(st.sampled_from(live)))
        else:  # a wait of a wait (as traced: funcol waits twice), read by compute
            gather = g.add("gather", 0)
            w2 = g.add("wait", g.add("wait", gather))
            live.append(g.add("compute", w2))
    return g.done(*draw(st.lists(st.sampled_from(live), max_size=2)))


@given(_graphs(), st.integers(1, 3))
def test_any_graph_keeps_its_dependencies_and_the_depth(nodes: list[GraphNode], depth: int) -> None:
    order = overlap_order(nodes, depth=depth)
    _check(nodes, order, depth)
    assert overlap_order(nodes, depth=depth) == order  # every rank gets the same order
