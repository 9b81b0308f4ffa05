"""Learning-rate schedules in the optax style: pure functions ``count -> value``.

``count`` is the number of updates taken before the one the value is for (0 first), as in optax
and as :func:`~functional_fsdp.functional.adamw` calls a schedule passed as ``lr``. Values are
Python floats computed in double precision, so a schedule gives the same learning rates as the
equivalent ``torch.optim.lr_scheduler.LambdaLR`` factor times the base rate.

Example:
    >>> from functional_fsdp.functional import schedules
    >>> f = schedules.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=2, decay_steps=6)
    >>> [round(f(i), 3) for i in range(7)]
    [0.0, 0.5, 1.0, 0.854, 0.5, 0.146, 0.0]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

from ..core.errors import HyperparameterError

__all__ = [
    "Schedule",
    "constant_schedule",
    "cosine_decay_schedule",
    "exponential_decay",
    "join_schedules",
    "linear_schedule",
    "warmup_cosine_decay_schedule",
]


class Schedule(Protocol):
    """A schedule: the value for the update after ``count`` updates."""

    def __call__(self, count: int) -> float:
        """Return the value at ``count`` (an int >= 0)."""
        ...


def _check_steps(name: str, steps: int, *, allow_zero: bool = True) -> None:
    if not isinstance(steps, int) or steps < (0 if allow_zero else 1):
        raise HyperparameterError(
            f"{name} must be an int >= {0 if allow_zero else 1}, got {steps!r}"
        )


def constant_schedule(value: float) -> Callable[[int], float]:
    """``count -> value``.

    Args:
        value: the constant.
    """
    value = float(value)

    def schedule(count: int) -> float:
        return value

    return schedule


def linear_schedule(
    init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0
) -> Callable[[int], float]:
    """Linear interpolation from ``init_value`` to ``end_value`` over ``transition_steps``.

    Args:
        init_value: the value up to ``transition_begin``.
        end_value: the value from ``transition_begin + transition_steps`` on.
        transition_steps: length of the ramp (0: jump to ``end_value`` at ``transition_begin``).
        transition_begin: updates to wait before the ramp starts.
    """
    _check_steps("transition_steps", transition_steps)
    _check_steps("transition_begin", transition_begin)
    a, b = float(init_value), float(end_value)

    def schedule(count: int) -> float:
        t = count - transition_begin
        if t <= 0:
            return a if transition_steps > 0 or t < 0 else b
        if t >= transition_steps:
            return b
        return a + (b - a) * (t / transition_steps)

    return schedule


def cosine_decay_schedule(
    init_value: float, decay_steps: int, alpha: float = 0.0, exponent: float = 1.0
) -> Callable[[int], float]:
    """Cosine decay from ``init_value`` to ``alpha * init_value`` over ``decay_steps``.

    Args:
        init_value: the value at count 0.
        decay_steps: updates until the final value (>= 1).
        alpha: the final value as a fraction of ``init_value``.
        exponent: power applied to the cosine factor (optax's ``exponent``).
    """
    _check_steps("decay_steps", decay_steps, allow_zero=False)
    v0, alpha = float(init_value), float(alpha)

    def schedule(count: int) -> float:
        t = min(max(count, 0), decay_steps) / decay_steps
        cosine = 0.5 * (1.0 + math.cos(math.pi * t))
        return v0 * ((1.0 - alpha) * cosine**exponent + alpha)

    return schedule


def join_schedules(
    schedules: Sequence[Callable[[int], float]], boundaries: Sequence[int]
) -> Callable[[int], float]:
    """Schedule ``i`` from ``boundaries[i-1]`` on, counted from its own start (optax's rule).

    Args:
        schedules: ``len(boundaries) + 1`` schedules.
        boundaries: increasing update counts where the next schedule takes over.
    """
    if len(schedules) != len(boundaries) + 1:
        raise HyperparameterError(
            f"join_schedules needs one more schedule than boundaries, got {len(schedules)} "
            f"schedules and {len(boundaries)} boundaries"
        )
    if list(boundaries) != sorted(boundaries):
        raise HyperparameterError(f"boundaries must increase, got {list(boundaries)}")
    starts = [0, *boundaries]

    def schedule(count: int) -> float:
        i = sum(1 for b in boundaries if count >= b)
        return schedules[i](count - starts[i])

    return schedule


def warmup_cosine_decay_schedule(
    init_value: float,
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    end_value: float = 0.0,
    exponent: float = 1.0,
) -> Callable[[int], float]:
    """Linear warmup from ``init_value`` to ``peak_value``, then cosine decay to ``end_value``.

    As optax: ``decay_steps`` counts the warmup too (the cosine part lasts
    ``decay_steps - warmup_steps`` updates).

    Args:
        init_value: the value at count 0.
        peak_value: the value at the end of the warmup.
        warmup_steps: updates of linear warmup.
        decay_steps: total length of warmup and decay (``> warmup_steps``).
        end_value: the value after ``decay_steps``.
        exponent: power of the cosine factor.
    """
    _check_steps("warmup_steps", warmup_steps)
    if not isinstance(decay_steps, int) or decay_steps <= warmup_steps:
        raise HyperparameterError(
            f"decay_steps (warmup included) must be an int > warmup_steps={warmup_steps}, "
            f"got {decay_steps!r}"
        )
    peak = float(peak_value)
    alpha = float(end_value) / peak if peak != 0 else 0.0
    return join_schedules(
        [
            linear_schedule(init_value, peak, warmup_steps),
            cosine_decay_schedule(peak, decay_steps - warmup_steps, alpha, exponent),
        ],
        [warmup_steps],
    )


def exponential_decay(
    init_value: float,
    transition_steps: int,
    decay_rate: float,
    *,
    staircase: bool = False,
    end_value: float | None = None,
) -> Callable[[int], float]:
    """``init_value * decay_rate ** (count / transition_steps)`` (optax's ``exponential_decay``).

    Args:
        init_value: the value at count 0.
        transition_steps: updates per factor of ``decay_rate`` (>= 1).
        decay_rate: the factor.
        staircase: decay in whole steps of ``transition_steps``.
        end_value: a bound the value does not cross (a floor when decaying).
    """
    _check_steps("transition_steps", transition_steps, allow_zero=False)
    v0, rate = float(init_value), float(decay_rate)

    def schedule(count: int) -> float:
        p = count / transition_steps
        value = v0 * rate ** (math.floor(p) if staircase else p)
        if end_value is not None:
            value = max(value, end_value) if rate < 1 else min(value, end_value)
        return value

    return schedule
