"""Warn when ``torch.nn.utils.clip_grad_norm_`` clips parameters of reproducible groups.

torch's clip sums the ranks' partial norms (``torch._foreach_norm`` on the ``DTensor``
gradients, then an all-reduce) in an order set by the world size, so under a
:class:`~functional_fsdp.ReproduciblePolicy` the norm it returns, and the gradients it scales,
differ in their last bits between world sizes: silently, while everything else stays
bit-identical. :func:`functional_fsdp.clip_grad_norm_` takes the same arguments and gives the
same bits on every world size.

The mechanism, the simplest that sees every way torch's clip is called: ``clip_grad_norm_``
(and the deprecated ``clip_grad_norm``) compute the norm and then call the module global
``torch.nn.utils.clip_grad._clip_grads_with_norm_(parameters, ...)`` with the parameters as a
list. When the first group under a policy is built (:func:`watch`), that global and the public
alias ``torch.nn.utils.clip_grads_with_norm_`` are replaced, once per process, by a wrapper that
checks the parameters against the sharded parameters of the live policy groups (a ``WeakSet``:
a group that is gone is forgotten) and warns with :class:`ReproducibilityWarning`, then clips
as torch does. Looking the global up at call time, torch's clip finds the wrapper however the
user imported ``clip_grad_norm_``. A process without policy groups keeps torch's function
untouched; with them, each torch clip costs one set lookup per parameter. ``get_total_norm``
alone (a norm without clipping) is given gradients, not parameters, and is not checked.

A warning, not an error: the run still trains, only not bit-identically across world sizes.
Python's default filter shows it once per calling line (so once per training loop);
``warnings.simplefilter("error", ReproducibilityWarning)`` makes it an error.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
import weakref
from typing import Any

import torch
import torch.nn.utils.clip_grad as _clip_grad

from ...core.errors import ReproducibilityWarning

__all__ = ["watch"]

_GROUPS: weakref.WeakSet[Any] = weakref.WeakSet()  # live groups under a ReproduciblePolicy
_ORIGINAL: list[Any] = []  # torch's _clip_grads_with_norm_, once the wrapper is installed


def watch(group: Any) -> None:
    """Check torch's gradient clipping against ``group`` (a ``ParamGroup`` built with
    ``fully_shard(..., reproducible=policy)``) from now on, for as long as it lives."""
    _GROUPS.add(group)
    if _ORIGINAL:
        return
    original = _clip_grad._clip_grads_with_norm_
    _ORIGINAL.append(original)

    @functools.wraps(original)
    def checked(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        return _clip_checked(original, parameters, *args, **kwargs)

    _clip_grad._clip_grads_with_norm_ = checked
    if torch.nn.utils.clip_grads_with_norm_ is original:
        torch.nn.utils.clip_grads_with_norm_ = checked


def _clip_checked(original: Any, parameters: Any, *args: Any, **kwargs: Any) -> Any:
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    hits = _policy_params(params)
    if hits:
        warnings.warn(
            "torch.nn.utils.clip_grad_norm_ was given parameters of groups that reduce under a "
            f"ReproduciblePolicy ({', '.join(hits[:3])}{', ...' if len(hits) > 3 else ''}): "
            "it sums the ranks' partial norms in an order set by the world size, so the norm "
            "and the clipped gradients differ between world sizes and the run is no longer "
            "bit-identical. Use functional_fsdp.clip_grad_norm_(parameters, max_norm) instead "
            "(the same arguments, the same bits on every world size)",
            ReproducibilityWarning,
            stacklevel=_caller_level(),
        )
    return original(params, *args, **kwargs)


def _policy_params(params: list[Any]) -> list[str]:
    """``group: fqn`` of each of ``params`` that a live policy group owns."""
    owned = {
        id(sp.sharded): f"{g.name}: {sp.fqn}" for g in list(_GROUPS) for sp in g.sharded_params
    }
    return [owned[id(p)] for p in params if id(p) in owned]


_SKIP = (os.path.dirname(torch.__file__) + os.sep, __file__)


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside torch and this module: the user's call."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP):
        level, frame = level + 1, frame.f_back  # type: ignore[assignment]
    return level
