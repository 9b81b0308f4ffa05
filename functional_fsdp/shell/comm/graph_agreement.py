"""The ranks agree on the collectives of their compiled graphs before each graph runs.

A compiled step's collectives are graph nodes that each rank traced on its own: where a
module of a ``fully_shard`` group runs on some ranks only (data-dependent control flow), one
rank's graph all-gathers that group and another's does not, and running them pairs unrelated
collectives (gloo aborts the process on the first size mismatch, or both wait for ever). The
eager engine finds this at the first such collective (``CollectiveMismatchError``); a graph
runs its collectives without the engine, so before each run of a graph the ranks compare
digests of the collectives they are about to run (:func:`agree_on_run`: one max all-reduce
of a number per mesh dim). Which graph runs is each rank's own: a guard that failed on some
ranks only compiles a graph there alone, so comparing only the graphs compiled together (the
first ones) left a later one-rank recompile to hang. Where the digests differ, the ranks
publish their graphs' collectives to the default store and every rank raises the same error,
naming the first collective that differs, before any of them ran.

Each rank also knows which parameters each of its graphs never reads (:func:`unused_locals`);
the same all-reduce carries, per trainable parameter, whether the graph about to run reads it:
those no rank's graph read in a step get no gradient from ``compile_backward``, as from
``loss.backward()``.
"""

from __future__ import annotations

import datetime
import itertools
import json
import operator
import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ...core.errors import CollectiveMismatchError, CollectiveTimeoutError
from ...core.traced import GraphCollective, collectives_difference

__all__ = [
    "agree_on_run",
    "graph_collectives",
    "next_graph_key",
    "unused_locals",
]

_KEYS = itertools.count()


def next_graph_key() -> str:
    """A store key prefix for one compiled step; every rank makes its steps in the same order
    (a program that runs the same code on every rank), so the n-th step of each rank shares
    the n-th key."""
    return f"ffsdp/compiled_graphs/{next(_KEYS)}"


def graph_collectives(gm: torch.fx.GraphModule) -> list[GraphCollective]:
    """The collective nodes of the graph ``gm`` (dynamo's or AOTAutograd's) and of the graphs
    nested in it (the autograd functions' forward and backward bodies, checkpointed regions),
    in order: ``(op, ranks in its group, elements, dtype)`` each. In dynamo's graph the
    backward bodies' collectives are there too: they are traced with the forward."""
    out: list[GraphCollective] = []
    groups: dict[str, int] = {}

    def walk(g: torch.fx.GraphModule) -> None:
        for node in g.graph.nodes:
            target = str(node.target)
            if node.op == "call_function" and target.startswith(_C10D):
                op = target[len(_C10D) :].split(".")[0]
                if op == "wait_tensor":
                    continue
                name = next((a for a in reversed(node.args) if isinstance(a, str)), None)
                if name is None:
                    continue
                if name not in groups:
                    pg = _group(name)
                    groups[name] = dist.get_world_size(pg)
                value = node.meta.get("example_value")
                numel = int(value.numel()) if isinstance(value, torch.Tensor) else -1
                dtype = str(value.dtype) if isinstance(value, torch.Tensor) else "?"
                out.append((op, groups[name], numel, dtype))
            elif node.op == "get_attr":
                sub = getattr(g, str(node.target), None)
                if isinstance(sub, torch.fx.GraphModule):
                    walk(sub)

    walk(gm)
    return out


_GATHERS = ("autograd_function_apply", "tag_activation_checkpoint")
_LOCAL = re.compile(r"^L\['locals_'\]\[(\d+)\]$")


