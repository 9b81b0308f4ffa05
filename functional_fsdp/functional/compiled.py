"""The training step compiled whole: each group's all-gather and reduce-scatter are graph nodes.

``make_train_step(..., compile=...)`` uses this module. Instead of the module's FSDP hooks
(eager Python around every group), the forward is one traced function of this rank's local
shards and the micro-batch, as SimpleFSDP writes it:

    for every group: flat = pack_shards(its local shards)            # core/traced.py
                     full = gather(flat)          # a functional all-gather in the graph
                     params += full_params(full)  # views, core/traced.py
    loss = loss_fn(skeleton, batch)               # functional_call on a hook-free copy

``gather`` is an autograd function whose forward casts to the group's gather dtype
(``param_dtype``) and all-gathers with PyTorch's traceable functional collectives, and whose
backward casts the gradient to the reduce dtype and reduce-scatters it (HSDP: then all-reduces
over the replicas), divided as FSDP2 divides (the core's ``divide_factors``). ``torch.compile``
traces it with ``fullgraph=True``: a graph break is an error, never a silent eager fallback.
AOTAutograd derives the backward graph, reduce-scatters included. With
``reshard_after_forward=True`` (the group's setting) the all-gather is marked must-recompute for
the partitioner, so the backward graph gathers the parameters again instead of keeping them
from the forward; with ``False`` the forward's full parameters are kept for the backward.

The module itself is not run: a *skeleton* (the same classes and submodules, parameters
replaced by meta placeholders, the package's hooks dropped, the input and output casts of the
mixed-precision policy kept as plain hooks) is what ``loss_fn`` sees. The gradient norm, the
loss all-reduce and the optimizer update run as in the eager step.
"""

from __future__ import annotations

import functools
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from ..core.errors import UnsupportedError
from ..core.layout import DivideFactors, divide_factors
from ..core.records import GroupLayout
from ..core.traced import full_params, pack_shards, traceable_reason
from ..shell.api.state import _cast_floats
from ..shell.recovery.copies import model_groups
from ._stepping import Accumulated, _loss_and_aux, split_batch

__all__ = ["CompileReport", "CompiledGrads"]

