"""Refuse an optimizer step over parameters that ``fully_shard`` replaced.

``fully_shard`` registers new (sharded ``DTensor``) parameters on the module in place of the old
ones. An optimizer built before it holds the old parameters: its steps update tensors the model
no longer uses, and training silently does nothing (FSDP2 behaves the same). So ``fully_shard``
marks each parameter it replaces with its name, and a global optimizer step pre-hook raises
:class:`~functional_fsdp.core.errors.ReplacedParameterError` at the first step of an optimizer
that holds one, before anything is modified.

The check reads every parameter of the optimizer once, then only when something may have
changed: the verdict is kept on the optimizer with the number of ``fully_shard`` calls so far
and the sizes of its param groups (``add_param_group``), so a step costs one comparison.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ...core.errors import ReplacedParameterError

__all__ = ["check_replaced_params", "install", "mark_replaced"]

_REPLACED = "_ffsdp_replaced_as"  # on a replaced parameter: "<its name> (fully_shard(<module>))"
_VERDICT = "_ffsdp_replaced_checked"  # on an optimizer: the signature it was found clean at
# fully_shard calls so far in this process (a parameter replaced after an optimizer's check
# makes its verdict stale); and the hook's handle, registered once.
_SHARDINGS = [0]
_HANDLE: list[Any] = []


def mark_replaced(params: Iterable[tuple[torch.nn.Parameter, str]], module: str) -> None:
    """Mark each ``(parameter, name)`` as replaced by ``fully_shard(<module>)``."""
    for p, name in params:
        setattr(p, _REPLACED, f"{name!r} (fully_shard({module}))")
    _SHARDINGS[0] += 1


def install() -> Any:
    """Register :func:`check_replaced_params` as a global optimizer step pre-hook (once per
    process, at the first ``fully_shard``); the hook itself."""
    if not _HANDLE:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _HANDLE.append(register_optimizer_step_pre_hook(check_replaced_params))
    return check_replaced_params


def check_replaced_params(
    optimizer: torch.optim.Optimizer, args: Any = (), kwargs: Any = None
) -> None:
    """Raise if ``optimizer`` holds a parameter that ``fully_shard`` replaced.

    Args:
        optimizer: any optimizer.
        args: the step's positional arguments (unused; the hook's signature).
        kwargs: the step's keyword arguments (unused).

    Raises:
        ReplacedParameterError: naming the replaced parameters and the fix.
    """
    del args, kwargs
    groups = optimizer.param_groups
    signature = (_SHARDINGS[0], *(len(g["params"]) for g in groups))
    if optimizer.__dict__.get(_VERDICT) == signature:
        return
    stale = [name for g in groups for p in g["params"] if (name := getattr(p, _REPLACED, None))]
    if stale:
        shown = ", ".join(stale[:5]) + (f" and {len(stale) - 5} more" if len(stale) > 5 else "")
        raise ReplacedParameterError(
            f"{type(optimizer).__name__} holds {len(stale)} parameter(s) that fully_shard "
            f"replaced: {shown}. fully_shard registers new sharded parameters on the module, "
            "so this optimizer would step tensors the model no longer uses and train nothing. "
            "Build the optimizer after fully_shard (from model.parameters())"
        )
    optimizer.__dict__[_VERDICT] = signature
