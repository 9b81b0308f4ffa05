"""The autograd Functions of the shell: where gathers and reductions meet autograd.

- :class:`UnshardFn` (the module path): forward returns a group's full parameters (views of
  its persistent buffer); backward reduces their gradients into ``.grad`` (overlapped with the
  rest of backward), or, while ``torch.autograd.grad`` runs, returns them to autograd.
- :class:`GatherFn` (the functional path, ``functional_call`` / ``torch.func``): forward
  all-gathers the tensors the caller registered; backward returns their reduced gradients.
- :class:`UseFn` (weights tied across groups): one use's views of full tensors; backward passes
  the gradients on and says the use's backward is done (so the buffer can be resharded).
- :class:`ReduceFn` and :class:`GatherGradFn`: the reduce-scatter of gradients and its adjoint,
  an all-gather. The reduction is linear, so recording it (``create_graph=True``) makes double
  backward and Hessian-vector products work; FSDP2 cannot do them.

Semantics of the second order: ``GatherFn``'s backward is the group's reduction (the mean over
data-parallel ranks, or the configured divide factor), ``ReduceFn``'s backward a plain
all-gather, so ``autograd.grad(autograd.grad(loss, p, create_graph=True), p, v)`` is the
Hessian-vector product of the data-parallel mean loss.

This module imports no engine module: each Function names what it calls back into as a
``Protocol`` (:class:`Unsharding`, :class:`GradReduction`, :class:`SourceGather`), which the
group (``group.ParamGroup``, ``gradients.OwnReduction``) and the functional path
(``functional_path.GatherCall``) implement. The group's phases create the Functions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch.distributed.tensor import DTensor

__all__ = [
    "FORWARD_AD_MESSAGE",
    "PER_EXAMPLE_MESSAGE",
    "GatherFn",
    "GatherGradFn",
    "GradReduction",
    "ReduceFn",
    "SourceGather",
    "UnshardFn",
    "Unsharding",
    "UseFn",
    "explain_forward_ad_on_dtensor",
    "reduce_differentiably",
]


class Unsharding(Protocol):
    """What :class:`UnshardFn` needs of a group (``ParamGroup``)."""

    @property
    def views(self) -> tuple[torch.Tensor, ...]:
        """The full parameters (views of the group's unsharded buffer)."""
        ...

    @property
    def requires_grad(self) -> tuple[bool, ...]:
        """Per parameter, whether it trains."""
        ...

    def unshard_backward(
        self, grads: Sequence[torch.Tensor | None], made_in_forward: bool = True
    ) -> tuple[Any, ...]:
        """Reduce the full gradients (``made_in_forward``: the full tensors were not made by
        a recompute inside the backward); what autograd gets for the sharded parameters."""
        ...


class GradReduction(Protocol):
    """A reduction whose sharded gradients autograd receives (:class:`ReduceFn`'s ``call``):
    a functional call's (``functional_path.GatherCall``) or the group's own
    (``gradients.OwnReduction``)."""

    create_graph: bool

    def reduce(self, grads: Sequence[torch.Tensor | None]) -> tuple[DTensor | None, ...]:
        """Reduce-scatter full gradients into sharded ``DTensor`` gradients."""
        ...

    def gather_cotangents(self, cotangents: Sequence[Any]) -> tuple[torch.Tensor, ...]:
        """The adjoint of :meth:`reduce`: all-gather sharded cotangents into full tensors."""
        ...


class SourceGather(GradReduction, Protocol):
    """What :class:`GatherFn` needs of a functional call (``functional_path.GatherCall``)."""

    @property
    def requires_grad(self) -> tuple[bool, ...]:
        """Per parameter, whether it trains."""
        ...

    def gather(self, sources: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """All-gather the sources; the full parameters."""
        ...


class UnshardFn(torch.autograd.Function):
    """Forward: the group's full parameters. Backward: reduce-scatter their gradients."""

    @staticmethod
    def forward(ctx: Any, group: Unsharding, *sharded: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        # Made by the forward, or by a recompute inside the backward (a reentrant checkpoint's).
        # (The hooks that apply this run eagerly, outside any compiled region.)
        ctx.made_in_forward = torch._C._current_graph_task_id() == -1
        ctx.set_materialize_grads(False)
        outs = tuple(v.view_as(v) for v in group.views)
        frozen = [o for o, rg in zip(outs, group.requires_grad) if not rg]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        # Into .grad (loss.backward()), or returned reduced while torch.autograd.grad runs.
        group: Unsharding = ctx.group
        return (None, *group.unshard_backward(grads, ctx.made_in_forward))


class UseFn(torch.autograd.Function):
    """Forward: views of full tensors for one use (a module of another group using a tied
    weight, or a lending group's own modules). Backward: the gradients unchanged (autograd
    sums every use's in the tensors viewed) and ``done()`` called: the use's backward is over.

    Written in the ``setup_context`` style so ``torch.func`` transforms can run it.
    """

    @staticmethod
    def forward(done: Callable[[], None], *fulls: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t.view_as(t) for t in fulls)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        ctx.done = inputs[0]
        ctx.set_materialize_grads(False)
        frozen = [o for o, t in zip(output, inputs[1:]) if not t.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        ctx.done()
        return (None, *grads)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        raise NotImplementedError(FORWARD_AD_MESSAGE)


class GatherFn(torch.autograd.Function):
    """Forward: all-gather the sources. Backward: reduce-scatter (through :class:`ReduceFn`).

    Written in the ``setup_context`` style so ``torch.func`` transforms can run it.
    """

    @staticmethod
    def forward(call: SourceGather, *sources: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return call.gather(sources)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        call: SourceGather = inputs[0]
        ctx.call = call
        ctx.set_materialize_grads(False)
        frozen = [o for o, rg in zip(output, call.requires_grad) if not rg]
        if frozen:
            ctx.mark_non_differentiable(*frozen)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        # Under torch.func the grads arrive wrapped at the transform's level: a second Function
        # unwraps them, runs the collective on plain tensors and wraps the sharded results.
        return (None, *reduce_differentiably(ctx.call, grads))

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        raise NotImplementedError(FORWARD_AD_MESSAGE)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, call: SourceGather, *sources: torch.Tensor) -> Any:
        raise NotImplementedError(
            "vmap over the parameters of a sharded module (e.g. model ensembling) is not "
            "supported: each parameter is one DTensor shard per rank. vmap over the inputs works "
            "(pass the parameters unbatched, in_dims=None)"
        )


class ReduceFn(torch.autograd.Function):
    """Forward: reduce-scatter full gradients into sharded ``DTensor`` gradients."""

    @staticmethod
    def forward(call: GradReduction, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        return call.reduce(grads)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        ctx.call = inputs[0]
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, *cotangents: Any) -> tuple[Any, ...]:
        # Double backward: the reduce-scatter is linear; its adjoint is an all-gather.
        if torch._C._are_functorch_transforms_active():
            raise NotImplementedError(
                "higher-order derivatives through torch.func transforms (grad(grad(...)), "
                "hessian) of a sharded module are not supported; double backward works with "
                "torch.autograd: torch.autograd.grad(loss, params, create_graph=True), then "
                "torch.autograd.grad(grads, params, grad_outputs=v) for a Hessian-vector product"
            )
        return (None, *GatherGradFn.apply(ctx.call, *cotangents))

    @staticmethod
    def vmap(info: Any, in_dims: tuple, call: GradReduction, *grads: Any) -> Any:
        raise NotImplementedError(PER_EXAMPLE_MESSAGE)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        raise NotImplementedError(FORWARD_AD_MESSAGE)


class GatherGradFn(torch.autograd.Function):
    """Forward: all-gather sharded cotangents of the reduced gradients into full tensors (the
    adjoint of the reduction). Backward: the reduction again (third order and up)."""

    @staticmethod
    def forward(call: GradReduction, *cotangents: Any) -> tuple[torch.Tensor, ...]:
        return call.gather_cotangents(cotangents)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        ctx.call = inputs[0]
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        return (None, *reduce_differentiably(ctx.call, grads))


def reduce_differentiably(
    call: GradReduction, grads: Sequence[torch.Tensor | None]
) -> tuple[Any, ...]:
    """Reduce-scatter full gradients into sharded ``DTensor`` gradients through autograd: when
    the backward runs with ``create_graph=True`` the reduction is recorded (its derivative is an
    all-gather) and the full parameters are kept for the double backward."""
    call.create_graph = torch.is_grad_enabled()
    return ReduceFn.apply(call, *grads)


PER_EXAMPLE_MESSAGE = (
    "batched gradients through a sharded module (vmap(grad(...)) per-example gradients, jacrev "
    "over parameters) are not supported. Note what grad through a sharded module computes: the "
    "gradient of the loss averaged over the data-parallel ranks (each rank's call contributes "
    "its own inputs, and the reduce-scatter averages them), so a per-example grad on one rank "
    "is NOT that example's gradient. For per-example gradients use an unsharded copy of the "
    "model (functional_fsdp.summon_full_params, or a full state dict) with torch.func there"
)

FORWARD_AD_MESSAGE = (
    "forward-mode AD (torch.func.jvp, jacfwd, hessian, jvp(grad(...))) over DTensor primals, "
    "such as the parameters of a module sharded with fully_shard, is not supported: DTensor has "
    "no forward-AD rules in torch 2.13 (it cannot make a dual DTensor). For Hessian-vector "
    "products use reverse over reverse: "
    "torch.autograd.grad(torch.autograd.grad(loss, params, create_graph=True), params, v)"
)


def _refuse_dual_dtensor(op_call: Any, args: Any, kwargs: Any) -> Any:
    raise NotImplementedError(FORWARD_AD_MESSAGE)


def explain_forward_ad_on_dtensor() -> None:
    """Make DTensor refuse forward-mode AD with :data:`FORWARD_AD_MESSAGE`.

    ``torch.func.jvp`` over ``DTensor`` primals fails inside ``make_dual`` (DTensor has no rule
    for ``aten._has_same_storage_numel``), before any FSDP code runs, with a bare "no sharding
    strategy" message. This registers a handler for that one op in DTensor's dispatcher, which
    raises the same ``NotImplementedError`` with a message that says what is unsupported and
    what to use instead. The only change we make to torch's state; idempotent.
    """
    handlers = DTensor._op_dispatcher._custom_op_handlers
    handlers.setdefault(torch.ops.aten._has_same_storage_numel.default, _refuse_dual_dtensor)
