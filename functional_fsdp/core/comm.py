"""The communicator protocol the core receives.

The core never imports ``torch.distributed``: a transition that needs a collective takes a
:class:`Communicator` argument. Implementations: :class:`functional_fsdp.shell.comm.process_group.ProcessGroupComm`
(real process groups, gloo or NCCL) and :class:`functional_fsdp.testing.SimulatedWorld` (N ranks
as threads of one process).

Reductions are named by strings: ``"sum"`` or ``"avg"``.

Every communicator declares ``supports_pieces``. One that sets it also implements
:class:`PiecesCommunicator`: ``all_gather_pieces(outputs, inputs)`` (``outputs[r][i]`` receives
rank ``r``'s ``inputs[i]``) and ``reduce_scatter_pieces(outputs, inputs, op)`` (``outputs[i]``
receives the reduction over ranks of their ``inputs[rank][i]``). The core then gathers straight
into the unsharded buffer and sends gradient rows without packing them; otherwise it packs and
uses the packed collectives below (``all_to_all`` carries compressed gradients). (A declared flag, not an ``isinstance`` check against the
protocol: that costs about 20 microseconds per collective on Python 3.11.) Every collective may run asynchronously
(``async_op=True`` returns a :class:`Work`); the output is valid only after ``wait()``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, cast, runtime_checkable

import attrs
import torch

from .errors import MeshError

__all__ = [
    "PLAIN_COMM",
    "CommCapabilities",
    "Communicator",
    "DoneWork",
    "PiecesCommunicator",
    "ScopedCommunicator",
    "ThenWork",
    "Work",
    "capabilities",
    "check_comm",
    "coalesces",
    "collective_or_copy",
    "scoped_view",
    "uses_pieces",
    "work_done",
]


@runtime_checkable
class Work(Protocol):
    """A pending collective."""

    def wait(self) -> None:
        """Block until the collective's output is ready."""


def work_done(work: Work) -> bool | None:
    """Whether ``work``'s collective has completed (no message can land in its buffers any
    more), without waiting: its ``is_completed()`` (torch's ``Work`` and this package's
    handles have one; a handle answers ``None`` when the work it wraps cannot say), or
    ``None`` when it has none. A work that completed with an error counts as completed."""
    check = getattr(work, "is_completed", None)
    done = None if check is None else check()
    return None if done is None else bool(done)


class DoneWork:
    """A :class:`Work` that is already complete."""

    __slots__ = ()

    def wait(self) -> None:
        """Nothing to wait for."""

    def is_completed(self) -> bool:
        """Always: there was nothing to wait for."""
        return True


def collective_or_copy(
    world_size: int, out: torch.Tensor, inp: torch.Tensor, collective: Callable[[], Work]
) -> Work:
    """Run ``collective`` (which writes ``out`` from ``inp`` across the ranks), or, at world
    size 1, where there is no peer to talk to, copy ``inp`` into ``out`` (done at once)."""
    if world_size == 1:
        out.copy_(inp)
        return DoneWork()
    return collective()


class ThenWork:
    """A :class:`Work` that waits for ``work``, then runs ``then`` once (e.g. decoding what a
    collective received)."""

    __slots__ = ("_then", "_work")

    def __init__(self, work: Work, then: Callable[[], None]) -> None:
        self._work = work
        self._then: Callable[[], None] | None = then

    def wait(self) -> None:
        """Wait for the collective, then run the continuation (once)."""
        self._work.wait()
        then, self._then = self._then, None
        if then is not None:
            then()

    def is_completed(self) -> bool | None:
        """Whether the collective completed (the continuation may not have run yet);
        ``None`` when ``work`` cannot say."""
        return work_done(self._work)


def coalesces(comm: object) -> bool:
    """Whether ``comm`` can run a bucket of several groups' collectives as one (its optional
    ``coalesces`` capability: a process group's communicator declares it; custom
    collectives, wrappers and the simulated world do not)."""
    return bool(getattr(comm, "coalesces", False))


