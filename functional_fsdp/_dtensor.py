"""A local tensor wrapped as a ``DTensor`` with a known layout, cheaply: shared by the shell
(gradients each step, :mod:`functional_fsdp.shell.engine.dtensors`) and the shell-free
functional optimizers (``functional/whole_matrix.py``), which must not load the shell."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

__all__ = ["wrap", "wrap_like"]


def wrap(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """``DTensor(local, spec, requires_grad=False)``, in a third of its time outside tracing.

    ``DTensor.__init__`` does nothing but sits behind ``torch._disable_dynamo``'s wrapper: 4 of
    the 6 us a gradient's wrapper took (measured, torch 2.13, one per parameter per step).
    ``DTensor.__new__`` alone makes the same tensor; while dynamo traces, the whole
    constructor runs as torch wrote it.
    """
    if torch.compiler.is_compiling():
        return DTensor(local, spec, requires_grad=False)
    return DTensor.__new__(DTensor, local, spec, requires_grad=False)


def wrap_like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``local`` as a tensor like ``like``: a ``DTensor`` with ``like``'s spec (``like``
    itself when ``local`` is its local tensor), or ``local`` when ``like`` is a plain tensor.
    The functional step's new parameters, moments and gradients, one per parameter a step."""
    if not isinstance(like, DTensor):
        return local
    if local is like._local_tensor:
        return like
    return wrap(local, like._spec)
