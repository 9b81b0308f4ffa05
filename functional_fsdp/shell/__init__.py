"""The imperative shell: the only code that touches torch.distributed, hooks and autograd.

Everything other layers (``functional_fsdp.functional``, the top level) use from the shell is
exported here; they import this package, never its modules.
"""

from .api import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method
from .checkpoint import (
    ChecksummingFileSystemWriter,
    SafeFileSystemReader,
    SafeLoadPlanner,
    load_checkpoint,
    save_checkpoint,
)
from .comm import ProcessGroupComm
from .functional_path import DeferredReductions
from .summon import summon_full_params

__all__ = [
    "ChecksummingFileSystemWriter",
    "DeferredReductions",
    "FSDPModule",
    "ProcessGroupComm",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "UnshardHandle",
    "fully_shard",
    "load_checkpoint",
    "register_fsdp_forward_method",
    "save_checkpoint",
    "summon_full_params",
]
