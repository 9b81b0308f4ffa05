"""The engine's one unsharded copy: a buffer, the all-gather in flight into it, its version;
and the codecs of tensor-subclass parameters, which every gather of their group runs.

Every all-gather the shell issues goes through a :class:`GatherSlot`: a group's own shards into
its persistent buffer (the module path, :class:`~.group.ParamGroup`), the tensors a caller passed
to ``functional_call`` into a buffer per call (:class:`~.functional_path.GatherCall`), and the
``reshard_after_forward=k`` rows over the sub-group. Issuing, landing, freeing and abandoning a
gather therefore exist once, on the core's one unshard path
(:func:`~functional_fsdp.core.transitions.begin_unshard` /
:func:`~functional_fsdp.core.transitions.land_unshard`); callers differ only in the *source*
they pass (a :class:`~functional_fsdp.core.records.ShardedState` or a
:class:`~functional_fsdp.core.records.PostForwardState`) and the communicator.

A slot is a handle, not a record: it owns live storage (resized to 0 when freed, so views
autograd saved stay valid objects) and in-flight work. Its device runtime orders the copy-in,
the all-gather, the copy-out and the frees on streams (:mod:`.ordering`). The *version* it
remembers is the source's version when the gather was issued
(:meth:`ParamGroup.sharded_version`); a caller compares it before reusing the data.

Tensor subclasses with FSDP2's all-gather hooks (``fsdp_pre_all_gather`` /
``fsdp_post_all_gather``): :func:`~functional_fsdp.shell.api.codecs.adopt_codecs` (called by
``fully_shard``) agrees on each such
parameter's all-gather inputs across the shard group (a small object all-gather at
``fully_shard`` time, so ranks whose hooks disagree fail together, by name), teaches the
layout, puts the subclass back as each sharded ``DTensor``'s local tensor (a wrapper of a view
of the packed shards, so the optimizer still writes the group's buffer) and gives the group a
slot with its codecs. Such a slot's buffer holds the gathered inputs (FSDP2's
``all_gather_outputs``, as views); the first gather keeps the post hooks' tensors, later ones
call the post hooks with ``out=`` into them; freeing frees the buffer and their inner tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...core import codec as C
from ...core import transitions as T
from ...core.comm import Communicator
from ...core.errors import GatherCodecError
from ...core.records import GroupLayout, PostForwardState, ShardedState
from ..device.runtime import CPURuntime, DeviceRuntime
from . import ordering
from .group_common import _preserve_version

__all__ = ["GatherSlot", "start_coalesced"]


def _nothing() -> None:
    """The default ``abort`` of a slot: no peer to tell."""


class GatherSlot:
    """One unsharded copy of a group's parameters (see the module docstring).

    Args:
        layout: the group layout.
        device: where the buffer lives.
        advise: called on every (re-)allocated buffer (huge-page advice).
        codecs: per parameter, its all-gather codec (``None``: the identity), or ``None`` when
            every codec is the identity.
        abort: called before a codec's error propagates (tells the peers not to wait).
        runtime: the device runtime (default: the CPU's); the group replaces it with the
            root's at lazy init.

    Attributes:
        layout: the group layout (the buffer holds ``world_size`` rows of its wire packing:
            :func:`~functional_fsdp.core.codec.wire`).
        buffer: the unsharded buffer (``None`` until first allocated); its storage is freed,
            not the tensor, when the slot is freed.
        views: the full (unpadded) parameters (views of ``buffer``, or the codecs' tensors);
            empty until the first gather lands in a new buffer.
        inner: the storage the codecs' decodes made outside ``buffer`` (freed with it).
        pending: the all-gather in flight (``None`` when none).
        bucket: the shared wait of the bucket ``pending`` is a member of, when its members
            land one by one (:class:`~.ordering.BucketWait`), else ``None``.
        live: whether ``buffer`` holds gathered data now.
        version: the source version the live data was gathered from.
        output: the padded gather output kept for ``reshard_after_forward=k``, else ``None``.
        runtime: the device runtime the slot's operations run on.
        landings: how many gathers have landed (a later landing shows the peers finished
            an abandoned one: :mod:`.abandoned`).
    """

    __slots__ = (
        "_abort",
        "_advise",
        "_dtype",
        "_numel",
        "_staged",
        "bucket",
        "buffer",
        "codecs",
        "device",
        "inner",
        "landings",
        "layout",
        "live",
        "output",
        "pending",
        "pending_version",
        "runtime",
        "version",
        "views",
    )

    def __init__(
        self,
        layout: GroupLayout,
        device: torch.device,
        advise: Callable[[torch.Tensor], Any],
        *,
        codecs: Sequence[C.GatherCodec | None] | None = None,
        abort: Callable[[], None] = _nothing,
        runtime: DeviceRuntime | None = None,
    ) -> None:
        self.layout = layout
        self.runtime: DeviceRuntime = CPURuntime() if runtime is None else runtime
        self.device = device
        self._advise = advise
        self.codecs = None if codecs is None else tuple(codecs)
        self._abort = abort
        pack, self._dtype = C.wire(layout)
        self._numel = layout.world_size * pack.total
        self.buffer: torch.Tensor | None = None
        self.views: tuple[torch.Tensor, ...] = ()
        self.inner: tuple[torch.Tensor, ...] = ()
        self.pending: T.PendingUnshard | None = None
        self.bucket: ordering.BucketWait | None = None
        self.live = False
        self.version = -1
        self.pending_version = -1  # the source version of the gather in flight
        self.output: torch.Tensor | None = None
        self._staged: torch.Tensor | None = None  # an offloaded source's device copy in flight
        self.landings = 0

    def alloc(self) -> torch.Tensor:
        """The buffer with its storage allocated (made on first use, re-grown after a free,
        with the codecs' inner tensors), on the compute stream."""
        rt = self.runtime
        if self.buffer is None:
            # A normal tensor even when first made under inference_mode: later training
            # forwards save views of it for backward (and need its version counter).
            with torch.inference_mode(False):
                self.buffer = torch.empty(self._numel, dtype=self._dtype, device=self.device)
            self.views, self.inner = (), ()  # decoded from the new buffer by the next landing
            self._advise(self.buffer)
        else:
            storage = self.buffer.untyped_storage()
            nbytes = self.buffer.numel() * self.buffer.element_size()
            if storage.size() != nbytes:
                rt.regrow(self.buffer)
                self._advise(self.buffer)
            for t in self.inner:
                n = t.numel() * t.element_size()
                if t.untyped_storage().size() != n:
                    rt.regrow(t)
                rt.allocated(rt.compute, t)
        # (A free still deferred on the device is cancelled: the new writer is ordered after
        # the old readers by events.)
        rt.allocated(rt.compute, self.buffer)
        return self.buffer

    def start(
        self,
        source: ShardedState | PostForwardState,
        comm: Communicator,
        *,
        version: int = -1,
        direct: bool = True,
        stage_to: torch.device | None = None,
    ) -> None:
        """Issue the all-gather of ``source`` (async) unless live or already in flight.

        ``direct``: gather straight into the buffer when the communicator can (no copy-out);
        ``False`` keeps the padded output (``reshard_after_forward=k`` slices it).
        ``stage_to``: copy an offloaded source's shards to this device first (CPU offload).
        """
        if self.live or self.pending is not None:
            return
        self.pending_version = version
        into = self.alloc() if direct and isinstance(source, ShardedState) else None
        try:
            with torch.no_grad(), _preserve_version(into):
                self.pending, self._staged = ordering.issue_gather(
                    self.runtime, source, comm, codecs=self.codecs, into=into, stage_to=stage_to
                )
        except GatherCodecError:  # a pre hook failed: the peers must not wait for this rank
            self._abort()
            raise

    def ready_to_coalesce(self) -> bool:
        """Whether a coalesced gather may start this slot: idle (not live, nothing in flight)
        and of identity codecs (a bucket sends packed shards as they are)."""
        return not self.live and self.pending is None and self.codecs is None

    def wait(self, *, keep_output: bool = False) -> None:
        """Land the gather in flight in the buffer (copying out on the packed path) and decode
        it: :func:`~functional_fsdp.core.transitions.land_unshard`, into the views of the last
        landing when the buffer is the same (codecs decode with ``out=``)."""
        pending, self.pending = self.pending, None
        bucket, self.bucket = self.bucket, None
        assert pending is not None, "GatherSlot.wait: no gather in flight (call start first)"
        # start allocated the buffer when it passed it (the pieces may have landed there).
        buf = self.alloc() if pending.into is None else pending.into
        keep = buf if self.codecs is None else (buf, *self.inner, *self.views)
        staged, self._staged = self._staged, None
        try:
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(keep):
                landed = ordering.land_gather(
                    self.runtime,
                    pending,
                    staged,
                    into=buf,
                    out=self.views or None,
                    keep_output=keep_output,
                    bucket=bucket,
                )
        except GatherCodecError:  # a post hook failed: the peers must not wait for this rank
            self.pending, self.bucket = pending, bucket
            self._abort()
            raise
        except BaseException:
            # The wait failed (a peer aborted, a mismatch, a timeout): the gather is still in
            # flight as far as anyone knows, so reset_iter_state abandons it (its buffers stay
            # referenced, never freed under a late write) instead of freeing the buffer.
            self.pending, self.bucket = pending, bucket
            raise
        if not self.views:
            self.views = landed.params
            ptr = buf.untyped_storage().data_ptr()
            self.inner = tuple(t for t in landed.inner if t.untyped_storage().data_ptr() != ptr)
        self.output = pending.output if keep_output else None
        self.version = self.pending_version
        self.live = True
        self.landings += 1

    def gather(
        self,
        source: ShardedState | PostForwardState,
        comm: Communicator,
        *,
        version: int = -1,
        direct: bool = True,
        keep_output: bool = False,
    ) -> None:
        """:meth:`start` (if not in flight) then :meth:`wait`; nothing when already live."""
        if self.live:
            return
        self.start(source, comm, version=version, direct=direct)
        self.wait(keep_output=keep_output)

    def mark_read(self, what: str, name: str) -> None:
        """Compute is about to read the unsharded parameters (``what``: the forward, the
        backward, of group ``name``): told to a checking runtime, which holds the next free
        to it."""
        rt = self.runtime
        if rt.checks and self.buffer is not None:
            label = f"{what} of {name} (reads its unsharded parameters)"
            rt.access(rt.compute, label, reads=[self.buffer, *self.inner])

    def free(self) -> None:
        """Free the buffer's storage and the codecs' inner tensors' (views saved by autograd
        stay valid objects), after their last readers on compute."""
        events = ordering.consumers_done(self.runtime)
        if self.pending is not None and self.pending.into is not None:
            # A gather in flight writes into this buffer: let it land before freeing.
            events.append(self._retire())
        self._release(events)

    def _release(self, events: list[Any]) -> None:
        """Free the buffer, the inner tensors and a kept output after ``events``."""
        kept = [t for t in (self.buffer, self.output) if t is not None]
        ordering.free_buffers(self.runtime, [*kept, *self.inner], events)
        self.live = False
        self.output = None

    def _retire(self) -> Any:
        """Wait for the gather in flight, which nobody lands; free its own buffers after it."""
        pending, self.pending = self.pending, None
        staged, self._staged = self._staged, None
        bucket, self.bucket = self.bucket, None
        assert pending is not None
        return ordering.retire_gather(self.runtime, pending, staged, bucket)

    def discard(self) -> None:
        """Drop a gather in flight that will not be used (wait for it: every rank issued it)."""
        if self.pending is not None:
            gathered = self._retire()
            if not self.live:
                self._release([*ordering.consumers_done(self.runtime), gathered])

    def abandon(self) -> list[Any]:
        """Forget in-flight work without waiting (a peer may never complete it); return what
        must stay referenced so a late message never lands in freed or reused memory (the
        buffer included: the slot allocates a fresh one from now on)."""
        kept: list[Any] = []
        if self.pending is not None:
            kept = [self.pending, self.buffer, self._staged]
            self.buffer, self.views, self.inner = None, (), ()
        self.pending = None
        self.bucket = None
        self._staged = None
        self.live = False
        self.output = None
        return kept


def start_coalesced(
    slots: Sequence[GatherSlot],
    sources: Sequence[ShardedState],
    comm: Communicator,
    versions: Sequence[int],
) -> None:
    """Issue one all-gather for several groups' slots (a bucket: see
    :mod:`functional_fsdp.core.coalesce`); each slot then lands its part as if its own gather
    had been in flight. Every slot must be :meth:`~GatherSlot.ready_to_coalesce` and share
    ``comm``'s runtime.

    Where the bucket receives only the peers' rows (:func:`~functional_fsdp.core.coalesce.
    lands_by_member`), no member's buffer is allocated now: each is allocated when its
    member lands (:meth:`GatherSlot.wait`), so a prefetched bucket holds the peers' rows alone
    until its members run, and a member's buffer can reuse the one the member before it freed.
    """
    rt = slots[0].runtime
    with torch.no_grad():
        pendings, bucket = ordering.issue_gather_coalesced(
            rt, sources, comm, lambda: [slot.alloc() for slot in slots], guard=_preserve_versions
        )
    for slot, pending, version in zip(slots, pendings, versions):
        slot.pending, slot.bucket = pending, bucket
        slot.pending_version = version


def _preserve_versions(tensors: tuple[torch.Tensor, ...]) -> Any:
    """Keep the buffers' version counters across the bucket's copy-out (autograd saved views
    of them; the data is the same parameters, refreshed)."""
    return torch.autograd._unsafe_preserve_version_counter(tensors)