def unused_locals(gm: torch.fx.GraphModule, n_locals: int) -> frozenset[int] | None:
    """Which of the traced forward's local shards (``locals_[i]``, the parameters in
    ``TracedModel.order``) the graph never uses, or ``None`` where the graph is not laid out
    as the traced forward lays it out (then every parameter counts as used).

    Each bucket's gather is an ``autograd_function_apply`` node (inside a
    ``tag_activation_checkpoint`` body where the bucket is gathered again in backward) whose
    outputs are the bucket's full parameters in order; dynamo keeps a ``getitem`` only for an
    output that is read. The bucket's first parameter is the smallest ``locals_`` index among
    the gather's inputs (buckets are consecutive runs of ``order``); a bucket no module of
    which ran on this rank has no gather at all."""
    used: set[int] = set()
    reached: set[int] = set()  # the local shards some recognised gather reads

    def walk(
        g: torch.fx.GraphModule, sources: list[set[int]] | None, live_out: set[int] | None
    ) -> bool:
        anc: dict[torch.fx.Node, set[int]] = {}
        placeholders = 0
        for node in g.graph.nodes:
            if node.op == "placeholder":
                if sources is None:
                    grapharg = node.meta.get("grapharg")
                    source = getattr(grapharg, "source", None)
                    name = getattr(source, "name", "")
                    name = name() if callable(name) else str(name)  # a property on newer torch
                    m = _LOCAL.match(name)
                    anc[node] = {int(m.group(1))} if m else set()
                else:
                    if placeholders >= len(sources):
                        return False
                    anc[node] = sources[placeholders]
                placeholders += 1
            else:
                anc[node] = set().union(*(anc.get(a, set()) for a in node.all_input_nodes))
        live = _live(g, live_out)
        for node in g.graph.nodes:
            if node.op != "call_function":
                continue
            target = getattr(node.target, "__name__", str(node.target))
            if target == "autograd_function_apply":
                inputs = set().union(
                    *(anc[a] for a in node.args[2:] if isinstance(a, torch.fx.Node))
                )
                if not inputs:
                    return False
                reached.update(inputs)
                start = min(inputs)
                for user in node.users:
                    if user in live and user.target is operator.getitem:
                        used.add(start + int(user.args[1]))
            elif target == "tag_activation_checkpoint":
                body = getattr(g, str(node.args[0].target), None)
                if not isinstance(body, torch.fx.GraphModule):
                    return False
                inner = [anc[a] if isinstance(a, torch.fx.Node) else set() for a in node.args[1:]]
                outs = {
                    int(u.args[1]) for u in node.users if u in live and u.target is operator.getitem
                }
                if not walk(body, inner, outs):
                    return False
        if sources is None:
            # A shard that reaches the loss through no gather recognised above: a layout of
            # dynamo's this does not know, so it says nothing.
            for node in g.graph.nodes:
                if node.op == "placeholder" and node in live and anc[node] - reached:
                    return False
        return True

    if not walk(gm, None, None):
        return None
    return frozenset(range(n_locals)) - used


def _live(g: torch.fx.GraphModule, live_out: set[int] | None) -> set[torch.fx.Node]:
    """The nodes of ``g`` whose values reach its output (only the output positions in
    ``live_out``, when given: a checkpointed body whose caller reads some of its outputs), or
    a node that nothing reads: dynamo drops dead nodes, so one left is kept for its effect (an
    in-place write, ``y[:, :4] = f(w)`` or ``y.add_(f(w))``: later reads of ``y`` read the
    node before it, and the parameter's only way to the loss is that write)."""
    nodes = list(g.graph.nodes)
    live: set[torch.fx.Node] = set()
    for node in reversed(nodes):
        if node.op == "output":
            outs = node.args[0]
            flat = list(outs) if isinstance(outs, (tuple, list)) else [outs]
            for k, a in enumerate(flat):
                if isinstance(a, torch.fx.Node) and (live_out is None or k in live_out):
                    live.add(a)
        elif node in live or (not node.users and _effect(node)):
            live.add(node)
            live.update(node.all_input_nodes)
    return live


def _effect(node: torch.fx.Node) -> bool:
    """A call that may write (anything but a ``getitem`` and the gathers' own wrappers, which
    are read-only: an unread one is a parameter nobody uses)."""
    if node.op in ("call_method", "call_module"):  # y.add_(...), y.copy_(...)
        return True
    if node.op != "call_function" or node.target is operator.getitem:
        return False
    return getattr(node.target, "__name__", "") not in _GATHERS


