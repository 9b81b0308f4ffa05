"""Whole-matrix optimizers for sharded parameters (``torch.optim.Optimizer`` s).

:class:`Muon` is ``torch.optim.Muon`` for parameters sharded with ``fully_shard``: each 2-D
matrix is orthogonalized whole by one owner rank (gathered, Newton-Schulz, rows scattered back),
the other parameters are stepped with AdamW. ``torch.optim.Muon`` itself, stepped on sharded
``DTensor`` parameters, raises :class:`~functional_fsdp.core.errors.WholeMatrixError` once
``functional_fsdp`` is imported (see :mod:`functional_fsdp._torch_muon_guard`). The functional
counterparts are :func:`functional_fsdp.functional.muon` and
:func:`functional_fsdp.functional.whole_matrix`. See ``docs/muon.md``.
"""

from ._whole_matrix import (
    ExchangeStats,
    MatrixLayout,
    assign_owners,
    map_whole_matrices,
    matrix_layout,
    plan_owners,
)
from .muon import DEFAULT_NS_COEFFICIENTS, DEFAULT_NS_STEPS, EPS, Muon, adjust_lr, newton_schulz

__all__ = [
    "DEFAULT_NS_COEFFICIENTS",
    "DEFAULT_NS_STEPS",
    "EPS",
    "ExchangeStats",
    "MatrixLayout",
    "Muon",
    "adjust_lr",
    "assign_owners",
    "map_whole_matrices",
    "matrix_layout",
    "newton_schulz",
    "plan_owners",
]
