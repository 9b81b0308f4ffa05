"""A group's settings: the flags that change only through ``FSDPModule.set_*``.

One frozen record per group (:class:`GroupConfig`). The setters validate their arguments, then
replace the record through ``ParamGroup.configure`` (``attrs.evolve``); the engine reads
``group.config.<flag>``. Nothing in a step writes it, so the engine may read it without a copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch

from ...core.compression import GradCompression
from ...core.reproducible import ReproduciblePolicy

__all__ = ["GroupConfig"]


@attrs.frozen
class GroupConfig:
    """The settings of one parameter group (FSDP2's ``FSDPModule`` setters, and ours).

    Attributes:
        reshard_after_forward: free the full parameters after forward (``True``), keep them
            (``False``), or keep the rows of a ``k``-rank sub-group (an int ``k``). ``fully_shard``
            sets it; the root's lazy init sets ``False`` unless the user chose;
            ``set_reshard_after_forward``.
        reshard_after_backward: free the full parameters after backward
            (``set_reshard_after_backward``).
        requires_gradient_sync: reduce gradients in backward, or accumulate them unsharded
            (``set_requires_gradient_sync``).
        requires_all_reduce: HSDP: all-reduce across replicas now, or keep a partial sum
            (``set_requires_all_reduce``).
        divide_factor: divide gradients by this instead of the data-parallel size (``None``:
            average; ``set_gradient_divide_factor``).
        force_sum: sum reductions with explicit pre/post division
            (``set_force_sum_reduction_for_comms``).
        reduce_unused: reduce-scatter zeros for parameters that got no gradient
            (``set_reduce_scatter_unused_params``).
        all_reduce_hook: FSDP2's hook on the reduced gradients, or ``None``
            (``set_all_reduce_hook``).
        unshard_in_backward: all-gather the parameters for backward (``set_unshard_in_backward``).
        allocate_from_process_group: FSDP2's allocation hint; accepted, no effect here.
        reduce_scatter_max_input_buffers: FSDP2's knob; accepted, no effect here.
        separate_reduce_scatter_group: FSDP2's knob; accepted, no effect here.
        keep_unsharded_storage: FSDP2 2.15's knob (``set_keep_unsharded_storage``); accepted,
            no effect here.
        grad_compression: beyond FSDP2: the compressed reduce-scatter, or ``None`` for the exact
            one (``set_gradient_compression``; its residual lives in the group's record).
        reproducible: beyond FSDP2: the :class:`ReproduciblePolicy` its gradients are reduced
            under (``fully_shard(reproducible=...)``), or ``None``.
    """

    reshard_after_forward: bool | int = True
    reshard_after_backward: bool = True
    requires_gradient_sync: bool = True
    requires_all_reduce: bool = True
    divide_factor: float | None = None
    force_sum: bool = False
    reduce_unused: bool = False
    all_reduce_hook: Callable[[torch.Tensor], Any] | None = None
    unshard_in_backward: bool = True
    allocate_from_process_group: bool = False
    reduce_scatter_max_input_buffers: int = 1
    separate_reduce_scatter_group: bool = False
    keep_unsharded_storage: bool = False
    grad_compression: GradCompression | None = None
    reproducible: ReproduciblePolicy | None = None

    def conflicts_with_reproducible(self) -> list[str]:
        """The settings that change a reduction's sums, which the policy cannot order."""
        return [
            what
            for what, on in (
                ("set_gradient_compression", self.grad_compression is not None),
                ("set_gradient_divide_factor", self.divide_factor is not None),
                ("set_force_sum_reduction_for_comms", self.force_sum),
                ("set_all_reduce_hook", self.all_reduce_hook is not None),
            )
            if on
        ]

    @property
    def keeps_gather_output(self) -> bool:
        """Whether forward keeps a sub-group's rows (``reshard_after_forward`` is an int)."""
        raf = self.reshard_after_forward
        return isinstance(raf, int) and not isinstance(raf, bool)
