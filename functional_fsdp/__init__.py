"""functional_fsdp: fully sharded data parallelism for PyTorch around immutable state."""

from . import errors
from .comm import Communicator, Work
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
from .shell import FSDPModule, ProcessGroupComm, UnshardHandle, fully_shard, register_fsdp_forward_method
from .transitions import reduce_grad, reshard, shard, unshard, writeback

__version__ = "0.1.0"

__all__ = [
    "CPUOffloadPolicy",
    "Communicator",
    "FSDPModule",
    "GroupLayout",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ParamSpec",
    "ProcessGroupComm",
    "PostForwardState",
    "ShardedState",
    "UnshardHandle",
    "UnshardedState",
    "Work",
    "errors",
    "fully_shard",
    "reduce_grad",
    "register_fsdp_forward_method",
    "reshard",
    "shard",
    "unshard",
    "writeback",
]
