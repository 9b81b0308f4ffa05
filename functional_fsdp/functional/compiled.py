"""The training step compiled whole: each group's all-gather and reduce-scatter are graph nodes.

``make_train_step(..., compile=...)`` uses this module. The shell's
:class:`~functional_fsdp.shell.api.traced.TracedModel` is the forward as one function of this
rank's local shards, its collectives PyTorch's traceable functional collectives;
``torch.compile`` traces it with ``fullgraph=True`` (a graph break is a named error, never a
silent eager fallback) and AOTAutograd derives the backward graph, reduce-scatters included.
:class:`CompiledGrads` runs it over the micro-batches and returns what the eager step's
``accumulate_grads`` returns; the gradient norm, the loss all-reduce and the optimizer update
run as in the eager step.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
import torch.nn as nn

from ..core.errors import ArgumentTypeError, UnsupportedError
from ..core.overlap import GraphNode, NodeKind, overlap_order
from ..core.reproducible import ReproduciblePolicy
from ..core.traced import collectives_digest
from ..shell import (
    TracedModel,
    TreeReductions,
    agree_on_run,
    graph_collectives,
    next_graph_key,
    unused_locals,
    wrap_like,
)
from ._stepping import (
    Accumulated,
    _local,
    _loss_and_aux,
    add_micro_grads,
    detached,
    dp_size,
    split_batch,
    tree_grads,
)

__all__ = ["CompileReport", "CompiledGrads", "compile_backward"]


@attrs.frozen
class CompileReport:
    """What compiling the step did (``step.compile_report()``).

    Attributes:
        backend: the ``torch.compile`` backend.
        compile_seconds: the first call's time beyond a steady call's (tracing and compiling).
        graphs: graphs compiled so far (1 per distinct micro-batch signature; more means
            recompiles).
        recompiles: compiles after the first (a guard failed: new shapes, dtypes or settings).
        forward_collectives: collective nodes in the forward graph, by op (aot backends only:
            ``{}`` for inductor, whose graphs are not handed to us).
        backward_collectives: the same for the backward graph.
        overlap: whether the reordering pass ran on the graphs (``compile_overlap`` on a
            backend it applies to: ``aot_eager``, ``inductor``), so that each collective is
            issued early and waited for late (:mod:`functional_fsdp.core.overlap`).
        moved_nodes: for each graph the pass ran on (forward, then backward), how many of its
            nodes it moved (0: a graph it must leave as traced, or nothing to move). Inductor
            runs it only when it compiles a graph (not on a cache hit).
    """

    backend: str
    compile_seconds: float
    graphs: int
    recompiles: int
    forward_collectives: dict[str, int]
    backward_collectives: dict[str, int]
    overlap: bool = False
    moved_nodes: tuple[int, ...] = ()


class CompiledGrads:
    """Forward and backward of the step for one model, compiled: ``grads(params, batch)``
    returns the same :class:`~._stepping.Accumulated` the eager step's ``accumulate_grads``
    does (sharded, reduced local gradients), from graphs with the collectives inside."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Any,
        trainable: Sequence[str],
        backend: str,
        *,
        overlap: bool = True,
        reproducible: ReproduciblePolicy | None = None,
        where: str = "make_train_step",
    ) -> None:
        self.where = where  # the caller, named in errors
        self.overlap = overlap
        self.policy = reproducible
        self._moved: list[int] = []
        reduce = "scatter"
        if reproducible is not None:  # one micro-batch per rank: the whole tree in the graph
            reduce = (
                "tree"
                if reproducible.micro_batches_per_rank(dp_size(model.parameters())) == 1
                else "outside"
            )
        traced = TracedModel(model, loss_fn, reduce=reduce, where=where)
        self._traced = traced
        self.reduce = reduce
        self.trainable = list(trainable)
        self.backend = backend
        self._order = traced.order
        self._graphs: dict[str, Any] = {}
        self._calls = 0
        self._first_s = 0.0
        self._steady_s: float | None = None

        def forward(locals_: list[torch.Tensor], batch: Any, sinks: list[torch.Tensor]) -> Any:
            return traced.forward(locals_, batch, sinks)

        # A code object of its own: dynamo caches compiled frames per code object, and every
        # step made in a process would otherwise share (and evict) one cache.
        forward = types.FunctionType(
            forward.__code__.replace(), forward.__globals__, "forward", None, forward.__closure__
        )
        self._compiles = 0
        self._graph_key = next_graph_key()
        self._runs = 0  # graphs run so far (the same count on every rank)
        # Per graph this rank compiled, worked out once when it is compiled: its collectives,
        # their digest, and per trainable parameter whether the graph reads it.
        self._graph_facts: list[tuple[list[Any], int, list[bool]]] = []
        # Per trainable parameter: whether a graph that ran in the current step, on any rank,
        # reads it (answered with each run's agreement).
        self._read: list[bool] = []
        self._compiled = torch.compile(forward, backend=self._backend(), fullgraph=True)

    def _backend(self) -> Any:
        """The backend, counting the graphs it compiles; for ``aot_eager`` (AOTAutograd with
        no code generation and the min-cut partitioner, which honours the recompute marks) the
        forward and backward graphs are kept for :meth:`report`."""
        if self.backend == "aot_eager":
            from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
            from torch._dynamo.backends.common import aot_autograd

            graphs = self._graphs

            def keep(kind: str) -> Any:
                def compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
                    del example_inputs
                    if self.overlap:
                        self._moved.append(reorder_for_overlap(gm.graph))
                        gm.recompile()
                    graphs[kind] = gm
                    return make_boxed_func(gm.forward)

                return compiler

            inner: Any = aot_autograd(
                fw_compiler=keep("forward"),
                bw_compiler=keep("backward"),
                partition_fn=min_cut_rematerialization_partition,
                keep_inference_input_mutations=True,
            )
        elif self.backend == "inductor" and self.overlap:
            from torch._inductor.compile_fx import compile_fx

            overlap_pass = _overlap_pass(self._moved)

            def inner(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
                return compile_fx(
                    gm, example_inputs, config_patches={"post_grad_custom_post_pass": overlap_pass}
                )

        else:
            try:
                inner = torch._dynamo.lookup_backend(self.backend)
            except Exception as e:  # torch's InvalidBackend (its module moved between releases)
                raise ArgumentTypeError(
                    f"{self.where}: compile={self.backend!r} is not a torch.compile backend; "
                    f"use True (inductor) or one of {sorted(torch._dynamo.list_backends())} "
                    "(or 'aot_eager')"
                ) from e

        def counted(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            order = self._order
            # Every graph, the first and any a guard that failed (maybe on this rank only)
            # compiled later: its collectives, compared with the peers' before each run, and
            # what it never reads.
            collectives = graph_collectives(gm)
            never = {order[i] for i in unused_locals(gm, len(order)) or ()}
            reads = [n not in never for n in self.trainable]
            self._graph_facts.append((collectives, collectives_digest(collectives), reads))
            index = self._compiles
            self._compiles += 1
            return _noting_runs(inner(gm, example_inputs), lambda: self._about_to_run(index))

        return counted

    def _about_to_run(self, index: int) -> None:
        """Before graph ``index`` runs: check that every rank runs graphs with the same
        collectives (:func:`agree_on_run`; a recompile on some ranks only is checked as the
        first graphs are), and learn in the same all-reduce which trainable parameters some
        rank's graph reads (for :meth:`unused`)."""
        self._runs += 1
        collectives, digest, reads = self._graph_facts[index]
        read = agree_on_run(
            collectives,
            digest,
            f"{self._graph_key}/{self._runs}",
            self.where,
            self._traced.ranks,
            self._traced.mesh_dims,
            reads=reads,
        )
        self._read = [a or b for a, b in zip(self._read, read)] if self._read else read

    def grads(
        self, params: dict[str, Any], batch: Any, grad_accum: int, has_aux: bool
    ) -> Accumulated:
        """The step's forward and backward passes over ``grad_accum`` micro-batches."""
        t0 = time.perf_counter()
        self._read = []
        trainable = set(self.trainable)
        leaves = {n: _local(params[n]).detach().requires_grad_(n in trainable) for n in self._order}
        ordered = [leaves[n] for n in self._order]
        inputs = [leaves[n] for n in self.trainable]
        acc: list[torch.Tensor] | None = None
        loss_sum = torch.zeros(())
        auxes: list[Any] = []
        tree = _Tree(self._traced, self.policy, leaves) if self.reduce == "outside" else None
        for micro in split_batch(batch, grad_accum):
            sinks = tree.sinks() if tree is not None else []
            loss, aux = _loss_and_aux(self._call(ordered, micro, sinks), has_aux)
            loss_sum = loss_sum + loss.detach().float()
            if has_aux:
                auxes.append(detached(aux))
            scaled = loss / grad_accum if grad_accum > 1 else loss
            if tree is not None:
                tree.push(scaled, sinks)
            else:
                got = torch.autograd.grad(scaled, inputs, allow_unused=True)
                acc = add_micro_grads(acc, got, inputs)
            del loss, aux, scaled
        if tree is not None:
            acc = tree.finish(inputs)
        assert acc is not None
        seconds = time.perf_counter() - t0
        self._calls += 1
        if self._calls == 1:
            self._first_s = seconds
        elif self._steady_s is None or seconds < self._steady_s:
            self._steady_s = seconds
        return Accumulated(acc, loss_sum, auxes)

    def _call(self, ordered: list[torch.Tensor], micro: Any, sinks: list[torch.Tensor]) -> Any:
        self._traced.refresh()  # the model's settings as they are now, outside the graph
        try:
            return self._compiled(ordered, micro, sinks)
        except torch._dynamo.exc.Unsupported as e:  # traced on fake tensors: no collective ran
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UnsupportedError(
                f"{self.where}(compile=...): the step does not trace as one graph ({first}); "
                "the model or loss_fn calls something torch.compile cannot trace (see the "
                "chained error for where). Make the step without compile, or change that call"
            ) from e

    def unused(self) -> frozenset[str]:
        """The trainable parameters no rank's graph read in the step that just ran (no
        collective: each graph run's agreement all-reduced, per trainable parameter, whether
        the graph each rank runs reads it). Which graphs run is each rank's own: a guard that
        failed on some ranks only compiles a graph there, and a graph compiled later (a branch
        switched off after the first steps) may not read what the first graphs read, so no
        rank can answer alone."""
        return frozenset(n for n, read in zip(self.trainable, self._read) if not read)

    def report(self) -> CompileReport:
        """What compiling did so far (see :class:`CompileReport`)."""
        steady = self._steady_s if self._steady_s is not None else 0.0
        return CompileReport(
            self.backend,
            max(0.0, self._first_s - steady),
            self._compiles,
            max(0, self._compiles - 1),
            _collectives(self._graphs.get("forward")),
            _collectives(self._graphs.get("backward")),
            self.overlap and bool(self._moved),
            tuple(self._moved),
        )


def _noting_runs(fn: Any, note: Callable[[], None]) -> Any:
    """``fn`` (a compiled graph as a backend returns it) calling ``note()`` first whenever it
    runs. It passes its arguments on as it gets them and carries ``fn``'s attributes (such as
    ``_boxed_call``), so its caller calls it as it would call ``fn``."""

    def run(*args: Any, **kwargs: Any) -> Any:
        note()
        return fn(*args, **kwargs)

    run.__dict__.update(getattr(fn, "__dict__", {}))
    return run


def _collectives(gm: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for op, *_ in graph_collectives(gm) if gm is not None else ():
        out[op] = out.get(op, 0) + 1
    return out


class _Tree:
    """A ReproduciblePolicy's reduction of a step with several micro-batches per rank: each
    micro-batch's graph hands out its full gradients (as the gradients of *sinks*, one per
    parameter) and the eager engine's :class:`~functional_fsdp.shell.TreeReductions` sums them
    in the canonical tree and reduces each group once after the last, as the eager step does."""

    def __init__(self, traced: TracedModel, policy: Any, leaves: dict[str, torch.Tensor]) -> None:
        self.traced, self.leaves = traced, leaves
        self.tree = TreeReductions(policy)
        self.shapes = [
            (spec.shape, dtype)
            for lay in traced.layouts
            for spec, dtype in zip(lay.specs, lay.gather_dtypes)
        ]
        self.trains = [leaves[name].requires_grad for name in traced.order]

    def sinks(self) -> list[torch.Tensor]:
        """One micro-batch's sinks: each a parameter's full shape and dtype, one element of
        memory (stride 0: their values are never read); a frozen parameter's needs no
        gradient."""
        return [
            torch.empty_strided(shape, (0,) * len(shape), dtype=dtype).requires_grad_(trains)
            for (shape, dtype), trains in zip(self.shapes, self.trains)
        ]

    def push(self, loss: torch.Tensor, sinks: Sequence[torch.Tensor]) -> None:
        """One micro-batch's full gradients (the sinks'), each group's a leaf of its tree."""
        wanted = [s for s in sinks if s.requires_grad]
        got = iter(torch.autograd.grad(loss, wanted, allow_unused=True))
        grads = [next(got) if s.requires_grad else None for s in sinks]
        order, k = self.traced.order, 0
        for group, lay in zip(self.traced.groups, self.traced.layouts):
            n = len(lay)
            sources = tuple(id(self.leaves[name]) for name in order[k : k + n])
            self.tree.push(group, group.state, sources, grads[k : k + n])
            k += n
        self.tree.end_backward()

    def finish(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Reduce every group once; the local gradients of ``inputs`` (zeros where none)."""
        return tree_grads(self.tree, inputs)


_C10D = "_c10d_functional."
_KINDS: dict[str, NodeKind] = {
    "all_gather_into_tensor": "gather",
    "reduce_scatter_tensor": "reduce",
    "all_reduce": "reduce",
    "all_to_all_single": "reduce",
    "wait_tensor": "wait",
}


def _ordered(node: torch.fx.Node) -> bool:
    """A random op (it draws from the generator's state: its order among them matters)."""
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def _kind(node: torch.fx.Node) -> NodeKind | None:
    """The scheduler's kind of ``node``; ``None`` for a node it must not move (an in-place
    op: reordering it could change what its readers see; a collective it does not know)."""
    if node.op in ("placeholder", "get_attr"):
        return "input"
    if node.op == "output":
        return "output"
    target = str(node.target)
    if _C10D in target:
        return _KINDS.get(target.split(_C10D, 1)[1].split(".")[0])
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or (schema is not None and schema.is_mutable):
        return None
    return "compute"


def reorder_for_overlap(graph: torch.fx.Graph, depth: int = 1) -> int:
    """Reorder ``graph`` in place (its nodes are moved, none added) as
    :func:`~functional_fsdp.core.overlap.overlap_order` says: each collective issued early,
    waited for late, at most ``depth`` of a kind in flight, random ops in their order. A graph
    with a node the scheduler must not move (an in-place op, an unknown collective) or cannot
    describe is left as it is. Returns how many nodes changed place."""
    nodes = list(graph.nodes)
    kinds = [_kind(n) for n in nodes]
    if any(k is None for k in kinds):
        return 0
    index = {n: i for i, n in enumerate(nodes)}
    desc = [
        GraphNode(k, tuple(index[a] for a in n.all_input_nodes), _ordered(n))  # type: ignore[arg-type]
        for n, k in zip(nodes, kinds)
    ]
    try:
        order = overlap_order(desc, depth=depth)
    except ValueError:  # a graph the scheduler cannot describe (a wait of a view): as traced
        return 0
    moved = sum(1 for pos, i in enumerate(order) if pos != i)
    if moved:
        prev = nodes[order[0]]
        for i in order[1:]:
            prev.append(nodes[i])
            prev = nodes[i]
        graph.lint()
    return moved


def _overlap_pass(moved: list[int]) -> Any:
    """:func:`reorder_for_overlap` as inductor's post-grad pass (on inductor's own graphs),
    appending to ``moved`` what it moved in each."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class OverlapPass(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            moved.append(reorder_for_overlap(graph))

        def uuid(self) -> Any:
            return "functional_fsdp.reorder_for_overlap/1"

    return OverlapPass()


def compile_backward(
    model: nn.Module,
    loss_fn: Any,
    *,
    compile: bool | str = True,
    grad_accum: int = 1,
    compile_overlap: bool = True,
) -> Callable[[Any], torch.Tensor]:
    """The compiled step for the module API: ``backward(batch) -> loss`` runs ``loss_fn`` and its
    backward as graphs with every group's all-gather and reduce-scatter inside (see
    :func:`~functional_fsdp.functional.make_train_step`'s ``compile``), on ``model``'s own
    sharded parameters, and accumulates the reduced gradients into their ``.grad`` as
    ``loss.backward()`` through the FSDP hooks would. A torch optimizer steps as usual::

        backward = compile_backward(model, lambda m, b: m.loss(*b), compile="aot_eager")
        for batch in data:
            loss = backward(batch)
            opt.step()
            opt.zero_grad()

    Args:
        model: the root module sharded with ``fully_shard``.
        loss_fn: ``loss_fn(module, batch) -> scalar``.
        compile: ``True`` (inductor) or a ``torch.compile`` backend's name.
        grad_accum: micro-batches per call (``batch`` split on dim 0), each loss divided by it.
        compile_overlap: reorder the graphs so that collectives overlap compute (as
            ``make_train_step``'s).

    Returns:
        ``backward(batch)``: the mean loss over the micro-batches (detached). The compile report
        is ``backward.compile_report()``.

    Raises:
        UnsupportedError: what the trace does not cover (as ``make_train_step``), before any
            collective.
        CollectiveMismatchError: at any call, on every rank, when the ranks' graphs run
            different collectives (a module of a group that runs on some ranks only, also in
            a graph that some ranks recompiled alone), before any of them ran.
    """
    from .step import _check_arguments, _compiled, _trainable

    _check_arguments(model, None, grad_accum, where="compile_backward")
    if compile is False:
        raise ArgumentTypeError(
            "compile_backward: compile=False compiles nothing; without compiling, call "
            "loss_fn(model, batch).backward() (the FSDP hooks reduce the gradients)"
        )
    trainable = _trainable(model)
    compiled = _compiled(
        model, loss_fn, trainable, compile, None, where="compile_backward", overlap=compile_overlap
    )
    own = dict(model.named_parameters())

    def backward(batch: Any) -> torch.Tensor:
        acc = compiled.grads(own, batch, grad_accum, False)
        unused = compiled.unused()  # as loss.backward(): no gradient where no rank used it
        with torch.no_grad():
            for n, g in zip(trainable, acc.grads):
                if n in unused:
                    continue
                p = own[n]
                if p.grad is None:
                    p.grad = wrap_like(g, p)
                else:
                    _local(p.grad).add_(g)
        return acc.loss_sum / grad_accum

    backward.compile_report = compiled.report  # type: ignore[attr-defined]
    return backward