@attrs.frozen
class CommCapabilities:
    """What a communicator can do beyond the :class:`Communicator` protocol, declared as its
    optional ``capabilities`` attribute, so that callers read a flag instead of testing the
    communicator's class.

    Attributes:
        scoped: its collectives carry one parameter group's key and name (its ``name`` may be
            set, and collective errors name it), and it gives views with tags of their own:
            ``for_summon()`` (``summon_full_params``) and ``for_bucket(names)`` (several
            groups' collectives run as one).
        custom_all_gather: its all-gathers run through a user's FSDP2 ``AllGather`` object.
        custom_reduce_scatter: its reduce-scatters run through a user's FSDP2
            ``ReduceScatter`` object.
    """

    scoped: bool = False
    custom_all_gather: bool = False
    custom_reduce_scatter: bool = False

    @property
    def custom(self) -> bool:
        """Whether any of its collectives is a user's object."""
        return self.custom_all_gather or self.custom_reduce_scatter


PLAIN_COMM = CommCapabilities()
"""A communicator that declares nothing beyond the protocol (the simulated world, a user's)."""


def capabilities(comm: object) -> CommCapabilities:
    """What ``comm`` declares (:class:`CommCapabilities`; :data:`PLAIN_COMM` when it declares
    nothing, or for ``None``)."""
    return cast(CommCapabilities, getattr(comm, "capabilities", PLAIN_COMM))


def scoped_view(comm: object) -> ScopedCommunicator | None:
    """``comm`` as a :class:`ScopedCommunicator` when it declares ``scoped``, else ``None``."""
    return cast(ScopedCommunicator, comm) if capabilities(comm).scoped else None


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

    @property
    def supports_pieces(self) -> bool:
        """Whether this communicator implements :class:`PiecesCommunicator` (and it pays off)."""
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

    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False
    ) -> Work:
        """Chunk ``r`` of ``input`` (1-D, ``ws * n``) goes to rank ``r``; chunk ``r`` of
        ``output`` (1-D, ``ws * n``) comes from rank ``r`` (this rank's own chunk: a copy)."""
        ...


class ScopedCommunicator(Communicator, Protocol):
    """A :class:`Communicator` that declares ``CommCapabilities(scoped=True)``: one parameter
    group's view of a shared communicator."""

    name: str | None

    def for_summon(self) -> ScopedCommunicator:
        """The same group's view with tags of its own, for ``summon_full_params``."""
        ...

    def for_bucket(self, names: Sequence[str | None]) -> ScopedCommunicator:
        """A view for one collective run by the groups ``names`` together (a bucket)."""
        ...


@runtime_checkable
class PiecesCommunicator(Communicator, Protocol):
    """A :class:`Communicator` that also moves lists of tensors ("pieces") in one collective.

    On gloo these are point-to-point messages straight between the parameters' storage and the
    unsharded buffer, with no packing copy; they move the bytes of the packed collectives.
    They pay off for large groups only (a message per parameter costs more than one packing
    copy for small ones): the core takes them for a group whose unsharded bytes
    (:attr:`~functional_fsdp.core.records.GroupLayout.unsharded_bytes`) reach ``pieces_min_bytes``.
    """

    @property
    def pieces_min_bytes(self) -> int:
        """Smallest group (unsharded bytes) worth the pieces collectives; 0: every group."""
        ...

    def all_gather_pieces(
        self,
        outputs: list[list[torch.Tensor]],
        inputs: list[torch.Tensor],
        *,
        async_op: bool = False,
    ) -> Work:
        """``outputs[r][i]`` receives rank ``r``'s ``inputs[i]`` (an empty ``outputs[rank]``:
        no copy of this rank's own)."""
        ...

    def reduce_scatter_pieces(
        self,
        outputs: list[torch.Tensor],
        inputs: list[list[torch.Tensor]],
        *,
        op: str = "sum",
        async_op: bool = False,
    ) -> Work:
        """``outputs[i]`` receives the reduction (``op``) over ranks of ``inputs[rank][i]``."""
        ...


def check_comm(comm: Communicator, world_size: int, what: str) -> None:
    """Raise :class:`~functional_fsdp.core.errors.MeshError` unless ``comm`` spans ``world_size``
    ranks (checked before any collective)."""
    if comm.world_size != world_size:
        raise MeshError(
            f"{what}: the communicator has {comm.world_size} ranks but the layout was built for "
            f"{world_size}; pass the shard group the state was sharded over"
        )


def uses_pieces(comm: Communicator, unsharded_bytes: int) -> bool:
    """Whether a group of ``unsharded_bytes`` takes the pieces collectives on ``comm``.

    Rank-consistent (it reads only the communicator's declaration and the layout), so every
    rank takes the same path and their messages pair.
    """
    if not comm.supports_pieces:
        return False
    return unsharded_bytes >= cast(PiecesCommunicator, comm).pieces_min_bytes
