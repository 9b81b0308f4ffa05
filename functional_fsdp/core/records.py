"""Frozen records: parameter specs, group layouts, sharded/unsharded states, and policies.

State records (:class:`ShardedState`, :class:`UnshardedState`, :class:`PostForwardState`) are
pytrees in :data:`functional_fsdp.core._tree.NAMESPACE`: their tensors are children, their layout and
rank are static metadata. Layout records (:class:`ParamSpec`, :class:`GroupLayout`) hold only
integers, dtypes and strings: they are hashable and answer shape questions without data.
Invariants are checked when a record is built, so a record that exists is consistent. Only
unflattening skips them (:func:`functional_fsdp.core._tree.register`): ``tree_map(lambda t: t.shape,
state)`` is a record of shapes, as a pytree must allow.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import optree
import torch

from . import layout as L
from ._tree import STATIC, register
from .errors import LayoutMismatchError, PolicyError

__all__ = [
    "CPUOffloadPolicy",
    "GatherInputSpec",
    "GroupLayout",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ParamSpec",
    "PostForwardState",
    "ShardedState",
    "UnshardedState",
]


@attrs.frozen
class ParamSpec:
    """Static description of one parameter FSDP shards.

    Attributes:
        fqn: the parameter's fully qualified name (for messages and state dicts).
        shape: the shape FSDP shards: the full shape, or for a tensor-parallel ``DTensor`` the
            TP-local shape (FSDP shards the TP-local tensor over the data-parallel dims only).
        dtype: the original dtype.
        requires_grad: whether the parameter trains.
        shard_dim: the dimension sharded (``Shard(shard_dim)``); dims > 0 divide evenly.
        global_shape: the global logical shape (differs from ``shape`` only under TP).
        tp_placements: opaque descriptors of the TP placements to rebuild (empty without TP).
        keep_dtype: gathered and computed in ``dtype`` whatever the group's ``param_dtype``
            (``MixedPrecisionPolicy.param_dtype_override_fn`` returned the original dtype).
    """

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = True
    shard_dim: int = 0
    global_shape: tuple[int, ...] | None = None
    tp_placements: tuple[str, ...] = ()
    keep_dtype: bool = False

    @classmethod
    def for_tensor(cls, fqn: str, tensor: torch.Tensor, *, shard_dim: int = 0) -> ParamSpec:
        """Spec of a plain tensor (``requires_grad`` read from it)."""
        return cls(fqn, tuple(tensor.shape), tensor.dtype, bool(tensor.requires_grad), shard_dim)

    @property
    def numel(self) -> int:
        """Elements of the (unsharded) tensor FSDP shards."""
        return L.prod(self.shape)


@attrs.frozen
class GatherInputSpec:
    """Per-rank all-gather inputs of one parameter under an all-gather codec (a tensor subclass
    with ``fsdp_pre_all_gather``): their shapes and dtypes, the same on every rank."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]


