"""functional_fsdp: fully sharded data parallelism for PyTorch around immutable state."""

from . import errors, functional
from ._tree import tree_flatten, tree_leaves, tree_map, tree_unflatten
from .comm import Communicator, Work
from .functional import TrainState, apply_to_module, make_train_step
from .functional import init as init_train_state
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
    summon_full_params,
)
from .shell.launch import run_local
from .transitions import reduce_grad, reshard, shard, unshard, writeback

__version__ = "0.1.0"

__all__ = [
    "CPUOffloadPolicy",
    "ChecksummingFileSystemWriter",
    "Communicator",
    "FSDPModule",
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
    "reduce_grad",
    "register_fsdp_forward_method",
    "reshard",
    "run_local",
    "save_checkpoint",
    "shard",
    "summon_full_params",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_unflatten",
    "unshard",
    "writeback",
]
