"""Tensor-subclass parameters at ``fully_shard``: the codecs of FSDP2's all-gather hooks.

A parameter whose local tensor is a subclass with ``fsdp_pre_all_gather`` /
``fsdp_post_all_gather`` (torchao's float8 weights, ``extensions/int8.py``) is sharded as its one
inner tensor (:func:`plain_data`); :func:`adopt_codecs` then agrees on its all-gather inputs
across the shard group (a small object all-gather, so ranks whose hooks disagree fail together,
by name), teaches the group's layout, re-wraps each sharded ``DTensor``'s local tensor as the
subclass (a wrapper of a view of the packed shards, so the optimizer still writes the group's
buffer) and hands the group a :class:`~..engine.gather.GatherSlot` that runs the codecs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ...core import codec as C
from ...core.errors import GatherCodecError
from ...core.records import GatherInputSpec
from ..comm.custom import _abort_peers
from ..engine.gather import GatherSlot
from ..engine.group import ParamGroup

__all__ = ["adopt_codecs", "plain_data"]


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
    group: ParamGroup, templates: list[torch.Tensor | None], mesh: DeviceMesh, raf: bool | int
) -> None:
    """Give ``group`` its codecs: agree on input specs, re-layout, re-wrap, a slot that runs
    them (see the module docstring). Nothing when no parameter has hooks."""
    if not any(t is not None for t in templates):
        return
    if isinstance(raf, int) and not isinstance(raf, bool):
        raise GatherCodecError(
            f"{group.name}: parameters with all-gather hooks cannot use reshard_after_forward="
            f"{raf} (FSDP2 raises NotImplementedError too); use True or False"
        )
    names = mesh.mesh_dim_names or ()
    shard_mesh = mesh if mesh.ndim == 1 else mesh[names[-1]]
    codecs: list[C.GatherCodec | None] = []
    specs: list[GatherInputSpec | None] = []
    for i, tmpl in enumerate(templates):
        if tmpl is None:
            codecs.append(None)
            specs.append(None)
            continue
        p: Any = group.params[i]  # a DTensor parameter: its local tensor becomes the subclass
        p._local_tensor = _rewrap(tmpl, group.state.local(i))
        m, _ = group.holders[i][0]
        spec = group.layout.specs[i]
        codec = C.SubclassCodec(
            spec.fqn, shard_mesh, spec.shape, module=m, mp_policy=group.mp_policy, wrap=_local_of(p)
        )
        codecs.append(codec)
        specs.append(C.describe_inputs(spec.fqn, codec, group.state.local(i)))
    _agree(group, specs)
    layout = C.with_codec_inputs(group.layout, specs)
    slot = GatherSlot(
        layout,
        group.device,
        group._advise,
        codecs=codecs,
        abort=lambda: _abort_peers(group.base_comms()),
        runtime=group.runtime,
    )
    group.use_gather_codecs(layout, slot)


def _local_of(p: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    def local(_shard: torch.Tensor) -> torch.Tensor:
        return p._local_tensor

    return local


def _agree(group: ParamGroup, specs: list[GatherInputSpec | None]) -> None:
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
