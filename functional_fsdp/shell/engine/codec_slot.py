"""The shell side of all-gather codecs (tensor subclasses with FSDP2's all-gather hooks).

:func:`adopt_codecs` (called by ``fully_shard``) agrees on each codec parameter's all-gather
inputs across the shard group (a small object all-gather at ``fully_shard`` time, so ranks
whose hooks disagree fail together, by name), teaches the layout, and puts the subclass back
as each sharded ``DTensor``'s local tensor (a wrapper of a view of the packed shards, so the
optimizer still writes the group's buffer). :class:`CodecSlot` is the group's unsharded copy:
one packed all-gather of the encoded inputs, per-input outputs that persist (FSDP2's
``all_gather_outputs``), the post hook's tensors (first gather), or the post hook with
``out=`` into them (later gathers); resharding frees the storage of both.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.distributed as dist

from ...core import codec as C
from ...core.errors import GatherCodecError
from ...core.records import GatherInputSpec, PostForwardState, ShardedState
from ..comm.custom import _abort_peers
from .gather import GatherSlot

__all__ = ["CodecSlot", "adopt_codecs", "plain_data"]


def plain_data(t: torch.Tensor) -> torch.Tensor:
    """The one inner tensor of a hooked subclass (what FSDP shards and the optimizer updates)."""
    names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = getattr(t, names[0]) if len(names) == 1 else None
    if inner is None or tuple(inner.shape) != tuple(t.shape) or inner.dtype != t.dtype:
        raise GatherCodecError(
            f"{type(t).__name__}: fully_shard shards subclasses with all-gather hooks that wrap "
            "one inner tensor of their own shape and dtype (__tensor_flatten__)"
        )
    return inner


def _rewrap(template: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    names, ctx = template.__tensor_flatten__()  # type: ignore[attr-defined]
    return type(template).__tensor_unflatten__(  # type: ignore[attr-defined]
        {names[0]: data}, ctx, data.shape, data.stride()
    )


def adopt_codecs(
    group: Any, templates: list[torch.Tensor | None], mesh: Any, raf: bool | int
) -> None:
    """Give ``group`` its codecs: agree on input specs, re-layout, re-wrap, swap the slot."""
    if not any(t is not None for t in templates):
        return
    if isinstance(raf, int) and not isinstance(raf, bool):
        raise GatherCodecError(
            f"{group.name}: parameters with all-gather hooks cannot use reshard_after_forward="
            f"{raf} (FSDP2 raises NotImplementedError too); use True or False"
        )
    shard_mesh = mesh if mesh.ndim == 1 else mesh[mesh.mesh_dim_names[-1]]
    codecs: list[C.SubclassCodec | None] = []
    specs: list[GatherInputSpec | None] = []
    for i, tmpl in enumerate(templates):
        if tmpl is None:
            codecs.append(None)
            specs.append(None)
            continue
        p = group.params[i]
        p._local_tensor = _rewrap(tmpl, group.state.local(i))
        m, _ = group.holders[i][0]
        spec = group.layout.specs[i]
        codec = C.SubclassCodec(
            spec.fqn,
            shard_mesh,
            spec.shape,
            module=m,
            mp_policy=group.mp_policy,
            wrap=_local_of(p),
        )
        codecs.append(codec)
        specs.append(C.describe_inputs(spec.fqn, codec, group.state.local(i)))
    _agree(group, specs)
    layout = C.with_codec_inputs(group.layout, specs)
    group.layout = layout
    group.state = attrs.evolve(group.state, layout=layout)
    group.codecs = codecs
    group.slot = CodecSlot(group, codecs)


def _local_of(p: Any) -> Any:
    def local(_shard: torch.Tensor) -> torch.Tensor:
        return p._local_tensor

    return local


def _agree(group: Any, specs: list[GatherInputSpec | None]) -> None:
    pg = getattr(getattr(group.comm, "base", group.comm), "group", None)
    if group.layout.world_size == 1 or pg is None:
        return
    seen: list[Any] = [None] * group.layout.world_size
    dist.all_gather_object(seen, specs, group=pg)
    if any(s != specs for s in seen):
        names = [s.fqn for s in group.layout.specs]
        raise GatherCodecError(
            f"{group.name}: fsdp_pre_all_gather returns different input shapes/dtypes on "
            f"different ranks for {names}: {seen}; every rank must send the same sizes"
        )


class CodecSlot(GatherSlot):
    """A group's unsharded copy gathered through its codecs (see the module docstring)."""

    __slots__ = ("_bases", "codecs", "inner", "outputs")

    def __init__(self, group: Any, codecs: list[C.SubclassCodec | None]) -> None:
        super().__init__(group.layout, group.device, group._advise)
        self.codecs = codecs
        self._bases = group.base_comms
        self.outputs: list[tuple[torch.Tensor, ...]] | None = None
        self.inner: list[torch.Tensor] = []

    def _storages(self) -> list[torch.Tensor]:
        return [t for ts in (self.outputs or []) for t in ts] + list(self.inner)

    def start(
        self,
        source: ShardedState | PostForwardState,
        comm: Any,
        *,
        version: int = -1,
        direct: bool = True,
    ) -> None:
        """Encode, check and issue the packed all-gather (peers are told if this rank fails)."""
        del direct
        if self.live or self.pending is not None:
            return
        assert isinstance(source, ShardedState)
        self.pending_version = version
        try:
            with torch.no_grad():
                self.pending = C.begin_codec_unshard(source, comm, self.codecs)  # type: ignore[assignment]
        except GatherCodecError:
            _abort_peers(self._bases())
            raise

    def wait(self, *, keep_output: bool = False) -> None:
        """Land the gather: split into the persistent outputs and decode (``out=`` reuse)."""
        del keep_output
        pending: Any = self.pending
        self.pending = None
        assert pending is not None, "CodecSlot.wait: no gather in flight"
        pending.work.wait()
        try:
            self._land(pending)
        except GatherCodecError:  # a post hook failed: the peers must not wait for this rank
            _abort_peers(self._bases())
            raise
        self.version = self.pending_version
        self.live = True

    def _land(self, pending: Any) -> None:
        lay = self.layout
        with torch.no_grad():
            if self.outputs is None:
                self.outputs = C.split_outputs(lay, pending.output)
                fulls = C.decode_outputs(lay, self.outputs, self.codecs, pending.metadata)
                self.views = tuple(f for f, _ in fulls)
                self.inner = [t for c, (_, ts) in zip(self.codecs, fulls) if c for t in ts]
            else:
                for t in self._storages():
                    n = t.numel() * t.element_size()
                    if t.untyped_storage().size() != n:
                        t.untyped_storage().resize_(n)
                keep = tuple(self._storages()) + tuple(self.views)
                with torch.autograd._unsafe_preserve_version_counter(keep):
                    C.split_outputs(lay, pending.output, self.outputs)
                    out = [v if c else None for v, c in zip(self.views, self.codecs)]
                    C.decode_outputs(lay, self.outputs, self.codecs, pending.metadata, out=out)

    def free(self) -> None:
        """Free the gathered outputs' and the decoded tensors' storage."""
        if self.pending is not None:
            self.pending.work.wait()
            self.pending = None
        for t in self._storages():
            if t.untyped_storage().size() != 0:
                t.untyped_storage().resize_(0)
        self.live = False
        self.output = None
