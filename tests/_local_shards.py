"""torch FSDP2's reference optimizer step on its parameters' local shards, for the tests that
compare our training with FSDP2's.

FSDP2's parameters are ``DTensor`` s, and a torch optimizer's step on them goes through
``DTensor``'s dispatch for each of its elementwise ops: on the 2-D (FSDP + TP) cases about a
third of a torch reference run's CPU. :class:`LocalShards` runs the same optimizer (and state)
on each parameter's local shard instead, with the gradient's local tensor as its ``.grad``. An
elementwise optimizer (AdamW, SGD) computes there exactly what its ``DTensor`` step computes,
kernel for kernel; ``test_tensor_parallel.py``'s
``test_the_local_shard_reference_is_fsdp2s_dtensor_step`` checks it bit for bit. Our own groups
take their local step inside the engine, which is under test; torch's FSDP2 runs as it is, but
for the optimizer's dispatch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn


def is_torch_fsdp(model: nn.Module) -> bool:
    """Whether ``model`` is torch's own FSDP2 module (wherever ``functional_fsdp.as_fsdp2`` may
    point the public name)."""
    from torch.distributed.fsdp._fully_shard._fully_shard import FSDPModule

    return isinstance(model, FSDPModule)


class LocalShards:
    """``make(local shards)``'s optimizer, stepped for the ``DTensor`` parameters ``params``
    (FSDP2 keeps each one's memory for its life; it may hand out a new view of it)."""

    def __init__(
        self, params: Iterable[Any], make: Callable[[list], torch.optim.Optimizer]
    ) -> None:
        self.params = list(params)
        with torch.no_grad():
            self.local = [p.to_local() for p in self.params]
        self.opt = make(self.local)

    def step(self) -> None:
        with torch.no_grad():
            for p, local in zip(self.params, self.local):
                now = p.to_local()
                assert (now.data_ptr(), now.shape) == (local.data_ptr(), local.shape), (
                    "FSDP2 moved a parameter's local shard"
                )
                local.grad = None if p.grad is None else p.grad.to_local()
        self.opt.step()
        for local in self.local:
            local.grad = None

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def reference_optimizer(
    model: nn.Module, make: Callable[[Any], torch.optim.Optimizer], local: bool = True
) -> Any:
    """``make(model.parameters())``, or for torch's FSDP2 (with ``local``) the same optimizer
    on the local shards."""
    if local and is_torch_fsdp(model):
        return LocalShards(model.parameters(), make)
    return make(model.parameters())