_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


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
    """

    backend: str
    compile_seconds: float
    graphs: int
    recompiles: int
    forward_collectives: dict[str, int]
    backward_collectives: dict[str, int]


@attrs.frozen
class _GroupTrace:
    """What the traced forward needs of one group: its parameters' names in layout order, the
    layout, the collectives' groups, FSDP2's divide factors and whether to re-gather in
    backward."""

    names: tuple[str, ...]
    layout: GroupLayout
    shard: Any  # (DeviceMesh, dim) of the shard group
    replicate: Any  # (DeviceMesh, dim) of the replicate group (HSDP), or None
    factors: DivideFactors
    recompute: bool

    def gather_fn(self) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
        """The group's full parameters from this rank's packed shards: the all-gather (an
        autograd function whose backward is the reduce-scatter) and the unpacking views; with
        ``recompute``, the whole region is recomputed in backward rather than kept."""
        lay, shard, replicate, df = self.layout, self.shard, self.replicate, self.factors
        gather_dtype = lay.gather_buffer_dtype
        reduce_dtype = lay.reduce_dtype or gather_dtype
        storage_dtype = lay.storage_dtype
        rs_size, ar_size = lay.world_size, _size(replicate)

        class _Gather(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, flat: torch.Tensor) -> torch.Tensor:
                return funcol.wait_tensor(_all_gather(flat.to(gather_dtype), 0, shard))

            @staticmethod
            def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
                g = grad.to(reduce_dtype)
                if df.premul is not None:
                    g = g * df.premul
                if df.pre is not None:
                    g = g / df.pre
                g = funcol.wait_tensor(_reduce_scatter(g.contiguous(), "sum", 0, shard))
                if df.op == "avg":
                    g = g / rs_size
                if replicate is not None:
                    g = funcol.wait_tensor(funcol.all_reduce(g, "sum", replicate))
                    if df.all_reduce_op == "avg":
                        g = g / ar_size
                if df.post is not None:
                    g = g / df.post
                return g.to(storage_dtype)

        def gathered(flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return full_params(_Gather.apply(flat), lay)

        if not self.recompute:
            return gathered

        def regathered(flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return checkpoint(
                gathered,
                flat,
                use_reentrant=False,
                context_fn=functools.partial(create_selective_checkpoint_contexts, _must_recompute),
            )

        return regathered


def _must_recompute(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    del ctx, op, args, kwargs
    return CheckpointPolicy.MUST_RECOMPUTE


def _size(group: Any) -> int:
    return 1 if group is None else group[0].size(group[1])


def _group_traces(model: nn.Module) -> list[_GroupTrace]:
    """Every group of ``model`` as a :class:`_GroupTrace`, or a named error for what the trace
    does not cover (raised before any collective)."""
    names = {id(p): n for n, p in model.named_parameters()}
    root = getattr(model, "_ffsdp_state", None)
    traces = []
    for g, path in model_groups(model):
        why = traceable_reason(g.layout)
        if why is None and g.tp is not None:
            why = "it is sharded with tensor parallelism (a 2-D mesh)"
        if why is None and g.config.reproducible is not None:
            why = "its gradients are reduced in a ReproduciblePolicy's canonical tree"
        if why is None and g.config.grad_compression is not None:
            why = "its gradients are compressed (grad_compression)"
        if why is None and g.offload:
            why = "its parameters are offloaded to the CPU (OffloadPolicy)"
        if why is not None:
            raise UnsupportedError(
                f"make_train_step(compile=...): group {path} cannot be traced: {why}; make the "
                "step without compile (the eager functional step supports it)"
            )
        params = [getattr(m, attr) for m, attr in (h[0] for h in g.holders)]
        hsdp = g.mesh.ndim == 2
        df = divide_factors(
            g.layout.world_size,
            g.mesh.size(0) if hsdp else 1,
            overflow_risk=(g.layout.reduce_dtype or g.layout.gather_buffer_dtype) == torch.float16,
            factor=g.config.divide_factor,
            force_sum=g.config.force_sum,
        )
        traces.append(
            _GroupTrace(
                tuple(names[id(p)] for p in params),
                g.layout,
                (g.mesh, 1 if hsdp else 0),
                (g.mesh, 0) if hsdp else None,
                df,
                _regathers(g, root),
            )
        )
    return traces


def _regathers(group: Any, root: Any) -> bool:
    """Whether the backward gathers ``group`` again: its ``reshard_after_forward`` (an int
    sub-group counts as resharding: the trace gathers from the whole shard group), except the
    root's group by default, which FSDP2 keeps after forward (as the eager path's lazy init
    does)."""
    if root is not None and group is root.group and root.user_reshard_after_forward is None:
        return False
    return group.config.reshard_after_forward is not False


# ------------------------------------------------------------------------------ the skeleton


_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def _skeleton(model: nn.Module) -> nn.Module:
    """A hook-free stand-in for ``model``: the same classes (FSDP's subclasses undone) and
    attributes, each parameter a meta tensor of its full shape (ties kept), buffers shared,
    the package's forward hooks dropped and the mixed-precision casts kept as plain hooks."""
    placeholders: dict[int, nn.Parameter] = {}
    done: dict[int, nn.Module] = {}

    def meta(p: torch.Tensor) -> nn.Parameter:
        if id(p) not in placeholders:
            shape = p.shape  # a DTensor's is the full shape
            placeholders[id(p)] = nn.Parameter(
                torch.empty(shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad
            )
        return placeholders[id(p)]

    def copy(m: nn.Module) -> nn.Module:
        if id(m) in done:
            return done[id(m)]
        cls = type(m)
        state = getattr(m, "_ffsdp_state", None)
        if state is not None:
            cls = next(c for c in cls.__mro__[1:] if "FSDP" not in c.__name__ and c is not object)
        new = cls.__new__(cls)
        new.__dict__.update(m.__dict__)
        new.__dict__.pop("_ffsdp_state", None)
        new._parameters = {k: None if p is None else meta(p) for k, p in m._parameters.items()}
        new._buffers = dict(m._buffers)
        for d in _HOOK_DICTS:
            hooks = getattr(m, d, None)
            if hooks is not None:
                setattr(
                    new,
                    d,
                    hooks.__class__(
                        (k, h)
                        for k, h in hooks.items()
                        if not getattr(h, "__module__", "").startswith("functional_fsdp.")
                    )
                    if not isinstance(hooks, set)
                    else set(),
                )
        done[id(m)] = new
        new._modules = {k: None if c is None else copy(c) for k, c in m._modules.items()}
        if state is not None:
            _keep_casts(new, state.mp_policy)
        return new

    return copy(model)


def _keep_casts(module: nn.Module, policy: Any) -> None:
    """The mixed-precision policy's input and output casts of one FSDP module, as hooks."""
    if policy.cast_forward_inputs and policy.param_dtype is not None:
        dtype = policy.param_dtype
        module.register_forward_pre_hook(
            lambda m, args, kwargs: _cast_floats((args, kwargs), dtype), with_kwargs=True
        )
    if policy.output_dtype is not None:
        out_dtype = policy.output_dtype
        module.register_forward_hook(lambda m, args, out: _cast_floats(out, out_dtype))


class _LossOf(nn.Module):
    def __init__(self, module: nn.Module, loss_fn: Any) -> None:
        super().__init__()
        self.module = module
        self.loss_fn = loss_fn

    def forward(self, batch: Any) -> Any:
        return self.loss_fn(self.module, batch)


# ---------------------------------------------------------------------------------- the step


class CompiledGrads:
    """Forward and backward of the step for one model, compiled: ``grads(params, batch)``
    returns the same :class:`~._stepping.Accumulated` the eager step's ``accumulate_grads``
    does (sharded, reduced local gradients), from graphs with the collectives inside."""

    def __init__(
        self, model: nn.Module, loss_fn: Any, trainable: Sequence[str], backend: str
    ) -> None:
        self.traces = _group_traces(model)
        self.trainable = list(trainable)
        self.backend = backend
        caller = _LossOf(_skeleton(model), loss_fn)
        traces = self.traces
        gathers = [t.gather_fn() for t in traces]
        order = [n for t in traces for n in t.names]
        self._order = order
        self._graphs: dict[str, Any] = {}
        self._calls = 0
        self._first_s = 0.0
        self._steady_s: float | None = None

        def forward(locals_: list[torch.Tensor], batch: Any) -> Any:
            full: dict[str, torch.Tensor] = {}
            k = 0
            for t, gather in zip(traces, gathers):
                mine = locals_[k : k + len(t.names)]
                k += len(t.names)
                views = gather(pack_shards(mine, t.layout))
                full.update(("module." + n, v) for n, v in zip(t.names, views))
            return torch.func.functional_call(caller, full, (batch,), tie_weights=True)

        # A code object of its own: dynamo caches compiled frames per code object, and every
        # step made in a process would otherwise share (and evict) one cache.
        forward = types.FunctionType(
            forward.__code__.replace(), forward.__globals__, "forward", None, forward.__closure__
        )
        self._compiles = 0
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
                    graphs[kind] = gm
                    return make_boxed_func(gm.forward)

                return compiler

            inner: Any = aot_autograd(
                fw_compiler=keep("forward"),
                bw_compiler=keep("backward"),
                partition_fn=min_cut_rematerialization_partition,
                keep_inference_input_mutations=True,
            )
        else:
            inner = torch._dynamo.lookup_backend(self.backend)

        def counted(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            self._compiles += 1
            return inner(gm, example_inputs)

        return counted

    def grads(
        self,
        params: dict[str, Any],
        batch: Any,
        grad_accum: int,
        has_aux: bool,
    ) -> Accumulated:
        """The step's forward and backward passes over ``grad_accum`` micro-batches."""
        t0 = time.perf_counter()
        trainable = set(self.trainable)
        leaves = {n: _local(params[n]).detach().requires_grad_(n in trainable) for n in self._order}
        ordered = [leaves[n] for n in self._order]
        inputs = [leaves[n] for n in self.trainable]
        acc: list[torch.Tensor] | None = None
        loss_sum = torch.zeros(())
        auxes: list[Any] = []
        for micro in split_batch(batch, grad_accum):
            loss, aux = _loss_and_aux(self._call(ordered, micro), has_aux)
            loss_sum = loss_sum + loss.detach().float()
            if has_aux:
                auxes.append(torch.utils._pytree.tree_map_only(torch.Tensor, torch.detach, aux))
            got = torch.autograd.grad(
                loss / grad_accum if grad_accum > 1 else loss, inputs, allow_unused=True
            )
            del loss, aux
            locals_ = [g if g is not None else torch.zeros_like(x) for g, x in zip(got, inputs)]
            if acc is None:
                acc = locals_
            else:
                torch._foreach_add_(acc, locals_)
        assert acc is not None
        seconds = time.perf_counter() - t0
        self._calls += 1
        if self._calls == 1:
            self._first_s = seconds
        elif self._steady_s is None or seconds < self._steady_s:
            self._steady_s = seconds
        return Accumulated(acc, loss_sum, auxes)

    def _call(self, ordered: list[torch.Tensor], micro: Any) -> Any:
        try:
            return self._compiled(ordered, micro)
        except torch._dynamo.exc.Unsupported as e:  # traced on fake tensors: no collective ran
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UnsupportedError(
                f"make_train_step(compile=...): the step does not trace as one graph ({first}); "
                "the model or loss_fn calls something torch.compile cannot trace (see the "
                "chained error for where). Make the step without compile, or change that call"
            ) from e

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
        )


def _collectives(gm: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    if gm is None:
        return out
    for node in gm.graph.nodes:
        if node.op == "call_function" and "_c10d_functional" in str(node.target):
            name = str(node.target).split(".")[-2] if "." in str(node.target) else str(node.target)
            if name != "wait_tensor":
                out[name] = out.get(name, 0) + 1
    return out


def _local(t: Any) -> Any:
    return t._local_tensor if isinstance(t, DTensor) else t
