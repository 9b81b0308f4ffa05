"""What the group runtime (:mod:`.group`) is built from: its training states, the layout rule
for mixed precision, the profiler-name decorator, and two small tensor helpers."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..._compat import FSDP2_REDUCES_IN_ORIGINAL_DTYPE
from ...core.lifecycle import Stage
from ...core.records import GroupLayout, MixedPrecisionPolicy, ParamSpec

__all__ = ["TrainingState", "layout_for", "profiled", "traced"]

_NO_RANGE = contextlib.nullcontext()
_profiler_enabled = torch._C._autograd._profiler_enabled


def profiled(name: str | Callable[[], str]) -> Any:
    """``record_function(name)`` while a profiler records, else nothing: the range costs
    about 6 us per call (a few hundred calls per step on a deep model) and only a trace reads
    it. ``name`` may be a callable, called only when recording (skips formatting too)."""
    if not _profiler_enabled():
        return _NO_RANGE
    return torch.profiler.record_function(name() if callable(name) else name)


def _preserve_version(t: torch.Tensor | None) -> Any:
    """Filling the unsharded buffer must not bump the version autograd saved with its views."""
    if t is None:
        return contextlib.nullcontext()
    return torch.autograd._unsafe_preserve_version_counter(t)


# FSDP2's training states (and FSDP1's summon state): the life cycle's stages.
TrainingState = Stage


def traced(label: str) -> Any:
    """Run a method of a ``ParamGroup`` or ``FSDPState`` (anything with a ``name``) inside
    ``record_function("FSDP::<label> (<name>)")``, FSDP2's profiler names, so a trace shows every
    collective and transition per group."""

    def wrap(fn: Any) -> Any:
        @functools.wraps(fn)
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not _profiler_enabled():
                return fn(self, *args, **kwargs)
            with torch.profiler.record_function(f"FSDP::{label} ({self.name})"):
                return fn(self, *args, **kwargs)

        return method

    return wrap


def layout_for(
    specs: Sequence[ParamSpec], world_size: int, mp_policy: MixedPrecisionPolicy
) -> GroupLayout:
    """The group layout of ``specs`` under FSDP2's mixed-precision rules.

    ``reduce_dtype`` is dropped when it equals ``param_dtype`` (FSDP2 reduces in the compute
    dtype then). When it is ``None``, FSDP2 before torch 2.15 reduces in ``param_dtype`` (the
    layout's default); from 2.15 on it reduces in the parameters' original dtype (promoted over
    the group's trainable floating-point parameters), so the layout names that dtype.
    """
    reduce = mp_policy.reduce_dtype
    if reduce is None and mp_policy.param_dtype is not None and FSDP2_REDUCES_IN_ORIGINAL_DTYPE:
        originals = {s.dtype for s in specs if s.requires_grad and s.dtype.is_floating_point}
        if originals:
            reduce = functools.reduce(torch.promote_types, sorted(originals, key=str))
    if reduce is not None and reduce == mp_policy.param_dtype:
        reduce = None
    return GroupLayout.build(
        specs, world_size, param_dtype=mp_policy.param_dtype, reduce_dtype=reduce
    )


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))
