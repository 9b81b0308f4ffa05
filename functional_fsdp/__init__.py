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
from .transitions import reduce_grad, reshard, shard, unshard, writeback

__version__ = "0.1.0"

__all__ = [
    "CPUOffloadPolicy",
    "Communicator",
    "GroupLayout",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ParamSpec",
    "PostForwardState",
    "ShardedState",
    "UnshardedState",
    "Work",
    "errors",
    "reduce_grad",
    "reshard",
    "shard",
    "unshard",
    "writeback",
]
