"""functional_fsdp: fully sharded data parallelism for PyTorch around immutable state.

The top level is lazy: ``import functional_fsdp`` (and any pure core module such as
``functional_fsdp.layout``, ``records``, ``transitions`` or ``testing``) loads only the core.
The imperative shell (``fully_shard``, checkpoints, ``torch.distributed``) and the functional
API load on first use of one of their names. ``tests/test_architecture.py`` checks this in a
subprocess.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import errors
from ._torch_muon_guard import install as _install_torch_muon_guard
from ._tree import tree_flatten, tree_leaves, tree_map, tree_unflatten
from .comm import Communicator, Work
from .compression import GradCompression
from .records import (
    CPUOffloadPolicy,
    GroupLayout,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ParamSpec,
    PostForwardState,
    ShardedState,
    UnshardedState,
)
from .transitions import reduce_grad, reshard, shard, unshard, writeback

if TYPE_CHECKING:
    from . import functional, optim
    from .functional import TrainState, apply_to_module, make_train_step
    from .functional import init as init_train_state
    from .shell import (
        ChecksummingFileSystemWriter,
        FSDPModule,
        ProcessGroupComm,
        SafeFileSystemReader,
        SafeLoadPlanner,
        UnshardHandle,
        fully_shard,
        load_checkpoint,
        register_fsdp_forward_method,
        save_checkpoint,
        share_comm_ctx,
        summon_full_params,
    )
    from .shell.launch import run_local

__version__ = "0.1.0"

# Public name -> (module, attribute); loaded on first access (module ``__getattr__``).
_LAZY: dict[str, tuple[str, str | None]] = {
    "functional": (".functional", None),
    "optim": (".optim", None),
    "TrainState": (".functional", "TrainState"),
    "apply_to_module": (".functional", "apply_to_module"),
    "make_train_step": (".functional", "make_train_step"),
    "init_train_state": (".functional", "init"),
    "run_local": (".shell.launch", "run_local"),
    **{
        name: (".shell", name)
        for name in (
            "ChecksummingFileSystemWriter",
            "FSDPModule",
            "ProcessGroupComm",
            "SafeFileSystemReader",
            "SafeLoadPlanner",
            "UnshardHandle",
            "fully_shard",
            "load_checkpoint",
            "register_fsdp_forward_method",
            "save_checkpoint",
            "share_comm_ctx",
            "summon_full_params",
        )
    },
}


# torch.optim.Muon stepped on sharded DTensor parameters raises instead of silently
# orthogonalizing without the whole matrix (a global step pre-hook, see _torch_muon_guard).
_TORCH_MUON_GUARD = _install_torch_muon_guard()


def __getattr__(name: str) -> Any:
    """Load a shell or functional-API name on first use (the core never imports the shell)."""
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    module = importlib.import_module(module_name, __name__)
    return module if attr is None else getattr(module, attr)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "CPUOffloadPolicy",
    "ChecksummingFileSystemWriter",
    "Communicator",
    "FSDPModule",
    "GradCompression",
    "GroupLayout",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ParamSpec",
    "ProcessGroupComm",
    "PostForwardState",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "ShardedState",
    "TrainState",
    "UnshardHandle",
    "UnshardedState",
    "Work",
    "apply_to_module",
    "errors",
    "fully_shard",
    "functional",
    "init_train_state",
    "load_checkpoint",
    "make_train_step",
    "optim",
    "reduce_grad",
    "register_fsdp_forward_method",
    "reshard",
    "run_local",
    "save_checkpoint",
    "shard",
    "share_comm_ctx",
    "summon_full_params",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_unflatten",
    "unshard",
    "writeback",
]
