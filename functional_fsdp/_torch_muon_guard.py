"""Refuse ``torch.optim.Muon`` on sharded ``DTensor`` parameters instead of stepping wrongly.

``torch.optim.Muon`` accepts FSDP's row-sharded ``DTensor`` parameters and steps them without
error, but its Newton-Schulz iteration then does not compute the single-process result
(measured: a 48x64 layer on 2 ranks differs by 0.0026 after one step whose largest change is
0.0066). Its constructor has no hook, so the check is a global optimizer step pre-hook
(``torch.optim.optimizer.register_optimizer_step_pre_hook``), installed once when
``functional_fsdp`` is imported. It costs one ``isinstance`` per optimizer step of any other
optimizer, and raises :class:`~functional_fsdp.core.errors.WholeMatrixError` (before anything is
modified) only for a ``torch.optim.Muon`` with a ``DTensor`` parameter sharded over a mesh dim
of more than one rank, pointing to ``functional_fsdp.optim.Muon``.

This module imports no ``torch.distributed`` (the core's import stays free of it): the
``DTensor`` check runs only when a ``torch.optim.Muon`` steps.
"""

from __future__ import annotations

from typing import Any

import torch

from .core.errors import WholeMatrixError

__all__ = ["check_torch_muon", "install"]


def _sharded(p: Any) -> bool:
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return False
    mesh = p.device_mesh
    return any(not pl.is_replicate() and mesh.size(d) > 1 for d, pl in enumerate(p.placements))


def check_torch_muon(optimizer: torch.optim.Optimizer, args: Any = (), kwargs: Any = None) -> None:
    """Raise if ``optimizer`` is a ``torch.optim.Muon`` over sharded ``DTensor`` parameters.

    Args:
        optimizer: any optimizer (only ``torch.optim.Muon`` and its subclasses are checked).
        args: the step's positional arguments (unused; the hook's signature).
        kwargs: the step's keyword arguments (unused).

    Raises:
        WholeMatrixError: naming the parameter and the fix.
    """
    torch_muon = getattr(torch.optim, "Muon", None)
    if torch_muon is None or not isinstance(optimizer, torch_muon):
        return
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if _sharded(p):
                raise WholeMatrixError(
                    f"torch.optim.Muon was given a sharded DTensor parameter (param group {gi}, "
                    f"parameter {pi}, global shape {tuple(p.shape)}, placements "
                    f"{tuple(p.placements)}): it would orthogonalize the update without the "
                    "whole matrix and silently differ from a single process. Use "
                    "functional_fsdp.optim.Muon (the same arguments; it gathers each matrix to "
                    "one rank), or functional_fsdp.functional.muon in the functional API"
                )


def install() -> Any:
    """Register :func:`check_torch_muon` as a global optimizer step pre-hook.

    Returns:
        The hook's removable handle (``handle.remove()`` turns the check off).
    """
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    return register_optimizer_step_pre_hook(check_torch_muon)
