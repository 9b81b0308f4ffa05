"""FSDP2's communication extension points, adapted to the engine's communicator protocol.

* :class:`CustomCollectiveComm` wraps a group's communicator so that its all-gathers and/or
  reduce-scatters run through a user's FSDP2 ``AllGather`` / ``ReduceScatter`` object
  (``torch.distributed.fsdp._fully_shard._fsdp_api``; :meth:`FSDPModule.set_custom_all_gather`
  and :meth:`~FSDPModule.set_custom_reduce_scatter`). It declares no pieces collectives, so the
  core takes the packed path (one flat buffer per collective, as FSDP2 builds it) for the group.
* :func:`with_all_reduce_hook` makes a pending reduction call FSDP2's all-reduce hook
  (:meth:`FSDPModule.set_all_reduce_hook`) exactly where FSDP2 calls it.

The core stays untouched: both are shell-side wrappers of what the core receives (a
communicator) or returns (a :class:`~functional_fsdp.core.reduction.PendingReduce` handle).

How FSDP2 calls the user's objects, and what we do:

* **all-gather**: ``output = comm.allocate((ws * n,), dtype=..., device=...)``, this rank's
  ``n`` packed elements copied into ``output[rank*n:(rank+1)*n]``, then
  ``comm(output_tensor=output, input_tensor=that slice, group=..., async_op=...)``. We do the
  same, then copy ``output`` into the engine's gather buffer (one extra copy: the core owns its
  packed buffers).
* **reduce-scatter**: ``input = allocate((ws * n,))``, ``output = allocate((n,))`` in the reduce
  dtype, the packed gradients copied into ``input``, ``comm(output_tensor=output,
  input_tensor=input, group=..., op=...)`` with ``op`` ``ReduceOp.AVG`` or ``ReduceOp.SUM``
  (FSDP2's ``PREMUL_SUM(1/f)`` for a custom divide factor arrives as ``SUM`` of an input
  already multiplied by ``1/f``). Then ``output`` is copied into the engine's buffer.
* Both are called with ``async_op=True`` (FSDP2 passes ``False`` by default and orders the
  collective on a CUDA stream instead): the engine overlaps the collective with compute and waits
  the returned ``Work`` with its bounded, abort-aware wait. A collective may return ``None``
  when it completed before returning.
* World size 1 issues no collective (FSDP2 neither).

Misbehaving objects end in named errors (before anything is written to the group): an
``allocate`` that returns a wrong size, dtype or device, or a collective or hook that resizes
its buffer, raises :class:`~functional_fsdp.core.errors.LayoutMismatchError`; a collective or hook
that raises is re-raised as :class:`~functional_fsdp.core.errors.CollectiveError`. Either way the
peers are told at once (they raise :class:`~functional_fsdp.core.errors.PeerAbortedError` instead of
waiting), and ``reset_iter_state()`` on every rank recovers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist

from ...core.comm import CommCapabilities, Communicator, DoneWork, ThenWork, Work, work_done
from ...core.errors import CollectiveError, LayoutMismatchError, PolicyError
from ...core.reduction import PendingReduce
from .process_group import ProcessGroupComm

__all__ = ["CustomCollectiveComm", "check_custom_comm", "unwrap", "with_all_reduce_hook"]

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG}


def check_custom_comm(comm: Any, what: str) -> None:
    """Raise :class:`PolicyError` unless ``comm`` has FSDP2's ``Comm`` shape (``allocate`` and
    ``__call__``); checked when it is set, before any collective."""
    if comm is None:
        return
    if not callable(getattr(comm, "allocate", None)) or not callable(comm):
        raise PolicyError(
            f"{what} expects an object implementing FSDP2's "
            f"{'AllGather' if 'gather' in what else 'ReduceScatter'} protocol (an allocate(size, "
            f"*, dtype, device) method and __call__), got {type(comm).__name__}"
        )


def unwrap(comm: Communicator) -> Communicator:
    """The communicator under a :class:`CustomCollectiveComm` (``comm`` itself otherwise)."""
    return comm.inner if isinstance(comm, CustomCollectiveComm) else comm


def base_comm(comm: Any) -> ProcessGroupComm | None:
    """The shared process-group communicator under scoped/custom wrappers (their ``base``; a
    :class:`ProcessGroupComm` is its own), or ``None`` (the simulated world, a user's)."""
    base = getattr(comm, "base", None)
    return base if isinstance(base, ProcessGroupComm) else None


def _abort_peers(bases: Sequence[ProcessGroupComm]) -> None:
    """Tell the peers to stop waiting for this rank (it is about to raise)."""
    for b in bases:
        if b.world_size > 1:
            b._post_abort()


class _CustomWork:
    """The user's ``Work`` (or ``None``), waited with the engine's bounded wait, then checked
    and copied into the engine's buffer."""

    __slots__ = ("_comm", "_then", "_what", "_work")

    def __init__(
        self, comm: CustomCollectiveComm, work: Any, then: Callable[[], None], what: str
    ) -> None:
        self._comm, self._work, self._what = comm, work, what
        self._then: Callable[[], None] | None = then

    def wait(self) -> None:
        work = self._work
        if work is not None:
            base = self._comm.base
            if base is not None and callable(getattr(work, "is_completed", None)):
                base.wait_works([work], self._what)
            else:
                self._comm.guard(work.wait, self._what)
            self._work = None  # (kept until waited: a failed wait leaves it in flight)
        then, self._then = self._then, None
        if then is not None:
            then()

    def is_completed(self) -> bool | None:
        """Whether the user's collective completed (``None`` when its ``Work`` cannot say)."""
        return True if self._work is None else work_done(self._work)


class _Delegating:
    """A communicator wrapper: every collective is ``inner``'s unless a subclass overrides it.
    Wrapped groups take the packed path (one flat buffer per collective, as FSDP2's)."""

    supports_pieces = False
    pieces_min_bytes = 0
    coalesces = False  # a user's collectives (or a hook) run per group
    inner: Communicator

    @property
    def rank(self) -> int:
        """This rank's index in the group."""
        return self.inner.rank

    @property
    def world_size(self) -> int:
        """Ranks in the group."""
        return self.inner.world_size

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False
    ) -> Work:
        """The wrapped communicator's."""
        return self.inner.all_gather(output, input, async_op=async_op)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, op: str = "sum", async_op: bool = False
    ) -> Work:
        """The wrapped communicator's."""
        return self.inner.reduce_scatter(output, input, op=op, async_op=async_op)

    def all_reduce(self, tensor: torch.Tensor, *, op: str = "sum", async_op: bool = False) -> Work:
        """The wrapped communicator's (FSDP2 has no custom all-reduce object)."""
        return self.inner.all_reduce(tensor, op=op, async_op=async_op)

    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False
    ) -> Work:
        """The wrapped communicator's (compressed gradient reduction)."""
        return self.inner.all_to_all(output, input, async_op=async_op)


