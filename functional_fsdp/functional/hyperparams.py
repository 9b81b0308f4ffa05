"""Hyper-parameters that live in the optimizer state (optax's ``inject_hyperparams``).

``inject_hyperparams(adamw)(lr=1e-3, weight_decay=0.1)`` is ``adamw(1e-3, weight_decay=0.1)``
whose numeric hyper-parameters are 0-d float64 tensors in the state
(:class:`InjectHyperparamsState` ``.hyperparams``): change them between steps with
:func:`set_hyperparams` (a new state; the old one is unchanged), save and restore them with the
state, and read them as metrics. A hyper-parameter given as a schedule (a callable
``count -> value``) is evaluated at every update instead, and the state records the value used.

The numbers are those of the wrapped optimizer built with the current values: with ``adamw``,
changing ``lr`` equals setting ``param_groups[0]["lr"]`` of ``torch.optim.AdamW`` bit for bit.

Example:
    >>> import torch
    >>> from functional_fsdp.functional import adamw, inject_hyperparams, set_hyperparams
    >>> opt = inject_hyperparams(adamw)(lr=1e-3)
    >>> state = opt.init({"w": torch.ones(2)})
    >>> state = set_hyperparams(state, lr=5e-4)
    >>> state.hyperparams["lr"].item()
    0.0005
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import optree
import torch

from ..core.errors import OptimizerStateError
from ._pytrees import register_everywhere
from .optim import Optimizer
from .transforms import GradientTransformation, check_functional_optimizer

__all__ = ["InjectHyperparamsState", "inject_hyperparams", "set_hyperparams"]

_LR_NAMES = ("lr", "learning_rate")


@register_everywhere
@attrs.frozen(eq=False)
class InjectHyperparamsState:
    """State of an :func:`inject_hyperparams` optimizer.

    Attributes:
        count: updates taken (0-d int64 tensor).
        hyperparams: ``{name: 0-d float64 tensor}``, the values the next update uses (for a
            scheduled one: the value the last update used).
        inner_state: the wrapped optimizer's state.
    """

    count: torch.Tensor
    hyperparams: dict[str, torch.Tensor]
    inner_state: Any


def _numeric(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def inject_hyperparams(
    factory: Callable[..., Any], *, static_args: tuple[str, ...] = ()
) -> Callable[..., Any]:
    """Wrap an optimizer factory so its numeric hyper-parameters live in the state.

    Args:
        factory: ``adamw``, ``sgd``, a transformation factory (``scale_by_adam``, ...), or any
            function of keyword arguments returning an ``Optimizer`` / ``GradientTransformation``.
        static_args: names of numeric arguments to keep fixed (not in the state).

    Returns:
        ``make(**hyperparams)``: an ``Optimizer`` or ``GradientTransformation`` of the same kind
        as ``factory``'s, with state :class:`InjectHyperparamsState`. Floats and ints become
        state entries; callables are schedules; anything else (tuples, bools) stays static.
    """

    def make(**kwargs: Any) -> Any:
        dynamic = {
            k: v for k, v in kwargs.items() if k not in static_args and (_numeric(v) or callable(v))
        }
        static = {k: v for k, v in kwargs.items() if k not in dynamic}
        scheduled = {k for k, v in dynamic.items() if callable(v)}

        def values(count: int, hps: dict[str, torch.Tensor]) -> dict[str, float]:
            return {
                k: float(dynamic[k](count)) if k in scheduled else float(hps[k].item())
                for k in dynamic
            }

        def build(hps: dict[str, float]) -> Any:
            inner = factory(**static, **hps)
            check_functional_optimizer(inner, f"inject_hyperparams({factory.__name__})")
            return inner

        first = {k: float(v(0)) if k in scheduled else float(v) for k, v in dynamic.items()}
        probe = build(first)

        def init(params: Any) -> InjectHyperparamsState:
            hps = {k: torch.tensor(v, dtype=torch.float64) for k, v in first.items()}
            return InjectHyperparamsState(
                torch.zeros((), dtype=torch.int64), hps, probe.init(params)
            )

        def step(
            grads: Any, state: InjectHyperparamsState, params: Any, kw: dict[str, Any]
        ) -> tuple[Any, InjectHyperparamsState]:
            hps = values(int(state.count.item()), state.hyperparams)
            out, inner_state = build(hps).update(grads, state.inner_state, params, **kw)
            used = {
                k: torch.tensor(hps[k], dtype=torch.float64) if k in scheduled else t
                for k, t in state.hyperparams.items()
            }
            return out, InjectHyperparamsState(state.count + 1, used, inner_state)

        def learning_rate(state: InjectHyperparamsState) -> float:
            name = next(n for n in _LR_NAMES if n in state.hyperparams)
            return float(state.hyperparams[name].item())

        lr = learning_rate if any(n in dynamic for n in _LR_NAMES) else None
        if isinstance(probe, Optimizer):

            def update_params(
                grads: Any, state: Any, params: Any, *, donate: bool = False, **extra: Any
            ) -> tuple[Any, Any]:
                return step(grads, state, params, {"donate": donate, **extra})

            return Optimizer(init, update_params, lr)

        def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
            return step(updates, state, params, extra)

        return GradientTransformation(init, update, lr)

    return make


def set_hyperparams(tree: Any, **values: float) -> Any:
    """A copy of ``tree`` with new hyper-parameter values in its :class:`InjectHyperparamsState`.

    Args:
        tree: an ``InjectHyperparamsState``, an optimizer state containing one (a chain's
            tuple), or a ``TrainState``.
        **values: ``name=value`` for hyper-parameters the state holds (e.g. ``lr=1e-4``). A
            scheduled hyper-parameter is recomputed by its schedule at the next update.

    Returns:
        The new tree (the input is unchanged).
    """
    found = [False]

    def replace(node: Any) -> Any:
        if not isinstance(node, InjectHyperparamsState):
            return node
        unknown = sorted(set(values) - set(node.hyperparams))
        if unknown:
            raise KeyError(
                f"set_hyperparams: {unknown} are not hyper-parameters of this state "
                f"(it has {sorted(node.hyperparams)}); inject them with inject_hyperparams"
            )
        found[0] = True
        new = {k: torch.tensor(float(v), dtype=torch.float64) for k, v in values.items()}
        return attrs.evolve(node, hyperparams={**node.hyperparams, **new})

    out = optree.tree_map(
        replace, tree, is_leaf=lambda n: isinstance(n, InjectHyperparamsState), none_is_leaf=True
    )
    if not found[0]:
        raise OptimizerStateError(
            "set_hyperparams: no InjectHyperparamsState in the tree; build the optimizer with "
            "inject_hyperparams(adamw)(lr=...) to change hyper-parameters between steps"
        )
    return out
