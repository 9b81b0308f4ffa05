"""All-gather codecs: a parameter encoded before the all-gather and decoded after (pure).

FSDP2's tensor-subclass extension protocol, as a part of the layout. A parameter whose local
tensor defines ``fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy) ->
(inputs, metadata)`` and ``fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None)``
sends its ``inputs`` (any number, any dtypes: e.g. int8 data and fp32 scales) instead of its
padded shard, and is rebuilt from the gathered outputs by the post hook.

* :func:`with_codec_inputs` teaches a :class:`~functional_fsdp.core.records.GroupLayout` the
  per-parameter input shapes and dtypes (:class:`~functional_fsdp.core.records.GatherInputSpec`);
  the packed all-gather buffer then holds every parameter's inputs (``layout.encoded``; plain
  parameters send their padded shard in the gather dtype), bytes when dtypes mix.
* :func:`begin_codec_unshard` encodes (checking each rank's inputs against the layout before
  any collective), packs and issues one all-gather; :func:`finish_codec_unshard` splits the
  output per input (``t.view(-1, *shape[1:])``, rank-major as FSDP2) and decodes.

A codec is any object with ``encode(shard) -> (inputs, metadata)`` and
``decode(outputs, metadata, param_dtype, *, out=None)`` (:class:`GatherCodec`);
:class:`SubclassCodec` calls a subclass's hooks exactly as FSDP2 does. Codec groups use the
packed path and dim-0 sharding only. Nothing here imports ``torch.distributed``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs
import torch

from . import layout as L
from .comm import Communicator, Work, check_comm, collective_or_copy
from .errors import GatherCodecError
from .records import GatherInputSpec, GroupLayout, ShardedState, UnshardedState

__all__ = [
    "GatherCodec",
    "PendingCodecUnshard",
    "SubclassCodec",
    "begin_codec_unshard",
    "codec_unshard",
    "decode_outputs",
    "describe_inputs",
    "encode_inputs",
    "finish_codec_unshard",
    "gather_bytes",
    "has_hooks",
    "split_outputs",
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


def gather_bytes(layout: GroupLayout) -> int:
    """Bytes one rank sends in the group's all-gather (its packed inputs)."""
    if layout.encoded is None:
        return layout.gather.total * layout.gather_buffer_dtype.itemsize
    return layout.encoded.total * _buffer_dtype(layout).itemsize


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


@attrs.frozen(eq=False)
class PendingCodecUnshard:
    """A handle (not a record) for a codec all-gather in flight: the padded rank-major
    ``output``, the ``work``, and each parameter's metadata from its pre hook."""

    layout: GroupLayout
    rank: int
    output: torch.Tensor
    work: Work
    metadata: tuple[Any, ...]
    source: ShardedState


def begin_codec_unshard(
    state: ShardedState,
    comm: Communicator,
    codecs: Sequence[GatherCodec | None],
    *,
    async_op: bool = True,
) -> PendingCodecUnshard:
    """Encode (checked before any collective), pack, and issue the group's one all-gather."""
    lay = state.layout
    check_comm(comm, lay.world_size, "unshard")
    inputs, metas = encode_inputs(state, codecs)
    inp = pack_encoded(lay, inputs)
    out = torch.empty(lay.world_size * inp.numel(), dtype=inp.dtype, device=inp.device)
    work = collective_or_copy(
        lay.world_size, out, inp, lambda: comm.all_gather(out, inp, async_op=async_op)
    )
    return PendingCodecUnshard(lay, state.rank, out, work, metas, state)


def split_outputs(
    layout: GroupLayout,
    output: torch.Tensor,
    outs: Sequence[Sequence[torch.Tensor]] | None = None,
) -> list[tuple[torch.Tensor, ...]]:
    """Per parameter, its gathered inputs: 1-D tensors of ``ws * numel`` (FSDP2's
    ``all_gather_outputs``), copied out of the rank-major ``output`` (into ``outs`` if given)."""
    pack, ws = layout.encoded, layout.world_size
    assert pack is not None
    rows = output.view(ws, pack.total)
    result: list[tuple[torch.Tensor, ...]] = []
    k = 0
    for i in range(len(layout)):
        spec = _input_specs(layout, i)
        mine = []
        for j, dtype in enumerate(spec.dtypes):
            dst = (
                outs[i][j]
                if outs is not None
                else torch.empty(ws * pack.numels[k], dtype=dtype, device=output.device)
            )
            src = rows.narrow(1, pack.offsets[k], pack.sizes[k])
            if not pack.uniform:
                dst.view(torch.uint8).view(ws, -1).copy_(src)
            else:
                dst.view(ws, -1).copy_(src)
            mine.append(dst)
            k += 1
        result.append(tuple(mine))
    return result


def decode_outputs(
    layout: GroupLayout,
    outputs: Sequence[Sequence[torch.Tensor]],
    codecs: Sequence[GatherCodec | None],
    metadata: Sequence[Any],
    *,
    out: Sequence[torch.Tensor | None] | None = None,
) -> list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
    """Each parameter's full tensor (and the inner tensors holding its storage).

    Plain parameters view their gathered shard rows (padding stripped). Codec parameters call
    ``decode`` with the outputs viewed as ``(-1, *input_shape[1:])`` and ``layout``'s gather
    dtype; with ``out[i]`` given, the codec writes into it (FSDP2's reuse) and it is returned.
    The result is viewed at the parameter's size with contiguous strides (FSDP2's
    ``as_strided``).
    """
    result: list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = []
    for i, spec in enumerate(layout.specs):
        ins = _input_specs(layout, i)
        ws = layout.world_size
        views = tuple(t.view(ws * s[0], *s[1:]) for t, s in zip(outputs[i], ins.shapes))
        codec = codecs[i]
        if layout.codec_inputs is None or layout.codec_inputs[i] is None or codec is None:
            full = views[0].view(layout.padded_full_shape(i)).narrow(0, 0, spec.shape[0])
            result.append((full, (outputs[i][0],)))
            continue
        target = out[i] if out is not None else None
        res = _call_decode(codec, spec.fqn, views, metadata[i], layout.gather_dtypes[i], target)
        if target is not None:
            result.append((target, ()))
            continue
        result.append(_as_param(layout, i, res))
    return result


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
    full = torch.as_strided(tensor, spec.shape, _contiguous(spec.shape), 0)
    return full, tuple(inner)


def finish_codec_unshard(
    pending: PendingCodecUnshard, codecs: Sequence[GatherCodec | None]
) -> UnshardedState:
    """Wait, split the output per input and decode: the group's :class:`UnshardedState`."""
    pending.work.wait()
    outputs = split_outputs(pending.layout, pending.output)
    fulls = decode_outputs(pending.layout, outputs, codecs, pending.metadata)
    return UnshardedState(pending.layout, pending.rank, tuple(f for f, _ in fulls), pending.source)


def codec_unshard(
    state: ShardedState, comm: Communicator, codecs: Sequence[GatherCodec | None]
) -> UnshardedState:
    """:func:`begin_codec_unshard` then :func:`finish_codec_unshard` (synchronous)."""
    return finish_codec_unshard(begin_codec_unshard(state, comm, codecs, async_op=False), codecs)
