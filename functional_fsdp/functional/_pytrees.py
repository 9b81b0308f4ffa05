"""Registration of the functional API's records as pytrees in every registry a user may reach for.

Each record (``TrainState``, the optimizer states) is registered

- in optree's **global** namespace, so ``optree.tree_map(fn, state)`` works without a
  namespace, and ``optree.tree_map(fn, state, namespace=functional_fsdp.core._tree.NAMESPACE)``
  too (optree falls back to the global registration in every namespace);
- in ``torch.utils._pytree``, so ``torch.utils._pytree.tree_map`` and torch's own utilities
  (``torch.func``, ``torch.distributed.checkpoint`` helpers) see their tensors.

Fields are children unless declared with ``attrs.field(metadata=STATIC)`` (static metadata,
part of the tree structure), as for the core's records.
"""

from __future__ import annotations

from typing import Any, TypeVar

import attrs
import torch.utils._pytree as torch_pytree
from optree.integrations import attrs as optree_attrs

# optree's only spelling of its global namespace (the registry's default for every lookup).
from optree.registry import __GLOBAL_NAMESPACE as _GLOBAL

__all__ = ["register_everywhere"]

_T = TypeVar("_T", bound=type)


def register_everywhere(cls: _T) -> _T:
    """Register a frozen ``attrs`` class as a pytree node in optree (global) and torch.

    Args:
        cls: an ``attrs`` class; fields with ``metadata={"pytree_node": False}`` are static.

    Returns:
        ``cls`` (use it as a decorator above ``@attrs.frozen``).
    """
    optree_attrs.register_node(cls, namespace=_GLOBAL)
    fields = attrs.fields(cls)
    children = tuple(f.name for f in fields if f.metadata.get("pytree_node", True))
    static = tuple(f.name for f in fields if not f.metadata.get("pytree_node", True) and f.init)

    def flatten(obj: Any) -> tuple[list[Any], Any]:
        meta = tuple((n, getattr(obj, n)) for n in static)
        return [getattr(obj, n) for n in children], meta

    def flatten_with_keys(obj: Any) -> tuple[list[tuple[Any, Any]], Any]:
        leaves, meta = flatten(obj)
        return [(torch_pytree.GetAttrKey(n), v) for n, v in zip(children, leaves)], meta

    def unflatten(values: Any, meta: Any) -> Any:
        return cls(**dict(zip(children, values)), **dict(meta))

    torch_pytree.register_pytree_node(
        cls,
        flatten,
        unflatten,
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=flatten_with_keys,
    )
    return cls
