"""``Int8RowwiseWeight``: a float weight all-gathered as int8 rows and one fp32 scale per row.

The parameter stays a floating-point tensor for the optimizer (its data is the wrapped
``_data``); only the all-gather is quantized. ``fsdp_pre_all_gather`` quantizes this rank's
padded shard row by row (``scale = amax(|row|) / 127``, ``q = round(row / scale)``) and sends
``(q: int8, scale: fp32 (rows, 1))``; ``fsdp_post_all_gather`` dequantizes the gathered rows to
the compute dtype (``param_dtype`` under mixed precision), or writes them into ``out`` when the
unsharded tensor is reused. Gradients are plain tensors of the full weight (straight-through),
reduce-scattered as usual.

FSDP2's protocol requires every all-gather input of an unevenly sharded parameter to have the
padded shard shape; the scale does not, so dim 0 must divide by the shard world size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

__all__ = ["Int8RowwiseWeight"]

aten = torch.ops.aten

# Ops whose floating-point results stay Int8RowwiseWeight: what sharding needs (chunk, narrow,
# new_zeros, view, detach) and copies; everything else returns plain tensors.
_WRAP = {
    aten.detach.default,
    aten.alias.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.slice.Tensor,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.chunk.default,
    aten.narrow.default,
    aten.as_strided.default,
    aten.new_zeros.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten.clone.default,
    aten._to_copy.default,
}


class Int8RowwiseWeight(torch.Tensor):
    """A floating-point weight whose FSDP all-gather sends int8 rows and fp32 row scales.

    Wrap a parameter's data before ``fully_shard``
    (``m.weight = nn.Parameter(Int8RowwiseWeight(m.weight.data))``); both torch's FSDP2 and
    ``functional_fsdp.fully_shard`` then all-gather it through :meth:`fsdp_pre_all_gather` and
    :meth:`fsdp_post_all_gather`. In-place updates (optimizer steps) write the wrapped data.

    Args:
        data: the floating-point tensor to wrap (kept by reference).
        requires_grad: autograd flag of the wrapper.
    """

    _data: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, requires_grad: bool = False) -> Int8RowwiseWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            device=data.device,
            requires_grad=requires_grad,
        )

    def __init__(self, data: torch.Tensor, requires_grad: bool = False) -> None:
        del requires_grad
        self._data = data

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Int8RowwiseWeight({self._data!r})"

    def __tensor_flatten__(self) -> tuple[list[str], type]:
        return ["_data"], type(self)

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], ctx: Any, outer_size: Any, outer_stride: Any
    ) -> Int8RowwiseWeight:
        del outer_size, outer_stride
        cls = ctx if isinstance(ctx, type) else Int8RowwiseWeight
        return cls(inner["_data"])

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        def unwrap(t: Any) -> Any:
            return t._data if isinstance(t, cls) else t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        if func._schema.is_mutable:
            # In place (add_, copy_, an optimizer's foreach ops): the wrapped data changed.
            first = args[0] if args else None
            return first if isinstance(first, cls) and isinstance(out, torch.Tensor) else out
        if func in _WRAP:
            return tree_map(
                lambda t: cls(t) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                out,
            )
        return out

    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: torch.Size, outer_stride: Any, module: Any, mp_policy: Any
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], None]:
        """This rank's all-gather inputs: ``(int8 rows, fp32 scales of shape (rows, 1))``."""
        del outer_stride, module, mp_policy
        data = self._data
        rows = -(-int(outer_size[0]) // int(mesh.size()))
        if data.shape[0] < rows:  # an uneven last shard: pad to the padded shard shape
            padded = data.new_zeros((rows, *data.shape[1:]))
            padded[: data.shape[0]].copy_(data)
            data = padded
        return quantize_rows(data)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """Dequantize the gathered rows to ``param_dtype`` (into ``out`` when given)."""
        del metadata
        q, scale = all_gather_outputs
        full = dequantize_rows(q, scale, param_dtype)
        if out is not None:
            # The same data autograd saved views of (FSDP2 re-gathers for backward): keep the
            # version counter, as FSDP2's own copy-out does.
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(full.view(-1)[: out.numel()].view(out.shape))
            return None
        return full, (full,)


def quantize_rows(data: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], None]:
    """Rowwise symmetric int8: ``(q, scale)`` with ``q * scale ≈ data`` (rows = dim 0)."""
    with torch.no_grad():
        rows = data.detach().reshape(data.shape[0], -1).to(torch.float32)
        amax = (
            rows.abs().amax(dim=1, keepdim=True)
            if rows.shape[1]
            else rows.new_zeros((rows.shape[0], 1))
        )
        scale = (amax / 127.0).clamp(min=1e-12)
        q = torch.round(rows / scale).clamp(-127, 127).to(torch.int8).view(data.shape)
    return (q, scale), None


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale`` row by row, cast to ``dtype`` (the inverse of :func:`quantize_rows`)."""
    rows = q.reshape(q.shape[0], -1).to(torch.float32) * scale
    return rows.to(dtype).view(q.shape)