class CustomCollectiveComm(_Delegating):
    """A group's communicator whose all-gather and/or reduce-scatter are a user's FSDP2
    ``AllGather`` / ``ReduceScatter`` objects (``None``: the wrapped communicator's own).

    Args:
        inner: the group's communicator (a scoped view of a process-group communicator).
        all_gather: FSDP2 ``AllGather`` object, or ``None``.
        reduce_scatter: FSDP2 ``ReduceScatter`` object, or ``None``.
        name: the group's name (in error messages).
    """

    def __init__(
        self,
        inner: Communicator,
        *,
        all_gather: Any = None,
        reduce_scatter: Any = None,
        name: str = "",
    ) -> None:
        self.inner = unwrap(inner)
        self.base = base_comm(self.inner)
        self.all_gather_comm = all_gather
        self.reduce_scatter_comm = reduce_scatter
        self.name = name

    @property
    def capabilities(self) -> CommCapabilities:
        """Which of its collectives are the user's (:class:`CommCapabilities`)."""
        return CommCapabilities(
            custom_all_gather=self.all_gather_comm is not None,
            custom_reduce_scatter=self.reduce_scatter_comm is not None,
        )

    @property
    def group(self) -> Any:
        """The ``torch.distributed`` process group passed to the user's collectives."""
        return self.base.group if self.base is not None else None

    def guard(self, fn: Callable[[], Any], what: str) -> Any:
        """Run user code; on an exception tell the peers and raise :class:`CollectiveError`."""
        try:
            return fn()
        except LayoutMismatchError:
            self._abort()
            raise
        except Exception as e:
            self._abort()
            raise CollectiveError(
                f"{what} raised {type(e).__name__}: {e}; the peers were told to stop waiting. "
                "Call reset_iter_state() on the root module on every rank to recover"
            ) from e

    def _abort(self) -> None:
        if self.base is not None:
            _abort_peers([self.base])

    def _allocate(self, comm: Any, numel: int, like: torch.Tensor, what: str) -> torch.Tensor:
        t = self.guard(
            lambda: comm.allocate((numel,), dtype=like.dtype, device=like.device),
            f"{what}: {type(comm).__name__}.allocate",
        )
        if (
            not isinstance(t, torch.Tensor)
            or t.numel() != numel
            or t.dtype != like.dtype
            or t.device != like.device
        ):
            got = (
                f"{tuple(t.shape)} {t.dtype} on {t.device}"
                if isinstance(t, torch.Tensor)
                else type(t).__name__
            )
            self._abort()
            raise LayoutMismatchError(
                f"{what}: {type(comm).__name__}.allocate(({numel},), dtype={like.dtype}, "
                f"device={like.device}) returned {got}; it must return a tensor of exactly "
                f"{numel} elements of that dtype on that device"
            )
        return t.view(-1)

    def _check_size(self, t: torch.Tensor, numel: int, what: str) -> None:
        if t.numel() != numel or t.untyped_storage().nbytes() < numel * t.element_size():
            self._abort()
            raise LayoutMismatchError(
                f"{what} changed the size of its buffer ({numel} elements) to {t.numel()}; a "
                "collective must write its result in place, without resizing"
            )

    def _call(self, comm: Any, what: str, **kwargs: Any) -> Any:
        work = self.guard(lambda: comm(**kwargs), what)
        if work is not None and not callable(getattr(work, "wait", None)):
            self._abort()
            raise CollectiveError(
                f"{what} returned {type(work).__name__}; a custom collective returns a "
                "torch.distributed Work (or None when it has completed)"
            )
        return work

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False
    ) -> Work:
        """Through the user's ``AllGather`` when set (see the module docstring)."""
        comm = self.all_gather_comm
        if comm is None:
            return self.inner.all_gather(output, input, async_op=async_op)
        what = f"custom all-gather {type(comm).__name__} of group {self.name!r}"
        n, total = input.numel(), output.numel()
        buf = self._allocate(comm, total, output, what)
        mine = buf.narrow(0, self.rank * n, n)
        mine.copy_(input)
        work = self._call(
            comm, what, output_tensor=buf, input_tensor=mine, group=self.group, async_op=True
        )

        def then() -> None:
            self._check_size(buf, total, what)
            output.copy_(buf)

        return self._finish(_CustomWork(self, work, then, what), async_op)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, op: str = "sum", async_op: bool = False
    ) -> Work:
        """Through the user's ``ReduceScatter`` when set (see the module docstring)."""
        comm = self.reduce_scatter_comm
        if comm is None:
            return self.inner.reduce_scatter(output, input, op=op, async_op=async_op)
        what = f"custom reduce-scatter {type(comm).__name__} of group {self.name!r}"
        inp = self._allocate(comm, input.numel(), input, what)
        out = self._allocate(comm, output.numel(), output, what)
        inp.copy_(input)
        work = self._call(
            comm,
            what,
            output_tensor=out,
            input_tensor=inp,
            group=self.group,
            op=_REDUCE_OPS[op],
            async_op=True,
        )

        def then() -> None:
            self._check_size(out, output.numel(), what)
            output.copy_(out.view_as(output))

        return self._finish(_CustomWork(self, work, then, what), async_op)

    @staticmethod
    def _finish(work: _CustomWork, async_op: bool) -> Work:
        if async_op:
            return work
        work.wait()
        return DoneWork()


