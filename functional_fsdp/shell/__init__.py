"""The imperative shell: the only code that touches torch.distributed, hooks and autograd.

Everything other layers (``functional_fsdp.functional``, the top level) use from the shell is
exported here; they import this package, never its modules.
"""

from typing import TYPE_CHECKING, Any

from .api import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method
from .comm import ProcessGroupComm
from .functional_path import DeferredReductions
from .module import share_comm_ctx
from .summon import summon_full_params

if TYPE_CHECKING:
    from .checkpoint import (
        ChecksummingFileSystemWriter,
        SafeFileSystemReader,
        SafeLoadPlanner,
        load_checkpoint,
        save_checkpoint,
    )


# The checkpoint names (in __all__, not imported above) load torch.distributed.checkpoint (about
# 6 MiB of RSS per rank): only on first use, so a run that never checkpoints does not pay.
def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    "share_comm_ctx",
    "summon_full_params",
]
