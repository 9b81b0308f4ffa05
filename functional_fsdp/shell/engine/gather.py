"""The engine's one unsharded copy: a buffer, the all-gather in flight into it, its version.

Every all-gather the shell issues goes through a :class:`GatherSlot`: a group's own shards into
its persistent buffer (the module path, :class:`~.group.ParamGroup`), the tensors a caller passed
to ``functional_call`` into a buffer per call (:class:`~.functional_path.GatherCall`), and the
``reshard_after_forward=k`` rows over the sub-group. Issuing, landing, freeing and abandoning a
gather therefore exist once; callers differ only in the *source* they pass (a
:class:`~functional_fsdp.core.records.ShardedState` or a
:class:`~functional_fsdp.core.records.PostForwardState`) and the communicator.

A slot is a handle, not a record: it owns live storage (resized to 0 when freed, so views
autograd saved stay valid objects) and in-flight work. The *version* it remembers is the
source's version when the gather was issued (:meth:`ParamGroup.sharded_version`); a caller
compares it before reusing the data.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...core import transitions as T
from ...core.comm import Communicator
from ...core.records import GroupLayout, PostForwardState, ShardedState
from .group_common import _preserve_version

__all__ = ["GatherSlot"]


class GatherSlot:
    """One unsharded copy of a group's parameters (see the module docstring).

    Attributes:
        layout: the group layout (the buffer holds ``world_size * gather.total`` elements).
        buffer: the unsharded buffer (``None`` until first allocated); its storage is freed,
            not the tensor, when the slot is freed.
        views: the full (unpadded) parameters as views of ``buffer``.
        pending: the all-gather in flight (``None`` when none).
        live: whether ``buffer`` holds gathered data now.
        version: the source version the live data was gathered from.
        output: the padded gather output kept for ``reshard_after_forward=k``, else ``None``.
    """

    __slots__ = (
        "_advise",
        "buffer",
        "device",
        "layout",
        "live",
        "output",
        "pending",
        "pending_version",
        "version",
        "views",
    )

    def __init__(
        self, layout: GroupLayout, device: torch.device, advise: Callable[[torch.Tensor], Any]
    ) -> None:
        self.layout = layout
        self.device = device
        self._advise = advise
        self.buffer: torch.Tensor | None = None
        self.views: tuple[torch.Tensor, ...] = ()
        self.pending: T.PendingUnshard | None = None
        self.live = False
        self.version = -1
        self.pending_version = -1  # the source version of the gather in flight
        self.output: torch.Tensor | None = None

    def alloc(self) -> torch.Tensor:
        """The buffer with its storage allocated (made on first use, re-grown after a free)."""
        lay = self.layout
        if self.buffer is None:
            # A normal tensor even when first made under inference_mode: later training
            # forwards save views of it for backward (and need its version counter).
            with torch.inference_mode(False):
                self.buffer = torch.empty(
                    lay.world_size * lay.gather.total,
                    dtype=lay.gather_buffer_dtype,
                    device=self.device,
                )
                self.views = T.full_views(lay, self.buffer)
            self._advise(self.buffer)
        else:
            storage = self.buffer.untyped_storage()
            nbytes = self.buffer.numel() * self.buffer.element_size()
            if storage.size() != nbytes:
                storage.resize_(nbytes)
                self._advise(self.buffer)
        return self.buffer

    def start(
        self,
        source: ShardedState | PostForwardState,
        comm: Communicator,
        *,
        version: int = -1,
        direct: bool = True,
    ) -> None:
        """Issue the all-gather of ``source`` (async) unless live or already in flight.

        ``direct``: gather straight into the buffer when the communicator can (no copy-out);
        ``False`` keeps the padded output (``reshard_after_forward=k`` slices it).
        """
        if self.live or self.pending is not None:
            return
        self.pending_version = version
        into = self.alloc() if direct and isinstance(source, ShardedState) else None
        with torch.no_grad(), _preserve_version(into):
            self.pending = T.begin_unshard(source, comm, async_op=True, into=into)

    def wait(self, *, keep_output: bool = False) -> None:
        """Land the gather in flight into the buffer (copying out on the packed path)."""
        pending, self.pending = self.pending, None
        assert pending is not None, "GatherSlot.wait: no gather in flight (call start first)"
        pending.work.wait()
        if pending.output is not None:
            buf = self.alloc()
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(buf):
                T.copy_out(self.layout, pending.output, buf)
            self.output = pending.output if keep_output else None
        self.version = self.pending_version
        self.live = True

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

    def free(self) -> None:
        """Free the buffer's storage (views saved by autograd stay valid objects)."""
        if self.pending is not None and self.pending.into is not None:
            # A gather in flight writes into this buffer: let it land before freeing.
            self.pending.work.wait()
            self.pending = None
        buf = self.buffer
        if buf is not None and buf.untyped_storage().size() != 0:
            buf.untyped_storage().resize_(0)
        self.live = False
        self.output = None

    def discard(self) -> None:
        """Drop a gather in flight that will not be used (wait for it: every rank issued it)."""
        if self.pending is not None:
            self.pending.work.wait()
            self.pending = None
            if not self.live:
                self.free()

    def abandon(self) -> list[Any]:
        """Forget in-flight work without waiting (a peer may never complete it); return what
        must stay referenced so a late message never lands in freed or reused memory (the
        buffer included: the slot allocates a fresh one from now on)."""
        kept: list[Any] = []
        if self.pending is not None:
            kept = [self.pending, self.buffer]
            self.buffer, self.views = None, ()
        self.pending = None
        self.live = False
        self.output = None
        return kept
