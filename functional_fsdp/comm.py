"""The communicator protocol the core receives.

The core never imports ``torch.distributed``: a transition that needs a collective takes a
:class:`Communicator` argument. Implementations: :class:`functional_fsdp.shell.comm.ProcessGroupComm`
(real process groups, gloo or NCCL) and :class:`functional_fsdp.testing.SimulatedWorld` (N ranks
as threads of one process).

Reductions are named by strings: ``"sum"`` or ``"avg"``.

A communicator may also offer *pieces* collectives (``supports_pieces = True``):
``all_gather_pieces(outputs, inputs)`` (``outputs[r][i]`` receives rank ``r``'s ``inputs[i]``) and
``reduce_scatter_pieces(outputs, inputs, op)`` (``outputs[i]`` receives the reduction over ranks
of their ``inputs[rank][i]``). The core then gathers straight into the unsharded buffer and sends
gradient rows without packing them; otherwise it packs and uses the three collectives below. Every collective may run asynchronously
(``async_op=True`` returns a :class:`Work`); the output is valid only after ``wait()``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["Communicator", "DoneWork", "Work"]


@runtime_checkable
class Work(Protocol):
    """A pending collective."""

    def wait(self) -> None:
        """Block until the collective's output is ready."""


class DoneWork:
    """A :class:`Work` that is already complete."""

    __slots__ = ()

    def wait(self) -> None:
        """Nothing to wait for."""


@runtime_checkable
class Communicator(Protocol):
    """Collectives over one group of ranks.

    Attributes:
        rank: this rank's index in the group.
        world_size: ranks in the group.
    """

    @property
    def rank(self) -> int:
        """This rank's index in the group."""
        ...

    @property
    def world_size(self) -> int:
        """Ranks in the group."""
        ...

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False
    ) -> Work:
        """Gather ``input`` (1-D) of every rank into ``output`` (1-D, rank-major, ``ws * n``)."""
        ...

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, op: str = "sum", async_op: bool = False
    ) -> Work:
        """Reduce ``input`` (1-D, ``ws * n``) over ranks; rank ``r`` gets chunk ``r`` in ``output``."""
        ...

    def all_reduce(self, tensor: torch.Tensor, *, op: str = "sum", async_op: bool = False) -> Work:
        """Reduce ``tensor`` in place over ranks."""
        ...
