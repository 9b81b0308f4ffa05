"""The ranks agree on the collectives of their compiled graphs before any of them runs.

A compiled step's collectives are graph nodes that each rank traced on its own: where a
module of a ``fully_shard`` group runs on some ranks only (data-dependent control flow), one
rank's graph all-gathers that group and another's does not, and running them pairs unrelated
collectives (gloo aborts the process on the first size mismatch, or both wait for ever). The
eager engine finds this at the first such collective (``CollectiveMismatchError``); a graph
runs its collectives without the engine, so the ranks compare their graphs when they are
first compiled instead: each publishes its collectives to the default store, waits (bounded)
for the ranks it shares a process group with, and raises the same error on every rank whose
graphs differ, before any collective ran.
"""

from __future__ import annotations

import datetime
import itertools
import json

import torch
import torch.distributed as dist

from ...core.errors import CollectiveMismatchError, CollectiveTimeoutError
from ...core.traced import GraphCollective, collectives_difference

__all__ = ["agree_on_graphs", "graph_collectives", "next_graph_key"]

_KEYS = itertools.count()


def next_graph_key() -> str:
    """A store key prefix for one compiled step; every rank makes its steps in the same order
    (a program that runs the same code on every rank), so the n-th step of each rank shares
    the n-th key."""
    return f"ffsdp/compiled_graphs/{next(_KEYS)}"


def graph_collectives(gm: torch.fx.GraphModule) -> tuple[list[GraphCollective], list[str]]:
    """The collective nodes of dynamo's graph ``gm`` and of the graphs nested in it (the
    autograd functions' forward and backward bodies, checkpointed regions), in order:
    ``(op, ranks in its group, elements, dtype)`` each; and the process groups they run on.
    The backward bodies' collectives are in it too: they are traced with the forward."""
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
    return out, list(groups)


_C10D = "_c10d_functional."


def _group(name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(name)  # type: ignore[arg-type]


def agree_on_graphs(
    gm: torch.fx.GraphModule, key: str, where: str, timeout_s: float = 300.0
) -> None:
    """Publish the collectives of this rank's graph ``gm`` (:func:`graph_collectives`) under
    ``key`` and compare them with those of every rank it shares a process group with; raise
    :class:`CollectiveMismatchError` naming the first difference, or
    :class:`CollectiveTimeoutError` when a rank did not publish within ``timeout_s`` (it
    failed before compiling, or makes its steps in another order)."""
    if not dist.is_initialized():
        return
    collectives, group_names = graph_collectives(gm)
    peers = sorted({r for name in group_names for r in dist.get_process_group_ranks(_group(name))})
    me = dist.get_rank()
    if len(peers) <= 1:
        return
    store = dist.distributed_c10d._get_default_store()
    store.set(f"{key}/{me}", json.dumps([list(c) for c in collectives]))
    keys = [f"{key}/{r}" for r in peers]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception as e:  # the store's timeout (DistStoreError, or RuntimeError on older torch)
        missing = [r for r, k in zip(peers, keys) if not store.check([k])]
        raise CollectiveTimeoutError(
            f"{where}: rank {me} compiled its step and waited {timeout_s:g} s for the graphs of "
            f"rank(s) {missing}, which did not compile theirs (they failed before, or make their "
            "compiled steps in another order: every rank must make the same steps)"
        ) from e
    by_rank = {r: [tuple(c) for c in json.loads(store.get(k))] for r, k in zip(peers, keys)}
    why = collectives_difference(by_rank)  # type: ignore[arg-type]
    if why is not None:
        raise CollectiveMismatchError(
            f"{where}: the ranks compiled graphs with different collectives ({why}), which "
            "would pair unrelated collectives. A module of a fully_shard group whose forward "
            "runs on some ranks only gathers its group there only: run every module on every "
            "rank (route inside a group, e.g. multiply an unused branch's output by 0), or make "
            "the step without compile (the eager path raises at the first such collective)"
        )
