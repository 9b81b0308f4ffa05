"""Composable gradient transformations in the optax style.

A :class:`GradientTransformation` is a pair of pure functions, ``init(params) -> state`` and
``update(updates, state, params=None, **extra) -> (updates, state)``: it maps gradients to
*updates* (added to the parameters by :func:`apply_updates`). :func:`chain` composes them::

    opt = chain(clip_by_global_norm(1.0), scale_by_adam(), add_decayed_weights(0.1),
                scale_by_learning_rate(warmup_cosine_decay_schedule(0.0, 3e-4, 100, 10_000)))

The last element of a chain may instead be an :class:`~.optim.Optimizer`
(:func:`~.optim.adamw`, :func:`~.optim.sgd`), which returns the *new parameters*: then the chain
is an ``Optimizer`` too, and ``chain(clip_by_global_norm(1.0), adamw(lr))`` equals
``clip_grad_norm_`` + ``torch.optim.AdamW`` bit for bit (the update is torch's own sequence of
kernels; an additive update tree rounds differently). Chains of transformations only match
torch to rounding (about 1e-7 relative per step).

Inputs are never modified. ``**extra`` arguments go to every transformation of a chain (optax's
``GradientTransformationExtraArgs``); the training step passes ``global_norm_fn``, which
:func:`clip_by_global_norm` uses to take the norm over every shard (see :mod:`.norms`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import attrs
import torch

from ..core._tree import tree_flatten, tree_unflatten
from ..core.errors import ArgumentTypeError, HyperparameterError, OptimizerStateError
from ._pytrees import register_everywhere
from .norms import global_norm
from .optim import LearningRate, Optimizer, _lerp_copy, _zeros, structure_mismatch

__all__ = [
    "EmptyState",
    "GradientTransformation",
    "ScaleByAdamState",
    "ScaleByScheduleState",
    "TransformInitFn",
    "TransformUpdateFn",
    "add_decayed_weights",
    "apply_updates",
    "as_optimizer",
    "chain",
    "check_functional_optimizer",
    "clip_by_global_norm",
    "identity",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_schedule",
]


class TransformInitFn(Protocol):
    """``init(params) -> state`` of a :class:`GradientTransformation`."""

    def __call__(self, params: Any) -> Any:
        """Return the initial state for ``params``."""
        ...


class TransformUpdateFn(Protocol):
    """``update(updates, state, params=None, **extra) -> (updates, state)``."""

    def __call__(
        self, updates: Any, state: Any, params: Any = None, **extra: Any
    ) -> tuple[Any, Any]:
        """Transform ``updates`` (gradients at the start of a chain); inputs are unchanged.

        Args:
            updates: a pytree of tensors.
            state: the state from ``init`` or the previous ``update``.
            params: the current parameters (needed by e.g. :func:`add_decayed_weights`).
            **extra: extra arguments (e.g. ``global_norm_fn``); ignore the ones not used.
        """
        ...


class GradientTransformation(NamedTuple):
    """optax's ``GradientTransformation``: ``(init, update)`` returning additive updates.

    Attributes:
        init: ``init(params) -> state``.
        update: ``update(updates, state, params=None, **extra) -> (updates, state)``.
        learning_rate: optional ``state -> float``, the learning rate of the last update
            (reported by the training step as ``metrics["lr"]``).
    """

    init: TransformInitFn
    update: TransformUpdateFn
    learning_rate: Callable[[Any], float] | None = None


class EmptyState(NamedTuple):
    """The state of a stateless transformation (an empty pytree node)."""


@register_everywhere
@attrs.frozen(eq=False)
class ScaleByAdamState:
    """State of :func:`scale_by_adam`.

    Attributes:
        count: updates taken (0-d float32 tensor, as torch stores ``step``).
        mu: first moments, a pytree like the parameters.
        nu: second moments, a pytree like the parameters.
    """

    count: torch.Tensor
    mu: Any
    nu: Any


@register_everywhere
@attrs.frozen(eq=False)
class ScaleByScheduleState:
    """State of :func:`scale_by_schedule`.

    Attributes:
        count: updates taken (0-d int64 tensor).
    """

    count: torch.Tensor


def _map(fn: Callable[[list[torch.Tensor]], list[torch.Tensor]], tree: Any) -> Any:
    leaves, spec = tree_flatten(tree)
    return tree_unflatten(spec, fn(leaves) if leaves else [])


def _like(tree: Any, spec: Any, what: str) -> list[torch.Tensor]:
    leaves, other = tree_flatten(tree)
    if other != spec:
        raise OptimizerStateError(structure_mismatch(what, other, spec))
    return leaves


def identity() -> GradientTransformation:
    """Leave the updates as they are."""

    def init(params: Any) -> EmptyState:
        return EmptyState()

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        return updates, state

    return GradientTransformation(init, update)


def scale(step_size: float) -> GradientTransformation:
    """Multiply the updates by a constant.

    Args:
        step_size: the factor (e.g. ``-lr``).
    """
    factor = float(step_size)

    def init(params: Any) -> EmptyState:
        return EmptyState()

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        return _map(lambda u: list(torch._foreach_mul(u, factor)), updates), state

    return GradientTransformation(init, update)


def scale_by_schedule(step_size_fn: Callable[[int], float]) -> GradientTransformation:
    """Multiply the updates by ``step_size_fn(count)``, ``count`` = updates taken before.

    Args:
        step_size_fn: a schedule (:mod:`.schedules`), e.g. ``lambda c: -lr(c)``.
    """

    def init(params: Any) -> ScaleByScheduleState:
        return ScaleByScheduleState(torch.zeros((), dtype=torch.int64))

    def update(
        updates: Any, state: ScaleByScheduleState, params: Any = None, **extra: Any
    ) -> tuple[Any, ScaleByScheduleState]:
        factor = float(step_size_fn(int(state.count.item())))
        new = _map(lambda u: list(torch._foreach_mul(u, factor)), updates)
        return new, ScaleByScheduleState(state.count + 1)

    def learning_rate(state: ScaleByScheduleState) -> float:
        return abs(float(step_size_fn(max(int(state.count.item()) - 1, 0))))

    return GradientTransformation(init, update, learning_rate)


def scale_by_learning_rate(
    learning_rate: LearningRate, *, flip_sign: bool = True
) -> GradientTransformation:
    """Scale by ``-learning_rate`` (gradient descent), a float or a schedule.

    Args:
        learning_rate: a float, or a schedule ``count -> lr``.
        flip_sign: multiply by ``-lr`` (default) rather than ``lr``.
    """
    sign = -1.0 if flip_sign else 1.0
    if callable(learning_rate):
        lr_fn = learning_rate
        return scale_by_schedule(lambda count: sign * float(lr_fn(count)))
    inner = scale(sign * float(learning_rate))
    rate = abs(float(learning_rate))
    return GradientTransformation(inner.init, inner.update, lambda state: rate)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adam's normalisation: ``m_hat / (sqrt(v_hat) + eps)`` with bias-corrected moments.

    Args:
        b1: first-moment decay.
        b2: second-moment decay.
        eps: added to the denominator (outside the square root, as torch and optax).
    """
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise HyperparameterError(f"b1 and b2 must be in [0, 1), got {b1!r}, {b2!r}")

    def init(params: Any) -> ScaleByAdamState:
        return ScaleByAdamState(torch.tensor(0.0), _zeros(params), _zeros(params))

    def update(
        updates: Any, state: ScaleByAdamState, params: Any = None, **extra: Any
    ) -> tuple[Any, ScaleByAdamState]:
        g, spec = tree_flatten(updates)
        count = state.count + 1
        if not g:
            return updates, ScaleByAdamState(count, state.mu, state.nu)
        step = count.item()
        mu = _lerp_copy(_like(state.mu, spec, "ScaleByAdamState.mu"), g, 1 - b1)
        nu = torch._foreach_mul(_like(state.nu, spec, "ScaleByAdamState.nu"), b2)
        torch._foreach_addcmul_(nu, g, g, 1 - b2)
        denom = torch._foreach_sqrt(nu)
        torch._foreach_div_(denom, (1 - b2**step) ** 0.5)
        torch._foreach_add_(denom, eps)
        out = torch._foreach_div(mu, denom)
        torch._foreach_div_(out, 1 - b1**step)
        new_state = ScaleByAdamState(count, tree_unflatten(spec, mu), tree_unflatten(spec, nu))
        return tree_unflatten(spec, out), new_state

    return GradientTransformation(init, update)