_C10D = "_c10d_functional."


def _group(name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(name)  # type: ignore[arg-type]


def agree_on_run(
    collectives: Sequence[GraphCollective],
    digest: int,
    key: str,
    where: str,
    ranks: Sequence[int],
    mesh_dims: Sequence[tuple[Any, int]],
    reads: Sequence[bool] = (),
    timeout_s: float = 300.0,
) -> list[bool]:
    """Before a compiled graph runs ``collectives`` (:func:`graph_collectives` of it), whose
    ``digest`` is the core's :func:`~functional_fsdp.core.traced.collectives_digest` of them
    (worked out once per graph by the caller): check that every rank of the model's mesh is
    about to run the same ones; for each of ``reads`` (flags of this rank's graph, such as
    whether it reads a parameter), whether it holds on any rank.

    One max all-reduce per ``(mesh, dim)`` of ``mesh_dims`` compares the digests and carries
    the flags. Only where the digests differ, each rank publishes its collectives under
    ``key`` (unique to this run, the same on every rank) and compares them with every rank of
    ``ranks``.

    Raises :class:`CollectiveMismatchError` on every rank, naming the first difference, when
    the ranks' collectives differ; :class:`CollectiveTimeoutError` when a rank did not publish
    within ``timeout_s``."""
    if not dist.is_initialized() or len(ranks) <= 1:
        return list(reads)
    flags = [1.0 if f else 0.0 for f in reads]
    values = torch.tensor([float(digest), -float(digest), *flags], dtype=torch.float64)
    out = _max_over(values, mesh_dims)
    most, least, *anywhere = out.tolist()
    if most != -least:
        _name_the_difference(collectives, key, where, ranks, timeout_s)
    return [v > 0 for v in anywhere]


def _name_the_difference(
    collectives: Sequence[GraphCollective],
    key: str,
    where: str,
    ranks: Sequence[int],
    timeout_s: float,
) -> None:
    """Publish this rank's ``collectives`` under ``key``, wait (bounded) for every rank of
    ``ranks``, and raise :class:`CollectiveMismatchError` naming the first difference."""
    me = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    store.set(f"{key}/{me}", json.dumps([list(c) for c in collectives]))
    peers = sorted(ranks)
    keys = [f"{key}/{r}" for r in peers]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception as e:  # the store's timeout (DistStoreError, or RuntimeError on older torch)
        missing = [r for r, k in zip(peers, keys) if not store.check([k])]
        raise CollectiveTimeoutError(
            f"{where}: rank {me}'s compiled graph runs other collectives than its peers', and "
            f"rank(s) {missing} did not publish theirs within {timeout_s:g} s to say which"
        ) from e
    theirs = {r: json.loads(store.get(k)) for r, k in zip(peers, keys)}
    why = collectives_difference({r: [tuple(c) for c in t] for r, t in theirs.items()})
    raise CollectiveMismatchError(
        f"{where}: the ranks compiled graphs with different collectives ({why}), which "
        "would pair unrelated collectives. A module of a fully_shard group whose forward "
        "runs on some ranks only gathers its group there only (also when only some ranks "
        "recompiled: a guard that failed there, such as a flag that changed on those ranks): "
        "run every module on every rank (route inside a group, e.g. multiply an unused "
        "branch's output by 0), or make the step without compile (the eager path raises at "
        "the first such collective)"
    )


def _max_over(values: torch.Tensor, mesh_dims: Sequence[tuple[Any, int]]) -> torch.Tensor:
    """``values``' elementwise max over every rank of the meshes: one max all-reduce over each
    ``(mesh, dim)`` in turn (together they reach every rank of a mesh)."""
    out = values
    for mesh, dim in mesh_dims:
        if mesh.size(dim) > 1:
            t = out.to(mesh.device_type)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
            out = t.cpu()
    return out
