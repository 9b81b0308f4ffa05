"""What the group runtime (:mod:`.group`) is built from: its training states, the layout rule
for mixed precision, the profiler-name decorator, and two small tensor helpers."""

from __future__ import annotations

import contextlib
import enum
import functools
from collections.abc import Sequence
from typing import Any

import torch

from ...core.errors import UnsupportedError
from ...core.records import GroupLayout, MixedPrecisionPolicy, ParamSpec

__all__ = ["ReduceChain", "TrainingState", "layout_for", "traced"]


def _preserve_version(t: torch.Tensor | None) -> Any:
    """Filling the unsharded buffer must not bump the version autograd saved with its views."""
    if t is None:
        return contextlib.nullcontext()
    return torch.autograd._unsafe_preserve_version_counter(t)


class TrainingState(enum.Enum):
    """Where a group is in an iteration (FSDP2's states)."""

    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"
    SUMMON_FULL_PARAMS = "summon_full_params"  # inside summon_full_params (FSDP1's state)


class ReduceChain:
    """The one gradient reduction in flight among a root's groups, as FSDP2 keeps one
    reduce-scatter input buffer (``reduce_scatter_max_input_buffers=1``): a group starting its
    reduction first finishes the previous group's, so at most one group's full-size reduce
    buffers are alive at a time (33 groups otherwise pile them up until the end of backward).

    Attributes:
        group: the group whose reduction is in flight (or last was), else ``None``.
    """

    __slots__ = ("group",)

    def __init__(self) -> None:
        self.group: Any = None

    def hand_over(self, group: Any) -> None:
        """Finish the reduction in flight of another group; ``group`` issues the next one."""
        prev, self.group = self.group, group
        if prev is not None and prev is not group:
            prev.finish_reduce()


def traced(label: str) -> Any:
    """Run a method of a ``ParamGroup`` or ``FSDPState`` (anything with a ``name``) inside
    ``record_function("FSDP::<label> (<name>)")``, FSDP2's profiler names, so a trace shows every
    collective and transition per group."""

    def wrap(fn: Any) -> Any:
        @functools.wraps(fn)
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            with torch.profiler.record_function(f"FSDP::{label} ({self.name})"):
                return fn(self, *args, **kwargs)

        return method

    return wrap


def layout_for(
    specs: Sequence[ParamSpec], world_size: int, mp_policy: MixedPrecisionPolicy
) -> GroupLayout:
    """The group layout of ``specs`` under FSDP2's mixed-precision rules.

    ``reduce_dtype`` is dropped when it equals ``param_dtype`` (FSDP2 reduces in the compute
    dtype then).
    """
    reduce = mp_policy.reduce_dtype
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


def refuse_functional_sources(group: Any) -> None:
    """Raise :class:`UnsupportedError` (before any collective) when ``group`` uses a feature
    the functional path (``functional_call``, ``torch.func``, the functional step) cannot run
    on caller-passed tensors: tensor-subclass all-gather hooks, compressed reduction."""
    if group.layout.codec_inputs is not None:
        raise UnsupportedError(
            f"group {group.name!r} all-gathers tensor subclasses through their "
            "fsdp_pre_all_gather / fsdp_post_all_gather hooks, which functional_call / "
            "torch.func / the functional step do not run yet; train it with the module path "
            "(loss.backward()), or use plain parameters for the functional path"
        )
    if group.grad_compression is not None:
        raise UnsupportedError(
            f"group {group.name!r} compresses its gradient reduction "
            "(set_gradient_compression), whose error-feedback residual is state that "
            "functional_call / torch.func / the functional step do not carry yet; call "
            "set_gradient_compression(None) on the model, or train it with the module "
            "path (loss.backward())"
        )