def add_decayed_weights(weight_decay: float) -> GradientTransformation:
    """Add ``weight_decay * params`` to the updates (decoupled weight decay before the lr).

    Args:
        weight_decay: the factor (``0`` leaves the updates unchanged).
    """
    if not weight_decay >= 0.0:
        raise HyperparameterError(f"weight_decay must be >= 0, got {weight_decay!r}")

    def init(params: Any) -> EmptyState:
        return EmptyState()

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        if params is None:
            raise OptimizerStateError(
                "add_decayed_weights needs params: call update(updates, s, params)"
            )
        if weight_decay == 0:
            return updates, state
        u, spec = tree_flatten(updates)
        p = _like(params, spec, "params")
        return tree_unflatten(spec, torch._foreach_add(u, p, alpha=weight_decay)), state

    return GradientTransformation(init, update)


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale the updates by ``min(1, max_norm / (norm + 1e-6))``, as ``clip_grad_norm_``.

    ``norm`` is the 2-norm of all the updates together over every shard: the ``global_norm_fn``
    extra argument when given (the training step passes one that sums the shards over the shard
    process group through its communicator), else :func:`~.norms.global_norm` (``DTensor``
    leaves are reduced over their mesh; plain tensors are local).

    Args:
        max_norm: the largest norm let through (> 0).
    """
    if not max_norm > 0:
        raise HyperparameterError(f"max_norm must be > 0, got {max_norm!r}")

    def init(params: Any) -> EmptyState:
        return EmptyState()

    def update(
        updates: Any,
        state: Any,
        params: Any = None,
        *,
        global_norm_fn: Callable[[Any], torch.Tensor] | None = None,
        **extra: Any,
    ) -> tuple[Any, Any]:
        norm = (global_norm_fn or global_norm)(updates)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        return _map(lambda u: list(torch._foreach_mul(u, coef)), updates), state

    return GradientTransformation(init, update)


def apply_updates(params: Any, updates: Any, *, donate: bool = False) -> Any:
    """``params + updates`` leaf by leaf (optax's ``apply_updates``).

    Args:
        params: the parameters.
        updates: a pytree like ``params``.
        donate: add in place into ``params`` (consumed) instead of new tensors.
    """
    p, spec = tree_flatten(params)
    u = _like(updates, spec, "updates")
    if not p:
        return params
    if donate:
        torch._foreach_add_(p, u)
        return params
    return tree_unflatten(spec, torch._foreach_add(p, u))


def as_optimizer(tx: GradientTransformation | Optimizer) -> Optimizer:
    """An :class:`~.optim.Optimizer` (returning new parameters) from a transformation.

    Args:
        tx: a :class:`GradientTransformation` (its updates are added by :func:`apply_updates`)
            or an ``Optimizer`` (returned as it is).
    """
    if isinstance(tx, Optimizer):
        return tx

    def update(
        grads: Any, state: Any, params: Any, *, donate: bool = False, **extra: Any
    ) -> tuple[Any, Any]:
        updates, new_state = tx.update(grads, state, params, **extra)
        return apply_updates(params, updates, donate=donate), new_state

    return Optimizer(tx.init, update, tx.learning_rate)


def check_functional_optimizer(opt: Any, where: str, *, last: bool = True) -> None:
    """Raise ``TypeError`` unless ``opt`` is a functional optimizer or transformation.

    Args:
        opt: the object to check.
        where: the caller's name, for the message.
        last: whether an :class:`~.optim.Optimizer` (new-parameters style) is allowed here.
    """
    if isinstance(opt, torch.optim.Optimizer):
        raise ArgumentTypeError(
            f"{where}: got a torch optimizer ({type(opt).__name__}); the functional API needs a "
            "functional one: functional_fsdp.functional.adamw(lr, betas, eps, weight_decay) for "
            "torch.optim.AdamW, sgd(lr, momentum, ...) for torch.optim.SGD, or a chain(...) of "
            "transformations; to continue from a torch optimizer's state, build the state with "
            "functional_fsdp.functional.from_torch_optimizer(model, torch_opt, adamw(...))"
        )
    if isinstance(opt, Optimizer) and not last:
        raise ArgumentTypeError(
            f"{where}: an Optimizer (adamw, sgd: returns new parameters) may only be the last "
            "element of a chain; use scale_by_adam() / scale_by_learning_rate() before the end"
        )
    if not isinstance(opt, (Optimizer, GradientTransformation)):
        raise ArgumentTypeError(
            f"{where}: expected a functional optimizer (adamw, sgd, chain(...), or a "
            f"GradientTransformation), got {type(opt).__name__}"
        )


def chain(*transforms: GradientTransformation | Optimizer) -> Any:
    """Apply transformations one after the other (optax's ``chain``).

    Args:
        *transforms: :class:`GradientTransformation` s; the last may be an
            :class:`~.optim.Optimizer` (``adamw``, ``sgd``).

    Returns:
        An ``Optimizer`` if the last element is one (the chain returns new parameters), else a
        ``GradientTransformation``. Its state is the tuple of the elements' states.
    """
    if not transforms:
        return identity()
    for i, t in enumerate(transforms):
        check_functional_optimizer(t, f"chain (element {i})", last=i == len(transforms) - 1)
    *front, last = transforms
    lr_at = next((i for i in reversed(range(len(transforms))) if transforms[i].learning_rate), None)

    def init(params: Any) -> tuple[Any, ...]:
        return tuple(t.init(params) for t in transforms)

    def learning_rate(state: tuple[Any, ...]) -> float:
        assert lr_at is not None
        fn = transforms[lr_at].learning_rate
        assert fn is not None
        return fn(state[lr_at])

    def run_front(updates: Any, state: tuple[Any, ...], params: Any, extra: Any) -> Any:
        new_states = []
        for t, s in zip(front, state):
            updates, s = t.update(updates, s, params, **extra)
            new_states.append(s)
        return updates, new_states

    lr = learning_rate if lr_at is not None else None
    if isinstance(last, Optimizer):

        def update_params(
            grads: Any, state: tuple[Any, ...], params: Any, *, donate: bool = False, **extra: Any
        ) -> tuple[Any, tuple[Any, ...]]:
            updates, states = run_front(grads, state, params, extra)
            new_params, s = last.update(updates, state[-1], params, donate=donate, **extra)
            return new_params, (*states, s)

        return Optimizer(init, update_params, lr)

    def update(
        updates: Any, state: tuple[Any, ...], params: Any = None, **extra: Any
    ) -> tuple[Any, tuple[Any, ...]]:
        updates, states = run_front(updates, state, params, extra)
        updates, s = last.update(updates, state[-1], params, **extra)
        return updates, (*states, s)

    return GradientTransformation(init, update, lr)
