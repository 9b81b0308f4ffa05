"""All-gather codecs: how each parameter is encoded for the all-gather and decoded after (pure).

Every unshard goes through one path, :func:`~functional_fsdp.core.transitions.begin_unshard` /
:func:`~functional_fsdp.core.transitions.finish_unshard`, and every parameter has a codec there.
A plain parameter's is the *identity* (written ``None``): it sends its padded shard in its
gather dtype and its full tensor is a view of the gathered rows. A group whose codecs are all
the identity is encoded and decoded as a whole (the sharded buffer itself is the all-gather
input, the full parameters are views of one buffer). This module holds the other codecs and
the layout they need.

FSDP2's tensor-subclass extension protocol is the codec of a parameter whose local tensor
defines ``fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy) -> (inputs,
metadata)`` and ``fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None)``: it
sends its ``inputs`` (any number, any dtypes: e.g. int8 data and fp32 scales) instead of its
padded shard, and is rebuilt from the gathered outputs by the post hook.

* :func:`with_codec_inputs` teaches a :class:`~functional_fsdp.core.records.GroupLayout` the
  per-parameter input shapes and dtypes (:class:`~functional_fsdp.core.records.GatherInputSpec`);
  the packed all-gather buffer then holds every parameter's inputs (``layout.encoded``; identity
  parameters send their padded shard in the gather dtype), bytes when dtypes mix. :func:`wire`
  is the packing a group's all-gather uses either way.
* :func:`encode_group` encodes (checking each rank's inputs against the layout before any
  collective) and packs; after the all-gather lands in a buffer laid out per input
  (:func:`~functional_fsdp.core.transitions.copy_out`, rank-major as FSDP2),
  :func:`decode_group` decodes each parameter from views of its inputs there.

A codec is any object with ``encode(shard) -> (inputs, metadata)`` and
``decode(outputs, metadata, param_dtype, *, out=None)`` (:class:`GatherCodec`);
:class:`SubclassCodec` calls a subclass's hooks exactly as FSDP2 does. Codec groups shard on
dim 0 only. Nothing here imports ``torch.distributed``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs
import torch

from . import layout as L
from .errors import GatherCodecError
from .records import GatherInputSpec, GroupLayout, ShardedState

__all__ = [
    "GatherCodec",
    "SubclassCodec",
    "decode_group",
    "describe_inputs",
    "encode_group",
    "encode_inputs",
    "gather_bytes",
    "has_hooks",
    "pack_encoded",
    "wire",
    "with_codec_inputs",
]


class GatherCodec(Protocol):
    """Encode a parameter's shard for the all-gather; decode the gathered inputs."""

    def encode(self, shard: torch.Tensor) -> Any:
        """``(inputs, metadata)`` for this rank's unpadded shard ``shard``."""

    def decode(
        self,
        outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: Any,
    ) -> Any:
        """``(full tensor, inner tensors)``; or write into ``out`` and return ``None``."""


def has_hooks(tensor: Any) -> bool:
    """Whether ``tensor`` defines FSDP2's all-gather hooks (both, as FSDP2 requires)."""
    pre, post = hasattr(tensor, "fsdp_pre_all_gather"), hasattr(tensor, "fsdp_post_all_gather")
    if pre != post:
        raise GatherCodecError(
            f"{type(tensor).__name__} defines only one of fsdp_pre_all_gather / "
            "fsdp_post_all_gather; define both to customise the all-gather"
        )
    return pre