def _floating(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


@attrs.frozen(cache_hash=True)
class GroupLayout:
    """Layout of one group: order, padded shard shapes, packed-buffer offsets, dtypes.

    Build it with :meth:`build`; every field is derived from ``specs``, ``world_size`` and the
    mixed-precision dtypes. Rank-independent: the same layout describes every rank's shard.

    Attributes:
        specs: the parameters, in packing order.
        world_size: ranks in the shard group.
        shard_dims: normalised shard dim per parameter.
        shard_shapes: padded per-rank shard shape per parameter.
        gather_dtypes: dtype each parameter is all-gathered (and computed) in.
        reduce_dtype: dtype gradients are reduced in.
        storage: packing of the padded shards in their original dtypes (the sharded buffer).
        gather: packing of the padded shards in ``gather_dtypes`` (the all-gather input).
        treespec: the structure to rebuild a user's pytree from the flat order, if any.
        codec_inputs: per parameter, the all-gather inputs its codec sends (``None``: the plain
            padded shard), or ``None`` when no parameter has a codec (see ``codec.py``).
        encoded: packing of every parameter's all-gather inputs when ``codec_inputs`` is set.
    """

    specs: tuple[ParamSpec, ...]
    world_size: int
    shard_dims: tuple[int, ...]
    shard_shapes: tuple[tuple[int, ...], ...]
    gather_dtypes: tuple[torch.dtype, ...]
    reduce_dtype: torch.dtype | None
    storage: L.PackLayout
    gather: L.PackLayout
    treespec: optree.PyTreeSpec | None = attrs.field(default=None, eq=False)
    codec_inputs: tuple[GatherInputSpec | None, ...] | None = None
    encoded: L.PackLayout | None = None

    @classmethod
    def build(
        cls,
        specs: Sequence[ParamSpec],
        world_size: int,
        *,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        treespec: optree.PyTreeSpec | None = None,
    ) -> GroupLayout:
        """Derive a layout from specs and FSDP2's mixed-precision rules.

        ``param_dtype`` applies to floating-point parameters only; ``reduce_dtype`` defaults to
        the gather dtype and is dropped when equal to it.
        """
        # The pure ``shard(param_dtype=...)`` path reaches here without a MixedPrecisionPolicy.
        _check_dtype("param_dtype")(None, None, param_dtype)
        _check_dtype("reduce_dtype")(None, None, reduce_dtype)
        specs = tuple(specs)
        dims = tuple(L.check_shard_dim(s.shape, s.shard_dim, world_size, name=s.fqn) for s in specs)
        shard_shapes = tuple(L.sharded_shape(s.shape, d, world_size) for s, d in zip(specs, dims))
        gather_dtypes = tuple(
            param_dtype
            if (param_dtype is not None and _floating(s.dtype) and not s.keep_dtype)
            else s.dtype
            for s in specs
        )
        numels = tuple(L.prod(sh) for sh in shard_shapes)
        storage = _pack(numels, tuple(s.dtype for s in specs))
        gather = _pack(numels, gather_dtypes)
        return cls(
            specs,
            world_size,
            dims,
            shard_shapes,
            gather_dtypes,
            reduce_dtype,
            storage,
            gather,
            treespec,
        )

    def __len__(self) -> int:
        return len(self.specs)

    @property
    def storage_dtype(self) -> torch.dtype:
        """dtype of the packed sharded buffer (``torch.uint8`` when dtypes are mixed)."""
        return self.specs[0].dtype if (self.specs and self.storage.uniform) else torch.uint8

    # Derived values read on every step (a reduction reads them per group): computed once per
    # layout (functools.cached_property on attrs' slotted classes; not fields, so not compared).

    @functools.cached_property
    def gather_buffer_dtype(self) -> torch.dtype:
        """dtype of the all-gather buffers (``torch.uint8`` when dtypes are mixed)."""
        return self.gather_dtypes[0] if (self.specs and self.gather.uniform) else torch.uint8

    @functools.cached_property
    def dim0(self) -> bool:
        """Every parameter is sharded on dim 0 (the fast paths' condition)."""
        return all(d == 0 for d in self.shard_dims)

    @functools.cached_property
    def gathers_storage(self) -> bool:
        """The sharded buffer is the all-gather input as it is: the same packing and dtypes
        (equal packings are not enough: a byte buffer packing bf16 looks like one of fp16)."""
        return (
            all(s.dtype == d for s, d in zip(self.specs, self.gather_dtypes))
            and self.storage == self.gather
            and self.storage_dtype == self.gather_buffer_dtype
        )

    @functools.cached_property
    def shard_numel(self) -> int:
        """Elements of one rank's padded shards of every parameter (a reduce-scatter row)."""
        return sum(self.shard_numels)

    @functools.cached_property
    def shard_numels(self) -> tuple[int, ...]:
        """Elements of each parameter's padded shard, in packing order."""
        return tuple(L.prod(sh) for sh in self.shard_shapes)

    @functools.cached_property
    def unsharded_bytes(self) -> int:
        """Bytes of the group's all-gather output (every rank's padded shards, gather dtypes)."""
        return self.world_size * self.gather.total * self.gather_buffer_dtype.itemsize

    def grad_reduce_dtype(self) -> torch.dtype:
        """dtype gradients are reduced in: ``reduce_dtype`` or the uniform gather dtype."""
        return self._grad_reduce_dtype

    @functools.cached_property
    def _grad_reduce_dtype(self) -> torch.dtype:
        if self.reduce_dtype is not None:
            return self.reduce_dtype
        floats = {d for d, s in zip(self.gather_dtypes, self.specs) if s.requires_grad}
        if len(floats) > 1:
            raise LayoutMismatchError(
                f"gradients of one group must share a dtype to be reduced together, got "
                f"{sorted(map(str, floats))}; set MixedPrecisionPolicy(reduce_dtype=...) or put "
                "parameters of different dtypes in different fully_shard groups"
            )
        return floats.pop() if floats else (self.gather_dtypes[0] if self.specs else torch.float32)

    def extent(self, i: int, rank: int) -> tuple[int, int]:
        """``(start, length)`` of ``rank``'s unpadded slice of parameter ``i`` on its shard dim."""
        return L.shard_extent(self.specs[i].shape[self.shard_dims[i]], self.world_size, rank)

    def local_shape(self, i: int, rank: int) -> tuple[int, ...]:
        """Unpadded shape of ``rank``'s shard of parameter ``i`` (may have a 0 dim)."""
        shape = list(self.shard_shapes[i])
        shape[self.shard_dims[i]] = self.extent(i, rank)[1]
        return tuple(shape)

    def padded_full_shape(self, i: int) -> tuple[int, ...]:
        """Shape of parameter ``i`` padded on its shard dim to ``world_size`` chunks."""
        shape = list(self.shard_shapes[i])
        shape[self.shard_dims[i]] *= self.world_size
        return tuple(shape)

    def check_full(
        self,
        tensors: Sequence[torch.Tensor | None],
        *,
        what: str,
        dtypes: Sequence[torch.dtype] | None = None,
    ) -> None:
        """Raise :class:`LayoutMismatchError` unless ``tensors`` match the full shapes."""
        if len(tensors) != len(self.specs):
            raise LayoutMismatchError(
                f"{what}: got {len(tensors)} tensors for a layout of {len(self.specs)} parameters "
                f"({[s.fqn for s in self.specs]}); pass one per parameter, in layout order"
            )
        for i, (t, s) in enumerate(zip(tensors, self.specs)):
            if t is None:
                continue
            if tuple(t.shape) != s.shape:
                raise LayoutMismatchError(
                    f"{what}: {s.fqn!r} has shape {tuple(t.shape)} but the layout expects {s.shape}"
                )
            if dtypes is not None and t.dtype != dtypes[i]:
                raise LayoutMismatchError(
                    f"{what}: {s.fqn!r} has dtype {t.dtype}, expected {dtypes[i]}"
                )


def _pack(numels: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> L.PackLayout:
    uniform = len(set(dtypes)) <= 1
    return L.PackLayout.build(numels, [d.itemsize for d in dtypes], uniform)


def region(flat: torch.Tensor, pack: L.PackLayout, i: int, dtype: torch.dtype) -> torch.Tensor:
    """1-D view of region ``i`` of a packed buffer, as ``dtype``."""
    r = flat.narrow(0, pack.offsets[i], pack.sizes[i])
    return r if pack.uniform else r.view(dtype)


def _check_flat(flat: torch.Tensor, total: int, dtype: torch.dtype, what: str) -> None:
    if flat.dim() != 1 or flat.numel() != total or flat.dtype != dtype:
        raise LayoutMismatchError(
            f"{what}: expected a 1-D {dtype} buffer of {total} elements, got "
            f"{tuple(flat.shape)} {flat.dtype}; build states with shard() or from a matching layout"
        )


@register
@attrs.frozen(eq=False)
class ShardedState:
    """One rank's sharded state of a group: padded shards packed in one buffer, optional grads.

    Attributes:
        layout: the group layout (static).
        rank: this rank's index in the shard group (static).
        flat: 1-D packed buffer of the padded shards in original dtypes (``layout.storage``).
        grads: padded sharded gradients per parameter (``None`` entries for no gradient), or
            ``None`` when the group has no gradients.

    What a reduction carries from one backward to the next (a compression residual, an HSDP
    partial sum) is not here: it is the reducers' own state,
    :class:`~functional_fsdp.core.reduction.ReduceState`, threaded beside this record.
    """

    layout: GroupLayout = attrs.field(metadata=STATIC)
    rank: int = attrs.field(metadata=STATIC)
    flat: torch.Tensor
    grads: tuple[torch.Tensor | None, ...] | None = None

    def __attrs_post_init__(self) -> None:
        lay = self.layout
        if not 0 <= self.rank < lay.world_size:
            raise LayoutMismatchError(
                f"rank {self.rank} is outside the layout's world of {lay.world_size}"
            )
        _check_flat(self.flat, lay.storage.total, lay.storage_dtype, "ShardedState.flat")
        if self.grads is not None:
            if len(self.grads) != len(lay.specs):
                raise LayoutMismatchError(
                    f"ShardedState.grads has {len(self.grads)} entries for {len(lay.specs)} parameters"
                )
            for g, shape, s in zip(self.grads, lay.shard_shapes, lay.specs):
                if g is not None and tuple(g.shape) != shape:
                    raise LayoutMismatchError(
                        f"sharded grad of {s.fqn!r} has shape {tuple(g.shape)}, expected padded {shape}"
                    )

    def shard(self, i: int) -> torch.Tensor:
        """Padded shard of parameter ``i`` (a view into :attr:`flat`)."""
        lay = self.layout
        return region(self.flat, lay.storage, i, lay.specs[i].dtype).view(lay.shard_shapes[i])

    def _index(self, i: int | str) -> int:
        if isinstance(i, int):
            return i
        names = [s.fqn for s in self.layout.specs]
        if i not in names:
            raise KeyError(f"no parameter named {i!r} in this group; its parameters are {names}")
        return names.index(i)

    def local(self, i: int | str) -> torch.Tensor:
        """Unpadded shard of parameter ``i`` (an index in layout order, or its fqn; a view)."""
        i = self._index(i)
        start, length = self.layout.extent(i, self.rank)
        del start
        return self.shard(i).narrow(self.layout.shard_dims[i], 0, length)

    def locals(self) -> tuple[torch.Tensor, ...]:
        """Unpadded shards of every parameter, in layout order."""
        return tuple(self.local(i) for i in range(len(self.layout)))

    def local_grad(self, i: int | str) -> torch.Tensor | None:
        """Unpadded sharded gradient of parameter ``i`` (index or fqn), or ``None``."""
        i = self._index(i)
        if self.grads is None or self.grads[i] is None:
            return None
        length = self.layout.extent(i, self.rank)[1]
        grad = self.grads[i]
        assert grad is not None
        dim = self.layout.shard_dims[i]
        # Unpadded already (most shards): the tensor itself, not a view (a narrow costs 3 us).
        return grad if grad.shape[dim] == length else grad.narrow(dim, 0, length)


@register
@attrs.frozen(eq=False)
class UnshardedState:
    """A group's full (unsharded) parameters on one rank.

    Attributes:
        layout: the group layout (static).
        rank: this rank's index (static).
        params: full parameters in ``layout.gather_dtypes``, in layout order.
        source: the sharded state these were gathered from (``reshard`` returns it), or ``None``.
        buffer: the buffer ``params`` view into, when they share one (the shell frees it).
    """

    layout: GroupLayout = attrs.field(metadata=STATIC)
    rank: int = attrs.field(metadata=STATIC)
    params: tuple[torch.Tensor, ...]
    source: ShardedState | None = None
    buffer: torch.Tensor | None = None

    def __attrs_post_init__(self) -> None:
        self.layout.check_full(
            self.params, what="UnshardedState.params", dtypes=self.layout.gather_dtypes
        )
        if self.source is not None and self.source.layout != self.layout:
            raise LayoutMismatchError("UnshardedState.source has a different layout than the state")

    def tree(self) -> Any:
        """The full parameters in the user's original pytree structure (if known)."""
        if self.layout.treespec is None:
            return self.params
        return optree.tree_unflatten(self.layout.treespec, list(self.params))


@register
@attrs.frozen(eq=False)
class PostForwardState:
    """State after forward with ``reshard_after_forward=k``: rows kept for a ``k``-rank sub-group.

    Each rank keeps the ``world_size // k`` consecutive padded shards (in gather dtypes) at block
    ``rank % k`` of the padded all-gather output; backward all-gathers them over the sub-group of
    ranks ``[rank // k * k, rank // k * k + k)``.

    Attributes:
        layout: the group layout (static).
        rank: this rank's index in the full shard group (static).
        group_size: ``k``, the sub-group size (static).
        rows: 1-D buffer of ``world_size // k`` packed gather rows.
        source: the sharded state (kept for gradients and ``reshard``).
    """

    layout: GroupLayout = attrs.field(metadata=STATIC)
    rank: int = attrs.field(metadata=STATIC)
    group_size: int = attrs.field(metadata=STATIC)
    rows: torch.Tensor
    source: ShardedState

    def __attrs_post_init__(self) -> None:
        L.check_sub_group_size(self.group_size, self.layout.world_size)
        per = self.layout.world_size // self.group_size
        _check_flat(
            self.rows,
            per * self.layout.gather.total,
            self.layout.gather_buffer_dtype,
            "PostForwardState.rows",
        )

    @property
    def sub_rank(self) -> int:
        """This rank's index inside its sub-group."""
        return self.rank % self.group_size


_FLOAT_NONE_MSG = "must be a floating-point torch.dtype or None"


def _check_dtype(name: str) -> Any:
    def check(_inst: Any, _attr: Any, value: Any) -> None:
        if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
            raise PolicyError(f"MixedPrecisionPolicy.{name} {_FLOAT_NONE_MSG}, got {value!r}")

    return check


@attrs.frozen
class MixedPrecisionPolicy:
    """Mixed precision, field-compatible with ``torch.distributed.fsdp.MixedPrecisionPolicy``.

    Attributes:
        param_dtype: dtype of unsharded parameters (forward/backward compute, all-gather).
        reduce_dtype: dtype of gradient reduction.
        output_dtype: dtype forward outputs are cast to.
        cast_forward_inputs: cast floating-point forward inputs to ``param_dtype``.
        param_dtype_override_fn: torch 2.15's per-parameter ``param_dtype`` (keyword only):
            called once per managed parameter at ``fully_shard``; returning the parameter's
            own dtype keeps it (gathered and computed) in that dtype, ``None`` or
            ``param_dtype`` uses ``param_dtype``; anything else is a ``PolicyError`` (a
            ``ValueError``, as FSDP2). Accepted on every supported torch.
    """

    param_dtype: torch.dtype | None = attrs.field(
        default=None, validator=_check_dtype("param_dtype")
    )
    reduce_dtype: torch.dtype | None = attrs.field(
        default=None, validator=_check_dtype("reduce_dtype")
    )
    output_dtype: torch.dtype | None = attrs.field(
        default=None, validator=_check_dtype("output_dtype")
    )
    cast_forward_inputs: bool = True
    param_dtype_override_fn: Callable[[Any], torch.dtype | None] | None = attrs.field(
        default=None, kw_only=True
    )

    def keeps_original_dtype(self, param: torch.Tensor) -> bool:
        """Whether ``param_dtype_override_fn`` keeps ``param`` in its original dtype.

        Raises:
            PolicyError: the function returned something other than ``None``, ``param_dtype``
                or the parameter's dtype (FSDP2 2.15 raises ``ValueError`` there too).
        """
        if self.param_dtype_override_fn is None:
            return False
        got = self.param_dtype_override_fn(param)
        if got is None:
            return False
        if not isinstance(got, torch.dtype):
            raise PolicyError(
                f"param_dtype_override_fn must return a torch.dtype or None but got {type(got)}"
            )
        if got not in (self.param_dtype, param.dtype):
            raise PolicyError(
                "param_dtype_override_fn must return None, param_dtype, or the parameter's "
                f"original dtype but got {got} for a parameter with dtype {param.dtype} and "
                f"param_dtype {self.param_dtype}"
            )
        return got == param.dtype and got != self.param_dtype

    @classmethod
    def coerce(cls, policy: Any) -> MixedPrecisionPolicy:
        """Accept ours or torch's policy object (or ``None``)."""
        if policy is None:
            return cls()
        if isinstance(policy, cls):
            return policy
        try:
            return cls(
                policy.param_dtype,
                policy.reduce_dtype,
                policy.output_dtype,
                bool(policy.cast_forward_inputs),
                # torch 2.15's field; absent from earlier torch policies
                param_dtype_override_fn=getattr(policy, "param_dtype_override_fn", None),
            )
        except AttributeError as e:
            raise PolicyError(
                f"mp_policy must be a MixedPrecisionPolicy (ours or torch's), got {type(policy).__name__}"
            ) from e


@attrs.frozen
class OffloadPolicy:
    """No offloading (the base class, as in torch)."""

    @classmethod
    def coerce(cls, policy: Any) -> OffloadPolicy:
        """Accept ours or torch's ``OffloadPolicy`` / ``CPUOffloadPolicy`` (or ``None``)."""
        if policy is None:
            return cls()
        if isinstance(policy, OffloadPolicy):
            return policy
        name = type(policy).__name__
        if name == "CPUOffloadPolicy":
            return CPUOffloadPolicy(pin_memory=bool(policy.pin_memory))
        if name == "OffloadPolicy":
            return cls()
        raise PolicyError(
            f"offload_policy must be an OffloadPolicy or CPUOffloadPolicy, got {name}"
        )


@attrs.frozen
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and gradients on CPU (pinned if ``pin_memory`` and possible);
    they are copied to the compute device before the all-gather and the optimizer steps on CPU.
    """

    pin_memory: bool = True
