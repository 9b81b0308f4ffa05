"""The imperative shell: the only code that touches torch.distributed, hooks and autograd."""

from .api import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method
from .comm import ProcessGroupComm

__all__ = ["FSDPModule", "ProcessGroupComm", "UnshardHandle", "fully_shard", "register_fsdp_forward_method"]