class SubclassCodec:
    """The codec of a tensor subclass: calls its hooks with FSDP2's arguments.

    Args:
        fqn: parameter name (for messages).
        mesh: passed to ``fsdp_pre_all_gather`` (FSDP2 passes the shard mesh).
        outer_size: the unsharded parameter's size.
        module: the module that holds the parameter.
        mp_policy: the mixed-precision policy.
        wrap: ``shard -> subclass tensor`` whose hooks run (by default ``shard`` itself; the
            shell passes the parameter's current local tensor, as FSDP2 does).
    """

    __slots__ = (
        "_last",
        "_nargs",
        "fqn",
        "mesh",
        "module",
        "mp_policy",
        "outer_size",
        "outer_stride",
        "wrap",
    )

    def __init__(
        self,
        fqn: str,
        mesh: Any,
        outer_size: Sequence[int],
        module: Any = None,
        mp_policy: Any = None,
        wrap: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.fqn, self.mesh, self.module, self.mp_policy = fqn, mesh, module, mp_policy
        self.outer_size = torch.Size(outer_size)
        self.outer_stride = _contiguous(tuple(outer_size))
        self.wrap = wrap
        self._nargs: int | None = None
        self._last: Any = None  # the tensor whose pre hook ran last (its post hook decodes)

    def encode(self, shard: torch.Tensor) -> Any:
        """Call ``fsdp_pre_all_gather`` (the 1-argument legacy form or FSDP2's 5 arguments)."""
        local = self.wrap(shard) if self.wrap is not None else shard
        self._last = local
        hook = local.fsdp_pre_all_gather  # type: ignore[attr-defined]
        if self._nargs is None:
            n = len(inspect.signature(hook).parameters)
            if n not in (1, 5):
                raise GatherCodecError(
                    f"{self.fqn}: fsdp_pre_all_gather{inspect.signature(hook)} must take (mesh) "
                    "or (mesh, outer_size, outer_stride, module, mp_policy)"
                )
            self._nargs = n
        if self._nargs == 1:
            return hook(self.mesh)
        return hook(self.mesh, self.outer_size, self.outer_stride, self.module, self.mp_policy)

    def decode(
        self,
        outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: Any,
    ) -> Any:
        """Call ``fsdp_post_all_gather`` of the tensor :meth:`encode` last ran on (as FSDP2
        calls it on the parameter's sharded local tensor)."""
        if self._last is None:
            raise GatherCodecError(f"{self.fqn}: decode before encode (no all-gather issued)")
        return self._last.fsdp_post_all_gather(outputs, metadata, param_dtype, out=out)


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def with_codec_inputs(layout: GroupLayout, inputs: Sequence[GatherInputSpec | None]) -> GroupLayout:
    """``layout`` whose all-gather sends ``inputs[i]`` for each codec parameter ``i``.

    Rank-independent checks (FSDP2's rules): codec groups shard on dim 0; a parameter sharded
    unevenly must send inputs of the padded shard shape (FSDP2 raises on the padded ranks only
    and leaves the others in the collective).
    """
    inputs = tuple(inputs)
    if len(inputs) != len(layout):
        raise GatherCodecError(f"{len(inputs)} codec input specs for {len(layout)} parameters")
    numels: list[int] = []
    dtypes: list[torch.dtype] = []
    for i, (spec, inp) in enumerate(zip(layout.specs, inputs)):
        if layout.shard_dims[i] != 0:
            raise GatherCodecError(
                f"{spec.fqn}: a group with all-gather hooks shards on dim 0 only (got "
                f"Shard({layout.shard_dims[i]})); return None from shard_placement_fn for it"
            )
        if inp is None:
            numels.append(L.prod(layout.shard_shapes[i]))
            dtypes.append(layout.gather_dtypes[i])
            continue
        if len(inp.shapes) != len(inp.dtypes) or not inp.shapes:
            raise GatherCodecError(f"{spec.fqn}: fsdp_pre_all_gather returned no inputs")
        uneven = spec.shape[0] % layout.world_size != 0
        for shape, dtype in zip(inp.shapes, inp.dtypes):
            if len(shape) == 0:
                raise GatherCodecError(f"{spec.fqn}: an all-gather input is 0-d; give it a dim")
            if uneven and tuple(shape) != layout.shard_shapes[i]:
                raise GatherCodecError(
                    f"{spec.fqn} is sharded unevenly (dim 0 = {spec.shape[0]} over "
                    f"{layout.world_size} ranks): fsdp_pre_all_gather must return inputs of the "
                    f"padded shard shape {layout.shard_shapes[i]}, got {tuple(shape)}; pad "
                    "dim 0 to a multiple of the world size"
                )
            numels.append(L.prod(shape))
            dtypes.append(dtype)
    uniform = len(set(dtypes)) <= 1
    pack = L.PackLayout.build(numels, [d.itemsize for d in dtypes], uniform)
    return attrs.evolve(layout, codec_inputs=inputs, encoded=pack)


def _input_specs(layout: GroupLayout, i: int) -> GatherInputSpec:
    assert layout.codec_inputs is not None
    spec = layout.codec_inputs[i]
    if spec is None:
        return GatherInputSpec((layout.shard_shapes[i],), (layout.gather_dtypes[i],))
    return spec


def _region_dtypes(layout: GroupLayout) -> list[torch.dtype]:
    return [d for i in range(len(layout)) for d in _input_specs(layout, i).dtypes]


def _buffer_dtype(layout: GroupLayout) -> torch.dtype:
    assert layout.encoded is not None
    dts = _region_dtypes(layout)
    return dts[0] if (dts and layout.encoded.uniform) else torch.uint8


def wire(layout: GroupLayout) -> tuple[L.PackLayout, torch.dtype]:
    """The packing of one rank's all-gather input and the dtype of its buffers.

    ``layout.gather`` when every codec is the identity; ``layout.encoded`` (a region per
    input) with codecs. The all-gather output is ``world_size`` such rows, and the buffer the
    parameters are decoded from holds the same regions, each ``world_size`` times longer.
    """
    if layout.encoded is None:
        return layout.gather, layout.gather_buffer_dtype
    return layout.encoded, _buffer_dtype(layout)


def gather_bytes(layout: GroupLayout) -> int:
    """Bytes one rank sends in the group's all-gather (its packed inputs)."""
    pack, dtype = wire(layout)
    return pack.total * dtype.itemsize


def describe_inputs(fqn: str, codec: GatherCodec, shard: torch.Tensor) -> GatherInputSpec:
    """Run ``codec.encode(shard)`` once and describe its inputs (how a layout learns them).

    Raises:
        GatherCodecError: the hook raised or did not return ``(tuple of tensors, metadata)``.
    """
    try:
        result = codec.encode(shard)
    except GatherCodecError:
        raise
    except Exception as e:
        raise GatherCodecError(f"{fqn}: fsdp_pre_all_gather raised {type(e).__name__}: {e}") from e
    inputs, _ = _well_formed(fqn, result)
    return GatherInputSpec(tuple(tuple(t.shape) for t in inputs), tuple(t.dtype for t in inputs))


def _well_formed(fqn: str, result: Any) -> tuple[Sequence[torch.Tensor], Any]:
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise GatherCodecError(
            f"{fqn}: fsdp_pre_all_gather must return (all_gather_inputs, metadata), got "
            f"{type(result).__name__}"
        )
    inputs, meta = result
    if not isinstance(inputs, (tuple, list)) or not all(
        isinstance(t, torch.Tensor) for t in inputs
    ):
        raise GatherCodecError(
            f"{fqn}: fsdp_pre_all_gather's all_gather_inputs must be a tuple of tensors, got "
            f"{type(inputs).__name__}"
        )
    return inputs, meta


def _checked(layout: GroupLayout, i: int, result: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
    fqn, want = layout.specs[i].fqn, _input_specs(layout, i)
    inputs, meta = _well_formed(fqn, result)
    got = [(tuple(t.shape), t.dtype) for t in inputs]
    if got != list(zip(want.shapes, want.dtypes)):
        raise GatherCodecError(
            f"{fqn}: fsdp_pre_all_gather returned inputs {got} but the layout expects "
            f"{list(zip(want.shapes, want.dtypes))} (the same on every rank and every step)"
        )
    return tuple(inputs), meta


def encode_inputs(
    state: ShardedState, codecs: Sequence[GatherCodec | None]
) -> tuple[list[tuple[torch.Tensor, ...]], tuple[Any, ...]]:
    """Every parameter's all-gather inputs and metadata, checked against ``state.layout``.

    Raises:
        GatherCodecError: a hook raised or returned inputs that do not match the layout
            (before any collective).
    """
    lay = state.layout
    if lay.codec_inputs is None:
        raise GatherCodecError("encode_inputs: the layout has no codec inputs (with_codec_inputs)")
    inputs: list[tuple[torch.Tensor, ...]] = []
    metas: list[Any] = []
    for i in range(len(lay)):
        codec = codecs[i]
        if lay.codec_inputs[i] is None or codec is None:
            if lay.codec_inputs[i] is not None:
                raise GatherCodecError(f"{lay.specs[i].fqn}: the layout has a codec, none given")
            inputs.append((state.shard(i).to(lay.gather_dtypes[i]),))
            metas.append(None)
            continue
        try:
            result = codec.encode(state.local(i))
        except GatherCodecError:
            raise
        except Exception as e:
            raise GatherCodecError(
                f"{lay.specs[i].fqn}: fsdp_pre_all_gather raised {type(e).__name__}: {e}"
            ) from e
        ins, meta = _checked(lay, i, result)
        inputs.append(ins)
        metas.append(meta)
    return inputs, tuple(metas)


def pack_encoded(layout: GroupLayout, inputs: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
    """Pack every input (flattened) into one 1-D buffer laid out by ``layout.encoded``."""
    pack = layout.encoded
    assert pack is not None
    flat = [t.reshape(-1) for ts in inputs for t in ts]
    device = flat[0].device if flat else torch.device("cpu")
    alloc = torch.empty if pack.uniform else torch.zeros
    out = alloc(pack.total, dtype=_buffer_dtype(layout), device=device)
    with torch.no_grad():
        for k, t in enumerate(flat):
            r = out.narrow(0, pack.offsets[k], pack.sizes[k])
            (r if pack.uniform else r.view(t.dtype)).copy_(t)
    return out


def encode_group(
    state: ShardedState, codecs: Sequence[GatherCodec | None]
) -> tuple[torch.Tensor, tuple[Any, ...]]:
    """This rank's all-gather input (packed by ``layout.encoded``) and each parameter's metadata.

    Raises:
        GatherCodecError: a hook raised or returned inputs that do not match the layout
            (before any collective).
    """
    inputs, metas = encode_inputs(state, codecs)
    return pack_encoded(state.layout, inputs), metas


def _gathered(layout: GroupLayout, buf: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Input ``k`` of every rank (1-D, ``world_size * numel``: FSDP2's all-gather output), a
    view of the decode buffer ``buf``."""
    pack, ws = layout.encoded, layout.world_size
    assert pack is not None
    r = buf.narrow(0, ws * pack.offsets[k], ws * pack.sizes[k])
    return r if pack.uniform else r.view(dtype)


def decode_group(
    layout: GroupLayout,
    buf: torch.Tensor,
    codecs: Sequence[GatherCodec | None],
    metadata: Sequence[Any],
    *,
    out: Sequence[torch.Tensor] | None = None,
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Each parameter's full tensor, decoded from ``buf`` (the copied-out all-gather, laid out
    per input: :func:`~functional_fsdp.core.transitions.copy_out`), and the inner tensors the
    codecs' ``decode`` made (where their storage lives, as FSDP2's ``inner_tensors``).

    Identity parameters view their gathered shard rows (padding stripped). Codec parameters
    call ``decode`` with their inputs viewed as ``(-1, *input_shape[1:])`` and ``layout``'s
    gather dtype; the result is viewed at the parameter's size with contiguous strides
    (FSDP2's ``as_strided``). With ``out`` (the full tensors an earlier decode of this buffer
    returned), codecs decode into ``out[i]`` (FSDP2's ``out=``), identity parameters are
    already there, and ``out`` is returned with no inner tensors.
    """
    assert layout.codec_inputs is not None
    ws = layout.world_size
    params: list[torch.Tensor] = []
    inner: list[torch.Tensor] = []
    k = 0
    for i, spec in enumerate(layout.specs):
        ins = _input_specs(layout, i)
        gathered = [_gathered(layout, buf, k + j, d) for j, d in enumerate(ins.dtypes)]
        k += len(ins.dtypes)
        codec = codecs[i]
        if layout.codec_inputs[i] is None or codec is None:
            params.append(
                out[i]
                if out is not None
                else gathered[0].view(layout.padded_full_shape(i)).narrow(0, 0, spec.shape[0])
            )
            continue
        views = tuple(t.view(ws * s[0], *s[1:]) for t, s in zip(gathered, ins.shapes))
        target = out[i] if out is not None else None
        res = _call_decode(codec, spec.fqn, views, metadata[i], layout.gather_dtypes[i], target)
        if target is not None:
            params.append(target)
            continue
        full, ts = _as_param(layout, i, res)
        params.append(full)
        inner.extend(ts)
    return tuple(params), tuple(inner)


def _call_decode(
    codec: GatherCodec, fqn: str, views: tuple, meta: Any, dtype: torch.dtype, out: Any
) -> Any:
    try:
        res = codec.decode(views, meta, dtype, out=out)
    except GatherCodecError:
        raise
    except Exception as e:
        raise GatherCodecError(f"{fqn}: fsdp_post_all_gather raised {type(e).__name__}: {e}") from e
    if out is not None and res is not None:
        raise GatherCodecError(f"{fqn}: fsdp_post_all_gather(out=...) must return None")
    return res


def _as_param(
    layout: GroupLayout, i: int, res: Any
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    spec = layout.specs[i]
    if (
        not isinstance(res, (tuple, list))
        or len(res) != 2
        or not isinstance(res[0], torch.Tensor)
        or not isinstance(res[1], (tuple, list))
    ):
        raise GatherCodecError(
            f"{spec.fqn}: fsdp_post_all_gather must return (tensor, inner_tensors), got "
            f"{type(res).__name__}"
        )
    tensor, inner = res
    if tensor.numel() < spec.numel or tensor.dtype != layout.gather_dtypes[i]:
        raise GatherCodecError(
            f"{spec.fqn}: fsdp_post_all_gather returned a {tensor.dtype} tensor of "
            f"{tensor.numel()} elements; expected {layout.gather_dtypes[i]} with at least "
            f"{spec.numel} (the unsharded parameter {spec.shape})"
        )
    # FSDP2 starts at offset 0 of an all-gather output of its own; here the outputs are views
    # of one buffer, so a tensor the hook built on one starts at its own offset.
    full = torch.as_strided(tensor, spec.shape, _contiguous(spec.shape), tensor.storage_offset())
    return full, tuple(inner)
