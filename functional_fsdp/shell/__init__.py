"""The imperative shell: the only code that touches torch.distributed, hooks and autograd."""

from .api import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method
from .checkpoint import SafeFileSystemReader, SafeLoadPlanner, load_checkpoint
from .comm import ProcessGroupComm
from .summon import summon_full_params

__all__ = [
    "FSDPModule",
    "ProcessGroupComm",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "UnshardHandle",
    "fully_shard",
    "load_checkpoint",
    "register_fsdp_forward_method",
    "summon_full_params",
]
