"""Functional optimizers in the optax style: ``(init, update)`` pairs over pytrees of tensors.

``update(grads, state, params) -> (new_params, new_state)`` returns the *new parameters*, not
optax's additive updates: torch's optimizers decay and step the parameter in place in a fixed
order (``p *= 1 - lr*wd``, then ``p += -step_size * m / d``), and an ``updates`` tree added
afterwards would round differently. Returning new parameters keeps the numbers equal to
``torch.optim.AdamW`` / ``torch.optim.SGD`` (the math is the same ``torch._foreach_*`` kernels in
the same order as torch's ``foreach`` implementation, applied to out-of-place copies).

Inputs are never modified unless ``donate=True`` is passed to ``update``: then the update runs
in place on ``params`` and ``state`` (as torch does) and returns them; the caller must not use the
donated inputs afterwards (like JAX's ``donate_argnums``).

Leaves may be plain tensors or ``DTensor`` s (the foreach kernels run on both; the functional
training step passes the local shards for speed). Trees are any pytree in
:data:`functional_fsdp.core._tree.NAMESPACE` (dicts of tensors, records).

Example:
    >>> import torch
    >>> from functional_fsdp.functional import adamw
    >>> opt = adamw(1e-3)
    >>> params = {"w": torch.ones(3)}
    >>> state = opt.init(params)
    >>> params, state = opt.update({"w": torch.ones(3)}, state, params)
    >>> round(params["w"][0].item(), 6)
    0.99899
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import attrs
import optree
import torch

from ..core._tree import tree_flatten, tree_unflatten
from ..core.errors import HyperparameterError, OptimizerStateError
from ._pytrees import register_everywhere

__all__ = [
    "AdamWState",
    "InitFn",
    "Optimizer",
    "SGDState",
    "UpdateFn",
    "adamw",
    "sgd",
]

LearningRate = float | Callable[[int], float]
"""A learning rate: a float, or a schedule ``count -> lr`` (see :mod:`.schedules`)."""


class InitFn(Protocol):
    """Build an optimizer state for ``params`` (a pytree of tensors)."""

    def __call__(self, params: Any) -> Any:
        """Return the initial state (zeros of ``params``' shapes, step count 0)."""
        ...


class UpdateFn(Protocol):
    """One optimizer step: ``(grads, state, params) -> (new_params, new_state)``."""

    def __call__(
        self, grads: Any, state: Any, params: Any, *, donate: bool = False, **extra: Any
    ) -> tuple[Any, Any]:
        """Apply one step.

        Args:
            grads: gradients, a pytree matching ``params``.
            state: the state from ``init`` or the previous ``update``.
            params: the current parameters.
            donate: update ``params`` and ``state`` in place and return them (the inputs are
                consumed); default ``False`` leaves every input unchanged.
            **extra: extra arguments passed down a :func:`~.transforms.chain` (optax's
                ``GradientTransformationExtraArgs``), e.g. ``global_norm_fn`` from the training
                step; transformations ignore the ones they do not use.
        """
        ...


class Optimizer(NamedTuple):
    """A functional optimizer: a pair of pure functions (optax's ``GradientTransformation``
    shape, except that ``update`` returns new parameters, see the module docstring).

    Attributes:
        init: ``init(params) -> state``.
        update: ``update(grads, state, params, *, donate=False) -> (new_params, new_state)``.
        learning_rate: optional ``learning_rate(state) -> float``: the learning rate the last
            ``update`` used, given the state it returned (the training step reports it as
            ``metrics["lr"]``); ``None`` when the optimizer has no single learning rate.
    """

    init: InitFn
    update: UpdateFn
    learning_rate: Callable[[Any], float] | None = None


@register_everywhere
@attrs.frozen(eq=False)
class AdamWState:
    """State of :func:`adamw`.

    Attributes:
        count: number of steps taken (0-d float32 tensor, as torch stores ``step``).
        mu: first moments (``exp_avg``), a pytree like the parameters.
        nu: second moments (``exp_avg_sq``), a pytree like the parameters.
    """

    count: torch.Tensor
    mu: Any
    nu: Any


@register_everywhere
@attrs.frozen(eq=False)
class SGDState:
    """State of :func:`sgd`.

    Attributes:
        count: number of steps taken (0-d float32 tensor).
        momentum: momentum buffers (a pytree like the parameters), or ``None`` without momentum.
            Before the first step they hold zeros; torch starts them from the first gradient.
    """

    count: torch.Tensor
    momentum: Any = None


def _lr_at(lr: LearningRate, count: int) -> float:
    return float(lr(count)) if callable(lr) else float(lr)


def last_lr(lr: LearningRate) -> Callable[[Any], float]:
    """``state -> lr`` of the last update, for a state whose ``count`` counts the updates."""

    def learning_rate(state: Any) -> float:
        return _lr_at(lr, max(int(state.count.item()) - 1, 0))

    return learning_rate


def _check_lr(lr: LearningRate) -> None:
    if not callable(lr) and not lr >= 0.0:
        raise HyperparameterError(f"lr must be >= 0 (or a schedule count -> lr), got {lr!r}")


def _lerp_copy(start: list[torch.Tensor], end: list[torch.Tensor], weight: float) -> list[Any]:
    """``torch._foreach_lerp(start, end, weight)`` as new tensors, on every supported torch.

    A copy and the in-place ``_foreach_lerp_``, bit-identical to the out-of-place op: DTensor
    has no sharding rule for ``aten._foreach_lerp.Scalar`` before torch 2.13 (only for the
    in-place form), so FSDP + TP state (``DTensor`` s) could not take the out-of-place one.
    """
    out = [t.clone() for t in start]
    torch._foreach_lerp_(out, end, weight)
    return out


def _zeros(params: Any) -> Any:
    leaves, spec = tree_flatten(params)
    return tree_unflatten(
        spec, [torch.zeros_like(p, memory_format=torch.preserve_format) for p in leaves]
    )


def _flat_like(tree: Any, spec: Any, what: str) -> list[torch.Tensor]:
    leaves, other = tree_flatten(tree)
    if other != spec:
        raise OptimizerStateError(structure_mismatch(what, other, spec))
    return leaves


def structure_mismatch(what: str, got: Any, want: Any) -> str:
    """The message for a tree whose structure is not the parameters' (names the usual cause)."""
    hint = ""
    if got.kind != want.kind and want.kind == optree.PyTreeKind.DICT:
        hint = (
            f"; the parameters are a dict, so pass {what} as a dict with the same keys "
            "(e.g. dict(zip(names, grads))), not a list or tuple in some order"
        )
    return f"{what} does not have the structure of params: {got} vs {want}{hint}"


def _count0() -> torch.Tensor:
    return torch.tensor(0.0, dtype=torch.float32)


def adamw(
    lr: LearningRate,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
) -> Optimizer:
    """AdamW with decoupled weight decay, numerically equal to ``torch.optim.AdamW``.

    Args:
        lr: learning rate, or a schedule ``count -> lr`` called with the number of steps taken
            before this one (0 for the first step, as optax's schedules).
        betas: ``(beta1, beta2)`` moment coefficients.
        eps: added to the denominator.
        weight_decay: decoupled weight decay (``p *= 1 - lr * weight_decay`` each step).

    Returns:
        An :class:`Optimizer` with state :class:`AdamWState`.
    """
    _check_lr(lr)
    beta1, beta2 = (float(b) for b in betas)
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise HyperparameterError(f"betas must be in [0, 1), got {betas!r}")
    if not eps >= 0.0:
        raise HyperparameterError(f"eps must be >= 0, got {eps!r}")
    if not weight_decay >= 0.0:
        raise HyperparameterError(f"weight_decay must be >= 0, got {weight_decay!r}")

    def init(params: Any) -> AdamWState:
        return AdamWState(_count0(), _zeros(params), _zeros(params))

    def update(
        grads: Any, state: AdamWState, params: Any, *, donate: bool = False, **extra: Any
    ) -> tuple[Any, AdamWState]:
        p, spec = tree_flatten(params)
        g = _flat_like(grads, spec, "grads")
        mu = _flat_like(state.mu, spec, "AdamWState.mu")
        nu = _flat_like(state.nu, spec, "AdamWState.nu")
        count = state.count.add_(1) if donate else state.count + 1
        step = count.item()
        rate = _lr_at(lr, int(step) - 1)
        if not p:
            return params, AdamWState(count, state.mu, state.nu)
        # The same kernels in the same order as torch.optim.adam._multi_tensor_adam.
        new_p: Any
        new_mu: Any
        new_nu: Any
        if donate:
            new_p = p
            if weight_decay != 0:
                torch._foreach_mul_(new_p, 1 - rate * weight_decay)
            new_mu = mu
            torch._foreach_lerp_(new_mu, g, 1 - beta1)
            new_nu = nu
            torch._foreach_mul_(new_nu, beta2)
        else:
            new_p = torch._foreach_mul(p, 1 - rate * weight_decay) if weight_decay != 0 else None
            new_mu = _lerp_copy(mu, g, 1 - beta1)
            new_nu = torch._foreach_mul(nu, beta2)
        torch._foreach_addcmul_(new_nu, g, g, 1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = [(rate / bias_correction1) * -1] * len(p)
        bias_correction2_sqrt = [bias_correction2**0.5] * len(p)
        denom = torch._foreach_sqrt(new_nu)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, eps)
        if new_p is None:
            new_p = torch._foreach_addcdiv(p, new_mu, denom, step_size)
        else:
            torch._foreach_addcdiv_(new_p, new_mu, denom, step_size)
        return (
            tree_unflatten(spec, new_p),
            AdamWState(count, tree_unflatten(spec, new_mu), tree_unflatten(spec, new_nu)),
        )

    return Optimizer(init, update, last_lr(lr))


def sgd(
    lr: LearningRate,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
) -> Optimizer:
    """SGD with optional momentum, dampening, Nesterov and L2 weight decay (``torch.optim.SGD``).

    Args:
        lr: learning rate, or a schedule ``count -> lr`` (see :func:`adamw`).
        momentum: momentum factor (``0`` keeps no buffers).
        dampening: dampening of the momentum (not applied on the first step, as in torch).
        weight_decay: L2 penalty added to the gradient.
        nesterov: Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).

    Returns:
        An :class:`Optimizer` with state :class:`SGDState`.
    """
    _check_lr(lr)
    if not momentum >= 0.0:
        raise HyperparameterError(f"momentum must be >= 0, got {momentum!r}")
    if not weight_decay >= 0.0:
        raise HyperparameterError(f"weight_decay must be >= 0, got {weight_decay!r}")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise HyperparameterError("Nesterov momentum requires a momentum > 0 and zero dampening")

    def init(params: Any) -> SGDState:
        return SGDState(_count0(), _zeros(params) if momentum != 0 else None)

    def update(
        grads: Any, state: SGDState, params: Any, *, donate: bool = False, **extra: Any
    ) -> tuple[Any, SGDState]:
        p, spec = tree_flatten(params)
        g: Any = _flat_like(grads, spec, "grads")
        first = state.count.item() == 0
        count = state.count.add_(1) if donate else state.count + 1
        rate = _lr_at(lr, int(count.item()) - 1)
        if not p:
            return params, SGDState(count, state.momentum)
        # The same kernels in the same order as torch.optim.sgd._multi_tensor_sgd.
        if weight_decay != 0:
            g = torch._foreach_add(g, p, alpha=weight_decay)
        new_buf: Any = None
        new_p: Any
        if momentum != 0:
            buf = _flat_like(state.momentum, spec, "SGDState.momentum")
            if first:
                # torch starts the buffer from the first gradient (no dampening).
                if donate:
                    torch._foreach_copy_(buf, g)
                    new_buf = buf
                else:
                    new_buf = [t.detach().clone() for t in g]
            else:
                if donate:
                    new_buf = buf
                    torch._foreach_mul_(new_buf, momentum)
                else:
                    new_buf = torch._foreach_mul(buf, momentum)
                torch._foreach_add_(new_buf, g, alpha=1 - dampening)
            g = torch._foreach_add(g, new_buf, alpha=momentum) if nesterov else new_buf
        if donate:
            torch._foreach_add_(p, g, alpha=-rate)
            new_p = p
        else:
            new_p = torch._foreach_add(p, g, alpha=-rate)
        mom = tree_unflatten(spec, new_buf) if new_buf is not None else None
        return tree_unflatten(spec, new_p), SGDState(count, mom)

    return Optimizer(init, update, last_lr(lr))