# ---------------------------------------------------------------------- all-reduce hook


class _HookedAllReduce(_Delegating):
    """The replicate communicator, running the hook after its all-reduce (native HSDP)."""

    def __init__(self, inner: Communicator, run_hook: Callable[[torch.Tensor], None]) -> None:
        self.inner, self._run_hook = inner, run_hook

    def all_reduce(self, tensor: torch.Tensor, *, op: str = "sum", async_op: bool = False) -> Work:
        """All-reduce, then the hook on the result."""
        self.inner.all_reduce(tensor, op=op, async_op=False).wait()
        self._run_hook(tensor)
        return DoneWork()


def with_all_reduce_hook(
    pending: PendingReduce,
    hook: Callable[[torch.Tensor], Any],
    *,
    bases: Sequence[ProcessGroupComm],
    name: str,
) -> PendingReduce:
    """``pending`` with FSDP2's all-reduce hook attached where FSDP2 runs it.

    FSDP2 (``foreach_reduce``) calls ``hook(reduce_output)`` on the flat reduced gradients of
    the group in the reduce dtype, before the post-divide and the cast to the parameters' dtype
    (the hook may change them in place): after the reduce-scatter without HSDP, after the
    replicate all-reduce with HSDP, and not at all on an HSDP step that skips the all-reduce
    (``set_requires_all_reduce(False)``).
    """

    grads_numel = pending.sharded.layout.shard_numel

    def run_hook(whole: torch.Tensor) -> None:
        # The hook sees the reduced gradients as FSDP2 has them: without the presence flags
        # that may follow them (core.reduction.agreed_present).
        t = whole.narrow(0, 0, grads_numel)
        what = f"the all-reduce hook of group {name!r}"
        numel = t.numel()
        try:
            hook(t)
        except Exception as e:
            _abort_peers(bases)
            raise CollectiveError(
                f"{what} raised {type(e).__name__}: {e}; the peers were told to stop waiting. "
                "Call reset_iter_state() on the root module on every rank to recover"
            ) from e
        if t.numel() != numel:
            _abort_peers(bases)
            raise LayoutMismatchError(
                f"{what} changed the size of the reduced gradients ({numel} elements) to "
                f"{t.numel()}; a hook must modify them in place, without resizing"
            )

    out, rep = pending.output, pending.replicate_comm
    if rep is None:
        return attrs.evolve(pending, work=ThenWork(pending.work, lambda: run_hook(out)))
    if not pending.all_reduce:
        return pending
    if rep.world_size > 1:
        return attrs.evolve(pending, replicate_comm=_HookedAllReduce(rep, run_hook))
    # A replicate group of one rank: the core skips its no-op all-reduce, so add the kept
    # partial sum here (in place, as FSDP2 does) and run the hook after it.
    state = pending.reduce_state
    partial = state.partial

    def then() -> None:
        if partial is not None:
            out.add_(partial)
        run_hook(out)

    return attrs.evolve(
        pending,
        work=ThenWork(pending.work, then),
        reduce_state=attrs.evolve(state, partial=None),
    )
