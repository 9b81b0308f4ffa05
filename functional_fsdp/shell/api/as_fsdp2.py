"""``use_as_fsdp2()``: make code that imports FSDP2 at call time get ours, reversibly.

Frameworks such as Hugging Face Accelerate, torchtitan and Lightning import FSDP2 inside the
function that applies it (``from torch.distributed.fsdp import fully_shard, FSDPModule`` in
Accelerate's ``fsdp2_prepare_model``), so changing one import in the user's script does not
reach them. While swapped, ``torch.distributed.fsdp``, ``torch.distributed.fsdp._fully_shard``
and its ``_fully_shard`` / ``_fsdp_api`` modules hand out ``functional_fsdp``'s ``fully_shard``,
``FSDPModule``, ``UnshardHandle``, ``register_fsdp_forward_method``, ``share_comm_ctx``,
``MixedPrecisionPolicy``, ``OffloadPolicy``, ``CPUOffloadPolicy`` (and
``GradientReductionHandle`` where torch has it). Only names torch defines there are replaced;
undoing puts torch's objects back.

A module imported *before* the swap keeps what it imported then (torch's pipelining stage,
for one, keeps torch's ``fully_shard``; it works with ours anyway). The swap is
process-wide: it changes torch's modules for every thread of the process.
"""

from __future__ import annotations

import importlib
from types import ModuleType, TracebackType
from typing import Any

from ...core.records import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .finalization import GradientReductionHandle
from .fully_shard import fully_shard
from .module import FSDPModule, UnshardHandle, register_fsdp_forward_method, share_comm_ctx

__all__ = ["FSDP2Swap", "use_as_fsdp2"]

# The modules frameworks import FSDP2's names from.
_TORCH_MODULES = (
    "torch.distributed.fsdp",
    "torch.distributed.fsdp._fully_shard",
    "torch.distributed.fsdp._fully_shard._fully_shard",
    "torch.distributed.fsdp._fully_shard._fsdp_api",
)


def _ours() -> dict[str, Any]:
    return {
        "fully_shard": fully_shard,
        "FSDPModule": FSDPModule,
        "UnshardHandle": UnshardHandle,
        "register_fsdp_forward_method": register_fsdp_forward_method,
        "share_comm_ctx": share_comm_ctx,
        "MixedPrecisionPolicy": MixedPrecisionPolicy,
        "OffloadPolicy": OffloadPolicy,
        "CPUOffloadPolicy": CPUOffloadPolicy,
        "GradientReductionHandle": GradientReductionHandle,
    }


class FSDP2Swap:
    """What :func:`use_as_fsdp2` replaced; :meth:`undo` (or leaving the ``with`` block) puts
    torch's objects back.

    Attributes:
        replaced: ``(module, name, torch's object)`` for each attribute swapped.
    """

    def __init__(self, replaced: list[tuple[ModuleType, str, Any]]) -> None:
        self.replaced = replaced

    @property
    def active(self) -> bool:
        """Whether the swap is still in place (not undone)."""
        return bool(self.replaced)

    def undo(self) -> None:
        """Put back what the swap replaced (a second call does nothing). Undo nested swaps
        in reverse order, as ``with`` blocks do."""
        replaced, self.replaced = self.replaced, []
        for module, name, before in reversed(replaced):
            setattr(module, name, before)

    def __enter__(self) -> FSDP2Swap:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.undo()


def use_as_fsdp2() -> FSDP2Swap:
    """Make ``torch.distributed.fsdp``'s FSDP2 names (``fully_shard``, ``FSDPModule``,
    ``MixedPrecisionPolicy``, ...) be ``functional_fsdp``'s, for code that imports them at
    call time (Accelerate, torchtitan, Lightning). Reversible: use it as a context manager, or
    call it and later ``undo()`` what it returns.

    Example::

        import functional_fsdp

        with functional_fsdp.use_as_fsdp2():
            model = accelerator.prepare(model)  # Accelerate's FSDP v2 path shards with ours

        swap = functional_fsdp.use_as_fsdp2()  # or for the whole run
        ...
        swap.undo()

    Modules that imported the names before the call keep torch's (``from
    torch.distributed.fsdp import fully_shard`` at the top of a file that was already
    imported). The swap changes torch's modules for the whole process.

    Returns:
        An :class:`FSDP2Swap`: a context manager whose exit, or whose ``undo()``, restores
        torch's objects.
    """
    ours = _ours()
    replaced: list[tuple[ModuleType, str, Any]] = []
    for module_name in _TORCH_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # another torch's layout: its public module is enough
            continue
        for name, value in ours.items():
            if name in vars(module):
                replaced.append((module, name, getattr(module, name)))
                setattr(module, name, value)
    return FSDP2Swap(replaced)
